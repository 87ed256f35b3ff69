"""Stage 2, fold: `Graph` -> `Folded`, the program seen as repeated layers plus glue.

Networks repeat one layer many times; folding finds those repeats so the search can
work on each *unique* layer once. An instance holds every top-level op of one layer:
its forward, backward and optimizer-update ops (ops nested in loop bodies travel with
the loop op that owns them). Two instances are the same unique layer when their
canonical subgraphs hash the same (`trace.subgraph_fingerprint`).

Two ways to find instances:
1. **names**: flax name stacks (`jvp(GPT)/Block_3/MLP`, `transpose(jvp(GPT))/Block_3`)
   give a scope tree; siblings whose subtrees hash the same are instances. Levels with
   no repeats are descended (T5: `encoder` -> `encoder/layers_i`).
2. **structure**: no names needed. Tandem repeats in the sequence of op signatures give
   runs of identical units (forward blocks, backward blocks, optimizer phases); units of
   later runs join the instance they share most values with. Used when names find no
   repeats, and when names leave much of the program outside layers (per-op names,
   Keras style) and structure folds it clearly better.
Ops still unassigned (optimizer updates under names; glue) take the segment of the
values they read or feed, then fall back to glue. A counted loop (`nn.scan` over
layers) is one instance whose unique layer repeats `trip_count` times.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tapas_jax.trace import trace
  >>> from tapas_jax.fold import fold
  >>> def net(ws, x):
  ...   for w in ws:
  ...     x = jnp.tanh(x @ w) + x
  ...   return jnp.sum(x)
  >>> w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
  >>> f = fold(trace(net, [w] * 4, jax.ShapeDtypeStruct((2, 8), jnp.float32)))
  >>> len(f.unique_layers), len(f.instances)
  (1, 4)
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
import re
import time
from typing import Sequence

import numpy as np

from tapas_jax import _jax_internals as jx
from tapas_jax import rules as ruleslib
from tapas_jax.repeats import (TopArrays, Wiring, contracts, loop_trip,
                               segment_by_structure, top_arrays)
from tapas_jax.trace import Graph, Op, subgraph_fingerprint

__all__ = ["Folded", "LayerInstance", "Segment", "UniqueLayer", "fold"]

# Below this share of ops in layers found by names, structure is tried too, and it
# takes over when its fold ratio beats the names' by this factor.
_NAMES_ENOUGH = 0.85
_TAKEOVER = 1.25


@dataclasses.dataclass(frozen=True)
class LayerInstance:
  """One copy of a layer in the program.

  Attributes:
    index: position in `Folded.instances` (program order of first op).
    name: scope path ("GPT/Block_3") or a structural name ("repeat0[3]").
    layer: index of its `UniqueLayer`.
    ops: top-level op indices in program order; position k of two instances of one
      unique layer is the same computation.
    inputs: values read from outside the instance (literals excluded).
    outputs: values made inside and read outside, or returned by the program.
    trip_count: iterations when the instance is a counted loop (a scanned stack), else 1.
  """

  index: int
  name: str
  layer: int
  ops: tuple[int, ...]
  inputs: tuple[int, ...]
  outputs: tuple[int, ...]
  trip_count: int = 1


@dataclasses.dataclass(frozen=True)
class UniqueLayer:
  """A layer computation that the search solves once.

  Attributes:
    index: position in `Folded.unique_layers`.
    name: readable name ("Block", "encoder/layers", "Block[MoE]", "repeat0").
    fingerprint: canonical hash shared by all its instances.
    instances: indices into `Folded.instances`.
    num_ops: top-level ops per instance.
    repeats: total executions: sum of the instances' trip counts.
  """

  index: int
  name: str
  fingerprint: str
  instances: tuple[int, ...]
  num_ops: int
  repeats: int


@dataclasses.dataclass(frozen=True)
class Segment:
  """Non-repeated glue (embedding, head, loss, step counter): searched as is."""

  name: str
  ops: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Folded:
  """The output of `fold`.

  Attributes:
    graph: the traced graph.
    unique_layers: the layers to search, in order of first appearance.
    instances: every layer instance, in program order.
    glue: the non-repeated segments.
    method: "names" or "structure": how instances were found.
    fold_s: seconds `fold` took.
  """

  graph: Graph
  unique_layers: tuple[UniqueLayer, ...]
  instances: tuple[LayerInstance, ...]
  glue: tuple[Segment, ...]
  method: str
  fold_s: float

  @property
  def num_ops(self) -> int:
    return len(self.graph.region_ops(0))

  @property
  def fold_ratio(self) -> float:
    """Top-level ops over the ops a folded search looks at (glue + one per unique layer)."""
    searched = sum(len(s.ops) for s in self.glue) + sum(u.num_ops for u in self.unique_layers)
    return self.num_ops / max(searched, 1)

  def summary(self) -> str:
    """A readable report of the folding.

    Example:
      >>> print(folded.summary())  # doctest: +SKIP
      Folded by names: 6835 ops -> 12 instances of 1 unique layer, 9 glue segments ...
    """
    in_layers = sum(len(i.ops) for i in self.instances)
    lines = [
        f"Folded by {self.method}: {self.num_ops} top-level ops "
        f"({len(self.graph.ops)} with loop bodies) -> {len(self.instances)} layer "
        f"instances of {len(self.unique_layers)} unique layer(s), {len(self.glue)} glue "
        f"segment(s); {100 * in_layers / max(self.num_ops, 1):.0f}% of ops in layers; "
        f"fold ratio {self.fold_ratio:.1f}x; fold {self.fold_s * 1e3:.0f} ms"]
    for u in self.unique_layers:
      names = [self.instances[i].name for i in u.instances]
      shown = ", ".join(names[:3]) + (f", ... {names[-1]}" if len(names) > 3 else "")
      runs = f", {u.repeats} runs (counted loops)" if u.repeats != len(u.instances) else ""
      lines.append(f"  layer {u.index} {u.name!r}: {u.num_ops} ops x {len(u.instances)} "
                   f"instance(s){runs} [{shown}]")
    glue = sorted(self.glue, key=lambda s: -len(s.ops))
    if glue:
      lines.append("  glue: " + ", ".join(f"{s.name or '(top)'} ({len(s.ops)})"
                                          for s in glue[:8])
                   + (f", ... {len(glue) - 8} more" if len(glue) > 8 else ""))
    return "\n".join(lines)


# -- name stacks -----------------------------------------------------------------

# A name stack's module path (its syntax is JAX's: parsed in `_jax_internals`).
scope_of = jx.scope_of


class _Scopes(dict):
  """Name stack -> `scope_of` it, parsed once per distinct stack.

  The ops of one module share a stack; Keras gives each op its own, and the scope tree
  and the layer names ask for every op's scope, so a parse per ask was most of folding.
  """

  def __missing__(self, name_stack: str) -> tuple[str, ...]:
    scope = self[name_stack] = scope_of(name_stack)
    return scope


class _ScopeTree:
  """Top-level ops grouped by scope prefix."""

  def __init__(self, graph: Graph, ops: Sequence[Op], stack_scopes: _Scopes,
               index: np.ndarray | None = None):
    """`index`: the ops' `Op.index`, as an array, where the caller has it."""
    self.subtree: dict[tuple[str, ...], list[int]] = collections.defaultdict(list)
    self.untransposed: dict[tuple[str, ...], list[int]] = collections.defaultdict(list)
    self.children: dict[tuple[str, ...], list[str]] = collections.defaultdict(list)
    self.loops: set[tuple[str, ...]] = set()
    # Ops grouped by name stack, then by scope (in order of each one's first op), so
    # that each stack is looked at once and each scope's prefixes walked once, not
    # once per op. A loop takes the common scope of its body: a group of its own.
    keys: list[object] = list(map(operator.attrgetter("name_stack"), ops))
    loop_scopes: dict[object, tuple[str, ...]] = {}
    for j in itertools.compress(range(len(ops)),
                                map(operator.attrgetter("subregions"), ops)):
      if loop_trip(graph, ops[j]):
        key = keys[j] = ("loop", ops[j].index)
        loop_scopes[key] = _op_scope(graph, ops[j], stack_scopes)
        self.loops.add(loop_scopes[key])
    by_stack = _group_by(keys, [op.index for op in ops] if index is None else index)
    by_scope: dict[tuple[str, ...], list[int]] = {}
    untransposed_by_scope: dict[tuple[str, ...], list[int]] = {}
    for key, members in by_stack.items():
      stack = graph.ops[members[0]].name_stack
      scope = loop_scopes[key] if key in loop_scopes else stack_scopes[stack]
      by_scope.setdefault(scope, []).extend(members)
      # Layer identity is decided on the ops that are not transposed (the forward, and
      # any op outside differentiation: `jx.is_primal` would drop a layer applied with
      # no gradient): backward ops of the first and last copies differ by where shared
      # cotangents get summed.
      if not jx.is_transposed(stack):
        untransposed_by_scope.setdefault(scope, []).extend(members)
    for scope, members in by_scope.items():
      for d in range(len(scope) + 1):
        prefix = scope[:d]
        if d and not self.subtree[prefix]:
          self.children[scope[:d - 1]].append(scope[d - 1])
        self.subtree[prefix].extend(members)
        self.untransposed[prefix].extend(untransposed_by_scope.get(scope, ()))
    # Op indices grow in program order.
    for lists in (self.subtree, self.untransposed):
      for members in lists.values():
        members.sort()


