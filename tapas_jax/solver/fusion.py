"""Which intermediates XLA writes out: dead code dropped, elementwise chains fused.

The memory model (`memory.py`) counts only values XLA keeps in memory, and the roofline
compute time (`tables.py`) charges an op only for the bytes it reads and writes to
memory. Both follow XLA's own rules: code no output depends on is removed, and
elementwise and data-movement ops are fused into the reader that consumes them
(duplicated into several readers when cheap), so their results are never written out.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tapas_jax import trace
  >>> from tapas_jax.solver import fusion
  >>> g = trace.trace(lambda x: jnp.sum(jnp.tanh(x) * 2.0),
  ...                 jax.ShapeDtypeStruct((8, 4), jnp.float32))
  >>> top = g.region_ops(0)
  >>> [g.ops[g.producer[v]].primitive
  ...  for v in sorted(fusion.fused_values(g, top, fusion.live_ops(g, top)))]
  ['tanh', 'mul']
"""

from __future__ import annotations

import dataclasses
import operator
from typing import TYPE_CHECKING, Collection, NamedTuple, Sequence

import numpy as np

from tapas_jax import _jax_internals as jx
from tapas_jax import rules as ruleslib
from tapas_jax.solver.memo import memo
from tapas_jax.trace import Graph, Op, TensorType, mask, ranges

if TYPE_CHECKING:
  from tapas_jax.solver.views import Copies

__all__ = ["TopLevel", "dot_epilogues", "fused_values", "fuses_into", "live_ops", "top_level"]


def live_ops(graph: Graph, top: Sequence[Op], outputs: Sequence[int] | None = None
             ) -> set[int]:
  """The ops of one region (the top level, or a loop body with its `outputs`) whose
  results reach an output: XLA removes the rest (the tangent of a constant a jvp
  broadcasts and never reads, say)."""
  needed = set(graph.outputs if outputs is None else outputs)
  live = set()
  for op in reversed(top):
    if not op.outputs or not needed.isdisjoint(op.outputs):
      live.add(op.index)
      needed.update(op.inputs)
  return live


def _top_live(graph: Graph) -> tuple[set[int], frozenset[int]]:
  """(`live_ops` of the top level, the rest of its ops), on the graph's wiring arrays
  (`Graph.top_wiring`, built by the fold): the top level's reads counted per value, the
  ops nothing reads and no output is removed, then those left unread by their
  removal, until none is (dead code is a few short chains: a few rounds). The reverse
  walk was a Python step per op of every layer copy."""
  w = graph.top_wiring
  read, made = w.values[w.read], w.values[~w.read]
  size = len(graph.types)
  reads = np.bincount(read, minlength=size)
  pinned = mask(size, graph.outputs)
  producer = np.full(size, -1, np.int64)
  producer[made] = np.repeat(np.arange(len(w.index)), w.num_outputs)
  made_from = np.concatenate([[0], np.cumsum(w.num_outputs)])
  read_from = np.concatenate([[0], np.cumsum(w.num_inputs)])
  dead = np.zeros(len(w.index), bool)
  rows = np.flatnonzero(w.num_outputs)  # an op with no output is kept (an effect)
  while len(rows):
    counts = w.num_outputs[rows]
    outputs = made[ranges(made_from[rows], counts)]
    used = np.bincount(np.repeat(np.arange(len(rows)), counts),
                       weights=(reads[outputs] > 0) | pinned[outputs], minlength=len(rows))
    gone = rows[used == 0]
    dead[gone] = True
    inputs = read[ranges(read_from[gone], w.num_inputs[gone])]
    reads -= np.bincount(inputs, minlength=size)
    # Only the makers of what the removed ops read can have become unread.
    rows = np.unique(producer[inputs])
    rows = rows[rows >= 0]
    rows = rows[~dead[rows]]
  return set(w.index[~dead].tolist()), frozenset(w.index[dead].tolist())


class TopLevel(NamedTuple):
  """What XLA keeps of the top-level program (`top_level`).

  Attributes:
    live: the ops some output depends on (`live_ops`).
    fused: the values never written out (`fused_values`, and with `dot_operands` the
      contractions' epilogues: `dot_epilogues`).
    side_reductions: reductions the compiler computes inside the fusion making their
      operand, as a second output (an epilogue's bias-gradient sum): their operand's
      readers as written do not include them.
    dead: the other top-level ops (XLA removes them).
  """

  live: set[int]
  fused: set[int]
  side_reductions: frozenset[int] = frozenset()
  dead: frozenset[int] = frozenset()


