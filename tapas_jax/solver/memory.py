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
from tapas_jax.solver.fusion import fused_values, live_ops
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
  """Every top-level intermediate value: live range and the class of each dim.

  Attributes:
    start: program position of the op writing it (of its first reader, for a
      parameter's gathered copy).
    stop: position of its last reader (the program's end for an output).
    nbytes: bytes of the whole value.
    dims: class of each dim as it is made (None: made whole).
    length: number of top-level ops.
    values: the value id of each entry.
    stored: for a parameter's gathered copy, or an activation's copy read through a
      cut, the classes it is stored (made) over (the copy takes no memory where the
      two layouts agree); None for other entries.
  """

  start: np.ndarray
  stop: np.ndarray
  nbytes: np.ndarray
  dims: tuple[tuple[int | None, ...], ...]
  length: int
  values: tuple[int, ...] = ()
  stored: tuple[tuple[int, ...] | None, ...] = ()


def activations(problem: Problem) -> Activations:
  """The intermediates of the top-level program, as XLA keeps them.

  * Values no output depends on are dropped (dead code).
  * A program output lives to the end, except the next value of carried state: the
    step runs with the state donated, so it is written into its input's buffer (the
    input is counted among the inputs).
  * A parameter stored apart from its use (ZeRO) is gathered once into its compute
    layout (`apply` pins one copy per value) and that copy lives from its first
    compute reader to its last.
  * Each dim is split as its producer makes it: over its class's axes, or whole where
    the producer's rule keeps it whole.
  """
  g = problem.graph
  top = g.region_ops(0)
  pos = {op.index: j for j, op in enumerate(top)}
  live = live_ops(g, top)
  end = len(top) - 1
  outputs = set(g.outputs)
  carried = {g.outputs[k] for k, _ in g.carried}
  start, stop, nbytes, dims, values, stored = [], [], [], [], [], []

  fused = fused_values(g, top, live)
  # A fused value is recomputed where it is read: what it is made of stays live until
  # then. Readers come after producers, so walk backwards.
  reach: dict[int, int] = {}
  for op in reversed(top):
    if op.index not in live:
      continue
    for v in op.inputs:
      here = max([pos[op.index]] + [reach[w] for w in op.outputs if w in fused])
      reach[v] = max(reach.get(v, here), here)

  def last_reader(v, default):
    return reach.get(v, default)

  for j, op in enumerate(top):
    rule = problem.rules.get(problem.view.op_canon.get(op.index, op.index))
    if rule is None or op.index not in live:
      continue
    for slot, v in enumerate(op.outputs):
      t = g.types[v]
      if not t.shape or (problem.cv(v), 0) not in problem.value_class:
        continue
      readers = [c for c in g.consumers.get(v, ()) if c in live]
      if v in fused or (v in carried and not readers):
        continue  # never written out, or written in place into the donated input
      if problem.cv(v) in problem.free_values and v not in outputs:
        continue  # a constant (a causal mask): XLA builds it inside its readers
      start.append(j)
      stop.append(end if v in outputs and v not in carried else last_reader(v, j))
      nbytes.append(t.nbytes)
      values.append(v)
      dims.append(tuple(None if f is None else problem.vclass(v, d)
                        for d, f in enumerate(rule.outputs[slot])))
      stored.append(None)
      # Read through a cut (sequence parallelism): each reader on the other side gets
      # a transient copy in its layout (a norm's output gathered into a dot, a dot's
      # result reduce-scattered for the residual add). XLA gathers again rather than
      # keep a gathered copy from the forward pass to the backward (measured on the
      # tiny zoo under sequence-parallel plans: a copy held from its first reader to
      # its last over-counted XLA's peak by ~10%).
      made = dims[-1]
      for c in readers:
        rep = problem.view.op_canon.get(c, c)
        for k, x in enumerate(g.ops[c].inputs):
          # Read as the op standing for this one reads its operand (an interior copy
          # reading the last layer's output reads it as the representative does).
          y = problem.cv(g.ops[rep].inputs[k])
          side = problem.read_sides.get((rep, y))
          if x != v or side is None:
            continue
          start.append(pos[c])
          stop.append(pos[c])
          nbytes.append(t.nbytes)
          values.append(v)
          stored.append(made)
          dims.append(problem.reader_dims[(y, side)])
  for i in g.inputs:
    use = problem.reader_dims.get((problem.cv(i.value), False))
    readers = sorted(pos[c] for c in g.consumers.get(i.value, ()) if c in live and
                     problem.view.op_canon.get(c, c) not in problem.update_ops)
    if use is None or not readers:
      continue
    start.append(readers[0])
    stop.append(readers[-1])
    nbytes.append(g.types[i.value].nbytes)
    values.append(i.value)
    dims.append(tuple(use))
    stored.append(tuple(problem.vclass(i.value, d) for d in range(len(use))))
  return Activations(np.array(start, int), np.array(stop, int), np.array(nbytes, float),
                      tuple(dims), len(top), tuple(values), tuple(stored))