def _group_by(keys: Sequence[object], index: Sequence[int] | np.ndarray
              ) -> dict[object, list[int]]:
  """Key -> the `index` entries at its positions in `keys`, keys in order of first
  appearance (as appending one by one would give, in C: Keras names every op)."""
  code = {key: n for n, key in enumerate(dict.fromkeys(keys))}
  ids = np.fromiter(map(code.__getitem__, keys), np.int64, len(keys))
  ends = np.cumsum(np.bincount(ids, minlength=len(code))).tolist()
  grouped = np.asarray(index, np.int64)[np.argsort(ids, kind="stable")].tolist()
  return {key: grouped[ends[n - 1] if n else 0:ends[n]] for key, n in code.items()}


def _op_scope(graph: Graph, op: Op, stack_scopes: _Scopes) -> tuple[str, ...]:
  """An op's scope; a counted loop also takes the common scope of its body (nn.scan)."""
  scope = stack_scopes[op.name_stack]
  if not loop_trip(graph, op):
    return scope
  body = [stack_scopes[o.name_stack][len(scope):] for o in graph.ops
          if o.region in op.subregions]
  common = body[0] if body else ()
  for s in body[1:]:
    n = 0
    while n < min(len(common), len(s)) and common[n] == s[n]:
      n += 1
    common = common[:n]
  return scope + common


