"""Interior copies of a unique layer: their live ranges mapped from their representative's.

A folded view (`views.folded_view`) searches one representative per unique layer, but
the memory model lists every copy's values, each live over its own positions. A value
a copy makes and that is read only inside that copy is written and read as the
representative's is, position for position (one fingerprint: the same ops, wiring and
types), so its entry is the representative's, moved to the copy's positions:
`mapped_entries` builds those with numpy, per unique layer, rather than walking each
copy op by op (the search stays flat in depth). Everything else is left to the direct
walk: a value read outside its instance (the residual stream, a gradient the update
reads), one whose last reader is found through a value that is, and every value of a
layer whose copies differ from the representative in what the walk asks of an op or
a value (live, fused, fed into the update, ...).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Iterable, Mapping

import numpy as np

from tapas_jax.solver.live_program import Entries, LiveProgram
from tapas_jax.solver.update_reads import UpdateReads
from tapas_jax.solver.views import Copies
from tapas_jax.trace import mask

__all__ = ["Mapped", "Reach", "mapped_entries", "merge"]


@dataclasses.dataclass(frozen=True)
class Mapped:
  """The entries `live._add_made` would add for the copies' ops it need not walk.

  Attributes:
    skip: program positions of those ops (they add exactly these entries).
    at: per entry, the position of the op adding it (the order to merge in).
    start, stop, nbytes, values: per entry, as `Entries` holds them.
    dims: per entry, the classes it is made over.
    stored: per entry, as `Entries` holds it (a copy read through a cut: the
      classes the value is made over).
  """

  skip: np.ndarray
  at: np.ndarray
  start: np.ndarray
  stop: np.ndarray
  nbytes: np.ndarray
  values: np.ndarray
  dims: tuple[tuple, ...]
  stored: tuple[tuple | None, ...]


class Reach:
  """`live._last_readers` asked value by value, for the values the direct walk adds:
  `get(v, default)` is the position of v's last reader (through the fused values its
  readers make), found from v's readers and kept; `readers(v)`: the ops counted as
  reading v. `conv`: the convolutions' transposed copies; `canon`: the view's value ->
  the value standing for it. `known`: a representative's value -> (its layer's copies'
  ops, the position in them of its last reader, -1 for none), where every copy's is
  the representative's (`mapped_entries` fills it): a copy's value is not walked from.
  """

  def __init__(self, prog: LiveProgram, update: UpdateReads, conv,
               canon: Mapping[int, int]):
    self.prog, self.update, self.conv, self.canon = prog, update, conv, canon
    self.at: dict[int, int] = {}  # value -> position (-1: no reader counts)
    self.known: dict[int, tuple[np.ndarray, int]] = {}
    self.row = None  # op -> its row in its layer's copies' ops

  def _known(self, x: int) -> int | None:
    rep = self.canon.get(x)
    if rep is None or rep not in self.known:
      return None
    ops, k = self.known[rep]
    if k < 0:
      return -1
    if self.row is None:
      self.row = np.full(len(self.prog.graph.ops), -1)
      for _, copies in self.prog.lineup.layers:
        self.row[copies] = np.arange(len(copies))[:, None]
    return int(self.prog.lineup.pos[ops[self.row[self.prog.graph.producer[x]], k]])

  def readers(self, v: int) -> list[int]:
    prog, update = self.prog, self.update
    return [c for c in prog.graph.consumers.get(v, ())
            if c in prog.pos and c in prog.live and c not in update.feeding
            and not (c in prog.update and v in update.delivered)
            and v not in self.conv.get(c, ())]

  def position(self, v: int) -> int:
    at, g, fused = self.at, self.prog.graph, self.prog.fused
    todo = [v]
    while todo:  # depth first, the fused values read later first
      x = todo[-1]
      if x in at:
        todo.pop()
        continue
      known = self._known(x) if self.known else None
      if known is not None:
        at[x] = known
        todo.pop()
        continue
      readers = self.readers(x)
      later = [w for c in readers for w in g.ops[c].outputs if w in fused and w not in at]
      if later:
        todo.extend(later)
        continue
      best = -1
      for c in readers:
        here = self.prog.pos[c]
        for w in g.ops[c].outputs:
          if w in fused and at[w] > here:
            here = at[w]
        best = max(best, here)
      at[x] = best
      todo.pop()
    return at[v]

  def get(self, v: int, default: int) -> int:
    at = self.position(v)
    return default if at < 0 else at


def merge(entries: Entries, at: list[int], own: dict[int, int], mapped: Mapped
          ) -> dict[int, int]:
  """Merges the mapped entries into the walked ones (each entry's op
  position in `at`), in program order as one walk over every op adds them; returns
  `own` (value -> its entry as made) with the mapped values', renumbered."""
  if not len(mapped.at):
    return own
  n = len(at)
  order = np.argsort(np.concatenate([np.array(at, int), mapped.at]), kind="stable")
  take = operator.itemgetter(*order.tolist())
  values = mapped.values.tolist()
  blank = len(values)
  for field, extra in (("start", mapped.start.tolist()), ("stop", mapped.stop.tolist()),
                       ("nbytes", mapped.nbytes.tolist()), ("values", values),
                       ("dims", list(mapped.dims)), ("stored", list(mapped.stored)),
                       ("unless", [()] * blank), ("only", [()] * blank),
                       ("padded", [False] * blank)):
    merged = take(getattr(entries, field) + extra)
    setattr(entries, field, list(merged) if len(order) > 1 else [merged])
  index = np.empty(len(order), int)
  index[order] = np.arange(len(order))
  own = dict(zip(own, index[list(own.values())].tolist()))
  own.update(zip(values, index[n:].tolist()))
  return own