def top_level(graph: Graph, cache: dict | None = None, *, reductions_duplicate: bool = True,
              dot_operands: bool = False, copies: Sequence[Copies] = ()) -> TopLevel:
  """`TopLevel` of the program, kept in `cache` (a search's table cache) so that the
  cost tables and the memory model, and every problem of one search, walk the program
  once. Read-only: callers must not change the sets. `copies` (a folded view's
  `View.copies`) only makes it faster: the same sets.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tapas_jax import trace
    >>> g = trace.trace(lambda x: jnp.sum(jnp.tanh(x) * 2.0),
    ...                 jax.ShapeDtypeStruct((8, 4), jnp.float32))
    >>> cache = {}
    >>> top_level(g, cache) is top_level(g, cache)
    True
  """
  def build():
    top = graph.region_ops(0)
    live, dead = _top_live(graph)
    fused = fused_values(graph, top, live, reductions_duplicate=reductions_duplicate,
                         dot_operands=dot_operands, copies=copies)
    if not dot_operands:
      return TopLevel(live, fused, dead=dead)
    values, sides = dot_epilogues(graph, top, live)
    return TopLevel(live, fused | values, frozenset(sides), dead)

  return memo(cache, ("fusion", reductions_duplicate, dot_operands), (graph,), build)


def fused_values(graph: Graph, top: Sequence[Op], live: set[int],
                 outputs: Sequence[int] | None = None, *,
                 reductions_duplicate: bool = True, dot_operands: bool = False,
                 copies: Sequence[Copies] = (), stack_writes: Collection[int] = ()
                 ) -> set[int]:
  """Values XLA computes inside their readers' fusions and never writes out.

  A fusible op's result is fused into its readers when every live reader is a fusion
  that can take it (fusible or a reduction) and it is cheap or read once; it is not
  fused into an output of its region (the program's, or a loop body's `outputs`).
  With `reductions_duplicate=False` (XLA:CPU, whose reductions are YNNPACK library
  fusions that recompute nothing another op also reads) a value read by several ops,
  one of which leads into a reduction through ops read once, is written out: a
  batch norm's centred activations, read by the forward pass and by the backward
  pass's sum for the scale's gradient.

  With `dot_operands=True` (the TPU compiler, read off its HLO: `DeviceProfile.
  dot_operand_fusion`) three more things are fused:
  * a dot (or a convolution: both are the TPU's convolution fusions) reads an
    elementwise chain inside its own fusion (a `kOutput` fusion whose convolution
    reads the chain; a kernel reversed for the backward convolution) where that reads
    no more bytes than the chain's
    result: the chain's unfused operands hold one value at least a quarter of its
    elements. A program input's cast (a weight's bf16 copy) is made once and kept:
    a weight is converted before it is gathered. A norm's output, the logits' cotangent
    `softmax - onehot` are never written; the norm's input and the logits are kept
    for the backward pass's dots instead. A chain of two such values read more than
    once (a residual add, `silu(gate) * up`) is written: the dot making one of them
    writes it as a second output;
  * the transcendental ops (exp, logistic) are recomputed in each reader like cheap
    ones: the softmax's exp is computed in the forward reduction and again in the
    backward dots, the gate's sigmoid in the MLP's forward and backward fusions; but
    a chain holding a `Facts.costly` op (erf) on the chain's scale, read by a dot and by
    another op, is written: the exact GELU's output is (its erfc is recomputed in the
    backward's elementwise fusion); so is one holding a `Facts.costly_narrow` op (a
    divide) where the value read is narrower than 32 bits: a bf16 softmax's
    probabilities, or an f32 one's converted to bf16 for the dots;
  * a one-hot scatter-add (`take_along_axis`'s transpose: one update per row, the
    loss's label gradient) is a select against an iota, elementwise;
  * in the top-level program (not a loop body's), a dot or convolution read once,
    through fusible ops, by a sum is computed inside the sum's fusion
    (`_output_fused`): a tied embedding's weight-gradient dot runs where its gradient
    is summed with the lookup's scatter-add, its result never written.

  `copies` (the top level's only: a folded view's `View.copies`): a copy's value read
  only inside its instance is decided as its representative's is (`_mapped`), without
  walking its op; the same set.

  `stack_writes` (a loop body's only): its outputs the compiler writes into the stacks
  of its scan's results as they are made (`DeviceProfile.stacks_in_place`). A fusible
  op's value among them that nothing in the body reads is computed in that write (a
  transposed weight gradient), never written on its own.
  """
  # Read off whole programs; inside a loop body the compiler was not seen to do it.
  top_level_program = outputs is None
  outputs = set(graph.outputs if outputs is None else outputs)
  into_reduction = set() if reductions_duplicate else _into_reduction(graph, top, live)
  # The TPU compiler's rules read chains across instances: every op is walked there.
  if copies and top_level_program and not dot_operands:
    skip, mapped = _mapped(graph, copies, live, outputs, into_reduction)
    top = _unskipped(graph, top, skip)
  else:
    mapped = ()
  out: set[int] = set()
  leaves: dict[int, frozenset[int]] = {}  # fused value -> the big values its chain reads
  # Fused value -> the elements of the largest `Facts.costly` op's result its chain holds.
  costly: dict[int, int] = {}
  narrow_only: set[int] = set()  # of those, chains whose op is costly only when narrow
  ops, consumers = graph.ops, graph.consumers
  # `_reader_fuses` is a fact of the reader's primitive, asked of every reader of every
  # op: asked once per primitive here (not cached across calls: rules may be registered).
  # A skipped op's primitive is its representative's, which is walked.
  takes = {p: _reader_fuses(ops[i], dot_operands)
           for p, i in {op.primitive: op.index for op in top}.items()}
  for op in top:
    if op.index not in live:
      continue
    one_hot = dot_operands and _one_hot_scatter(graph, op)  # its combiner is a region
    if not (one_hot or (ruleslib.facts(op.primitive).fusible and not op.subregions)):
      continue
    for v in op.outputs:
      if v in outputs:
        if v in stack_writes and not consumers.get(v) and not one_hot:
          out.add(v)
        continue
      readers = [ops[c] for c in consumers.get(v, ()) if c in live]
      if not (readers
              and all(takes[r.primitive] and not r.subregions
                      for r in readers)
              and (dot_operands or not ruleslib.facts(op.primitive).expensive
                   or len(readers) == 1)
              and (len(readers) == 1 or not any(r.index in into_reduction
                                                for r in readers))):
        continue
      if dot_operands:
        into_dot = any(ruleslib.facts(r.primitive).contracts for r in readers)
        size = _elements(graph, v)
        f = ruleslib.facts(op.primitive)
        if f.costly or f.costly_narrow:
          held, narrow = size, f.costly_narrow
        else:
          held, narrow = max(((costly.get(x, 0), x in narrow_only) for x in op.inputs),
                             default=(0, False))
        # Only one on the value's scale counts: a row statistic's erf is recomputed freely.
        if size and 4 * held >= size:
          if into_dot and len(readers) > 1 and (not narrow
                                                or graph.types[v].itemsize < 4):
            continue
          costly[v] = held
          if narrow:
            narrow_only.add(v)
        leaves[v] = _big_leaves(graph, op, v, out, leaves)
        if (len(leaves[v]) > 1 and (into_dot or len(readers) > 1)) or (
            into_dot and op.primitive == "convert_element_type"
            and op.inputs[0] not in graph.producer):
          continue
      out.add(v)
  if dot_operands and top_level_program:
    out.update(_output_fused(graph, top, live, outputs, out))
  for rep_values, values in mapped:  # as the representative's, decided above
    taken = [s for s, v in enumerate(rep_values.tolist()) if v in out]
    out.update(values[:, taken].ravel().tolist())
  return out