def _segment_by_names(graph: Graph, top: Sequence[Op], blind: dict[int, str],
                      stack_scopes: _Scopes, index: np.ndarray | None = None):
  """Scope -> (kind, ops) with kind "layer" or "glue", or None without repeats."""
  tree = _ScopeTree(graph, top, stack_scopes, index)
  layers: dict[tuple[str, ...], list[int]] = {}
  glue: dict[tuple[str, ...], list[int]] = {}
  _visit(graph, tree, blind, layers, glue, ())
  if not layers:
    return None
  return layers, glue


def _visit(graph: Graph, tree: _ScopeTree, blind: dict[int, str], layers: dict,
           glue: dict, node: tuple[str, ...]) -> None:
  """`_segment_by_names`' walk down from scope `node`, filling `layers` and `glue`. Not
  a closure: a recursive one is a cycle holding the graph until the collector runs."""
  kids = [node + (c,) for c in tree.children[node]]
  fps = {k: subgraph_fingerprint([graph.ops[i] for i in tree.untransposed[k] or tree.subtree[k]],
                                 signature=blind)
         for k in kids if contracts(graph, tree.subtree[k])}
  counts = collections.Counter(fps.values())
  repeated = any(n >= 2 for n in counts.values())
  for k in kids:
    if (k in fps and counts[fps[k]] >= 2) or k in tree.loops:
      layers[k] = tree.subtree[k]
    elif repeated or not tree.children[k]:
      glue[k] = tree.subtree[k]
    else:
      _visit(graph, tree, blind, layers, glue, k)
  if node:
    inner = {i for c in tree.children[node] for i in tree.subtree[node + (c,)]}
    own = [i for i in tree.subtree[node] if i not in inner]
    if own:
      glue[node] = own


