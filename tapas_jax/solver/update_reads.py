"""What the state update reads of the rest of the program (`live.activations`' view of
the optimizer): the values it is delivered, the ops fused into it, the gradients XLA
reduces. Found from the values the update reads, not by walking every op: flat in
depth where the view folds the layers (`LiveProgram.per_op` walks every op, the
reference).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

import numpy as np

from tapas_jax.solver.live_program import LiveProgram
from tapas_jax.solver.problem import Problem

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
    delivered = _delivered(problem, prog)
    feeding = _feeding(prog, delivered, None if prog.per_op else _may_feed(prog, delivered))
    return cls(delivered, feeding, _gradients(prog, delivered, feeding))


def _delivered(problem: Problem, prog: LiveProgram) -> dict[int, tuple[tuple[int, ...], int]]:
  g, pos, live, update = prog.graph, prog.pos, prog.live, prog.update
  vcanon = problem.view.canon
  delivered = {}
  by_update = {v for v, side in problem.reader_dims if side is True}
  for w in ((w for op in prog.top if op.index in live for w in op.outputs) if prog.per_op
            else _standing_for(prog, problem.view.copies, by_update)):
    if vcanon.get(w, w) not in by_update or w in prog.outputs:
      continue
    updates = [pos[c] for c in g.consumers.get(w, ()) if c in live and c in update]
    if updates:
      delivered[w] = (tuple(problem.reader_dims[(vcanon.get(w, w), True)]), max(updates))
  return delivered


def _standing_for(prog: LiveProgram, copies, values) -> list[int]:
  """The values live top-level ops make that `values` stand for in the view: each
  made outside the interior copies itself, and the copies' of the representative's,
  in program order (op by op, output by output)."""
  g, pos = prog.graph, prog.pos
  found = set(values)
  for c in copies:
    cols = [s for s, v in enumerate(c.rep_values) if v in found]
    if cols:
      found.update(c.value_rows[:, cols].ravel().tolist())
  made = [(pos[p], g.ops[p].outputs.index(w), w) for w in found
          if (p := g.producer.get(w)) in pos and p in prog.live]
  return [w for _, _, w in sorted(made)]


def _feeding(prog: LiveProgram, delivered, among: Iterable[int] | None = None) -> set[int]:
  """The feeding ops (see `UpdateReads`), looked for among `among` (default: every
  top-level op), from the last back: an op is feeding where each value it makes feeds
  the update (`_feeds`), which asks of its readers only, decided before it."""
  feeding: set[int] = set()
  live, update = prog.live, prog.update
  if among is None:
    ops = reversed(prog.top)
  else:  # the last first, sorted on the lineup's positions (an array: no key per op)
    index = np.fromiter(among, np.int64, len(among))
    ops = map(prog.graph.ops.__getitem__,
              index[np.argsort(prog.lineup.pos[index])[::-1]].tolist())
  for op in ops:
    if op.index in live and op.outputs and op.index not in update:
      for w in op.outputs:  # a loop, not a generator per op (every copy's ops are asked)
        if not _feeds(prog, delivered, feeding, w):
          break
      else:
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


def _may_feed(prog: LiveProgram, delivered) -> set[int]:
  """The ops that can be feeding: those making a delivered value and, back from them,
  those making a fused value one of these reads. (A feeding op's outputs are each
  delivered or fused, and a fused value has a live reader, which must then be feeding
  too: walking back from the delivered values finds them all.)"""
  fused, pos, producer, ops = prog.fused, prog.pos, prog.graph.producer, prog.graph.ops
  todo = [producer[w] for w in delivered if w in producer]
  out: set[int] = set()
  while todo:
    p = todo.pop()
    if p in out or p not in pos:
      continue
    out.add(p)
    for v in ops[p].inputs:  # a loop, not a generator per op
      if v in fused:
        todo.append(producer[v])
  return out


def _gradients(prog: LiveProgram, delivered, feeding) -> dict[int, tuple[tuple[int, ...], int]]:
  pos, update = prog.pos, prog.update
  producer, types, ops = prog.graph.producer, prog.graph.types, prog.graph.ops
  gradients: dict[int, tuple[tuple[int, ...], int]] = {}
  for w, (read, last) in delivered.items():
    todo, seen = [w], set()
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
        dims0, last0 = gradients.get(x, (read, last))
        gradients[x] = (dims0, max(last0, last))
  return gradients
