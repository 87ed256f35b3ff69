"""The top-level program as the memory model reads it, and the entries it writes.

`live.activations` and the steps it calls (`update_reads`, `template`, `reorder`,
`conv_inputs`) each read one `LiveProgram` (the program's ops in order, what XLA keeps
of them, where a folded view's interior copies sit: `Lineup`) and add what they find to
one `Entries`; both are here so that every step can name their types without importing
`live`, which calls them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Collection, Iterable, Iterator, Mapping

import numpy as np

from tapas_jax.solver.fusion import top_level
from tapas_jax.solver.problem import Problem
from tapas_jax.solver.views import Copies
from tapas_jax.trace import Graph, Op, mask

__all__ = ["Entries", "Lineup", "LiveProgram", "live_program", "readers_through"]


@dataclasses.dataclass(frozen=True)
class Lineup:
  """Where a folded view's interior copies sit in the top-level program.

  Attributes:
    pos: op index -> program position (-1: not a top-level op).
    layers: per unique layer with interior copies, (its representative's ops, the other
      copies' ops: one row per copy, position for position).
    outside: the positions of the ops in no such copy (the glue, the first and last
      instance, the representative), ascending.
    op_canon: the view's op -> the op standing for it (`View.op_canon`).
  """

  pos: np.ndarray
  layers: tuple[tuple[np.ndarray, np.ndarray], ...]
  outside: np.ndarray
  op_canon: Mapping[int, int]

  @classmethod
  def of(cls, graph: Graph, pos: Mapping[int, int], copies: Iterable[Copies],
         op_canon: Mapping[int, int]) -> Lineup:
    at = graph.top_wiring.row  # `pos` as an array, built once per graph
    layers = tuple((np.array(c.rep, int), c.op_rows) for c in copies)
    walk = np.ones(len(pos), bool)
    for _, ops in layers:
      walk[at[ops].ravel()] = False
    return cls(at, layers, np.flatnonzero(walk), op_canon)

  def where(self, graph: Graph, top, keep: Callable) -> list[int]:
    """The positions of the top-level ops `keep(op)` holds for, ascending (see
    `ops_where`)."""
    return sorted(self.pos[np.array(self.ops_where(graph, top, keep), int)].tolist())

  def ops_where(self, graph: Graph, top, keep: Callable) -> list[int]:
    """The top-level ops `keep(op)` holds for, in no order, each op asked as the op
    standing for it (`keep` may ask only what a fingerprint fixes of a copy: the
    primitive, params and types, or what the view maps copies onto)."""
    canon = self.op_canon
    found = [i for j in self.outside.tolist()
             if keep(graph.ops[canon[i]] if (i := top[j].index) in canon else top[j])]
    for rep, ops in self.layers:
      slots = [k for k, i in enumerate(rep.tolist()) if keep(graph.ops[i])]
      if slots:
        found += ops[:, slots].ravel().tolist()
    return found


@dataclasses.dataclass(frozen=True)
class LiveProgram:
  """The top-level program as `live.activations` reads it: computed once, read by each step.

  Attributes:
    graph: the traced program.
    top: its top-level ops, in program order.
    pos: op index -> position in `top`.
    live: top-level ops some output depends on.
    fused: values XLA never writes out (recomputed in their readers).
    side_reductions: reductions computed inside the fusion making their operand
      (`fusion.TopLevel`).
    outputs: the program's outputs; carried: the next values of carried state.
    update: top-level ops of the state update (by the op standing for them).
    lineup: where the view's interior copies sit (`template.Lineup`): the steps ask an
      op's own facts (its primitive, its loop body) of the ops outside them and of
      each representative only.
    per_op: every step walks every op (`live.activations(per_op=True)`): the lineup has
      no copies.
  """

  graph: Graph
  top: tuple
  pos: Mapping[int, int]
  live: frozenset[int] | set[int]
  fused: frozenset[int] | set[int]
  side_reductions: frozenset[int]
  outputs: frozenset[int]
  carried: frozenset[int]
  update: frozenset[int]
  lineup: Lineup
  per_op: bool = False

  @property
  def end(self) -> int:
    return len(self.top) - 1

  @functools.cached_property
  def alive(self) -> np.ndarray:
    """`live` as a mask over op indices, built once: the passes that map copies read it
    as an array."""
    return mask(len(self.graph.ops), self.live)

  @functools.cached_property
  def updating(self) -> np.ndarray:
    """`update` as a mask over op indices, built once."""
    return mask(len(self.graph.ops), self.update)

  @functools.cached_property
  def value_masks(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`fused`, `outputs` and `carried` as masks over value ids, built once."""
    n = len(self.graph.types)
    return mask(n, self.fused), mask(n, self.outputs), mask(n, self.carried)


def live_program(problem: Problem, cache: dict | None, per_op: bool = False) -> LiveProgram:
  g = problem.graph
  top = tuple(g.region_ops(0))
  pos = dict(zip(g.top_wiring.index.tolist(), range(len(top))))  # `top`'s, from its array
  kept = top_level(g, cache, reductions_duplicate=problem.profile.reductions_duplicate,
                   dot_operands=problem.profile.dot_operand_fusion,
                   copies=() if per_op else problem.view.copies)
  lineup = Lineup.of(g, pos, () if per_op else problem.view.copies, problem.view.op_canon)
  update = problem.update_ops
  return LiveProgram(graph=g, top=top, pos=pos, live=kept.live, fused=kept.fused,
                     side_reductions=kept.side_reductions, outputs=frozenset(g.outputs),
                     carried=frozenset(g.outputs[k] for k, _ in g.carried),
                     update=frozenset(lineup.ops_where(g, top,
                                                       lambda op: op.index in update)),
                     lineup=lineup, per_op=per_op)


class Entries:
  """Entries of a `live.Activations` as they are found: one `add` per entry, so every
  field stays one per entry (`live.activations` builds its record from them; a remat
  adds its own with `Activations.with_entries`)."""

  def __init__(self):
    self.start: list[int] = []
    self.stop: list[int] = []
    self.nbytes: list[float] = []
    self.values: list[int] = []
    self.dims: list[tuple] = []
    self.stored: list[tuple | None] = []
    self.unless: list[tuple[int, ...]] = []
    self.only: list[tuple[int, ...]] = []
    self.padded: list[bool] = []  # its bytes are the value's as stored already
    self.notes: dict[int, str] = {}  # entry -> what it holds, where its value does not say
    self.shard_bytes: dict[int, Callable[[tuple[int, ...]], float]] = {}

  def add(self, start: int, stop: int, nbytes: float, value: int, dims, *,
          stored=None, unless: tuple[int, ...] = (), only: tuple[int, ...] = (),
          padded: bool = False, note: str = "",
          shard_bytes: Callable[[tuple[int, ...]], float] | None = None) -> int:
    """Adds one entry; returns its index. `padded`: `nbytes` is as stored already;
    `note`: what a copy of an input holds, for `memory.largest_live`; `shard_bytes`:
    its bytes on a device from its shard's shape, where `nbytes` over the shards is
    not what the compiler stores (`Activations.shard_bytes`)."""
    self.start.append(start)
    self.stop.append(stop)
    self.nbytes.append(nbytes)
    self.values.append(value)
    self.dims.append(tuple(dims))
    self.stored.append(stored)
    self.unless.append(unless)
    self.only.append(only)
    self.padded.append(padded)
    if note:
      self.notes[len(self.start) - 1] = note
    if shard_bytes is not None:
      self.shard_bytes[len(self.start) - 1] = shard_bytes
    return len(self.start) - 1


def readers_through(graph: Graph, live: Collection[int], values: Iterable[int],
                    skip: Callable[[int, int], bool], through: Callable[[Op], bool]
                    ) -> Iterator[tuple[int, Op]]:
  """(value read, reader) for each reader in `live` (op indices) of `values`, looking
  through the readers `through` holds for (whose results are taken as read instead,
  each once); `skip(c, x)`: reader c of x is not counted (nor looked through). Walks a
  program's live set (`LiveProgram.live`) or a loop body's."""
  todo = list(values)
  seen = set(todo)
  while todo:
    x = todo.pop()
    for c in graph.consumers.get(x, ()):
      if c not in live or skip(c, x):
        continue
      op = graph.ops[c]
      if through(op):
        todo.extend(w for w in op.outputs if w not in seen)
        seen.update(op.outputs)
      else:
        yield x, op