def _offset_blind(graph: Graph) -> dict[int, str]:
  """Op index -> signature blind to where a slice or pad sits (sizes kept), for the
  slices and pads of `graph`; other ops keep `Op.signature`.

  The params that place a slice (or its transpose, a pad) in its operand are the
  primitive's `Facts.offset_params`. Blocks over one stacked parameter (`stacked[i]`)
  differ only in them: the same computation on another slice, so the same sharding."""
  out = {}
  primitives = list(map(operator.attrgetter("primitive"), graph.ops))
  drops = {p: ruleslib.facts(p).offset_params for p in dict.fromkeys(primitives)}
  placing = {p for p, drop in drops.items() if drop}
  # The few slices and pads, picked in C: a look per op was most of this pass.
  for op in itertools.compress(graph.ops, map(placing.__contains__, primitives)):
    drop = drops[op.primitive]
    params = [(k, v) for k, v in op.params if k not in drop]
    if op.primitive == "pad":  # only how much each dim grows, not on which side
      params.append(("grow", str([(int(lo) + int(hi), int(mid))
                                  for lo, hi, mid in op.raw_params["padding_config"]])))
    types = [("L" if v in graph.literals else "") + str(graph.types[v]) for v in op.inputs]
    out[op.index] = f"{op.primitive}|{params}|{types}|" + ";".join(
        str(graph.types[v]) for v in op.outputs)
  return out




def _stack_trip(graph: Graph, ops: Sequence[int]) -> int:
  """Iterations of an instance that is a scanned stack of layers, else 1.

  A stack's loops hold all its contractions; a block that merely contains a loop
  (chunked attention, a `fori_loop`) runs once per instance, however many times the
  loop inside it turns.
  """
  if any(ruleslib.facts(graph.ops[i].primitive).contracts for i in ops):
    return 1
  return max((loop_trip(graph, graph.ops[i]) for i in ops), default=0) or 1


def _input_labels(graph: Graph, scopes: dict[tuple[str, ...], int]) -> dict[int, int]:
  """Graph inputs whose key path names a layer scope (params/Block_3/...) -> label."""
  by_suffix: dict[tuple[str, ...], int | None] = {}
  for scope, label in scopes.items():
    for start in range(len(scope)):
      suffix = scope[start:]
      by_suffix[suffix] = None if by_suffix.get(suffix, label) != label else label
  out = {}
  for inp in graph.inputs:
    comps = tuple(inp.path.split("/"))
    best = None
    for a in range(len(comps)):
      for b in range(len(comps), a, -1):
        label = by_suffix.get(comps[a:b])
        if label is not None and (best is None or b - a > best[0]):
          best = (b - a, label)
          break
    if best is not None:
      out[inp.value] = best[1]
  return out




# -- shared finishing -----------------------------------------------------------------