def _axes(dims: Iterable[int | None], choice: Mapping[int, tuple[str, ...]]):
  """Per dim, the mesh axes splitting it (an axis splits the first dim asking for it)."""
  out, seen = [], set()
  for c in dims:
    entry = tuple(a for a in choice.get(c, ()) if a not in seen) if c is not None else ()
    seen.update(entry)
    out.append(entry)
  return tuple(out)


def _entry_bytes(problem: Problem, nbytes: float, dims, stored,
                 choice: Mapping[int, tuple[str, ...]]) -> float:
  """Per-device bytes of one entry under a choice; a gathered copy laid out as its
  stored input is the input itself (nothing gathered)."""
  axes = _axes(dims, choice)
  if stored is not None and axes == _axes(stored, choice):
    return 0.0
  return nbytes / math.prod(problem.mesh.size(a) for d in axes for a in d)


def _per_device(problem: Problem, acts: Activations,
                choice: Mapping[int, tuple[str, ...]]) -> np.ndarray:
  stored = acts.stored or (None,) * len(acts.dims)
  return np.array([_entry_bytes(problem, b, d, s, choice)
                   for b, d, s in zip(acts.nbytes, acts.dims, stored)], float)


def activation_peak(problem: Problem, acts: Activations,
                     choice: Mapping[int, tuple[str, ...]]) -> tuple[float, int]:
  """(peak per-device bytes of live intermediates, program position of the peak)."""
  if not len(acts.nbytes):
    return 0.0, 0
  per_device = _per_device(problem, acts, choice)
  delta = np.zeros(acts.length + 1)
  np.add.at(delta, acts.start, per_device)
  np.add.at(delta, np.minimum(acts.stop + 1, acts.length), -per_device)
  live = np.cumsum(delta)
  k = int(np.argmax(live))
  return float(live[k]), k


def activation_tables(problem: Problem, acts: Activations, at: int) -> list[Table]:
  """Per-device bytes of the values live at program position `at`, as tables."""
  total: dict[tuple[int, ...], float] = {}
  copies = []
  for k in np.flatnonzero((acts.start <= at) & (acts.stop >= at)):
    if acts.stored and acts.stored[k] is not None:
      copies.append(_copy_table(problem, float(acts.nbytes[k]), acts.dims[k],
                                acts.stored[k]))
      continue
    key = _scope(problem, acts.dims[k])
    total[key] = total.get(key, 0.0) + float(acts.nbytes[k])
  return _bytes_tables(problem, total) + copies


def _copy_table(problem: Problem, nbytes: float, dims, stored) -> Table:
  """A gathered copy's bytes over its read and stored classes (zero where they agree)."""
  scope = _scope(problem, tuple(dims) + tuple(stored))
  domains = [problem.domains[c] for c in scope]
  table = np.empty(tuple(len(d) for d in domains))
  for idx in itertools.product(*(range(len(d)) for d in domains)):
    choice = {c: domains[k][j] for k, (c, j) in enumerate(zip(scope, idx))}
    table[idx] = _entry_bytes(problem, nbytes, dims, stored, choice)
  return Table(scope, table, np.zeros_like(table))


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
  per_device = _per_device(problem, acts, choice)
  live = np.flatnonzero((acts.start <= at) & (acts.stop >= at))
  g = problem.graph
  rows = []
  for k in live[np.argsort(-per_device[live])][:top]:
    v = acts.values[k]
    if v in g.producer:
      op = g.ops[g.producer[v]]
      what = f"{op.name_stack or '(top)'}/{op.primitive}"
    else:
      what = f"{g.input_path[v]} gathered for use"
    rows.append(f"{what} {g.types[v]} "
                f"({per_device[k] / 2**20:.1f} MiB)")
  return ", ".join(rows)
