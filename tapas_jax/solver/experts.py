"""Expert layouts as points of the search's own space: data parallel and FSDP.

Both are class choices of a `Problem` (FSDP's state storage is a choice of each state
input's storage class where the search sees the input apart from its compute), so the
budgeted search evaluates them as incumbents: whatever the Lagrange weight reaches, the
plan it returns is never slower than one of these that fits the budget
(`budget.best_of`). `tapas_jax.baselines` builds its plans from the same choices.
Megatron is not here: its layout is read off the zoo's parameter paths, which the search
never knows.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tapas_jax import cost, trace
  >>> from tapas_jax.solver import build_problem, experts
  >>> graph = trace.trace(lambda w, x: jnp.sum(jnp.tanh(x @ w)),
  ...                     jax.ShapeDtypeStruct((64, 64), jnp.float32),
  ...                     jax.ShapeDtypeStruct((256, 64), jnp.float32))
  >>> p = build_problem(graph, cost.mesh_spec({"data": 8}, "cpu"), cost.get_profile("cpu"),
  ...                   None)
  >>> sorted(experts.batch_choice(p, ("data",)).values())
  [('data',)]
"""

from __future__ import annotations

import math

from tapas_jax import cost as costlib
from tapas_jax.solver.problem import Problem
from tapas_jax.solver.views import scan_bindings

__all__ = ["batch_choice", "body_classes", "fsdp", "incumbents", "stacked_dims", "widest"]


def widest(problem: Problem, c: int, axes: tuple[str, ...]) -> tuple[str, ...]:
  """The largest subset of `axes` (kept in order) that class c can take."""
  best: tuple[str, ...] = ()
  for option in problem.domains[c]:
    if set(option) <= set(axes) and math.prod(problem.mesh.size(a) for a in option) > \
        math.prod(problem.mesh.size(a) for a in best):
      best = option
  return best


def batch_choice(problem: Problem, axes: tuple[str, ...]) -> dict[int, tuple[str, ...]]:
  """Every batch class over as many of `axes` as its domain allows."""
  return {c.index: widest(problem, c.index, axes) for c in problem.classes if c.batch}


def stacked_dims(problem: Problem) -> frozenset[tuple[int, int]]:
  """(input value, dim) of the layer dims of stacked parameters: the leading dim a scan
  slices per iteration (`nn.scan`, `scan_layers=True`). Expert layouts leave it whole:
  split, every iteration's slice would be gathered from the devices that hold it.

  The stack's optimizer state and gradients are stacked alike: found through the state
  update, which is pointwise (dim 0 is dim 0 on every operand).
  """
  g = problem.graph
  out = set()
  for loop in problem.view.loops:
    for outer, _, shift in scan_bindings(g, g.ops[loop]):
      if shift:
        out.add((problem.cv(outer), 0))
  update = [[(problem.cv(v), 0) for v in (*g.ops[i].inputs, *g.ops[i].outputs)
             if v not in g.literals and g.types[v].shape]
            for i in sorted(problem.update_ops)]
  grown = bool(out)
  while grown:  # a chain of update ops can meet the stack at its end (mu * b1 + g)
    grown = False
    for keys in update:
      if not out.issuperset(keys) and not out.isdisjoint(keys):
        out.update(keys)
        grown = True
  return frozenset(out)


def body_classes(problem: Problem, v: int, d: int) -> tuple[int, ...]:
  """The classes scan bodies read dim d (> 0) of stacked input v in, where they read it
  through a cut (`Problem.scan_cuts`); empty for any other input or dim."""
  v = problem.cv(v)
  return tuple(problem.value_class[(inner, d - 1)]
               for _, outer, inner, read in problem.scan_cuts if read and outer == v and d)


def _compute_classes(problem: Problem) -> frozenset[int]:
  """Classes the compute (every op of the view outside the state update) splits."""
  return frozenset(c for i, cs in problem.factor_class.items()
                   if i not in problem.update_ops for c in cs if c >= 0)