def _propagate(graph: Graph, top: Sequence[Op], label: dict[int, int],
               value_label: dict[int, int]) -> None:
  """Unlabeled ops take the one segment their non-scalar operands (then users) have."""
  def non_scalar(v):
    return v not in graph.literals and graph.types[v].shape != ()

  for _ in range(3):
    changed = False
    for op in top:  # forward: from producers and labeled graph inputs
      if op.index in label:
        continue
      seen = {value_label[v] for v in op.inputs if non_scalar(v) and v in value_label}
      if len(seen) == 1:
        label[op.index] = seen.pop()
        value_label.update((v, label[op.index]) for v in op.outputs)
        changed = True
    for op in reversed(top):  # backward: from consumers
      if op.index in label:
        continue
      seen = {label[c] for v in op.outputs for c in graph.consumers.get(v, ())
              if c in label and graph.ops[c].region == 0}
      if len(seen) == 1:
        label[op.index] = seen.pop()
        value_label.update((v, label[op.index]) for v in op.outputs)
        changed = True
    if not changed:
      break


def _members(arrays: TopArrays, rows: np.ndarray
             ) -> tuple[dict[int, list[int]], list[int]]:
  """(Label -> its top-level ops, the unlabeled ones), each in program order, from
  each top-level op's label (`rows`; -1: none)."""
  order = np.argsort(rows, kind="stable")  # by label, then program order
  ends = np.cumsum(np.bincount(rows + 1)).tolist()
  ops = arrays.wiring.index[order].tolist()
  members: dict[int, list[int]] = collections.defaultdict(list)
  for k in range(len(ends) - 1):
    if ends[k + 1] > ends[k]:
      members[k] = ops[ends[k]:ends[k + 1]]
  return members, ops[:ends[0]]


def _split_edge_sums(graph: Graph, ops: list[int], arrays: TopArrays
                     ) -> tuple[list[int], list[int]]:
  """Separates the cotangent sums that run along an instance's edge.

  A value used by several instances (a shared bias table, the encoder output, the
  residual stream) has its cotangents summed by a chain of `add_any` ops, each placed
  in the instance whose contribution it adds, so the copy that starts the chain holds
  one sum fewer. A sum that takes a partial total from outside, or whose total only
  leaves, is a link of such a chain; peeling those to a fixed point leaves every copy
  with the same ops.
  """
  inside = set(ops)
  at = np.array(ops, np.int64)
  sums = at[arrays.accumulate[arrays.wiring.row[at]]].tolist()
  changed = True
  while changed:
    changed = False
    for i in sums:
      if i not in inside:
        continue
      op = graph.ops[i]
      from_outside = not all(graph.producer.get(v) in inside for v in op.inputs)
      to_outside = not any(c in inside for v in op.outputs
                           for c in graph.consumers.get(v, ()))
      if from_outside or to_outside:
        inside.discard(i)
        changed = True
  if len(inside) == len(ops):
    return ops, []
  return [i for i in ops if i in inside], [i for i in ops if i not in inside]


def _restore_balanced_sums(graph: Graph, members: dict[int, list[int]],
                           edges: dict[int, list[int]], blind: dict[int, str],
                           arrays: TopArrays) -> tuple[dict[int, str], Wiring | None]:
  """Gives back to each instance the edge sums every copy of its layer has alike.

  `_split_edge_sums` peels every sum that reads from outside, also those each copy
  holds one of: the residual stream's cotangent plus the block's own (dy + d_branch),
  which only the chains of a shared value (a stacked parameter's gradient, summed over
  the blocks) lack in one copy. Sums whose signature every copy of a unique layer holds
  equally often, and that read a value the copy makes, go back in; kept only where the
  copies still fingerprint alike. Updates `members` and `edges` in place.

  Returns:
    Each instance's fingerprint, of its members as they end up (the caller's grouping
    into unique layers). Copies are told apart by `Wiring.keys`, and each distinct
    one fingerprinted once: a fingerprint per copy, before and after the sums go
    back, was most of this pass. Then the `Wiring` of the instances' members as they
    end up, in the order of `edges`, where this pass built it (no sums went back, or
    all instances are copies of one layer), else None.
  """
  wiring = Wiring(arrays, [members[k] for k in edges])
  keys = dict(zip(edges, wiring.keys()))
  groups = collections.defaultdict(list)
  for k in edges:
    groups[keys[k]].append(k)
  fingerprints = {}
  made_by, list_of = None, {k: j for j, k in enumerate(edges)}
  final = wiring
  for ks in groups.values():
    if len(ks) >= 2:
      if made_by is None:
        made_by = wiring.made_by().tolist()
      merged = _give_back_sums(graph, members, edges, ks, blind, arrays, made_by, list_of)
      if merged is not None:
        final = merged if len(ks) == len(edges) else None
    fingerprint = _fingerprint(graph, members[ks[0]], blind)  # once per group
    fingerprints.update((k, fingerprint) for k in ks)
  return fingerprints, final


