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
from typing import Iterable, Sequence

import numpy as np

from tapas_jax import rules as ruleslib
from tapas_jax.trace import Graph, Op

__all__ = ["ACCUMULATE", "MIN_PERIOD", "contracts", "loop_trip",
           "segment_by_structure"]

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
  return any(ruleslib.facts(graph.ops[i].primitive).contracts or graph.ops[i].subregions
             for i in ops)


def loop_trip(graph: Graph, op: Op) -> int:
  """The trip count of a loop op whose body is at least a unit long, else 0."""
  for r in op.subregions:
    region = graph.regions[r]
    if region.trip_count and region.trip_count > 1 and sum(
        1 for o in graph.ops if o.region == r) >= MIN_PERIOD:
      return region.trip_count
  return 0


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
  for p in _candidate_periods(codes):
    eq = np.concatenate([[False], codes[p:] == codes[:-p], [False]])
    edges = np.flatnonzero(np.diff(eq.astype(np.int8)))
    for start, end in zip(edges[0::2], edges[1::2]):
      copies = (end - start) // p + 1
      if copies >= 3 or (copies >= 2 and copies * p >= _MIN_COVERAGE * len(codes)):
        # Ops saved by folding: a long run of a short unit beats two copies of a long one.
        found.append(((copies - 1) * p, -p, int(start), int(end) + p, p))
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


def _cut_sizes(graph: Graph, top: Sequence[Op], start: int, stop: int,
               pos: dict[int, int]) -> np.ndarray:
  """cut[j - start]: values made in top[start:j] and read in top[j:stop].

  A layer boundary is where few values cross (the residual stream): the place to cut
  a periodic span into units. Values from outside the span (saved activations read
  by a backward pass) cross every point alike, so they are left out.
  """
  delta = np.zeros(stop - start + 2, np.int64)
  for j in range(start, stop):
    for v in top[j].outputs:
      if not graph.types[v].shape:
        continue
      last = max((pos[c] for c in graph.consumers.get(v, ())
                  if c in pos and pos[c] < stop), default=j)
      if last > j:
        delta[j + 1 - start] += 1
        delta[last + 1 - start] -= 1
  return np.cumsum(delta)[:stop - start]


class _OpFacts:
  """What matching and alignment read of each op, found once per op.

  Every candidate phase cuts the same span into units again, so per unit and phase
  these were found anew for every op; kept here for one `segment_by_structure` call.
  """

  def __init__(self, graph: Graph):
    self._graph = graph
    self._values: dict[int, tuple[int, ...]] = {}
    self._paths: dict[int, tuple[list[str], ...]] = {}

  def touch(self, ops: Iterable[int]) -> set[int]:
    """Non-scalar, non-literal values an op set reads or writes."""
    out = set()
    for i in ops:
      values = self._values.get(i)
      if values is None:
        op = self._graph.ops[i]
        values = self._values[i] = tuple(v for v in op.inputs + op.outputs
                                         if v not in self._graph.literals
                                         and self._graph.types[v].shape)
      out.update(values)
    return out

  def input_paths(self, i: int) -> tuple[list[str], ...]:
    """Key paths, split at "/", of the graph inputs op `i` reads, in operand order."""
    paths = self._paths.get(i)
    if paths is None:
      input_path = self._graph.input_path
      paths = self._paths[i] = tuple(input_path[v].split("/")
                                     for v in self._graph.ops[i].inputs
                                     if v in input_path)
    return paths


def _path_affinity(facts: _OpFacts, units: list[list[int]]) -> int:
  """How well units line up with the argument pytree: summed common path prefixes.

  A unit cut at the true layer boundary reads `params/blocks/3/...` only; a rotated
  one straddles two layers and shares just `params/blocks`.
  """
  total = 0
  for ops in units:
    # The prefix all paths share is the one the least and the greatest share.
    lo = hi = None
    for i in ops:
      for path in facts.input_paths(i):
        if lo is None:
          lo = hi = path
        elif path < lo:
          lo = path
        elif path > hi:
          hi = path
    if lo is not None:
      n = 0
      while n < min(len(lo), len(hi)) and lo[n] == hi[n]:
        n += 1
      total += n
  return total