def _unskipped(graph: Graph, top: Sequence[Op], skip: np.ndarray) -> list[Op]:
  """The ops of `top` that `skip` (a mask over the graph's ops) leaves, in order: one
  array lookup, not a set lookup per op of every copy."""
  index = (graph.top_wiring.index if top is graph.region_ops(0)  # the top level's, built
           else np.fromiter(map(operator.attrgetter("index"), top), int, len(top)))
  return list(map(top.__getitem__, np.flatnonzero(~skip[index]).tolist()))


def _mapped(graph: Graph, copies: Sequence[Copies], live: set[int], outputs: set[int],
            into_reduction: set[int]) -> tuple[np.ndarray, list]:
  """(a mask over the graph's ops of those `fused_values` need not walk,
  [(representative's values, the copies' values: one row per copy)]) of the values
  decided as their representative's.

  A value is decided by its op, its live readers and whether it is an output. A copy's
  value that neither it nor the representative's reads outside its own instance is
  read by the copies of the representative's readers (one fingerprint: the same ops
  and wiring); where every op of the layer is live, and taken into a reduction, in
  every copy as in the representative, the copy's value is fused just where the
  representative's is. An op is skipped where every value it makes maps.
  """
  live_mask = mask(len(graph.ops), live)
  reduction_mask = mask(len(graph.ops), into_reduction)
  output_mask = mask(len(graph.types), outputs)
  skip = np.zeros(len(graph.ops), bool)
  mapped = []
  for c in copies:
    rep, ops = np.array(c.rep, int), c.op_rows
    rep_values, values = np.array(c.rep_values, int), c.value_rows
    if not rep_values.size or not all((m[ops] == m[rep]).all()
                                      for m in (live_mask, reduction_mask)):
      continue
    outside = np.fromiter(c.read_outside, int, len(c.read_outside))
    bad = (np.isin(rep_values, outside) | np.isin(values, outside).any(0)
           | output_mask[rep_values] | output_mask[values].any(0))
    # Per op of the layer, how many values it makes do not map (`rep_values` lists
    # them op by op, output by output).
    made = [len(graph.ops[i].outputs) for i in c.rep]
    owner = np.repeat(np.arange(len(made)), made)
    unmapped = np.bincount(owner, weights=bad, minlength=len(made))
    skip[ops[:, unmapped == 0]] = True
    keep = np.flatnonzero(~bad)
    mapped.append((rep_values[keep], values[:, keep]))
  return skip, mapped