def _give_back_sums(graph: Graph, members: dict[int, list[int]],
                    edges: dict[int, list[int]], copies: list[int],
                    blind: dict[int, str], arrays: TopArrays, made_by: list[int],
                    list_of: dict[int, int]) -> Wiring | None:
  """`_restore_balanced_sums` for the `copies` of one layer (they fingerprint alike):
  the `Wiring` of their members once sums went back, None if none did. `made_by`:
  value -> which of the lists `list_of` numbers makes it (`Wiring.made_by` of the
  members before any go back)."""

  def own(k, i):
    return any(made_by[v] == list_of[k] for v in graph.ops[i].inputs)

  counts = [collections.Counter(blind.get(i, graph.ops[i].signature) for i in edges[k]
                                if own(k, i)) for k in copies]
  common = {sig for sig, n in counts[0].items() if all(c[sig] == n for c in counts[1:])}
  if not common:
    return None
  back = {k: [i for i in edges[k]
              if own(k, i) and blind.get(i, graph.ops[i].signature) in common]
          for k in copies}
  merged = {k: sorted(members[k] + back[k]) for k in copies}  # indices grow in program order
  wiring = Wiring(arrays, [merged[k] for k in copies])
  if len(set(wiring.keys())) > 1:
    return None
  for k in copies:
    members[k] = merged[k]
    returned = set(back[k])
    edges[k] = [i for i in edges[k] if i not in returned]
  return wiring


def _fingerprint(graph: Graph, ops: Sequence[int], blind: dict[int, str]) -> str:
  return subgraph_fingerprint([graph.ops[i] for i in ops], signature=blind)


def _layer_name(scope: tuple[str, ...], method: str) -> str:
  if method == "structure":
    return re.sub(r"\[\d+\]$", "", scope[0])
  parts = scope[1:] if len(scope) > 1 else scope
  return "/".join(re.sub(r"_?\d+$", "", p) or p for p in parts)


def _distinct_names(graph: Graph, groups: list[list[tuple[str, ...]]],
                    base: list[str], stack_scopes: _Scopes) -> list[str]:
  """Where two unique layers share a name, tell them apart by their child scopes."""
  counts = collections.Counter(base)
  names = list(base)
  if all(counts[b] < 2 for b in base):
    return names
  # Scopes of the top level, each once: Keras names every op, so a scan per op and
  # per group would be quadratic.
  top_scopes = {stack_scopes[op.name_stack] for op in graph.region_ops(0)}
  kids_of: dict[tuple[str, ...], set[str]] = {}

  def kids(scope):
    if scope not in kids_of:
      kids_of[scope] = {s[len(scope)] for s in top_scopes
                        if len(s) > len(scope) and s[:len(scope)] == scope}
    return kids_of[scope]

  for k, group in enumerate(groups):
    if counts[base[k]] < 2:
      continue
    others = set().union(*[kids(o[0]) for j, o in enumerate(groups)
                           if j != k and base[j] == base[k]] or [set()])
    own = [c for c in sorted(kids(group[0])) if c not in others]
    names[k] = f"{base[k]}[{','.join(own) or k}]"
  return names


