"""Donated inputs XLA copies before their update (`live._add_donated_copies`).

The next state is written into its input's buffer, so XLA's copy insertion keeps the
old value in a copy unless every reader of it is ordered before the update, that is,
is an ancestor of the next value in the dataflow. Which next values a reader feeds is
found walking the program backwards, a bitmask of them per op.

A folded view's interior copies (`Lineup.layers`) are not walked op by op: what an op
of a copy feeds through its copy's own ops is what its representative's feeds, place
for place (the same ops and wiring, checked here), and what it feeds past its copy is
what the readers of the few values the copy hands out feed. A read that feeds its next
value inside its copy (a moment read by its own update) is settled there; the walk
visits only what the other readers feed (what they reach, the copies' internals taken
as their representative's), so it stays flat in depth. Without copies
(`LiveProgram.per_op`) every op reached is walked.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tapas_jax.solver.live_program import LiveProgram
from tapas_jax.trace import mask, ranges

__all__ = ["donated_copies"]


def donated_copies(prog: LiveProgram) -> list[tuple[int, int, int]]:
  """(input, first reader, update) of each donated input XLA copies before its update.

  The backward pass's read of a weight (`dy @ W.T`, for the layers below) is not an
  ancestor of the weight's next value, so without anything joining the two the whole
  input is copied. Where the batch is split, the gradients' all-reduces are combined
  into one, which every update waits on and every backward read comes before: no copy
  (measured on XLA:CPU; `unless` in the entries).
  """
  reads = _Reads.of(prog)
  if not len(reads.reader):
    return []
  copies = _Copies.of(prog, reads.maker)
  # Which reads are settled inside their copy, and which need the walk.
  open_ = np.flatnonzero(~copies.settled(reads.reader, reads.maker[reads.pair]))
  readers, makers = reads.reader[open_], reads.maker[reads.pair[open_]]
  feeds = _feeds(prog, copies, np.unique(readers))
  top, bit = prog.top, copies.bit
  fails = np.array([not feeds[top[r].index] >> bit[top[m].index] & 1
                    for r, m in zip(readers.tolist(), makers.tolist())], bool)
  copied = np.zeros(len(reads.value), bool)
  copied[reads.pair[open_[fails]]] = True
  # Per input read (reads run input by input), its first reader and its last, or update.
  read = np.unique(reads.pair)
  starts = np.searchsorted(reads.pair, read)
  first = np.minimum.reduceat(reads.reader, starts)
  last = np.maximum(np.maximum.reduceat(reads.reader, starts), reads.maker[read])
  keep = copied[read]
  return list(zip(reads.value[read][keep].tolist(), first[keep].tolist(),
                  last[keep].tolist()))


@dataclasses.dataclass(frozen=True)
class _Reads:
  """The donated inputs with shapes whose next value a top-level op makes, and their
  live top-level reads.

  Attributes:
    value, maker: per input (in `Graph.carried` order), its value and the position of
      the op making its next value.
    pair, reader: per read, its input (an index into `value`) and its reader's
      position.
  """

  value: np.ndarray
  maker: np.ndarray
  pair: np.ndarray
  reader: np.ndarray

  @classmethod
  def of(cls, prog: LiveProgram) -> _Reads:
    g, pos, w = prog.graph, prog.pos, prog.graph.top_wiring
    inputs, outputs, producer, types = g.inputs, g.outputs, g.producer, g.types
    pairs = [(v, pos[p]) for k, j in g.carried
             if (p := producer.get(outputs[k])) in pos and types[v := inputs[j].value].shape]
    value = np.array([v for v, _ in pairs], np.int64)
    maker = np.array([m for _, m in pairs], np.int64)
    alive = prog.alive[w.index]  # per position
    read, read_at = w.values[w.read], w.positions[w.read]
    keep = mask(len(types), value)[read] & alive[read_at]
    read, read_at = read[keep], read_at[keep]
    order = np.argsort(read, kind="stable")
    read, read_at = read[order], read_at[order]
    lo = np.searchsorted(read, value, "left")
    count = np.searchsorted(read, value, "right") - lo
    return cls(value, maker, np.repeat(np.arange(len(value)), count),
               read_at[ranges(lo, count)])


@dataclasses.dataclass(frozen=True)
class _Layer:
  """A unique layer whose interior copies are mapped: per place in the layer, what its
  op feeds through the layer's own ops.

  Attributes:
    targets: per place, a bitmask of `makers` (bit i: `makers[i]`).
    handed: per place, a bitmask of `values` (bit i: `values[i]`).
    makers: the places where a copy makes a next value.
    values: (place, output slot) of the values a copy hands out (reads outside it).
  """

  targets: list[int]
  handed: list[int]
  makers: list[int]
  values: list[tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class _Copy:
  """One interior copy mapped: its layer, its ops' indices (place for place), its
  makers' first bit, and the bitmask of its layer's `values` it hands out."""

  layer: _Layer
  ops: np.ndarray
  base: int
  handed: int


@dataclasses.dataclass(frozen=True)
class _Copies:
  """The interior copies mapped, and the bits of the ops making next values.

  Attributes:
    copies: the copies mapped, by number.
    layers, layer_of: the layers mapped, and per copy its layer's number in them.
    copy_at, place_at: per position, the number of the mapped copy its op is in
      (-1: none) and its place in the copy.
    bit: op making a next value -> its bit (for a mapped copy, every op at one of its
      layer's `makers`).
  """

  copies: list[_Copy]
  copy_at: np.ndarray
  place_at: np.ndarray
  bit: dict[int, int]
  layers: list[_Layer]
  layer_of: np.ndarray

  @classmethod
  def of(cls, prog: LiveProgram, makers: np.ndarray) -> _Copies:
    """`makers`: the positions of the ops making next values."""
    g, at, w = prog.graph, prog.lineup.pos, prog.graph.top_wiring
    n = len(prog.top)
    made_at = np.full(len(g.types), -1)  # value -> its maker's position (-1: none)
    made_at[w.values[~w.read]] = w.positions[~w.read]
    alive = prog.alive
    # A layer whose copies differ from their representative in what the walk asks of
    # their ops (live, wired alike among themselves) is walked op by op.
    layers = [(rep, ops) for rep, ops in prog.lineup.layers
              if len(ops) and _alike(w, made_at, at[rep], at[ops], alive[rep], alive[ops])]
    copy_at, place_at = np.full(n, -1), np.full(n, -1)
    first = 0
    for rep, ops in layers:
      copy_at[at[ops]] = np.arange(first, first + len(ops))[:, None]
      place_at[at[rep]] = place_at[at[ops]] = np.arange(len(rep))
      first += len(ops)
    # The copies' values read outside their copy.
    read, read_at = w.values[w.read], w.positions[w.read]
    maker = made_at[read]
    maker_copy = np.where(maker >= 0, copy_at[maker], -1)
    handed = (maker_copy >= 0) & (maker_copy != copy_at[read_at])
    handed_copy, handed_value = maker_copy[handed], read[handed]
    makers = np.unique(makers)
    in_copy = copy_at[makers]
    top = prog.top
    bit = {top[p].index: k for k, p in enumerate(makers[in_copy < 0].tolist())}
    copies: list[_Copy] = []
    found: list[_Layer] = []
    for rep, ops in layers:
      first, last = len(copies), len(copies) + len(ops)
      places = np.unique(place_at[makers[(in_copy >= first) & (in_copy < last)]]).tolist()
      mine = (handed_copy >= first) & (handed_copy < last)
      by = (handed_copy[mine] - first).tolist(), handed_value[mine].tolist()
      key = {x: (int(place_at[made_at[x]]), g.ops[g.producer[x]].outputs.index(x))
             for x in set(by[1])}
      values = sorted(set(key.values()))
      layer = _Layer(*_reach(prog, rep.tolist(), places, values), places, values)
      found.append(layer)
      column = dict(zip(values, range(len(values))))
      by_copy = [0] * len(ops)
      for r, x in zip(*by):
        by_copy[r] |= 1 << column[key[x]]
      base = len(bit)
      at_places = ops[:, places]
      bit.update(zip(at_places.ravel().tolist(), range(base, base + at_places.size)))
      copies += [_Copy(layer, ops[r], base + r * len(places), by_copy[r])
                 for r in range(len(ops))]
    return cls(copies, copy_at, place_at, bit, found,
               np.repeat(np.arange(len(layers)), [len(ops) for _, ops in layers]))

  def settled(self, readers: np.ndarray, makers: np.ndarray) -> np.ndarray:
    """Per read (its reader's position, and its next value's maker's), whether the
    reader feeds the maker through their copy's own ops (both in one mapped copy):
    asked once per layer and pair of places."""
    copy = self.copy_at[readers]
    same = np.flatnonzero((copy >= 0) & (copy == self.copy_at[makers]))
    out = np.zeros(len(readers), bool)
    if not len(same):
      return out
    size = len(self.place_at)
    keys, index = np.unique(
        (self.layer_of[copy[same]] * size + self.place_at[readers[same]]) * size
        + self.place_at[makers[same]], return_inverse=True)
    found = []
    for key in keys.tolist():
      k, rest = divmod(key, size * size)
      layer = self.layers[k]
      s, t = divmod(rest, size)
      found.append(bool(layer.targets[s] >> layer.makers.index(t) & 1))
    out[same] = np.array(found, bool)[index]
    return out


def _alike(w, made_at: np.ndarray, rep: np.ndarray, ops: np.ndarray, rep_alive: np.ndarray,
           alive: np.ndarray) -> bool:
  """Whether each copy (`ops`: its ops' positions, one row per copy) has its
  representative's (`rep`) live ops, and reads its own values where the representative
  reads its own, place for place (`w`: `Graph.top_wiring`; `made_at`: value -> its
  maker's position)."""
  if (alive != rep_alive).any() or (w.num_inputs[ops] != w.num_inputs[rep]).any():
    return False
  place = np.full(len(w.index), -1)
  place[rep] = np.arange(len(rep))
  rep_reads = made_at[w.values[ranges(w.starts[rep], w.num_inputs[rep])]]
  own = np.where(rep_reads >= 0, place[rep_reads], -1)
  copy = np.full(len(w.index), -1)
  copy[ops] = np.arange(len(ops))[:, None]
  place[ops] = np.arange(len(rep))
  flat = ops.ravel()
  reads = made_at[w.values[ranges(w.starts[flat], w.num_inputs[flat])]].reshape(len(ops), -1)
  mine = (reads >= 0) & (copy[reads] == np.arange(len(ops))[:, None])
  return bool((np.where(mine, place[reads], -1) == own).all())


def _reach(prog: LiveProgram, rep: list[int], makers: list[int],
           values: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
  """Per place of a layer, the bitmasks of `makers` and of `values` its representative's
  op feeds through the representative's own ops (itself included), walking them
  backwards."""
  g, live = prog.graph, prog.live
  maker_bit = {s: 1 << k for k, s in enumerate(makers)}
  value_bit = {key: 1 << k for k, key in enumerate(values)}
  targets: dict[int, int] = {}
  handed: dict[int, int] = {}
  for s in range(len(rep) - 1, -1, -1):
    op = g.ops[rep[s]]
    if op.index not in live:
      continue
    t, h = maker_bit.get(s, 0), 0
    for slot, v in enumerate(op.outputs):
      h |= value_bit.get((s, slot), 0)
      for c in g.consumers.get(v, ()):
        if c in targets:  # the representative's own live reader
          t |= targets[c]
          h |= handed[c]
    targets[op.index], handed[op.index] = t, h
  return [targets.get(i, 0) for i in rep], [handed.get(i, 0) for i in rep]


def _feeds(prog: LiveProgram, copies: _Copies, start: np.ndarray) -> dict[int, int]:
  """Per op reached from the positions `start`, the bitmask of the next values it
  feeds (itself included); a mapped copy's op stands for what it reaches in its copy."""
  g, top, bit = prog.graph, prog.top, copies.bit
  reached = _reached(prog, copies, start)
  feeds: dict[int, int] = {}
  passed: dict[int, int] = {}  # a value a copy hands out -> what it feeds
  consumers = g.consumers
  order = np.array(sorted(reached, reverse=True), np.int64)
  for j, k, s in zip(order.tolist(), copies.copy_at[order].tolist(),
                     copies.place_at[order].tolist()):
    op = top[j]
    if k < 0:
      mask = 1 << bit[op.index] if op.index in bit else 0
      for v in op.outputs:
        for c in consumers.get(v, ()):
          fed = feeds.get(c)
          # Most ops feed what their one reader feeds: that reader's mask itself, not a
          # copy (the masks are as wide as the state: a new one per op filled memory,
          # and a fresh process paid for it in page faults).
          if fed and fed is not mask:
            mask = mask | fed if mask else fed
    else:
      one = copies.copies[k]
      mask = one.layer.targets[s] << one.base
      for x in _handed(g, one, s):
        if x not in passed:
          passed[x] = 0
          for c in consumers.get(x, ()):
            passed[x] |= feeds.get(c, 0)
        mask |= passed[x]
    feeds[op.index] = mask
  return feeds


def _reached(prog: LiveProgram, copies: _Copies, start: np.ndarray) -> set[int]:
  """The positions of the live top-level ops reached from `start` through the values
  they make, a mapped copy's op reaching past its copy only through the values the
  copy hands out (what it reaches inside is its representative's)."""
  g, top, pos, live = prog.graph, prog.top, prog.pos, prog.live
  copy_at, place_at = copies.copy_at, copies.place_at
  seen = set(start.tolist())
  todo = list(seen)
  while todo:
    j = todo.pop()
    k = int(copy_at[j])
    values = top[j].outputs if k < 0 else _handed(g, copies.copies[k], int(place_at[j]))
    for v in values:
      for c in g.consumers.get(v, ()):
        q = pos.get(c)
        if q is not None and q not in seen and c in live and (k < 0 or copy_at[q] != k):
          seen.add(q)
          todo.append(q)
  return seen


def _handed(g, one: _Copy, s: int) -> list[int]:
  """The values copy `one` hands out that its op at place `s` feeds in the copy."""
  layer, out = one.layer, []
  handed = layer.handed[s] & one.handed
  while handed:
    low = handed & -handed
    handed ^= low
    place, slot = layer.values[low.bit_length() - 1]
    out.append(g.ops[int(one.ops[place])].outputs[slot])
  return out