class _Touches:
  """The values each instance reads or writes, indexed by value: matching a unit asks
  which instances share its values, and scanning every instance per unit would make
  folding quadratic in depth."""

  def __init__(self):
    self.sets: list[set[int]] = []
    self._by_value: dict[int, list[int]] = collections.defaultdict(list)

  def __len__(self) -> int:
    return len(self.sets)

  def append(self, values: set[int]) -> None:
    self.sets.append(set())
    self.add(len(self.sets) - 1, values)

  def add(self, k: int, values: set[int]) -> None:
    new = values - self.sets[k]
    self.sets[k] |= new
    for v in new:
      self._by_value[v].append(k)

  def holders(self, v: int) -> Sequence[int]:
    """The instances that touch value `v`."""
    return self._by_value.get(v, ())

  def shared(self, values: Iterable[int]) -> dict[int, int]:
    """Instance -> how many of `values` it touches (instances touching none left out)."""
    counts: dict[int, int] = {}
    for v in values:
      for k in self._by_value.get(v, ()):
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
    hits = set(touches.shared(facts.touch([i])))
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


def segment_by_structure(graph: Graph, top: Sequence[Op], blind: dict[int, str]):
  """Name -> ops of instances found by tandem repeats, matched across runs by dataflow.

  Cotangent sums (`add_any`) are left out of the sequence searched for repeats and
  travel with the ops before them: the first block of a backward pass starts each
  chain of sums its successors extend (a stacked parameter's gradient, a shared
  table's), so it holds one sum fewer per chain and would break the period.
  """
  seq = [op for op in top if op.primitive != ACCUMULATE]
  codes_map: dict[str, int] = {}
  codes = np.array([codes_map.setdefault(blind.get(op.index, op.signature), len(codes_map))
                    for op in seq],
                   dtype=np.int64)
  top_pos = {op.index: j for j, op in enumerate(top)} | {None: len(top)}

  def unit(j: int, p: int) -> list[int]:  # seq[j:j + p] and the sums after each op
    end = seq[j + p].index if j + p < len(seq) else None
    return [top[t].index for t in range(top_pos[seq[j].index], top_pos[end])]

  instances: list[list[int]] = []
  names: list[str] = []
  touches = _Touches()
  facts = _OpFacts(graph)
  for k, (start, stop, p) in enumerate(_tandem_repeats(codes)):
    # Candidate phases: the cheapest cuts within one period.
    # Cut in the second period: the first one has nothing made before it.
    # Cut sizes in program order, where each unit starts: at its first op, after the
    # sums that end the one before.
    at = [top_pos[op.index] for op in seq[start:stop]]
    top_cut = _cut_sizes(graph, top, at[0], top_pos[seq[stop].index if stop < len(seq)
                                                   else None], top_pos)
    cut = top_cut[np.array(at[p:2 * p]) - at[0]]
    phases = [int(x) for x in np.flatnonzero(cut == cut.min())][:_MAX_PHASES]
    # Also the cheapest cuts that keep every copy whole: a later phase drops a unit.
    whole = cut[:(stop - start) % p + 1]
    phases += [int(x) for x in np.flatnonzero(whole == whole.min())][:_MAX_PHASES]
    phases = sorted(set(phases))
    best = None
    for phase in phases:
      first = start + phase
      units = [unit(u, p) for u in range(first, stop - p + 1, p)]
      # With no instances yet nothing matches: the values are needed only once chosen.
      unit_touch = [facts.touch(u) for u in units] if len(touches) else None
      score, target = (0, {}) if unit_touch is None else _match(unit_touch, touches)
      key = (score, _path_affinity(facts, units), -phase)
      if best is None or key > best[0]:
        best = (key, units, unit_touch, target)
    _, units, unit_touch, target = best
    if unit_touch is None:
      unit_touch = [facts.touch(u) for u in units]
    for u, ops in enumerate(units):
      if u in target:
        for owner, part in _split_straddling(graph, facts, ops, touches,
                                             target[u]).items():
          instances[owner].extend(part)
          touches.add(owner, facts.touch(part))
      elif contracts(graph, ops):  # a new layer must contract something
        instances.append(list(ops))
        names.append(f"repeat{k}[{u}]")
        touches.append(unit_touch[u])
  # Counted loops (a scanned stack): the backward scan joins the forward one it reads.
  claimed = {i for inst in instances for i in inst}
  loops: list[int] = []
  for op in top:
    if loop_trip(graph, op) and op.index not in claimed:
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