def fold(graph: Graph, use_names: bool = True) -> Folded:
  """Groups a traced program into layer instances and unique layers.

  Args:
    graph: the output of `tapas_jax.trace.trace`.
    use_names: try name stacks first; False forces structural detection.

  Returns:
    `Folded`: unique layers, instances in program order, and glue.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tapas_jax.trace import trace
    >>> x = jax.ShapeDtypeStruct((4, 16), jnp.float32)
    >>> def mlp(x):
    ...   for _ in range(3):
    ...     x = jax.nn.relu(x @ jnp.ones((16, 16))) * 2.0 + 1.0
    ...   return x
    >>> fold(trace(mlp, x)).unique_layers[0].repeats
    3
  """
  start = time.perf_counter()
  top = graph.region_ops(0)
  blind = _offset_blind(graph)
  arrays = top_arrays(graph, top, blind)
  stack_scopes = _Scopes()
  found = (_segment_by_names(graph, top, blind, stack_scopes, arrays.wiring.index) if use_names
           else None)
  if found is None:
    chosen = _group(graph, top, segment_by_structure(graph, top, blind, arrays),
                    "structure", blind, arrays)
    return _finish(graph, chosen, start, stack_scopes, arrays)
  # The two ways are weighed on their groupings: the boundaries and names of the one
  # left out are not worth finding.
  by_names = _group(graph, top, found, "names", blind, arrays)
  if by_names.in_layers >= _NAMES_ENOUGH:
    return _finish(graph, by_names, start, stack_scopes, arrays)
  # Names that do not delimit layers (Keras numbers every op: dense_7, add_3) give
  # repeats of single ops; structure takes over where it folds clearly better.
  by_structure = _group(graph, top, segment_by_structure(graph, top, blind, arrays),
                        "structure", blind, arrays)
  chosen = (by_structure if by_structure.fold_ratio > _TAKEOVER * by_names.fold_ratio
            else by_names)
  return _finish(graph, chosen, start, stack_scopes, arrays)


@dataclasses.dataclass(frozen=True, eq=False)
class _Grouping:
  """Top-level ops grouped into instances by one way of folding, before the instances'
  boundaries and the layers' names: all that weighing names against structure reads.

  Attributes:
    method: "names" or "structure".
    scopes: the layer scopes, then the glue scopes.
    num_layer_scopes: how many of `scopes` are layer scopes.
    members: scope index -> its ops, in program order (an instance's less its edge sums).
    layer_keys: the scope indices of the instances, in program order of first op.
    fingerprints: per instance (scope index), its fingerprint.
    wiring: the `Wiring` of the instances' members, in order of `layer_keys`, where
      known already.
    sums: the edge sums left outside the instances, in order of `layer_keys`.
    leftovers: top-level ops in no scope.
    num_ops: how many top-level ops.
  """

  method: str
  scopes: tuple[tuple[str, ...], ...]
  num_layer_scopes: int
  members: dict[int, list[int]]
  layer_keys: tuple[int, ...]
  fingerprints: dict[int, str]
  wiring: Wiring | None
  sums: tuple[int, ...]
  leftovers: tuple[int, ...]
  num_ops: int

  @property
  def in_layers(self) -> float:
    """Share of the top-level ops in instances."""
    return sum(len(self.members[k]) for k in self.layer_keys) / max(self.num_ops, 1)

  @property
  def fold_ratio(self) -> float:
    """`Folded.fold_ratio` of this grouping."""
    glue = sum(len(self.members[k]) for k in range(self.num_layer_scopes, len(self.scopes)))
    unique: dict[str, int] = {}
    for k in self.layer_keys:
      unique.setdefault(self.fingerprints[k], len(self.members[k]))
    searched = glue + len(self.sums) + len(self.leftovers) + sum(unique.values())
    return self.num_ops / max(searched, 1)