def _output_fused(graph: Graph, top: Sequence[Op], live: set[int], outputs: set[int],
                  fused: set[int]) -> set[int]:
  """Contraction results the TPU compiler computes inside the sum reading them (its
  `kOutput` fusion: a dot or convolution with the elementwise ops after it), so the
  result is never written and the contraction runs where the sum does, its operands
  kept until then.

  A result qualifies where it is read once, by a chain of single-reader fusible ops
  (layout moves, elementwise maps; no contraction, no reduction) that holds a sum
  (`Facts.sums`) and ends in a written value. Of a sum's operands only the one made
  last is taken: a fusion holds one contraction. Read off the compiled HLO of the
  small zoo (T5 and GPT at real widths on v5p:2x2x1): the tied embedding's gradient,
  `attend`'s weight-gradient dot (transposed) plus the lookups' scatter-adds, is one
  fusion run after the scatters, the dot's result never a buffer of its own
  (BENCHMARKS.md, "The sum fused into the dot").
  """
  taken: dict[int, int] = {}  # the sum -> the contraction result its fusion takes
  for op in top:
    if (op.index in live and len(op.outputs) == 1 and not op.subregions
        and ruleslib.facts(op.primitive).contracts and op.outputs[0] not in outputs):
      total = _sum_fusing(graph, op.outputs[0], live, fused)
      if total is not None:
        taken[total] = op.outputs[0]  # in program order: the operand made last wins
  return set(taken.values())


def _sum_fusing(graph: Graph, v: int, live: set[int], fused: set[int]) -> int | None:
  """The first sum on v's chain of single fusible readers, where that chain ends in a
  written value; else None."""
  total, x = None, v
  while True:
    readers = [c for c in graph.consumers.get(x, ()) if c in live]
    if len(readers) != 1:
      return None
    r = graph.ops[readers[0]]
    f = ruleslib.facts(r.primitive)
    if (not f.fusible or f.contracts or f.fusion_root or r.subregions
        or len(r.outputs) != 1):
      return None
    if f.sums and total is None:
      total = r.index
    x = r.outputs[0]
    if x not in fused:
      return total


# The most values one epilogue fusion is seen to take (the tanh GELU's backward: 9).
_EPILOGUE_LIMIT = 32


