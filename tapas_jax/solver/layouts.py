"""Layouts stated in plan terms (mesh axes, parameter paths, `PartitionSpec`s), as the
solver's class choice: how the baselines and `@tapas.shard`'s forward plans say what
they want costed, without reading the problem's classes.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tapas_jax import cost, trace
  >>> from tapas_jax.solver import build_problem, evaluate, layout_choice
  >>> graph = trace.trace(lambda w, x: jnp.sum(jnp.tanh(x @ w)),
  ...                     jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
  ...                     jax.ShapeDtypeStruct((65536, 4096), jnp.float32))
  >>> p = build_problem(graph, cost.mesh_spec({"data": 8}, "h100"),
  ...                   cost.get_profile("h100"), None)
  >>> dp = layout_choice(p, batch_axes=("data",))
  >>> [i.stored for i in evaluate(p, dp).terms.inputs]
  [P(None, None), P('data', None)]
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

from jax.sharding import PartitionSpec

from tapas_jax import cost as costlib
from tapas_jax.solver import experts
from tapas_jax.solver.problem import Problem

__all__ = ["LayoutChoice", "layout_choice"]


@dataclasses.dataclass(frozen=True)
class LayoutChoice:
  """A stated layout as `evaluate` costs it (`evaluate(problem, layout)`).

  Attributes:
    choice: class id -> mesh axes (the solver's terms; callers need not read it).
    input_layouts: input value -> the layout it is stored in, for inputs stored apart
      from their classes' choice; None when there are none.
  """

  choice: Mapping[int, tuple[str, ...]]
  input_layouts: Mapping[int, costlib.Layout] | None = None


def layout_choice(problem: Problem, *, batch_axes: Sequence[str] = (), fsdp: bool = False,
                  split: Iterable[tuple[str, int]] = (), split_axes: Sequence[str] = (),
                  stored: Mapping[str, PartitionSpec] | None = None,
                  used: Mapping[str, PartitionSpec] | None = None) -> LayoutChoice:
  """The class choice (and fixed input layouts) of a layout stated in plan terms.

  The parts apply in this order, a later one overriding an earlier one's axes:

  Args:
    problem: the problem to cost it on.
    batch_axes: the batch over as many of these mesh axes as it divides into (data
      parallel).
    fsdp: also every state input stored split over all mesh axes on its largest
      divisible dim, gathered where it is used (ZeRO-3; `experts.fsdp`).
    split: (input path, dim) pairs to split over as many of `split_axes` as divide
      it, stored as used (Megatron's columns and rows). The dim counts in one layer's
      parameter: a stacked parameter's (`scan_layers=True`) leading layer dim is not
      counted, and a scan body reading the stack through a cut is split alike.
    split_axes: the mesh axes of `split`; given, a scanned stack's gradient is kept in
      the layout it is made in (split as the body splits it).
    stored: input path -> the `PartitionSpec` it is stored in (fixed, whatever its
      classes take).
    used: input path -> the `PartitionSpec` its compute reads it in: each dim's class
      takes those axes where it can and no earlier input gave it others.

  Raises:
    ValueError: a path in `stored`, `used` or `split` names no input of the program.
  """
  g = problem.graph
  split = tuple(split)
  # Asked by path only where a layout names paths (a baseline's names none: the
  # thousands of inputs of a deep program are not listed for it).
  by_path = {i.path: i for i in g.inputs} if stored or used or split else {}
  for what, paths in (("stored", stored or {}), ("used", used or {}),
                      ("split", [p for p, _ in split])):
    missing = sorted(set(paths) - set(by_path))
    if missing:
      raise ValueError(f"layout_choice: {what} names {missing[:3]}, not inputs of the "
                       f"program; its inputs are e.g. {list(by_path)[:3]}")
  choice = dict(experts.batch_choice(problem, tuple(batch_axes))) if batch_axes else {}
  layouts: dict[int, costlib.Layout] = {}
  if fsdp:
    kept, layouts = experts.fsdp(problem)
    choice = {c: a for c, a in choice.items() if a}
    choice.update(kept)
  if split or split_axes:
    _split(problem, choice, [(by_path[p].value, d) for p, d in split], tuple(split_axes))
  for i in g.inputs if stored or used else ():  # in order: the first to ask a class wins
    rank = len(g.types[i.value].shape)
    if stored and i.path in stored:
      layouts[i.value] = costlib.Layout(_entries(stored[i.path], rank))
    if used and i.path in used:
      for d, axes in enumerate(_entries(used[i.path], rank)):
        c = problem.vclass(i.value, d)
        if axes and axes in problem.domains[c]:
          choice.setdefault(c, axes)
  return LayoutChoice(choice={c: a for c, a in choice.items() if a},
                      input_layouts=layouts or None)


def _split(problem: Problem, choice: dict[int, tuple[str, ...]],
           dims: Sequence[tuple[int, int]], axes: tuple[str, ...]) -> None:
  """Megatron's splits (input value, dim of a layer) over the widest of `axes`."""
  g, stacked = problem.graph, experts.stacked_dims(problem)
  for v, dim in dims:
    dim += (problem.cv(v), 0) in stacked
    if len(g.types[v].shape) > dim:
      # A scanned stack's body reads each layer through a cut: split there too.
      for c in {problem.vclass(v, dim), problem.read_class(v, dim),
                *experts.body_classes(problem, v, dim)}:
        choice[c] = experts.widest(problem, c, axes)  # stored as it is used
  for _, outer, inner, read in problem.scan_cuts:  # a stack's gradient kept as made
    for d in range(len(g.types[inner].shape)) if not read else ():
      made, c = choice.get(problem.value_class[(inner, d)]), problem.vclass(outer, d + 1)
      if made and made in problem.domains[c]:
        choice[c] = made


def _entries(spec: PartitionSpec, rank: int) -> tuple[tuple[str, ...], ...]:
  """Per-dim mesh axes of a `PartitionSpec` on a value of this rank."""
  out = []
  for d in range(rank):
    entry = spec[d] if d < len(spec) else None
    out.append(() if entry is None else (entry,) if isinstance(entry, str) else tuple(entry))
  return tuple(out)