def _group(graph: Graph, top: Sequence[Op], found, method: str, blind: dict[int, str],
           arrays: TopArrays) -> _Grouping:
  """Instances and glue scopes from segmented scopes (`found`: layers, glue)."""
  layers, glue = found if found is not None else ({}, {})

  # Labels: layer scopes first, then glue scopes; ints index `scopes`.
  scopes = list(layers) + list(glue)
  rows = np.full(len(top), -1, np.int64)  # per top-level op, its label
  if method == "names":
    label: dict[int, int] = {}
    for k, scope in enumerate(scopes):
      for i in (layers.get(scope) or glue[scope]):
        label.setdefault(i, k)
    # Under names, unnamed ops (optimizer updates, loss) join the layer whose values they
    # use. Structural runs already hold the backward and update units; the rest is glue.
    value_label = _input_labels(graph, {s: k for k, s in enumerate(layers)})
    for i, k in label.items():
      value_label.update((v, k) for v in graph.ops[i].outputs)
    _propagate(graph, top, label, value_label)
    rows[arrays.wiring.row[np.fromiter(label, np.int64, len(label))]] = np.fromiter(
        label.values(), np.int64, len(label))
  else:
    for k in reversed(range(len(scopes))):  # an op in two scopes takes the first
      ops = layers.get(scopes[k]) or glue[scopes[k]]
      rows[arrays.wiring.row[np.fromiter(ops, np.int64, len(ops))]] = k
  members, leftovers = _members(arrays, rows)
  layer_keys = sorted((k for k in range(len(layers)) if members[k]),
                      key=lambda k: members[k][0])
  edges = {}
  for k in layer_keys:
    members[k], edges[k] = _split_edge_sums(graph, members[k], arrays)
  fingerprints, wiring = _restore_balanced_sums(graph, members, edges, blind, arrays)
  return _Grouping(method=method, scopes=tuple(scopes), num_layer_scopes=len(layers),
                   members=members, layer_keys=tuple(layer_keys), fingerprints=fingerprints,
                   wiring=wiring,
                   sums=tuple(i for k in layer_keys for i in edges[k]),
                   leftovers=tuple(leftovers), num_ops=len(top))


def _finish(graph: Graph, grouping: _Grouping, start: float, stack_scopes: _Scopes,
            arrays: TopArrays) -> Folded:
  """The `Folded` of a grouping: instances with their boundaries, named unique layers,
  glue."""
  scopes, members, layer_keys = grouping.scopes, grouping.members, grouping.layer_keys
  by_fp: dict[str, list[int]] = {}
  raw = []
  wiring = grouping.wiring or Wiring(arrays, [members[k] for k in layer_keys])
  bounds = wiring.boundaries(graph.outputs)
  for pos, k in enumerate(layer_keys):
    ops = members[k]
    fp = grouping.fingerprints[k]
    by_fp.setdefault(fp, []).append(pos)
    inputs, outputs = bounds[pos]
    trip = _stack_trip(graph, ops)
    raw.append((scopes[k], ops, inputs, outputs, trip, fp))

  fp_index = {fp: n for n, fp in enumerate(by_fp)}
  instances = tuple(
      LayerInstance(index=pos, name="/".join(scope), layer=fp_index[fp], ops=tuple(ops),
                    inputs=inputs, outputs=outputs, trip_count=trip)
      for pos, (scope, ops, inputs, outputs, trip, fp) in enumerate(raw))
  method = grouping.method
  groups = [[raw[p][0] for p in positions] for positions in by_fp.values()]
  names = _distinct_names(graph, groups, [_layer_name(g[0], method) for g in groups],
                          stack_scopes)
  unique = tuple(
      UniqueLayer(index=n, name=names[n], fingerprint=fp, instances=tuple(positions),
                  num_ops=len(raw[positions[0]][1]),
                  repeats=sum(raw[p][4] for p in positions))
      for n, (fp, positions) in enumerate(by_fp.items()))

  glue_segments = [Segment(name="/".join(scopes[k]), ops=tuple(members[k]))
                   for k in range(grouping.num_layer_scopes, len(scopes)) if members[k]]
  if grouping.sums:
    glue_segments.append(Segment(name="(cotangent sums)", ops=tuple(sorted(grouping.sums))))
  if grouping.leftovers:
    glue_segments.append(Segment(name="", ops=grouping.leftovers))

  return Folded(graph=graph, unique_layers=unique, instances=instances,
                glue=tuple(glue_segments), method=method, fold_s=time.perf_counter() - start)