def dot_epilogues(graph: Graph, top: Sequence[Op], live: set[int]
                  ) -> tuple[set[int], set[int]]:
  """(values never written, reductions taken in as second outputs) of the top-level
  contractions the TPU compiler computes inside the elementwise chain after them.

  A contraction result whose elementwise readers (maps, not layout moves) all converge,
  through elementwise ops only, on one value read by something else (the chain's one
  exit: a dot, a convolution) is computed in one fusion with the chain: the result and
  every value of the chain but the exit are never written, and a reduction reading a
  value of the chain is a second output of that fusion. Read off the TPU compiler's
  HLO of the small ViT (BENCHMARKS.md, "The GELU's backward in one fusion"): the MLP's
  backward `dy @ W2.T`, the tanh GELU's derivative (two branches of muls joined by
  `add_any`s) and the bias gradient's sum are one fusion whose one large output is the
  chain's exit. Only the backward's chains: a forward value the loss reduces and the
  backward reads (a patch convolution's relu, a `tanh` summed) was seen written. A
  chain with two exits (SwiGLU's gate and up gradients), one that reaches a program
  output (an optimizer update) or that reads back a reduction of its own (a softmax's
  backward) is left as `fused_values` decides it.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tapas_jax import trace
    >>> def grads(w1, w2, x):  # an MLP's weight gradients; its GELU's backward is a chain
    ...   loss = lambda w1, w2: jnp.sum(jax.nn.gelu(x @ w1, approximate=True) @ w2)
    ...   return jax.grad(loss, argnums=(0, 1))(w1, w2)
    >>> s = jax.ShapeDtypeStruct
    >>> g = trace.trace(grads, s((16, 64), jnp.float32), s((64, 16), jnp.float32),
    ...                 s((8, 16), jnp.float32))
    >>> top = g.region_ops(0)
    >>> values, _ = dot_epilogues(g, top, live_ops(g, top))
    >>> sorted({g.ops[g.producer[v]].primitive for v in values})
    ['add_any', 'dot_general', 'mul']
  """
  values: set[int] = set()
  sides: set[int] = set()
  outputs = set(graph.outputs)
  for op in top:
    if (op.index not in live or len(op.outputs) != 1 or op.subregions
        or not ruleslib.facts(op.primitive).contracts or not jx.is_transposed(op.name_stack)):
      continue
    found = _epilogue(graph, op.outputs[0], live, outputs)
    if found is not None:
      values |= found[0]
      sides |= found[1]
  return values, sides


def _epilogue(graph: Graph, t: int, live: set[int], outputs: set[int]
              ) -> tuple[set[int], set[int]] | None:
  """(the chain's values but its exit, its reductions) of contraction result t, or None."""
  chain, order, exits, sides = {t}, [t], set(), set()
  for x in order:  # grows as readers are found
    for c in graph.consumers.get(x, ()):
      if c not in live:
        continue
      r = graph.ops[c]
      f = ruleslib.facts(r.primitive)
      if r.subregions:
        exits.add(x)
      elif f.fusion_root:
        sides.add(c)
      elif (f.fusible and not f.moves and not f.contracts and len(r.outputs) == 1
            and jx.is_transposed(r.name_stack)):
        if r.outputs[0] not in chain:
          chain.add(r.outputs[0])
          order.append(r.outputs[0])
      else:
        exits.add(x)
    if len(order) > _EPILOGUE_LIMIT:
      return None
  if len(exits) != 1 or t in exits or not chain.isdisjoint(outputs):
    return None
  (exit,) = exits
  # The exit is the next contractions' operand (with the chain's reductions).
  if not all(ruleslib.facts(graph.ops[c].primitive).contracts
             for c in graph.consumers.get(exit, ()) if c in live and c not in sides):
    return None
  # A reduction the chain itself reads back (a softmax's max and sum) needs a pass of
  # its own: the chain is split there, its values written (the logits are).
  made_in_chain = {graph.producer[x] for x in chain if x in graph.producer}
  if any(_feeds_back(graph, c, made_in_chain, live) for c in sides):
    return None
  return chain - exits, sides


def _feeds_back(graph: Graph, reduction: int, chain_ops: set[int], live: set[int]) -> bool:
  """Whether a reduction's result reaches an op of the chain through fusible ops and
  reductions."""
  todo, seen = list(graph.ops[reduction].outputs), set()
  while todo:
    for c in graph.consumers.get(todo.pop(), ()):
      if c in chain_ops:
        return True
      r = graph.ops[c]
      f = ruleslib.facts(r.primitive)
      if (c in live and c not in seen and (f.fusible or f.fusion_root)
          and not r.subregions and len(seen) < _EPILOGUE_LIMIT):
        seen.add(c)
        todo.extend(r.outputs)
  return False