def mapped_entries(prog: LiveProgram, copies: Iterable[Copies], readers: Callable[[int], list[int]],
                   reach: Callable[[int], int], made: Callable[[object, int, int], tuple | None],
                   feeding, delivered: Mapping, unmapped: Iterable[int], cuts,
                   known: dict | None = None) -> Mapped:
  """The made entries of the interior copies' ops whose values can be mapped.

  `readers(v)`: the ops counted as reading v (live, not
  fed into the update, ...); `reach(v)`: v's last reader's position (-1: none);
  `made(op, slot, v)`: the classes v is written over, None where `_add_made` adds no
  entry for it (`made.nbytes(op, slot, v)`: its bytes as made); `unmapped`: ops whose
  neighbourhood the walk treats apart (a convolution's transposed copies): their layer
  is walked directly; `cuts(v)`: the
  (reader, classes) of v's copies read through a cut (`live._cut_copies`; falsy: no
  cuts); `known` (`Reach.known`) gets each mapped value's last reader."""
  g, pos = prog.graph, prog.lineup.pos
  flags = {}  # built on first use: a program with no copies pays nothing

  def op_flags():
    if not flags:
      n = len(g.ops)
      flags["ops"] = [prog.alive, mask(n, feeding), prog.updating,
                      mask(n, unmapped)]
      fused, outputs, carried = prog.value_masks
      flags["values"] = [fused, mask(len(g.types), delivered)]
      flags["out"] = [outputs, carried]
    return flags

  parts = []
  for c in copies:
    part = _layer(prog, c, pos, op_flags, readers, reach, made, cuts, known)
    if part is not None:
      parts.append(part)
  if not parts:
    empty = np.zeros(0, int)
    return Mapped(empty, empty, empty, empty, np.zeros(0), empty, (), ())
  return Mapped(*(np.concatenate([p[k] for p in parts]) for k in range(6)),
                *(tuple(d for p in parts for d in p[k]) for k in (6, 7)))


