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

__all__ = ["batch_choice", "fsdp", "incumbents", "widest"]


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


def fsdp(problem: Problem) -> tuple[dict[int, tuple[str, ...]], dict[int, costlib.Layout]]:
  """Every state input stored split over all axes on its largest divisible dim.

  Where the search sees the input apart from its compute (parameters and optimizer
  state under a state update), that is a choice of its storage class: gradients are
  reduce-scattered into it and parameters gathered for use. Other inputs get a fixed
  layout, gathered where they are read.

  Returns:
    (class -> mesh axes of the storage classes, input value -> fixed layout of the
    others).
  """
  choice, layouts = {}, {}
  axes = tuple(a for a in problem.mesh.axis_names if problem.mesh.size(a) > 1)
  n = math.prod(problem.mesh.size(a) for a in axes)
  for i in problem.graph.inputs:
    shape = problem.graph.types[i.value].shape
    if i.value in problem.batch_inputs or not shape:
      continue
    dims = [d for d in sorted(range(len(shape)), key=lambda d: -shape[d]) if shape[d] % n == 0]
    if not dims:
      continue
    c = problem.vclass(i.value, dims[0])
    if problem.stored_apart(i.value) and axes in problem.domains[c]:
      choice.setdefault(c, axes)
    else:
      layouts[i.value] = costlib.Layout(tuple(axes if d == dims[0] else ()
                                              for d in range(len(shape))))
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
