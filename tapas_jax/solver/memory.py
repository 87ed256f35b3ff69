"""Per-device memory: the program's inputs and the intermediates live at the peak.

Input bytes are tables over the classes of each input's dims (inputs over the same
classes share one table). Intermediates are tracked with live ranges over the
top-level program (`live.activations`); the peak and the values live at it depend on
the plan, so the memory budget is posed at one plan's peak and re-posed as it moves
(`budget.py`).
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Iterable, Mapping

import numpy as np

from tapas_jax import cost as costlib
from tapas_jax.solver.live import Activations, activations, loop_body_values
from tapas_jax.solver.problem import Problem
from tapas_jax.solver.tables import Table, evaluate_tables

# `Activations`, `activations` and `loop_body_values` are built in `live` and named here
# too: the memory model is where tests and the budget read them.
__all__ = ["Activations", "activation_peak", "activation_tables", "activations",
           "largest_live", "loop_body_values", "memory_floor", "memory_tables",
           "memory_used"]


def memory_tables(problem: Problem,
                   fixed: Mapping[int, costlib.Layout] | None = None) -> list[Table]:
  """Per-device bytes of every program input, as tables over its dims' classes.

  Inputs over the same classes share one table (bytes add up), so a folded program's
  many copies of one parameter cost one table.
  """
  fixed = fixed or {}
  canon, types, tile = problem.view.canon, problem.graph.types, problem.profile.memory_tile
  fixed_bytes = 0.0
  # A folded layer's copies of a parameter stand for one value: the inputs are counted
  # per (value standing for them, type), in the order they first appear, and each such
  # kind's classes asked once.
  count: dict[tuple, int] = {}
  first: dict[tuple, int] = {}  # its first input
  for i in problem.graph.inputs:
    if i.value in fixed:
      t = types[i.value]
      fixed_bytes += (costlib.stored_bytes(costlib.local_shape(t.shape, fixed[i.value],
                                                               problem.mesh),
                                           t.itemsize, problem.profile)
                      if tile else t.nbytes / costlib.num_shards(fixed[i.value], problem.mesh))
      continue
    at = (canon.get(i.value, i.value), id(types[i.value]))  # types are shared objects
    if at in count:
      count[at] += 1
    else:
      count[at], first[at] = 1, i.value
  total: dict[tuple[int, ...], float] = {}
  tiled: dict[tuple[int, ...], np.ndarray] = {}
  for at, n in count.items():
    v = first[at]
    t = types[v]
    dims = tuple(problem.vclass(v, d) for d in range(len(t.shape)))
    key = _scope(problem, dims)
    # Whole bytes, n inputs of them: exact in a float, whatever the order of the sums.
    if tile:  # each shard's tiles: per input, per choice
      table = _stored_table(problem, t, dims, key) * n
      tiled[key] = tiled[key] + table if key in tiled else table
      continue
    total[key] = total.get(key, 0.0) + t.nbytes * n
  out = [Table((), np.array(fixed_bytes), np.array(0.0))] if fixed_bytes else []
  out += [Table(key, table, np.zeros_like(table)) for key, table in tiled.items()]
  return out + _bytes_tables(problem, total)


def _stored_table(problem: Problem, t, dims, scope) -> np.ndarray:
  """An input's per-device bytes as the compiler stores its shard (`cost.stored_bytes`),
  for every choice of its scope's domains."""
  return _shard_table(problem, t.shape, dims, scope,
                      lambda shape: costlib.stored_bytes(shape, t.itemsize, problem.profile))


def _shard_table(problem: Problem, shape, dims, scope, shard_bytes) -> np.ndarray:
  """`shard_bytes` of a value's shard, for every choice of its scope's domains."""
  domains = tuple(problem.domains[c] for c in scope)
  table = np.empty(tuple(len(d) for d in domains), float)
  for idx in itertools.product(*(range(len(d)) for d in domains)):
    choice = {c: domains[k][j] for k, (c, j) in enumerate(zip(scope, idx))}
    table[idx] = shard_bytes(_shard_shape(problem, shape, dims, choice))
  return table