def _layer(prog: LiveProgram, c: Copies, pos, op_flags, readers, reach, made, cuts, known):
  """(skip, at, start, stop, nbytes, values, dims, stored) of one unique layer's
  copies, or None where none is mapped."""
  g = prog.graph
  rep, ops = np.array(c.rep, int), c.op_rows
  rep_values, values = np.array(c.rep_values, int), c.value_rows
  if not rep_values.size:
    return None
  flags = op_flags()
  # Every copy asks the walk what the representative asks, op for op, value for value.
  if not all((f[ops] == f[rep]).all() for f in flags["ops"][:3]):
    return None
  if flags["ops"][3][rep].any() or flags["ops"][3][ops].any():
    return None
  if not all((f[values] == f[rep_values]).all() for f in flags["values"]):
    return None
  outside = np.fromiter(c.read_outside, int, len(c.read_outside))
  out = flags["out"][0]
  bad = (np.isin(rep_values, outside) | np.isin(values, outside).any(0)
         | out[rep_values] | out[values].any(0))
  # A value written in no copy as the representative's is not written: returned alike.
  alike = np.logical_and.reduce([(f[values] == f[rep_values]).all(0) for f in flags["out"]])
  slot_of = {op: k for k, op in enumerate(c.rep)}
  column = {v: s for s, v in enumerate(c.rep_values)}
  fused = prog.fused
  # A value maps where all its readers are the representative's own, and so are the
  # readers of the fused values they make (whose readers extend its live range):
  # decided last value first, as readers come after what they read.
  last = np.full(len(c.rep_values), -2)  # slot of the last reader; -1: none; -2: unmapped
  for s in range(len(c.rep_values) - 1, -1, -1):
    v = c.rep_values[s]
    if bad[s] or any(r not in slot_of or any(w in fused and last[column[w]] == -2
                                             for w in g.ops[r].outputs)
                     for r in readers(v)):
      continue
    at = reach(v)
    last[s] = -1 if at < 0 else slot_of[prog.top[at].index]
  if known is not None:
    known.update((c.rep_values[s], (ops, int(last[s])))
                 for s in np.flatnonzero(last != -2).tolist())
  # Each op of the representative: its entries, mapped when every value it writes out
  # is, and every copy writes out what it does: (column, op, start, stop, classes,
  # stored), the last three as positions in the layer.
  entries, skip, col_bytes = [], [], {}
  s = 0
  for k, i in enumerate(c.rep):
    op = g.ops[i]
    own = []
    for slot, v in enumerate(op.outputs):
      classes = made(op, slot, v) if flags["ops"][0][i] else None
      if classes is not None:
        own.append((s + slot, v, classes))
        col_bytes[s + slot] = made.nbytes(op, slot, v)
    n, s = s, s + len(op.outputs)
    if not (alike[n:s].all() and all(last[col] != -2 for col, _, _ in own)):
      continue
    skip.append(k)
    for col, v, classes in own:
      entries.append((col, k, k, k if last[col] < 0 else last[col], classes, None))
      # Its copies read through a cut, at their readers (inside: it maps).
      entries += [(col, k, slot_of[r], slot_of[r], dims, classes)
                  for r, dims in (cuts(v) if cuts else ())]
  skip_pos = pos[ops[:, skip]].ravel()
  if not entries:
    return skip_pos, *(np.zeros(0, int),) * 3, np.zeros(0), np.zeros(0, int), (), ()
  cols, op_at, start, stop = (np.array(x, int) for x in list(zip(*entries))[:4])
  nbytes = np.array([col_bytes[col] for col in cols.tolist()], float)
  m = len(c.ops)
  return (skip_pos, pos[ops[:, op_at]].ravel(), pos[ops[:, start]].ravel(),
          pos[ops[:, stop]].ravel(), np.tile(nbytes, m), values[:, cols].ravel(),
          tuple(e[4] for e in entries) * m, tuple(e[5] for e in entries) * m)