def fsdp(problem: Problem) -> tuple[dict[int, tuple[str, ...]], dict[int, costlib.Layout]]:
  """Every state input stored split over all axes on its largest divisible dim.

  Where the search sees the input apart from its compute (parameters and optimizer
  state under a state update, on classes of their own), that is a choice of its storage
  class: gradients are reduce-scattered into it and parameters gathered for use. Other
  inputs get a fixed layout, gathered where they are read: those whose classes are the
  compute's (a scanned stack's parameters and, through its update, their optimizer
  state), so that storing them split does not split the compute. A stacked parameter's
  layer dim is never split (`stacked_dims`), and no layout names a mesh axis twice.

  Returns:
    (class -> mesh axes of the storage classes, input value -> fixed layout of the
    others).
  """
  axes = tuple(a for a in problem.mesh.axis_names if problem.mesh.size(a) > 1)
  n = math.prod(problem.mesh.size(a) for a in axes)
  stacked, compute = stacked_dims(problem), _compute_classes(problem)
  # Each question below is one of the value standing for the input (`View.canon`: a
  # folded layer's copies of a parameter are laid out as their representative), asked
  # once per such value (in the order the inputs first name it), not once per copy.
  canon, types, batch = problem.view.canon, problem.graph.types, problem.batch_inputs
  group: dict[int, list[int]] = {}
  for i in problem.graph.inputs:
    if i.value not in batch and types[i.value].shape:
      group.setdefault(canon.get(i.value, i.value), []).append(i.value)
  picked: dict[int, tuple[int, int]] = {}  # standing for -> (dim, class) stored split
  for s, (v, *_) in group.items():
    shape = types[v].shape
    dims = [d for d in sorted(range(len(shape)), key=lambda d: -shape[d])
            if shape[d] % n == 0 and (s, d) not in stacked]
    if dims:
      picked[s] = (dims[0], problem.vclass(v, dims[0]))
  # A class may store one input's dim and be another dim of another input (a square
  # kernel's two dims): stored split, that input would name the axes twice.
  twice = {problem.vclass(group[s][0], d) for s, (k, _) in picked.items()
           for d in range(len(types[group[s][0]].shape)) if d != k}
  choice, kept = {}, {}  # kept: standing for -> its fixed layout
  for s, (k, c) in picked.items():
    v = group[s][0]
    if (problem.stored_apart(v) and c not in compute and c not in twice
        and axes in problem.domains[c]):
      choice[c] = axes
    else:
      kept[s] = costlib.Layout(tuple(axes if d == k else ()
                                     for d in range(len(types[v].shape))))
  layouts = {v: layout for s, layout in kept.items() for v in group[s]}
  for _, outer, _, read in problem.scan_cuts:
    # A scanned stack's gradient, made one layer per iteration: written into the stack
    # split as its parameter is stored (each layer reduce-scattered in the loop), not
    # whole on every device. Its classes are the compute's only through the pointwise
    # ops that lead it into the update (`Problem.scan_cuts`), which then run split too.
    shape = problem.graph.types[outer].shape
    dims = [d for d in sorted(range(1, len(shape)), key=lambda d: -shape[d])
            if shape[d] % n == 0] if not read else []
    c = problem.vclass(outer, dims[0]) if dims else None
    if c is not None and c not in twice and axes in problem.domains[c]:
      choice.setdefault(c, axes)
  return choice, layouts


def incumbents(problem: Problem) -> tuple[dict[int, int], ...]:
  """Data parallel and FSDP as assignments (class -> domain index) of this problem.

  The batch takes as many mesh axes as the search's batch domain allows; FSDP's fixed
  layouts (inputs the search does not see apart from their compute) are left out, so
  those inputs stay as the rest of the choice puts them: still a point of the space.
  """
  every = tuple(a for a in problem.mesh.axis_names if problem.mesh.size(a) > 1)
  dp = {c: a for c, a in batch_choice(problem, every).items() if a}
  out = []
  for choice in (dp, {**dp, **fsdp(problem)[0]}):
    assignment = {c: problem.domains[c].index(a) for c, a in choice.items()}
    if assignment not in out:
      out.append(assignment)
  return tuple(out)
