"""Repeats found by structure alone: the part of folding (`fold.py`) that needs no names.

Tandem repeats in the sequence of op signatures give runs of identical units (forward
blocks, backward blocks, optimizer phases); units of later runs join the instance they
share most values with. `fold` uses this when names find no repeats, and when names
leave much of the program outside layers (per-op names, Keras style) and structure
folds it clearly better.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tapas_jax.trace import trace
  >>> from tapas_jax.repeats import segment_by_structure
  >>> def net(ws, x):
  ...   for w in ws:
  ...     x = jnp.tanh(x @ w) + x
  ...   return jnp.sum(x)
  >>> g = trace(net, [jax.ShapeDtypeStruct((8, 8), jnp.float32)] * 4,
  ...           jax.ShapeDtypeStruct((2, 8), jnp.float32))
  >>> instances, _ = segment_by_structure(g, g.region_ops(0), {})
  >>> sorted(instances)
  [('repeat0[0]',), ('repeat0[1]',), ('repeat0[2]',), ('repeat0[3]',)]
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
from typing import Iterable, Sequence

import numpy as np

from tapas_jax import rules as ruleslib
from tapas_jax.trace import Graph, Op, TopWiring, ranges

__all__ = ["ACCUMULATE", "MIN_PERIOD", "TopArrays", "Wiring", "contracts", "loop_trip",
           "segment_by_structure", "top_arrays"]

# Units shorter than this many ops are noise (e.g. a run of `add`s), not layers.
MIN_PERIOD = 3
# The AD accumulation primitive: sums of cotangents at an instance's edge.
ACCUMULATE = "add_any"
# Phases tried when cutting a periodic span into units.
_MAX_PHASES = 64
# A structural repeat must cover at least this share of the program.
_MIN_COVERAGE = 0.02
# How many candidate periods the structural detector checks.
_MAX_PERIODS = 256


def contracts(graph: Graph, ops: Iterable[int]) -> bool:
  """Whether any of `ops` contracts (a dot, a convolution: `Facts.contracts`) or holds
  a loop or branch. A repeated scope is a layer only if it contracts something:
  repeated layer norms or casts are cheap glue, not a sharding decision worth folding."""
  known: dict[str, bool] = {}  # per primitive: the ops hold few distinct ones
  for i in ops:
    op = graph.ops[i]
    if op.subregions:
      return True
    c = known.get(op.primitive)
    if c is None:
      c = known[op.primitive] = ruleslib.facts(op.primitive).contracts
    if c:
      return True
  return False


def loop_trip(graph: Graph, op: Op) -> int:
  """The trip count of a loop op whose body is at least a unit long, else 0."""
  for r in op.subregions:
    region = graph.regions[r]
    if region.trip_count and region.trip_count > 1 and sum(
        1 for o in graph.ops if o.region == r) >= MIN_PERIOD:
      return region.trip_count
  return 0


@dataclasses.dataclass(frozen=True, eq=False)
class TopArrays:
  """The top-level ops' signatures and wiring as arrays, found once per `fold`.

  Folding by structure, and both ways of folding when they compare and bound the
  instances they found, read every op's signature and values; a Python pass over the
  ops per reader was a good part of folding.

  Attributes:
    wiring: the graph's own wiring arrays (`trace.TopWiring`, built once per graph),
      handed on as they are.
    codes: per top-level op, its signature (`blind`'s where given) as an int: equal
      ints, equal signatures.
    accumulate: per top-level op, whether it is a cotangent sum (`ACCUMULATE`).
    literal: per value of the graph, whether it is a literal (`Graph.literals`).
  """

  wiring: TopWiring
  codes: np.ndarray
  accumulate: np.ndarray
  literal: np.ndarray


def top_arrays(graph: Graph, top: Sequence[Op], blind: dict[int, str]) -> TopArrays:
  """`TopArrays` of `top` (`graph.region_ops(0)`), signatures blind where `blind` says."""
  wiring = graph.top_wiring  # kept on the graph: the search reads it too
  row = wiring.row
  signatures = [op.signature for op in top]
  for i, text in blind.items():  # few ops: the slices and pads
    if row[i] >= 0:
      signatures[row[i]] = text
  code = {text: k for k, text in enumerate(dict.fromkeys(signatures))}
  codes = np.fromiter(map(code.__getitem__, signatures), np.int64, len(top))
  primitives = [op.primitive for op in top]
  accumulate = np.fromiter(map(ACCUMULATE.__eq__, primitives), bool, len(top))
  literal = np.zeros(len(graph.types), bool)
  literal[np.fromiter(graph.literals, np.int64, len(graph.literals))] = True
  return TopArrays(wiring=wiring, codes=codes, accumulate=accumulate, literal=literal)


class Wiring:
  """Disjoint lists of top-level ops, each in program order, and how each is wired, as
  arrays: the lists concatenated, then their ops' inputs and outputs.

  `subgraph_fingerprint` names a value made inside a list by (op position, output
  slot), and one from outside by how many values the list had named before its first
  use; `keys` holds the same names (those from outside counted among themselves: each
  op's outputs count alike in two lists with the same signatures), so two lists have
  equal keys exactly when they fingerprint alike.
  """

  def __init__(self, arrays: TopArrays, op_lists: Sequence[Sequence[int]]):
    self._arrays = arrays
    self._sizes = np.fromiter(map(len, op_lists), np.int64, len(op_lists))
    num = int(self._sizes.sum())
    self.rows = arrays.wiring.row[np.fromiter(itertools.chain.from_iterable(op_lists), np.int64,
                                       num)]  # positions in the top level
    self.owner = np.repeat(np.arange(len(op_lists)), self._sizes)  # list of each row
    self._bounds = np.concatenate([[0], np.cumsum(self._sizes)])
    pos = np.arange(num) - self._bounds[:-1][self.owner]  # position within its list
    starts, n_in = arrays.wiring.starts[self.rows], arrays.wiring.num_inputs[self.rows]
    n_out = arrays.wiring.num_outputs[self.rows]
    self._n_in, self._n_out = n_in, n_out
    self.out_values = arrays.wiring.values[ranges(starts + n_in, n_out)]
    out_row = np.repeat(np.arange(num), n_out)
    made_at = np.full(len(arrays.literal), -1, np.int64)  # value -> row making it
    made_at[self.out_values] = out_row
    slot = np.zeros(len(arrays.literal), np.int64)
    slot[self.out_values] = np.arange(len(out_row)) - np.repeat(np.cumsum(n_out) - n_out,
                                                                 n_out)
    self.in_values = v = arrays.wiring.values[ranges(starts, n_in)]
    in_row = np.repeat(np.arange(num), n_in)
    self.in_owner = in_owner = self.owner[in_row]
    maker = made_at[v]
    inside = (maker >= 0) & (self.owner[np.maximum(maker, 0)] == in_owner)
    # Values from outside: numbered by first use within their list.
    outside = np.flatnonzero(~inside)
    _, first, again = np.unique(in_owner[outside] * len(arrays.literal) + v[outside],
                                return_index=True, return_inverse=True)
    is_first = np.zeros(len(outside), bool)
    is_first[first] = True
    self.first_use = np.zeros(len(v), bool)
    self.first_use[outside[is_first]] = True
    order = np.cumsum(is_first) - 1
    per_list = np.bincount(in_owner[outside[is_first]], minlength=len(op_lists))
    order -= (np.cumsum(per_list) - per_list)[in_owner[outside]]
    self._ref = np.where(inside, pos[np.maximum(maker, 0)], 0)
    self._ref[outside] = -1 - order[first][again.ravel()]
    self._slot = np.where(inside, slot[v], 0)
    in_ends = np.concatenate([[0], np.cumsum(n_in)])
    self._in_bounds = in_ends[self._bounds]
    out_ends = np.concatenate([[0], np.cumsum(n_out)])
    self._out_bounds = out_ends[self._bounds]

  def made_by(self) -> np.ndarray:
    """Per value of the graph, the list whose ops make it, else -1."""
    out = np.full(len(self._arrays.literal), -1, np.int64)
    out[self.out_values] = np.repeat(self.owner, self._n_out)
    return out

  def keys(self) -> list[tuple[bytes, ...]]:
    """Per list, its canonical wiring: equal exactly where the fingerprints are."""
    codes = self._arrays.codes[self.rows]
    out = []
    for j in range(len(self._sizes)):
      a, b = self._bounds[j], self._bounds[j + 1]
      c, d = self._in_bounds[j], self._in_bounds[j + 1]
      out.append((codes[a:b].tobytes(), self._n_in[a:b].tobytes(),
                  self._n_out[a:b].tobytes(), self._ref[c:d].tobytes(),
                  self._slot[c:d].tobytes()))
    return out

  def boundaries(self, returned: Sequence[int]) -> list[tuple[tuple[int, ...],
                                                             tuple[int, ...]]]:
    """Per list, (values it reads from outside, literals left out, in order of first
    use; values it makes that are `returned` by the program or read by a top-level op
    outside it, in program order)."""
    arrays = self._arrays
    owner_at = np.full(len(arrays.codes), -1, np.int64)  # top-level position -> list
    owner_at[self.rows] = self.owner
    maker_owner = self.made_by()
    w = arrays.wiring
    reads = w.values[w.read]
    theirs = maker_owner[reads]
    leaves = np.zeros(len(arrays.literal), bool)
    leaves[reads[(theirs >= 0) & (owner_at[w.positions[w.read]] != theirs)]] = True
    leaves[np.asarray(returned, np.int64)] = True
    takes = self.first_use & ~arrays.literal[self.in_values]
    out = []
    for j in range(len(self._sizes)):
      c, d = self._in_bounds[j], self._in_bounds[j + 1]
      e, f = self._out_bounds[j], self._out_bounds[j + 1]
      made = self.out_values[e:f]
      out.append((tuple(self.in_values[c:d][takes[c:d]].tolist()),
                  tuple(made[leaves[made]].tolist())))
    return out


def _candidate_periods(codes: np.ndarray) -> list[int]:
  """Gaps between successive occurrences of the same signature, most common first."""
  order = np.lexsort((np.arange(len(codes)), codes))
  same = codes[order][1:] == codes[order][:-1]
  gaps = (order[1:] - order[:-1])[same]
  gaps = gaps[gaps >= MIN_PERIOD]
  if not len(gaps):
    return []
  values, counts = np.unique(gaps, return_counts=True)
  score = counts * values  # ops a repeat of that period could cover
  keep = values[np.argsort(-score, kind="stable")][:_MAX_PERIODS]
  return sorted(int(p) for p in keep)


def _tandem_repeats(codes: np.ndarray) -> list[tuple[int, int, int]]:
  """Non-overlapping periodic spans (start, stop, period), most ops saved first.

  `codes[start:stop]` repeats with `period` at least twice. Where a unit starts inside
  the span (its phase) is not decided here: any rotation of a unit repeats too.
  """
  found = []
  n = len(codes)
  same = np.zeros(n + 2, bool)  # reused: one buffer for every period
  for p in _candidate_periods(codes):
    # Runs of codes[j] == codes[j + p], between False ends.
    eq = same[:n - p + 2]
    np.equal(codes[p:], codes[:-p], out=eq[1:-1])
    eq[-1] = False
    edges = np.flatnonzero(eq[1:] != eq[:-1])
    starts, ends = edges[0::2], edges[1::2]
    copies = (ends - starts) // p + 1
    keep = (copies >= 3) | ((copies >= 2) & (copies * p >= _MIN_COVERAGE * n))
    for start, end, c in zip(starts[keep].tolist(), ends[keep].tolist(),
                             copies[keep].tolist()):
      # Ops saved by folding: a long run of a short unit beats two copies of a long one.
      found.append(((c - 1) * p, -p, start, end + p, p))
  return _best_disjoint(found + _trimmed(found))


def _trimmed(found: list[tuple[int, int, int, int, int]]) -> list[tuple[int, int, int, int, int]]:
  """Copies of spans with less than a period cut off an end where another span ends or
  starts: two runs of different blocks share the op between them (the residual add has
  one signature in both) and would otherwise exclude each other."""
  stops = np.array(sorted({f[3] for f in found}), np.int64)
  starts = np.array(sorted({f[2] for f in found}), np.int64)
  out = []
  for _, _, start, stop, p in found:
    lo = min(start + p, stop - 2 * p)  # keep two whole copies
    for s in stops[np.searchsorted(stops, start, "right"):np.searchsorted(stops, lo, "right")]:
      out.append((((stop - s) // p - 1) * p, -p, int(s), stop, p))
    hi = max(stop - p, start + 2 * p)
    for t in starts[np.searchsorted(starts, hi, "left"):np.searchsorted(starts, stop, "left")]:
      out.append((((t - start) // p - 1) * p, -p, start, int(t), p))
  return out


def _best_disjoint(found: list[tuple[int, int, int, int, int]]) -> list[tuple[int, int, int]]:
  """Weighted interval scheduling: the disjoint spans that save the most ops in total.

  Greedy by single-span score would let two copies of a long unit (Adam's mu and nu
  corrections together) shadow two long runs of a short one.
  """
  spans = sorted(found, key=lambda f: f[3])  # by stop
  stops = [f[3] for f in spans]
  best = [0] * (len(spans) + 1)
  take = [False] * len(spans)
  prev = [0] * len(spans)
  for k, (saved, _, start, _stop, _) in enumerate(spans):
    prev[k] = int(np.searchsorted(stops, start, side="right"))
    with_k = saved + best[prev[k]]
    take[k] = with_k > best[k]
    best[k + 1] = max(best[k], with_k)
  chosen = []
  k = len(spans) - 1
  while k >= 0:
    if take[k]:
      _, _, start, stop, p = spans[k]
      chosen.append((start, stop, p))
      k = prev[k] - 1
    else:
      k -= 1
  return sorted(chosen)


def _cut_sizes(facts: _OpFacts, start: int, stop: int) -> np.ndarray:
  """cut[j - start]: values made in top[start:j] and read in top[j:stop].

  A layer boundary is where few values cross (the residual stream): the place to cut
  a periodic span into units. Values from outside the span (saved activations read
  by a backward pass) cross every point alike, so they are left out.
  """
  lo, hi = facts.starts[start], facts.starts[stop]
  values, pos, read = facts.values[lo:hi], facts.positions[lo:hi], facts.read[lo:hi]
  # The last read in the span of each value read there.
  backwards_v, backwards_pos = values[read][::-1], pos[read][::-1]
  read_v, first = np.unique(backwards_v, return_index=True)
  last = np.full(facts.num_values, -1, np.int64)
  last[read_v] = backwards_pos[first]
  made_v, made_at = values[~read], pos[~read]
  crossing = last[made_v] > made_at
  delta = np.zeros(stop - start + 2, np.int64)
  np.add.at(delta, made_at[crossing] + 1 - start, 1)
  np.add.at(delta, last[made_v[crossing]] + 1 - start, -1)
  return np.cumsum(delta)[:stop - start]


class _OpFacts:
  """What matching and alignment read of the top-level ops, found once.

  Every candidate phase cuts a span into units anew, and these facts, found per unit
  and phase, made folding a pass over the span per phase; here they are found once per
  `segment_by_structure` call, as arrays in program order.

  Attributes:
    values: the non-scalar, non-literal values each top-level op reads, then those it
      writes (repeats kept), flattened in program order: op top[t]'s are
      values[starts[t]:starts[t + 1]].
    starts: where each op's values start in `values`, then the end.
    positions: per entry of `values`, the position in `top` of its op.
    read: per entry of `values`, whether its op reads it (else writes it).
    num_values: how many values the graph has.
    ranked: the graph inputs' key paths, split at "/", in list order.
    path_pos: positions in `top` of the ops that read graph inputs, ascending.
    path_lo: per such op, the least rank in `ranked` of the paths it reads.
    path_hi: per such op, the greatest.
  """

  def __init__(self, graph: Graph, top: Sequence[Op], top_pos: list[int], arrays: TopArrays):
    self._top_pos = top_pos
    keep = np.fromiter(map(bool, map(operator.attrgetter("shape"), graph.types)), bool,
                       len(graph.types))
    keep[arrays.literal] = False
    kept = keep[arrays.wiring.values]
    self.values = arrays.wiring.values[kept]
    self.positions = arrays.wiring.positions[kept]
    self.read = arrays.wiring.read[kept]
    self.starts = np.concatenate([[0], np.cumsum(np.bincount(self.positions,
                                                             minlength=len(top)))])
    self._values, self._starts = self.values.tolist(), self.starts.tolist()
    self.num_values = len(graph.types)
    # Few ops read graph inputs: they are found from the inputs' readers.
    paths = [tuple(i.path.split("/")) for i in graph.inputs]
    self.ranked = sorted(set(paths))
    rank = {path: r for r, path in enumerate(self.ranked)}
    lo: dict[int, int] = {}
    hi: dict[int, int] = {}
    for inp, path in zip(graph.inputs, paths):
      r = rank[path]
      for c in graph.consumers.get(inp.value, ()):
        t = top_pos[c]
        if t >= 0:
          lo[t] = min(lo.get(t, r), r)
          hi[t] = max(hi.get(t, r), r)
    self.path_pos = np.array(sorted(lo), np.int64)
    self.path_lo = np.array([lo[t] for t in self.path_pos.tolist()], np.int64)
    self.path_hi = np.array([hi[t] for t in self.path_pos.tolist()], np.int64)

  def touch(self, ops: Iterable[int]) -> set[int]:
    """Non-scalar, non-literal values an op set reads or writes."""
    out = set()
    for i in ops:
      t = self._top_pos[i]
      out.update(self._values[self._starts[t]:self._starts[t + 1]])
    return out

  def touch_op(self, i: int) -> list[int]:
    """The values op `i` reads or writes, as `touch` but listed (repeats kept)."""
    t = self._top_pos[i]
    return self._values[self._starts[t]:self._starts[t + 1]]

  def touch_range(self, begin: int, end: int) -> set[int]:
    """`touch` of top[begin:end]."""
    return set(self._values[self._starts[begin]:self._starts[end]])


class _Span:
  """A periodic span's ops as arrays, to score each candidate phase of it.

  A phase cuts the span's ops into units anew, and scoring it by the units' ops was a
  pass over the span per phase. Here the span's values are paired once with the
  earlier instances that touch them; a phase is then its unit boundaries, and its
  score a few array operations.
  """

  def __init__(self, begin: int, end: int, facts: _OpFacts, touches: _Touches):
    """Gathers `top[begin:end]`, with `touches` as they stand (no phase changes them)."""
    first, last = facts.starts[begin], facts.starts[end]
    pos = np.repeat(np.arange(begin, end), np.diff(facts.starts[begin:end + 1]))
    ids, values = np.unique(facts.values[first:last], return_inverse=True)
    counts = touches.count[ids]
    # Most values have one holder at most: the first; the others are listed.
    holders = np.repeat(touches.first[ids], counts)
    at = np.cumsum(counts) - counts
    for j in np.flatnonzero(counts > 1).tolist():
      holders[at[j]:at[j] + counts[j]] = touches.holders(int(ids[j]))
    # One row per (value of an op, instance holding it).
    per_value = counts[values]
    rows = np.repeat(np.arange(len(values)), per_value)
    offset = (np.cumsum(counts) - counts)[values[rows]]
    within = np.arange(len(rows)) - np.repeat(np.cumsum(per_value) - per_value, per_value)
    self._pos = pos[rows]
    self._values = values[rows]
    self._holders = holders[offset + within]
    self._num_values = max(len(ids), 1)
    self._num_holders = max(len(touches), 1)
    lo, hi = np.searchsorted(facts.path_pos, [begin, end])
    self._path_pos = facts.path_pos[lo:hi]
    self._lo = facts.path_lo[lo:hi]
    self._hi = facts.path_hi[lo:hi]
    self._ranked = facts.ranked

  @staticmethod
  def _units(bounds: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unit of each position inside the units, which positions are inside)."""
    inside = (pos >= bounds[0]) & (pos < bounds[-1])
    return np.searchsorted(bounds, pos[inside], "right") - 1, inside

  def match(self, bounds: np.ndarray) -> tuple[int, dict]:
    """`_match` of the units `top[bounds[u]:bounds[u + 1]]` to the instances."""
    unit, inside = self._units(bounds, self._pos)
    # A value counts once per unit, however many of the unit's ops touch it.
    keys = np.unique((unit * self._num_values + self._values[inside]) * self._num_holders
                     + self._holders[inside])
    pairs, shared = np.unique((keys // (self._num_values * self._num_holders))
                              * self._num_holders + keys % self._num_holders,
                              return_counts=True)
    keep = shared >= 2
    return _assign(zip(shared[keep].tolist(), (pairs[keep] // self._num_holders).tolist(),
                       (pairs[keep] % self._num_holders).tolist()))

  def path_affinity(self, bounds: np.ndarray) -> int:
    """How well the units line up with the argument pytree: summed common path
    prefixes. A unit cut at the true layer boundary reads `params/blocks/3/...` only;
    a rotated one straddles two layers and shares just `params/blocks`."""
    unit, inside = self._units(bounds, self._path_pos)
    lo = np.full(len(bounds) - 1, len(self._ranked), np.int64)
    hi = np.full(len(bounds) - 1, -1, np.int64)
    np.minimum.at(lo, unit, self._lo[inside])
    np.maximum.at(hi, unit, self._hi[inside])
    total = 0
    for a, b in zip(lo[hi >= 0].tolist(), hi[hi >= 0].tolist()):
      first, last = self._ranked[a], self._ranked[b]
      n = 0
      while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
      total += n
    return total


class _Touches:
  """The values each instance reads or writes, indexed by value: matching a unit asks
  which instances share its values, and scanning every instance per unit would make
  folding quadratic in depth.

  Most values are touched by one instance: the index keeps the first toucher of each
  value in a dict (filled from sets, in C) and only the later ones in lists, since a
  list per value was most of indexing.
  """

  def __init__(self, num_values: int):
    self.sets: list[set[int]] = []
    self._first: dict[int, int] = {}
    self._more: dict[int, list[int]] = collections.defaultdict(list)
    # The same as arrays, for a span's values at once (`_Span`): per value, how many
    # instances touch it and the first of them.
    self.count = np.zeros(num_values, np.int64)
    self.first = np.zeros(num_values, np.int64)

  def __len__(self) -> int:
    return len(self.sets)

  def append(self, values: set[int]) -> None:
    self.sets.append(set())
    self.add(len(self.sets) - 1, values)

  def add(self, k: int, values: set[int]) -> None:
    new = values - self.sets[k]
    self.sets[k] |= new
    fresh = set(itertools.filterfalse(self._first.__contains__, new))
    self._first.update(dict.fromkeys(fresh, k))
    for v in new - fresh:
      self._more[v].append(k)
    added = np.fromiter(new, np.int64, len(new))
    self.first[np.fromiter(fresh, np.int64, len(fresh))] = k
    self.count[added] += 1

  def holders(self, v: int) -> Sequence[int]:
    """The instances that touch value `v`, in the order they came to."""
    k = self._first.get(v)
    if k is None:
      return ()
    return [k, *self._more[v]] if v in self._more else (k,)

  def holding(self, values: Iterable[int]) -> set[int]:
    """The instances that touch any of `values`."""
    out = set()
    for v in values:
      k = self._first.get(v)
      if k is not None:
        out.add(k)
        if v in self._more:
          out.update(self._more[v])
    return out

  def shared(self, values: Iterable[int]) -> dict[int, int]:
    """Instance -> how many of `values` it touches (instances touching none left out)."""
    counts: dict[int, int] = {}
    for v in values:
      for k in self.holders(v):
        counts[k] = counts.get(k, 0) + 1
    return counts


def _match(unit_touch: list[set[int]], touches: _Touches,
           among: set[int] | None = None) -> tuple[int, dict]:
  """Greedy one-to-one unit -> instance matching by shared values; (score, mapping).

  Only instances in `among`, where given, are candidates."""
  return _assign([(shared, u, i)
                  for u, t in enumerate(unit_touch)
                  for i, shared in touches.shared(t).items()
                  if shared >= 2 and (among is None or i in among)])


def _assign(shares: Iterable[tuple[int, int, int]]) -> tuple[int, dict]:
  """`_match` from (shared values, unit, instance) triples with shared >= 2."""
  pairs = sorted(((shared, -u, -i, u, i) for shared, u, i in shares), reverse=True)
  target: dict[int, int] = {}
  used, score = set(), 0
  for shared, _, _, u, i in pairs:
    if u not in target and i not in used:
      target[u] = i
      used.add(i)
      score += shared
  # A span may hold two units per instance (Adam corrects mu, then nu, leaf by leaf
  # with identical ops): the rest go to the instance they share most with.
  for shared, _, _, u, i in pairs:
    if u not in target:
      target[u] = i
      score += shared
  return score, target


def _split_straddling(graph: Graph, facts: _OpFacts, ops: list[int], touches: _Touches,
                      target: int) -> dict[int, list[int]]:
  """Instance -> ops of a unit matched to `target`, split where the unit straddles.

  An elementwise pass over every leaf (Adam's bias corrections: the mu then the nu
  leaves of all layers, one op each) repeats with the period of the whole pass when it
  runs twice, so one unit holds every layer's leaves. A unit that contracts nothing and
  shares values with several instances is such a pass: each op goes to the instance
  whose values it reads or writes, ops between them (the scalar correction factor both
  read) to the one instance their neighbours in the unit agree on, the rest to glue.
  """
  if contracts(graph, ops):
    return {target: list(ops)}
  owner: dict[int, int] = {}
  for i in ops:
    hits = touches.holding(facts.touch_op(i))
    if len(hits) == 1:
      owner[i] = hits.pop()
  if len(set(owner.values())) <= 1:
    return {target: list(ops)}
  members = set(ops)
  for _ in range(len(ops)):
    changed = False
    for i in ops:
      if i in owner:
        continue
      op = graph.ops[i]
      near = [graph.producer.get(v) for v in op.inputs] + [
          c for v in op.outputs for c in graph.consumers.get(v, ())]
      seen = {owner.get(j, -1) for j in near if j in members}
      if len(seen) == 1 and -1 not in seen:
        owner[i] = seen.pop()
        changed = True
    if not changed:
      break
  out: dict[int, list[int]] = collections.defaultdict(list)
  for i in ops:
    if i in owner:
      out[owner[i]].append(i)
  return out


def _best_phase(seq_pos: np.ndarray, span: tuple[int, int, int], facts: _OpFacts,
                touches: _Touches) -> tuple[list[int], dict[int, int]]:
  """Where to cut a periodic span seq[start:stop] (period p) into units.

  Returns:
    The units' boundaries in `top` (unit u is top[bounds[u]:bounds[u + 1]]), and the
    units matched to earlier instances (`_match`).
  """
  start, stop, p = span
  # Candidate phases: the cheapest cuts within one period.
  # Cut in the second period: the first one has nothing made before it.
  # Cut sizes in program order, where each unit starts: at its first op, after the
  # sums that end the one before.
  at = seq_pos[start:stop]
  top_cut = _cut_sizes(facts, int(at[0]), int(seq_pos[stop]))
  cut = top_cut[at[p:2 * p] - at[0]]
  phases = [int(x) for x in np.flatnonzero(cut == cut.min())][:_MAX_PHASES]
  # Also the cheapest cuts that keep every copy whole: a later phase drops a unit.
  whole = cut[:(stop - start) % p + 1]
  phases += [int(x) for x in np.flatnonzero(whole == whole.min())][:_MAX_PHASES]
  phases = sorted(set(phases))
  ops = _Span(int(at[0]), int(seq_pos[stop]), facts, touches)
  scored = []
  for phase in phases:
    first = start + phase
    count = len(range(first, stop - p + 1, p))
    bounds = seq_pos[first:first + count * p + 1:p]
    # With no instances yet nothing matches.
    score, target = ops.match(bounds) if len(touches) else (0, {})
    scored.append((score, phase, bounds, target))
  # The best match wins; the path affinity (the dearer score) only breaks its ties,
  # then the earlier phase.
  top_score = max(s[0] for s in scored)
  tied = [s for s in scored if s[0] == top_score]
  if len(tied) > 1:
    tied = [max(tied, key=lambda s: (ops.path_affinity(s[2]), -s[1]))]
  _, _, bounds, target = tied[0]
  return bounds.tolist(), target


def segment_by_structure(graph: Graph, top: Sequence[Op], blind: dict[int, str],
                         arrays: TopArrays | None = None):
  """Name -> ops of instances found by tandem repeats, matched across runs by dataflow.

  Cotangent sums (`add_any`) are left out of the sequence searched for repeats and
  travel with the ops before them: the first block of a backward pass starts each
  chain of sums its successors extend (a stacked parameter's gradient, a shared
  table's), so it holds one sum fewer per chain and would break the period.

  `arrays`: `top_arrays(graph, top, blind)`, where the caller has it already.
  """
  if arrays is None:
    arrays = top_arrays(graph, top, blind)
  # The sequence searched is `top` less the sums. Where each of its ops sits in `top`,
  # then the end: unit seq[j:j + p] is top[seq_pos[j]:seq_pos[j + p]], the sums after
  # each op included.
  seq_pos = np.append(np.flatnonzero(~arrays.accumulate), len(top))
  codes = arrays.codes[seq_pos[:-1]]
  top_pos = arrays.wiring.row.tolist()  # op index -> position in `top`, else -1
  index = arrays.wiring.index.tolist()

  instances: list[list[int]] = []
  names: list[str] = []
  touches = _Touches(len(graph.types))
  facts = _OpFacts(graph, top, top_pos, arrays)
  for k, (start, stop, p) in enumerate(_tandem_repeats(codes)):
    bounds, target = _best_phase(seq_pos, (start, stop, p), facts, touches)
    units = [index[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    for u, ops in enumerate(units):
      if u in target:
        for owner, part in _split_straddling(graph, facts, ops, touches,
                                             target[u]).items():
          instances[owner].extend(part)
          whole = len(part) == len(ops)  # the unit unsplit: its values are one slice
          touches.add(owner, facts.touch_range(bounds[u], bounds[u + 1]) if whole
                      else facts.touch(part))
      elif contracts(graph, ops):  # a new layer must contract something
        instances.append(list(ops))
        names.append(f"repeat{k}[{u}]")
        touches.append(facts.touch_range(bounds[u], bounds[u + 1]))
  # Counted loops (a scanned stack): the backward scan joins the forward one it reads.
  loop_ops = [op for op in top if op.subregions and loop_trip(graph, op)]
  claimed = {i for inst in instances for i in inst} if loop_ops else set()
  loops: list[int] = []
  for op in loop_ops:
    if op.index not in claimed:
      t = facts.touch([op.index])
      _, target = _match([t], touches, among=set(loops))
      if 0 in target:
        k = target[0]
        instances[k].append(op.index)
        touches.add(k, t)
      else:
        loops.append(len(instances))
        instances.append([op.index])
        names.append(f"loop{len(loops) - 1}")
        touches.append(t)
  if not instances:
    return None
  return {(n,): sorted(ops) for n, ops in zip(names, instances)}, {}