def fuses_into(op: Op, readers: Sequence[Op], dot_operands: bool = False,
               narrow: bool = False) -> bool:
  """Whether XLA computes `op`'s result inside each of these readers' fusions: an
  elementwise or data-movement op read only by fusions that take it, an expensive one
  by one reader only (with `dot_operands`, the TPU compiler's: dots too, and of the
  expensive ops only a `Facts.costly` one read by a dot is kept to one reader, or a
  `Facts.costly_narrow` one whose result is `narrow`er than 32 bits). Used where
  `fused_values` cannot see the readers: a scan body's recomputed residual read in the
  backward loop's body."""
  f = ruleslib.facts(op.primitive)
  if dot_operands:
    once = (f.costly or (f.costly_narrow and narrow)) and any(
        ruleslib.facts(r.primitive).contracts for r in readers)
  else:
    once = f.expensive
  return (f.fusible and not op.subregions and bool(readers)
          and all(_reader_fuses(r, dot_operands) and not r.subregions for r in readers)
          and (not once or len(readers) == 1))


def narrowing_cast(graph: Graph, readers: Sequence[Op], ttype: TensorType
                   ) -> TensorType | None:
  """The type a value of `ttype` is taken in where every reader converts it to one
  narrower float type (f32 weights cast to the bf16 a model computes in, as flax's
  `param_dtype` does), else None: what a compiler converting before it gathers
  gathers."""
  if not readers or any(op.primitive != "convert_element_type" for op in readers):
    return None
  dtypes = {graph.types[op.outputs[0]].dtype for op in readers}
  if len(dtypes) != 1:
    return None
  narrow = dataclasses.replace(ttype, dtype=dtypes.pop())
  return (narrow if narrow.itemsize < ttype.itemsize
          and narrow.dtype.startswith(("bfloat", "float")) else None)


def _reader_fuses(reader: Op, dot_operands: bool) -> bool:
  """Whether a fusible op's result can fuse into this reader: a fusible op or a
  reduction (a fusion's root), and a dot or convolution where they read their
  operands' chains."""
  f = ruleslib.facts(reader.primitive)
  # A dot and a convolution (`Facts.contracts`) are both the TPU's convolution fusions.
  return f.fusible or f.fusion_root or (dot_operands and f.contracts)


def _big_leaves(graph: Graph, op: Op, v: int, fused: set[int],
                leaves: dict[int, frozenset[int]]) -> frozenset[int]:
  """The written values a fused chain ending in `v` reads that have at least a quarter
  of v's elements (smaller ones, a norm's statistics or scale, are broadcast)."""
  size = max(1, _elements(graph, v))
  out: set[int] = set()
  for x in op.inputs:
    if x not in graph.literals:
      out.update(leaves.get(x, ()) if x in fused else (x,))
  return frozenset(x for x in out if 4 * _elements(graph, x) >= size
                   and not _constant(graph, x))


def _constant(graph: Graph, v: int) -> bool:
  """A broadcast literal or an iota (the zeros a scatter-add starts from): the
  compiler builds it inside its readers, reading nothing."""
  p = graph.producer.get(v)
  return p is not None and graph.ops[p].primitive in ("broadcast_in_dim", "iota") and all(
      x in graph.literals for x in graph.ops[p].inputs)


def _elements(graph: Graph, v: int) -> int:
  n = 1
  for d in graph.types[v].shape:
    n *= d
  return n


def _one_hot_scatter(graph: Graph, op: Op) -> bool:
  """A scatter-add of one update per row of its operand (the batch dims are the
  operand's batching dims, no window): `take_along_axis`'s transpose, which the TPU
  compiler makes a select of the update where an iota equals the index."""
  if op.primitive not in ("scatter-add", "scatter_add"):
    return False
  dn = jx.scatter_dims(op.raw_params)
  return bool(dn.operand_batching_dims) and not dn.update_window_dims


def _into_reduction(graph: Graph, top: Sequence[Op], live: set[int]) -> set[int]:
  """Ops a reduction's fusion takes in: reductions, and fusible ops whose one result
  is read once, by such an op."""
  out: set[int] = set()
  for op in reversed(top):  # readers come after their producers
    if op.index not in live or op.subregions:
      continue
    if ruleslib.facts(op.primitive).fusion_root:
      out.add(op.index)
    elif ruleslib.facts(op.primitive).fusible and len(op.outputs) == 1:
      readers = [c for c in graph.consumers.get(op.outputs[0], ()) if c in live]
      if len(readers) == 1 and readers[0] in out:
        out.add(op.index)
  return out