def _shard_shape(problem: Problem, shape, dims, choice) -> tuple[int, ...]:
  return tuple(-(-n // math.prod(problem.mesh.size(a) for a in d))
               for n, d in zip(shape, _axes(dims, choice)))


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
    table = _divide(nbytes, _union_shards(problem.mesh,
                                          tuple(problem.domains[c] for c in scope)))
    out.append(Table(scope, table, np.zeros_like(table)))
  return out


@functools.lru_cache(maxsize=1 << 12)
def _union_shards(mesh: costlib.MeshSpec, domains) -> np.ndarray:
  """Devices a value is split over, per choice of these domains: the product of the
  sizes of every mesh axis chosen (each once). Read-only: shared between calls."""
  table = np.empty(tuple(len(d) for d in domains), int)
  for idx in itertools.product(*(range(len(d)) for d in domains)):
    axes = {a for k, j in enumerate(idx) for a in domains[k][j]}
    table[idx] = math.prod(mesh.size(a) for a in axes)
  table.setflags(write=False)
  return table


def _axes(dims: Iterable[int | None], choice: Mapping[int, tuple[str, ...]]):
  """Per dim, the mesh axes splitting it (an axis splits the first dim asking for it)."""
  out, seen = [], set()
  for c in dims:
    entry = tuple(a for a in choice.get(c, ()) if a not in seen) if c is not None else ()
    seen.update(entry)
    out.append(entry)
  return tuple(out)


def _shards(mesh: costlib.MeshSpec, dims, stored, choice: Mapping[int, tuple[str, ...]],
            unless=(), only=()) -> int:
  """Devices one entry is split over under a choice; 0 where it takes no memory (a
  gathered copy laid out as its stored input is the input itself, nothing gathered;
  an `unless` class split; no `only` class split)."""
  if any(choice.get(c) for c in unless) or (only and not any(choice.get(c) for c in only)):
    return 0
  axes = _axes(dims, choice)
  if stored is not None and axes == _axes(stored, choice):
    return 0
  return math.prod(mesh.size(a) for d in axes for a in d)


def _per_device(problem: Problem, acts: Activations,
                choice: Mapping[int, tuple[str, ...]]) -> np.ndarray:
  kinds, index = acts.kinds
  shards = np.array([_shards(problem.mesh, d, s, choice, u, o) for d, s, u, o in kinds],
                    int)[index]
  out = _divide(acts.nbytes, shards)
  types = problem.graph.types
  for k, shard_bytes in acts.shard_bytes.items():
    out[k] = shard_bytes(_shard_shape(problem, types[acts.values[k]].shape, acts.dims[k],
                                      choice))
  return out


def _divide(nbytes, shards: np.ndarray) -> np.ndarray:
  """Per-device bytes: nbytes / shards, each entry divided on its own as a Python float
  would be; 0 where shards is 0 (the entry takes no memory)."""
  return np.where(shards > 0, nbytes / np.maximum(shards, 1), 0.0)


def activation_peak(problem: Problem, acts: Activations,
                     choice: Mapping[int, tuple[str, ...]]) -> tuple[float, int]:
  """(peak per-device bytes of live intermediates, program position of the peak)."""
  if not len(acts.nbytes):
    return 0.0, 0
  return _live_peak(acts, _per_device(problem, acts, choice))


def _live_peak(acts: Activations, nbytes: np.ndarray) -> tuple[float, int]:
  """(most bytes live at once, its position) with each entry taking `nbytes`."""
  delta = np.zeros(acts.length + 1)
  np.add.at(delta, acts.start, nbytes)
  np.add.at(delta, np.minimum(acts.stop + 1, acts.length), -nbytes)
  live = np.cumsum(delta)
  k = int(np.argmax(live))
  return float(live[k]), k


def _is_copy(acts: Activations, k: int) -> bool:
  """Whether entry k is a copy some layouts do without."""
  return _copy_kind(_stored(acts, k), acts.unless_of(k), acts.only_of(k))


def _copy_kind(stored, unless, only) -> bool:
  """Whether an entry so stored (`Activations.stored`, `unless`, `only`) is a copy
  some layouts do without."""
  return stored is not None or bool(unless or only)


def _stored(acts: Activations, k: int) -> tuple[int, ...] | None:
  return acts.stored[k] if acts.stored else None


def activation_tables(problem: Problem, acts: Activations, at: int) -> list[Table]:
  """Per-device bytes of the values live at program position `at`, as tables."""
  total: dict[tuple[int, ...], float] = {}
  copies = []
  for k in np.flatnonzero((acts.start <= at) & (acts.stop >= at)):
    if k in acts.shard_bytes:
      dims = acts.dims[k]
      scope = _scope(problem, dims)
      table = _shard_table(problem, problem.graph.types[acts.values[k]].shape, dims, scope,
                           acts.shard_bytes[k])
      copies.append(Table(scope, table, np.zeros_like(table)))
      continue
    if _is_copy(acts, k):
      copies.append(_copy_table(problem, float(acts.nbytes[k]), acts.dims[k],
                                _stored(acts, k), acts.unless_of(k), acts.only_of(k)))
      continue
    key = _scope(problem, acts.dims[k])
    total[key] = total.get(key, 0.0) + float(acts.nbytes[k])
  return _bytes_tables(problem, total) + copies


def _copy_table(problem: Problem, nbytes: float, dims, stored, unless=(), only=()
                ) -> Table:
  """A copy's bytes over its read, stored, `unless` and `only` classes (zero where the
  layouts agree, an `unless` class is split or no `only` class is)."""
  scope = _scope(problem, tuple(dims) + tuple(stored or ()) + tuple(unless) + tuple(only))
  domains = tuple(problem.domains[c] for c in scope)
  table = _divide(nbytes, _copy_shards(problem.mesh, scope, domains, tuple(dims), stored,
                                       tuple(unless), tuple(only)))
  return Table(scope, table, np.zeros_like(table))


@functools.lru_cache(maxsize=1 << 14)
def _copy_shards(mesh: costlib.MeshSpec, scope, domains, dims, stored, unless, only
                 ) -> np.ndarray:
  """`_shards` of a copy entry for every choice of its scope's domains. Read-only:
  shared between calls."""
  table = np.empty(tuple(len(d) for d in domains), int)
  for idx in itertools.product(*(range(len(d)) for d in domains)):
    choice = {c: domains[k][j] for k, (c, j) in enumerate(zip(scope, idx))}
    table[idx] = _shards(mesh, dims, stored, choice, unless, only)
  table.setflags(write=False)
  return table


def memory_used(problem: Problem, acts: Activations, memory, assignment):
  """(inputs + live intermediates at the peak, peak position, class -> axes) of a plan."""
  choice = {c: problem.domains[c][i] for c, i in assignment.items()}
  peak, at = activation_peak(problem, acts, choice)
  return evaluate_tables(memory, assignment)[0] + peak, at, choice


def memory_floor(problem: Problem, acts: Activations, memory: Iterable[Table]) -> float:
  """A lower bound on `memory_used` over every plan, without solving: each input
  table's least entry, plus, at the position where the most bytes are live whole, each
  scope's least share of its values there. (Any plan's peak is at least what it holds
  live there, and a sum's least is at least the sum of its terms' least.) Copies,
  which some layouts do without (`Activations.stored`, `unless`, `only`), and entries
  laid out per shard (`Activations.shard_bytes`) count nothing. A remat policy whose
  floor is over the budget cannot fit, whatever the search would choose.
  """
  floor = sum(float(t.value.min()) for t in memory)
  if not len(acts.nbytes):
    return floor
  _, at = _live_peak(acts, acts.nbytes)
  kinds, index = acts.kinds
  live = (acts.start <= at) & (acts.stop >= at)
  live[list(acts.shard_bytes)] = False  # laid out per shard: counted as nothing, as copies
  per_kind = np.bincount(index[live], weights=acts.nbytes[live], minlength=len(kinds))
  total: dict[tuple[int, ...], float] = {}
  for (dims, stored, unless, only), nbytes in zip(kinds, per_kind.tolist()):
    if nbytes and not _copy_kind(stored, unless, only):
      key = _scope(problem, dims)
      total[key] = total.get(key, 0.0) + nbytes
  return floor + sum(float(t.value.min()) for t in _bytes_tables(problem, total))


def largest_live(problem: Problem, acts: Activations, choice, top: int = 3) -> str:
  """The biggest intermediates live at the activation peak under a choice, as text."""
  if not len(acts.nbytes):
    return ""
  _, at = activation_peak(problem, acts, choice)
  per_device = _per_device(problem, acts, choice)
  live = np.flatnonzero((acts.start <= at) & (acts.stop >= at))
  g = problem.graph
  sliced = {inner for _, _, inner, read in problem.scan_cuts if read}
  rows = []
  for k in live[np.argsort(-per_device[live])][:top]:
    v = acts.values[k]
    if k in acts.notes:
      what = f"{g.input_path.get(v, 'an input')} {acts.notes[k]}"
    elif v in g.producer:
      op = g.ops[g.producer[v]]
      what = f"{op.name_stack or '(top)'}/{op.primitive}"
    elif v in sliced:  # a scan cut's: one layer's slice of a stacked input
      what = "a stacked input's slice for one iteration, in the loop's layout"
    elif v not in g.input_path:  # a loop body's input, written out per iteration
      what = "a scanned stack's carry, stacked for its recomputation"
    elif acts.unless_of(k):
      what = f"{g.input_path[v]} copied before its in-place update"
    else:
      what = f"{g.input_path[v]} gathered for use"
    rows.append(f"{what} {g.types[v]} "
                f"({per_device[k] / 2**20:.1f} MiB)")
  return ", ".join(rows)
