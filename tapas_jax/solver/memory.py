"""Per-device memory: the program's inputs and the intermediates live at the peak.

Input bytes are tables over the classes of each input's dims (inputs over the same
classes share one table). Intermediates are tracked with live ranges over the
top-level program; the peak and the values live at it depend on the plan, so the
memory budget is posed at one plan's peak and re-posed as it moves (`budget.py`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Iterable, Mapping

import numpy as np

from tapas_jax import cost as costlib
from tapas_jax.solver.problem import Problem
from tapas_jax.solver.tables import Table, evaluate_tables

__all__ = ["Activations", "activation_peak", "activation_tables", "activations",
           "largest_live", "memory_tables", "memory_used"]


def memory_tables(problem: Problem,
                   fixed: Mapping[int, costlib.Layout] | None = None) -> list[Table]:
  """Per-device bytes of every program input, as tables over its dims' classes.

  Inputs over the same classes share one table (bytes add up), so a folded program's
  many copies of one parameter cost one table.
  """
  fixed = fixed or {}
  total: dict[tuple[int, ...], float] = {}
  fixed_bytes = 0.0
  for i in problem.graph.inputs:
    t = problem.graph.types[i.value]
    if i.value in fixed:
      fixed_bytes += t.nbytes / costlib.num_shards(fixed[i.value], problem.mesh)
      continue
    dims = tuple(problem.vclass(i.value, d) for d in range(len(t.shape)))
    key = _scope(problem, dims)
    total[key] = total.get(key, 0.0) + t.nbytes
  out = [Table((), np.array(fixed_bytes), np.array(0.0))] if fixed_bytes else []
  return out + _bytes_tables(problem, total)


def _scope(problem: Problem, dims: Iterable[int | None]) -> tuple[int, ...]:
  scope: list[int] = []
  for c in dims:
    if c is not None and problem.classes[c].splittable and c not in scope:
      scope.append(c)
  return tuple(scope)


def _bytes_tables(problem: Problem, total: Mapping[tuple[int, ...], float]) -> list[Table]:
  """Per-device bytes as tables: for each scope, its bytes over the mesh axes chosen."""
  out = []
  for scope, nbytes in total.items():
    domains = [problem.domains[c] for c in scope]
    table = np.empty(tuple(len(d) for d in domains))
    for idx in itertools.product(*(range(len(d)) for d in domains)):
      axes = {a for k, j in enumerate(idx) for a in domains[k][j]}
      table[idx] = nbytes / math.prod(problem.mesh.size(a) for a in axes)
    out.append(Table(scope, table, np.zeros_like(table)))
  return out


@dataclasses.dataclass(frozen=True)
class Activations:
  """Every top-level intermediate value: live range and the class of each dim."""

  start: np.ndarray      # program position of the op writing it
  stop: np.ndarray       # position of its last reader
  nbytes: np.ndarray
  dims: tuple[tuple[int | None, ...], ...]
  length: int            # number of top-level ops
  values: tuple[int, ...] = ()


def activations(problem: Problem) -> Activations:
  g = problem.graph
  top = g.region_ops(0)
  pos = {op.index: j for j, op in enumerate(top)}
  start, stop, nbytes, dims, values = [], [], [], [], []
  for j, op in enumerate(top):
    rule = problem.rules.get(problem.view.op_canon.get(op.index, op.index))
    if rule is None:
      continue
    for slot, v in enumerate(op.outputs):
      t = g.types[v]
      if not t.shape or (problem.cv(v), 0) not in problem.value_class:
        continue
      start.append(j)
      stop.append(max((pos[c] for c in g.consumers.get(v, ()) if c in pos), default=j))
      nbytes.append(t.nbytes)
      values.append(v)
      dims.append(tuple(None if f is None else problem.vclass(v, d)
                        for d, f in enumerate(rule.outputs[slot])))
  return Activations(np.array(start, int), np.array(stop, int), np.array(nbytes, float),
                      tuple(dims), len(top), tuple(values))


def _shards(problem: Problem, acts: Activations,
            choice: Mapping[int, tuple[str, ...]]) -> np.ndarray:
  return np.array([math.prod(problem.mesh.size(a) for a in
                             {a for c in dims if c is not None for a in choice.get(c, ())})
                   for dims in acts.dims], float)


def activation_peak(problem: Problem, acts: Activations,
                     choice: Mapping[int, tuple[str, ...]]) -> tuple[float, int]:
  """(peak per-device bytes of live intermediates, program position of the peak)."""
  if not len(acts.nbytes):
    return 0.0, 0
  shards = _shards(problem, acts, choice)
  delta = np.zeros(acts.length + 1)
  np.add.at(delta, acts.start, acts.nbytes / shards)
  np.add.at(delta, np.minimum(acts.stop + 1, acts.length), -acts.nbytes / shards)
  live = np.cumsum(delta)
  k = int(np.argmax(live))
  return float(live[k]), k


def activation_tables(problem: Problem, acts: Activations, at: int) -> list[Table]:
  """Per-device bytes of the values live at program position `at`, as tables."""
  total: dict[tuple[int, ...], float] = {}
  for k in np.flatnonzero((acts.start <= at) & (acts.stop >= at)):
    key = _scope(problem, acts.dims[k])
    total[key] = total.get(key, 0.0) + float(acts.nbytes[k])
  return _bytes_tables(problem, total)


def memory_used(problem: Problem, acts: Activations, memory, assignment):
  """(inputs + live intermediates at the peak, peak position, class -> axes) of a plan."""
  choice = {c: problem.domains[c][i] for c, i in assignment.items()}
  peak, at = activation_peak(problem, acts, choice)
  return evaluate_tables(memory, assignment)[0] + peak, at, choice


def largest_live(problem: Problem, acts: Activations, choice, top: int = 3) -> str:
  """The biggest intermediates live at the activation peak under a choice, as text."""
  if not len(acts.nbytes):
    return ""
  _, at = activation_peak(problem, acts, choice)
  per_device = acts.nbytes / _shards(problem, acts, choice)
  live = np.flatnonzero((acts.start <= at) & (acts.stop >= at))
  g = problem.graph
  rows = []
  for k in live[np.argsort(-per_device[live])][:top]:
    op = g.ops[g.producer[acts.values[k]]]
    rows.append(f"{op.name_stack or '(top)'}/{op.primitive} {g.types[acts.values[k]]} "
                f"({per_device[k] / 2**20:.1f} MiB)")
  return ", ".join(rows)
