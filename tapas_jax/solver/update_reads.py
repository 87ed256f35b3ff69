"""What the state update reads of the rest of the program (`live.activations`' view of
the optimizer): the values it is delivered, the ops fused into it, the gradients XLA
reduces. Found from the values the update reads, not by walking every op: flat in
depth where the view folds the layers (`LiveProgram.per_op` walks every op, the
reference).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from tapas_jax.solver.live_program import LiveProgram
from tapas_jax.solver.problem import Problem
from tapas_jax.trace import mask, ranges

__all__ = ["UpdateReads"]


@dataclasses.dataclass(frozen=True)
class UpdateReads:
  """What the state update reads of the rest of the program.

  Attributes:
    delivered: value -> (classes the update reads it in, position of its last update
      reader).
    feeding: ops that only lead to delivered values through fused values (the
      moments' `g ** 2`, `(1 - b) * g`): they fuse into the update, after the
      gradient's reduction, whatever the program order, and write nothing of their own.
    gradients: the gradients as XLA reduces them: the values a delivered value is
      computed from through feeding ops (a tied weight's two gradients, each reduced on
      its own; one gradient however many moments read it) -> (delivered classes, last
      update reader).
  """

  delivered: Mapping[int, tuple[tuple[int, ...], int]]
  feeding: frozenset[int] | set[int]
  gradients: Mapping[int, tuple[tuple[int, ...], int]]

  @classmethod
  def of(cls, problem: Problem, prog: LiveProgram) -> UpdateReads:
    if prog.per_op:
      delivered = _delivered(problem, prog)
      feeding = _feeding(prog, delivered)
      return cls(delivered, feeding, _gradients(prog, delivered, feeding))
    found = _Found.of(prog)
    delivered = found.delivered(problem)
    feeding_at = found.feeding(delivered)
    feeding = set(prog.graph.top_wiring.index[feeding_at].tolist())
    return cls(delivered, feeding, found.gradients(delivered, feeding, feeding_at))


def _delivered(problem: Problem, prog: LiveProgram) -> dict[int, tuple[tuple[int, ...], int]]:
  """The delivered values (see `UpdateReads`), every op's asked in program order."""
  g, pos, live, update = prog.graph, prog.pos, prog.live, prog.update
  vcanon = problem.view.canon
  delivered = {}
  by_update = {v for v, side in problem.reader_dims if side is True}
  for w in (w for op in prog.top if op.index in live for w in op.outputs):
    if vcanon.get(w, w) not in by_update or w in prog.outputs:
      continue
    updates = [pos[c] for c in g.consumers.get(w, ()) if c in live and c in update]
    if updates:
      delivered[w] = (tuple(problem.reader_dims[(vcanon.get(w, w), True)]), max(updates))
  return delivered


def _feeding(prog: LiveProgram, delivered) -> set[int]:
  """The feeding ops (see `UpdateReads`), every op asked from the last back: an op is
  feeding where each value it makes feeds the update (`_feeds`), which asks of its
  readers only, decided before it."""
  feeding: set[int] = set()
  live, update = prog.live, prog.update
  for op in reversed(prog.top):
    if op.index in live and op.outputs and op.index not in update:
      if all(_feeds(prog, delivered, feeding, w) for w in op.outputs):
        feeding.add(op.index)
  return feeding


def _feeds(prog: LiveProgram, delivered, feeding: set[int], w: int) -> bool:
  """Whether value `w` feeds the update: delivered to it, or fused and read only by
  feeding (or dead) ops."""
  if w in delivered:
    return True
  if w not in prog.fused:
    return False
  for c in prog.graph.consumers.get(w, ()):
    if c not in feeding and c in prog.live:
      return False
  return True


@dataclasses.dataclass(frozen=True)
class _Found:
  """The top level's wiring (`Graph.top_wiring`) as `_delivered` and `_feeding` ask it
  of a folded program: array passes over the values the update reads and the ops
  back from them, no Python step per op.

  Attributes:
    prog: the program.
    made, made_at: per value written, in program order (op by op, output by output),
      the value and its maker's position.
    read, read_at: per value read, the value and its reader's position.
    maker: value -> its maker's position (-1: an input or a literal).
    alive, updating: per position, whether its op is live, and of the state update.
  """

  prog: LiveProgram
  made: np.ndarray
  made_at: np.ndarray
  read: np.ndarray
  read_at: np.ndarray
  maker: np.ndarray
  alive: np.ndarray
  updating: np.ndarray

  @classmethod
  def of(cls, prog: LiveProgram) -> _Found:
    w = prog.graph.top_wiring
    made, made_at = w.values[~w.read], w.positions[~w.read]
    maker = np.full(len(prog.graph.types), -1)
    maker[made] = made_at
    return cls(prog, made, made_at, w.values[w.read], w.positions[w.read], maker,
               prog.alive[w.index], prog.updating[w.index])

  def delivered(self, problem: Problem) -> dict[int, tuple[tuple[int, ...], int]]:
    """`_delivered` asked of the values standing for those the update reads (the
    interior copies' through their representative's, `View.copies`): each value
    live top-level ops make, in program order, with its last live update reader."""
    g = self.prog.graph
    by_update = np.array([v for v, side in problem.reader_dims if side is True], np.int64)
    canon = np.full(len(g.types), -1)  # value -> the value standing for it, if asked
    canon[by_update] = by_update
    for c in problem.view.copies:
      rep = np.asarray(c.rep_values, np.int64)
      cols = np.flatnonzero(np.isin(rep, by_update))
      if cols.size:
        canon[c.value_rows[:, cols]] = rep[cols]
    read = (canon[self.read] >= 0) & self.alive[self.read_at] & self.updating[self.read_at]
    last = np.full(len(g.types), -1)
    np.maximum.at(last, self.read[read], self.read_at[read])
    keep = ((last[self.made] >= 0) & self.alive[self.made_at]
            & ~self.prog.value_masks[1][self.made])
    values = self.made[keep]
    stand = canon[values].tolist()
    dims = {v: tuple(problem.reader_dims[(v, True)]) for v in set(stand)}
    return dict(zip(values.tolist(), zip(map(dims.__getitem__, stand),
                                         last[values].tolist())))

  def feeding(self, delivered) -> np.ndarray:
    """Per position, whether its op is feeding: `_feeding` asked of the ops that can
    be, those making a delivered value and, back from them, those making a fused value
    one of these reads (a feeding op's outputs are each delivered or fused, and a
    fused value has a live reader, which must then be feeding too). Decided all at
    once, again until nothing changes: an op stops feeding where a value it makes is
    neither delivered nor fused and read by feeding (or dead) ops only (one answer:
    readers come after)."""
    g, w = self.prog.graph, self.prog.graph.top_wiring
    fused = self.prog.value_masks[0]
    given = mask(len(g.types), delivered)
    may = np.zeros(len(self.alive), bool)
    front = np.unique(self.maker[np.fromiter(delivered, np.int64, len(delivered))])
    front = front[front >= 0]
    while front.size:
      may[front] = True
      read = w.values[ranges(w.starts[front], w.num_inputs[front])]
      front = self.maker[read[fused[read]]]
      front = np.unique(front[front >= 0])
      front = front[~may[front]]
    asked = may & self.alive & ~self.updating & (w.num_outputs > 0)
    # The values those ops make, and the live reads of them.
    out = asked[self.made_at]
    made, made_at = self.made[out], self.made_at[out]
    read = (self.maker[self.read] >= 0) & self.alive[self.read_at]
    read &= asked[np.maximum(self.maker[self.read], 0)]
    read, read_at = self.read[read], self.read_at[read]
    feeding = asked
    while True:
      open_read = np.zeros(len(g.types), bool)
      open_read[read[~feeding[read_at]]] = True
      fails = ~given[made] & (~fused[made] | open_read[made])
      now = asked.copy()
      now[made_at[fails]] = False
      if (now == feeding).all():
        return feeding
      feeding = now

  def gradients(self, delivered, feeding: set[int], feeding_at: np.ndarray
                ) -> dict[int, tuple[tuple[int, ...], int]]:
    """`_gradients` walked back from every delivered value at once: each step an array
    of (delivered value, value reached) pairs. A delivered value computed from more
    than one gradient (a tied weight's) is walked back alone, for the order it finds
    them in."""
    if not delivered:
      return {}
    g, w = self.prog.graph, self.prog.graph.top_wiring
    items = list(delivered.values())
    shaped = np.full(len(g.types), -1, np.int8)  # asked once per value reached
    ends_by, ends = [], []  # (delivered value, gradient) pairs, as arrays
    by, x = np.arange(len(items)), np.fromiter(delivered, np.int64, len(items))
    while x.size:
      maker = self.maker[x]
      ok = maker >= 0
      ok[ok] = ~self.updating[maker[ok]]
      ask = x[ok & (shaped[x] < 0)]
      shaped[ask] = [bool(g.types[v].shape) for v in ask.tolist()]
      ok &= shaped[x] == 1
      walk = ok & feeding_at[np.maximum(maker, 0)]
      ends_by.append(by[ok & ~walk])
      ends.append(x[ok & ~walk])
      maker, count = maker[walk], w.num_inputs[maker[walk]]
      pairs = np.unique(np.repeat(by[walk], count) * len(g.types)
                        + w.values[ranges(w.starts[maker], count)])
      by, x = np.divmod(pairs, len(g.types))
    pairs = np.unique(np.concatenate(ends_by) * len(g.types) + np.concatenate(ends))
    by, x = np.divmod(pairs, len(g.types))
    many = np.unique(by[1:][by[1:] == by[:-1]])
    if many.size:
      values = list(delivered)
      walked = [(k, v) for k in many.tolist()
                for v in _computed_from(self.prog, values[k], feeding)]
      keep = ~np.isin(by, many)
      by = np.concatenate([by[keep], np.array([k for k, _ in walked], np.int64)])
      x = np.concatenate([x[keep], np.array([v for _, v in walked], np.int64)])
      order = np.argsort(by, kind="stable")
      by, x = by[order], x[order]
    # In the order the walks find them, delivered value by delivered value: each
    # gradient read as the first delivered value it is found from reads it, until the
    # last update reader of any.
    first = np.sort(np.unique(x, return_index=True)[1])
    last = np.full(len(g.types), -1)
    np.maximum.at(last, x, np.array([at for _, at in items], np.int64)[by])
    found = x[first]
    return dict(zip(found.tolist(), zip([items[k][0] for k in by[first].tolist()],
                                        last[found].tolist())))


def _gradients(prog: LiveProgram, delivered, feeding) -> dict[int, tuple[tuple[int, ...], int]]:
  gradients: dict[int, tuple[tuple[int, ...], int]] = {}
  for w, (read, last) in delivered.items():
    for x in _computed_from(prog, w, feeding):
      dims0, last0 = gradients.get(x, (read, last))
      gradients[x] = (dims0, max(last0, last))
  return gradients


def _computed_from(prog: LiveProgram, w: int, feeding) -> list[int]:
  """The gradients delivered value `w` is computed from through feeding ops, in the
  order a walk back from it finds them (the last input first)."""
  pos, update = prog.pos, prog.update
  producer, types, ops = prog.graph.producer, prog.graph.types, prog.graph.ops
  todo, seen, out = [w], set(), []
  while todo:
    x = todo.pop()
    p = producer.get(x)
    if x in seen or p not in pos or not types[x].shape or p in update:
      continue  # an input (a moment scaled in the update), a literal, a scalar, or
      # made by the update itself
    seen.add(x)
    if p in feeding:
      todo.extend(ops[p].inputs)
    else:
      out.append(x)
  return out
