"""Per-op cost tables: an op's predicted time as a function of the classes it touches.

Cost = sum over ops of compute and the collectives on its input edges (`cost.reshard`
from the producer's layout, partial sums included, to the layout the op needs), the cuts
between the state update and the compute and between contractions and the ops around
them (sequence parallelism's gathers and reduce-scatters), plus state carried from
outputs back to inputs. Each op's cost depends only on the few classes it touches, so
the objective is a sum of small tables over class variables.

Compute is a roofline: max(FLOPs per device / peak, bytes moved per device / HBM
bandwidth), where the bytes are the op's operands and results as one device holds them
under the split, counting only values XLA writes to memory (`fusion.py`: an elementwise
chain fused into its reader moves its operands once, not once per op). Norms, softmax and
other memory-bound ops so cost time, and splitting them saves it. Ops no output depends
on cost nothing (XLA removes them).

Partial sums (a dot_general or reduction whose contracted dim is split) are reduced
once, where they are made, into the layout their readers get: XLA's SPMD partitioner
reduces at the producer and does not carry partial sums through the adds, transposes
and scalings after it (measured: `scripts/bench_compiled.py`, Megatron's backward
reduces dx of q, k and v one by one), so the model does not either.

With `reuse=True` (folding) structurally equal ops share one table build: the ops of
every instance of one unique layer cost the same, so a table is built once per unique
layer.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from typing import Iterable, Mapping, Sequence

import numpy as np

from tapas_jax import cost as costlib
from tapas_jax import rules as ruleslib
from tapas_jax.solver.fusion import fused_values, live_ops, narrowing_cast, top_level
from tapas_jax.solver.memo import memo
from tapas_jax.solver.problem import Problem
from tapas_jax.solver.views import Standing, scan_bindings, scan_region
from tapas_jax.trace import Op, TensorType

__all__ = ["Table", "TableBuilder", "all_tables", "evaluate_tables", "mesh_dims"]


# -- op cost tables ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Table:
  """One term of an objective, over the domains of a few classes.

  Attributes:
    scope: class ids; the table has one axis per class, indexed by domain entry.
    value: the term: seconds in a cost table, per-device bytes in a memory table.
    comm: bytes sent per device (cost tables; zero in memory tables).
  """

  scope: tuple[int, ...]
  value: np.ndarray
  comm: np.ndarray


class TableBuilder:
  """Builds per-op cost tables; with `reuse`, structurally equal ops share one build.

  A table's cache key holds everything it is computed from (fixed input layouts
  included), so one `cache` may serve several builders of the same problem.
  """

  def __init__(self, problem: Problem, reuse: bool,
               input_layouts: Mapping[int, costlib.Layout] | None = None,
               cache: dict | None = None):
    self.p = problem
    self.reuse = reuse
    self.fixed = dict(input_layouts or {})
    self.cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {} if cache is None else cache
    self.built = 0
    self._splittable = [c.splittable for c in problem.classes]
    g = problem.graph
    # The same for every builder over this program and view.
    self.ops, self.producer, self._searched, self.users = memo(
        self.cache, "searched ops", (g, problem.view), lambda: _searched_ops(problem))
    # Filled as asked, shared by the builders of one problem (the report's baselines):
    # what is partial where it is made depends on the problem alone; so do an op's
    # tables, given the fixed layouts of what it reads (`op_tables`).
    self._partial: dict[int, tuple[int, ...]] = memo(self.cache, "partial", (problem,), dict)
    self._op_tables: dict[tuple, list[Table | None]] = memo(
        self.cache, "op tables", (problem,), dict) if reuse else {}
    self.dead, self.unwritten = memo(self.cache, "unwritten", (g, problem.view),
                                     lambda: _dead_and_unwritten(problem, self.cache))
    # A loop's body reads its operands whole-summed: the loop is no op of the search.
    self._loop_read = memo(self.cache, "loop read", (g, problem.view),
                           lambda: frozenset(problem.cv(v) for i in problem.view.loops
                                             for v in g.ops[i].inputs))
    self._stacked = memo(self.cache, "stacked", (g, problem.view, problem.scan_cuts),
                         lambda: _stacked_results(problem))

  def _src(self, v: int):
    """(per-dim class or None, partial classes) of a value as it arrives."""
    p, g = self.p, self.p.graph
    v = p.cv(v)
    if v in self.producer:
      op = g.ops[self.producer[v]]
      slot = op.outputs.index(v)
      fixed = p.rules[op.index].fixed_output(slot)
      if fixed is not None:  # made on shards the program fixed (a shard_map's)
        return costlib.Layout(fixed), None
      return self.result_classes(op, slot), self.partial_expr(v)
    rank = len(g.types[v].shape)
    return tuple(p.value_class.get((v, d)) for d in range(rank)), None

  def partial_expr(self, v: int):
    """("r", classes): value v holds partial sums over those classes' mesh axes (its
    producer reduced over them); None: never partial. A copy's value reads as the
    value standing for it does."""
    return self._walk(self.p.cv(v))

  def _walk(self, v: int):
    """`partial_expr` of the program's value v itself."""
    if v in self._partial:
      return self._partial[v]
    # What v's sum reads first, deepest first: an unrolled stack's residual stream
    # chains hundreds of sums, past Python's recursion limit (32-layer LLaMA-3-8B).
    # The walk follows the program's own values, not the ones standing for them: in
    # the folded view a layer's input stands for its own output (the previous copy's
    # stands for it), a cycle where the stream really starts at the first copy.
    stack, opened = [(v, False)], set()
    while stack:
      u, inputs_known = stack.pop()
      if u in self._partial:
        continue
      if inputs_known:
        self._partial_of(u)
        continue
      opened.add(u)
      stack.append((u, True))
      stack += [(x, False) for x in self._summed_inputs(u)
                if x not in self._partial and x not in opened]
    return self._partial[v]

  def _made_by(self, v: int) -> tuple[Op, int] | None:
    """(the op making value v, the searched op standing for it), or None where no
    searched op makes it (an input, a loop's output)."""
    if v in self.producer:
      p = self.producer[v]
      return self.p.graph.ops[p], p
    p = self.p.graph.producer.get(v)
    rep = self.p.view.op_canon.get(p)
    if rep is None or rep not in self._searched:
      return None
    return self.p.graph.ops[p], rep

  def _summed_inputs(self, v: int) -> list[int]:
    """The values `_summed_partial` reads for v (none where v is not summed)."""
    made = None if v in self._partial else self._made_by(v)
    if made is None:
      return []
    op, g = made[0], self.p.graph
    facts = ruleslib.facts(op.primitive)
    if not self.p.profile.reassociates_all_reduces or not (facts.sums or facts.moves):
      return []
    return [x for x in op.inputs if x not in g.literals and g.types[x].shape]

  def _partial_of(self, v: int):
    """`partial_expr` of v, what it reads already known."""
    if v in self._partial:
      return self._partial[v]
    expr = None
    made = self._made_by(v)
    if made is not None:
      op, rep = made
      rule = self.p.rules[rep]
      classes = tuple(sorted({c for f in rule.reduce
                              if (c := self.p.factor_class[rep][f]) >= 0
                              and self.p.classes[c].splittable}))
      expr = ("r", classes) if classes else self._summed_partial(op)
    self._partial[v] = expr
    return expr

  def _summed_partial(self, op: Op):
    """A sum of partial values stays partial, reduced once after the add, where the
    compiler reassociates the reductions (`DeviceProfile.reassociates_all_reduces`):
    ("r", the operands' classes together); so does a partial value moved by a
    transpose or reshape on its way to such a sum (a tied embedding's head gradient).
    None otherwise."""
    facts = ruleslib.facts(op.primitive)
    if not self.p.profile.reassociates_all_reduces or not (facts.sums or facts.moves):
      return None
    g = self.p.graph
    arrays = [x for x in op.inputs if x not in g.literals and g.types[x].shape]
    exprs = [self._walk(x) for x in arrays]
    wrong = len(arrays) != 1 if facts.moves else len(arrays) < 2
    if wrong or any(e is None for e in exprs):
      return None
    return ("r", tuple(sorted({c for e in exprs for c in e[1]})))

  def absorbs_partial(self, op_index: int, v: int) -> bool:
    """Whether op reads partial `v` as it is, its own result then partial (a sum the
    compiler reduces once: `_summed_partial`)."""
    op = self.p.graph.ops[op_index]
    return (self._summed_partial(op) is not None and bool(op.outputs)
            and op.index == self.producer.get(self.p.cv(op.outputs[0]))
            and any(self.p.cv(x) == v for x in op.inputs))

  def _factor_class(self, op: Op, f: int) -> int:
    return self.p.factor_class[op.index][f]

  def factor_classes(self, op: Op) -> list[int]:
    """Class of each factor of op (-1: no value dim carries it; never split)."""
    return list(self.p.factor_class[op.index])

  def operand_classes(self, op: Op, k: int) -> tuple[int | None, ...]:
    """Per dim of operand k, the class it must arrive split by (None: whole)."""
    fclass = self.factor_classes(op)
    return tuple(None if f is None else fclass[f] for f in self.p.rules[op.index].inputs[k])

  def result_classes(self, op: Op, slot: int) -> tuple[int | None, ...]:
    """Per dim of result `slot`, the class it leaves split by (None: whole)."""
    v = self.p.cv(op.outputs[slot])
    return tuple(None if f is None else self.p.value_class[(v, d)]
                 for d, f in enumerate(self.p.rules[op.index].outputs[slot]))

  def op_layouts(self, op: Op, choice: Mapping[int, tuple[str, ...]]
                 ) -> tuple[tuple[costlib.Layout, ...], tuple[costlib.Layout, ...]] | None:
    """(operand layouts, result layouts) of op under a class choice, as its cost table
    prices them: operands as the op needs them, results as it makes them, partial
    over the axes of its split reduce classes. None where the table holds inf: the
    choice splits the op twice over one mesh axis.

    Built from the pieces the tables use (`operand_classes`, `result_classes`,
    `partial_expr`, `mesh_dims`), so tests can run an op in exactly these layouts.
    """
    def axes_of(c):
      ok = c is not None and c >= 0 and self.p.classes[c].splittable
      return tuple(choice.get(c, ())) if ok else ()

    split = sorted({c for c in self.factor_classes(op) if axes_of(c)})
    if _clash([axes_of(c) for c in split]):
      return None

    def dims(classes):
      return mesh_dims(range(len(classes)), [axes_of(c) for c in classes])

    ins = []
    for k, v in enumerate(op.inputs):
      rank = len(self.p.graph.types[v].shape)
      ins.append(costlib.Layout(dims(self.operand_classes(op, k)) if rank else ()))
    outs = []
    for slot, v in enumerate(op.outputs):
      out = dims(self.result_classes(op, slot))
      expr = self.partial_expr(v)
      part = () if expr is None else tuple(sorted({a for c in expr[1] for a in axes_of(c)}))
      outs.append(costlib.Layout(out, partial=_arriving_partial(out, part)))
    return tuple(ins), tuple(outs)

  def op_tables(self, op: Op, shared: frozenset[int] = frozenset()) -> list[Table | None]:
    """The op's cost as tables. An op with no factors (replicated: an unknown
    primitive, a loop kept whole) couples nothing, so each input edge gets a table of
    its own: one joint table over every operand's classes would grow without bound.
    `shared`: operand slots whose reshard another op's read already pays for.
    """
    fixed = tuple(map(self.fixed.get, op.inputs)) if self.fixed else ()
    key = (op.index, shared, () if all(f is None for f in fixed) else fixed)
    found = self._op_tables.get(key)
    if found is None:
      found = self._op_tables[key] = self._op_tables_of(op, shared)
    return found

  def _op_tables_of(self, op: Op, shared: frozenset[int]) -> list[Table | None]:
    if op.index in self.dead or all(self.p.cv(v) in self.p.free_values
                                     for v in op.outputs):
      return []  # XLA removes it, or folds it into its readers (a causal mask)
    if self.p.rules[op.index].factor_sizes:
      return [self.op_table(op, shared=shared)]
    return [self.op_table(op, only=k, shared=shared) for k in range(len(op.inputs))]

  def op_table(self, op: Op, only: int | None = None,
               shared: frozenset[int] = frozenset()) -> Table | None:
    p, g = self.p, self.p.graph
    rule = p.rules[op.index]
    fclass = self.factor_classes(op)
    edges = []
    for k, v in enumerate(op.inputs):
      if v in g.literals or not g.types[v].shape or only not in (None, k) or k in shared:
        continue
      if p.cv(v) in p.free_values:
        continue  # made where it is read, in any layout (a causal mask)
      # Partial sums arrive reduced: by `resolve_table`, or by `cut_table` in the
      # reader's layout.
      src_dims = p.read_dims(op.index, v)
      if src_dims is None:
        src_dims = self.fixed.get(v, self._src(v)[0])
      fixed = rule.fixed_input(k)
      dst_dims = (costlib.Layout(fixed) if fixed is not None
                  else self.operand_classes(op, k))
      edges.append((g.types[v], src_dims, None, dst_dims))
    flops = rule.flops if only in (None, 0) else 0.0
    traffic = self.traffic(op) if only in (None, 0) else []
    return self._table(("op", op.signature, only), fclass, flops, g.types[op.outputs[0]]
                       if op.outputs else None, edges, traffic)

  def traffic(self, op: Op) -> list[tuple[int, tuple[int | None, ...]]]:
    """(bytes, class per dim) of each operand the op reads from memory, in the layout
    it reads it, and each result it writes, as it makes it."""
    p, g = self.p, self.p.graph
    rule, fclass = p.rules[op.index], self.factor_classes(op)
    out = []
    for k, (v, dims) in enumerate(zip(op.inputs, rule.inputs)):
      if v not in g.literals and g.types[v].shape and p.cv(v) not in self.unwritten \
          and v not in self.unwritten:
        out.append((self._share(g.types[v].nbytes, rule.fixed_input(k)),
                    tuple(None if f is None else fclass[f] for f in dims)))
    for slot, (v, dims) in enumerate(zip(op.outputs, rule.outputs)):
      if g.types[v].shape and v not in self.unwritten:
        out.append((self._share(g.types[v].nbytes, rule.fixed_output(slot)),
                    tuple(None if f is None else fclass[f] for f in dims)))
    return out

  def _share(self, nbytes: int, fixed) -> float:
    """A device's bytes of a tensor, where a fixed layout splits it; else all."""
    if fixed is None:
      return nbytes
    return nbytes / costlib.num_shards(costlib.Layout(fixed), self.p.mesh)

  def resolve_table(self, v: int) -> Table | None:
    """The one reduction of a partial value, in its producer's layout.

    Charged once per value, however many users read it, as XLA reduces it once. A
    value read only through cuts (by the state update, or by norms after a
    sequence-parallel dot) is reduced by its `cut_table`s instead.
    """
    expr = self.partial_expr(v)
    if expr is None or not self._resolved_users(v):
      return None
    dims, _ = self._src(v)
    return self._table(("resolve",), [], 0.0, None,
                       [(self.p.graph.types[v], dims, expr, dims)])

  def _resolved_users(self, v: int) -> bool:
    """Whether partial-or-not value v is reduced where it is made: some reader reads it
    as made (not through a cut, not as a sum it absorbs), it is a program output, a
    scan body stacks it into a result (`_stacked_results`), or a scan reads it."""
    return (v in self.p.graph.output_set or v in self._stacked or v in self._loop_read
            or any(self.p.read_dims(c, v) is None and not self.absorbs_partial(c, v)
                   for c in self.users.get(v, ())))

  def carry_table(self, out: int, inp: int) -> Table | None:
    src_dims, _ = self._src(out)
    partial = None  # outputs are reduced by `resolve_table`
    rank = len(self.p.graph.types[inp].shape)
    dst = self.fixed.get(inp) or tuple(self.p.vclass(inp, d) for d in range(rank))
    return self._table(("carry",), [], 0.0, None,
                       [(self.p.graph.types[inp], src_dims, partial, dst)])

  def cut_table(self, v: int, side) -> Table | None:
    """Bringing a value seen apart by its maker and some readers into those readers'
    layout (`Problem.reader_dims`): a parameter gathered for use (ZeRO-3's
    all-gather), a gradient reduced into the update's layout (an all-reduce, or a
    reduce-scatter when the update is split further), a norm's output gathered into
    a sequence-parallel dot, a dot's partial result reduce-scattered into the
    residual's layout."""
    src_dims, _ = self._src(v)
    src_dims = self.fixed.get(v, src_dims)
    # None for inputs; a value some readers read as made is reduced once, by
    # `resolve_table`, and the cut moves the reduced value (a gradient that Keras'
    # Adam squares in the compute and subtracts in the update: one all-reduce).
    partial = None if self._resolved_users(v) else self.partial_expr(v)
    dst = self.p.reader_dims[(v, side)]
    readers = [i for i in self.users.get(v, ()) if self.p.read_side(i, v) == side]
    return self._table(("cut",), [], 0.0, None,
                       [(self._sent_type(self.p.graph.types[v], readers), src_dims, partial,
                         dst)])

  def scan_cut_table(self, outer: int, inner: int, read: bool) -> Table | None:
    """One iteration of a scan through a stacked-state cut (`Problem.scan_cuts`): the
    iteration's slice of the stored stack gathered into the body's layout (FSDP's
    per-layer all-gather), or the body's slice of the stack's gradient delivered into
    the stack's layout, its partial sums reduced on the way (a reduce-scatter) unless
    the body reduces them where they are made."""
    p, g = self.p, self.p.graph
    rank = len(g.types[inner].shape)
    fixed = self.fixed.get(outer)
    stack = (costlib.Layout(fixed.dims[1:]) if fixed is not None
             else tuple(p.vclass(outer, d + 1) for d in range(rank)))
    if read:
      edge = (self._sent_type(g.types[inner], self.users.get(inner, ())), stack, None,
              tuple(p.value_class[(inner, d)] for d in range(rank)))
    else:
      made, partial = self._src(inner)
      edge = (g.types[inner], made, None if self.users.get(inner) else partial, stack)
    return self._table(("scan cut",), [], 0.0, None, [edge])

  def _sent_type(self, ttype: TensorType, readers) -> TensorType:
    """The type a value is gathered in for these readers, where the compiler converts
    the shard before gathering it (`DeviceProfile.gathers_dot_operands_in_bf16`): bf16
    for an f32 value read only by dots and convolutions at DEFAULT precision (run as one
    bf16 pass), directly or through ops that only move its elements (a kernel reversed
    for the backward convolution: the TPU compiler gathers it once, in bf16), and
    the readers' type for a value read only by converts to one narrower type (f32
    weights cast to the bf16 the model computes in, as flax's `param_dtype` does)."""
    if not self.p.profile.gathers_dot_operands_in_bf16 or not readers:
      return ttype
    g = self.p.graph
    ops = [g.ops[i] for i in readers]
    if ttype.dtype == "float32" and _into_contractions(g, ops):
      return dataclasses.replace(ttype, dtype="bfloat16")
    return narrowing_cast(g, ops, ttype) or ttype

  def _table(self, kind, fclass, flops, out_type, edges, traffic=()) -> Table | None:
    scope: dict[int, int] = {}  # class -> its position, in order of first use
    splittable = self._splittable

    def pos(c):
      if c is None or c < 0 or not splittable[c]:
        return None
      q = scope.get(c)
      if q is None:
        q = scope[c] = len(scope)
      return q

    def place(dims):  # class ids -> scope positions; a fixed Layout stays as it is
      return dims if isinstance(dims, costlib.Layout) else tuple(pos(c) for c in dims)

    fpos = [pos(c) for c in fclass]
    def expr_pos(e):
      return None if e is None else ("r", tuple(pos(c) for c in e[1]))

    epos = [(t, place(src), expr_pos(partial), place(dst)) for t, src, partial, dst in edges]
    tpos = tuple((n, place(dims)) for n, dims in traffic)
    if not scope and not flops and not tpos:
      return None
    domains = tuple(self.p.domains[c] for c in scope)
    key = (kind, tuple(fpos), tuple(epos), domains, flops, out_type, tpos)
    cached = self.cache.get(key) if self.reuse else None
    if cached is None:
      cached = self._compute(fpos, flops, out_type, epos, domains, tpos)
      self.built += 1
      if self.reuse:
        self.cache[key] = cached
    return Table(tuple(scope), *cached)

  def _compute(self, fpos, flops, out_type, epos, domains, traffic=()):
    """(seconds, bytes sent) over every choice of the scope's domains.

    Built as arrays: each term over the scope positions it depends on, broadcast to
    the table, the terms added in the order one entry at a time would add them, and
    each division by a shard count done by Python on the same numbers: every entry is
    the same float the entry-by-entry sum gives.
    """
    p = self.p
    shape = tuple(len(d) for d in domains)
    dtype = out_type.dtype if out_type is not None else "float32"
    split = sorted({q for q in fpos if q is not None})
    grid = _Grid(domains, p.mesh)
    moved = 0
    for n, dims in traffic:
      moved = moved + _divided(n, grid.shards(dims))
    total = _pairwise(lambda s, m: costlib.roofline_time(flops / s, m, p.profile, dtype),
                      grid.shards(split), moved)
    sent, failed = 0.0, False
    for ttype, src, partial, dst in epos:
      seconds, nbytes, fails = grid.edge(ttype, src, partial, dst, p.profile)
      total = total + seconds  # inf where the edge cannot be made
      sent = np.where(failed | fails, sent, sent + nbytes)  # bytes up to the first failure
      failed = failed | fails
    clash = grid.clash(split)  # one op split twice over one mesh axis
    t = np.where(clash, np.inf, np.broadcast_to(total, shape)).astype(float)
    b = np.where(clash, 0.0, np.broadcast_to(sent, shape)).astype(float)
    return t, b


def _searched_ops(problem: Problem) -> tuple[list[Op], dict[int, int], set[int],
                                             dict[int, list[int]]]:
  """(the ops searched, value -> the searched op making it, their indices, value
  standing for others -> the searched ops reading it) of a problem's view."""
  g = problem.graph
  ops = [g.ops[i] for i in problem.view.ops if i not in problem.view.loops]
  users: dict[int, list[int]] = {}
  for op in ops:
    for v in op.inputs:
      users.setdefault(problem.cv(v), []).append(op.index)
  return (ops, {v: op.index for op in ops for v in op.outputs}, {op.index for op in ops},
          users)


def _into_contractions(g, ops: Sequence[Op], depth: int = 4) -> bool:
  """Whether these readers are DEFAULT-precision contractions, or ops that only move
  or select elements (`Facts.moves`, `Facts.selects`) read only by such, a few deep."""
  for op in ops:
    if ruleslib.default_precision_contraction(op):
      continue
    readers = [g.ops[c] for w in op.outputs for c in g.consumers.get(w, ())]
    facts = ruleslib.facts(op.primitive)
    if not (depth and (facts.moves or facts.selects) and readers
            and _into_contractions(g, readers, depth - 1)):
      return False
  return True


class _Grid:
  """Every choice of a table's domains (one per scope position), as broadcastable
  arrays: a term over some positions has size 1 along the others."""

  def __init__(self, domains, mesh: costlib.MeshSpec):
    self.domains, self.mesh = domains, mesh

  def clash(self, positions) -> np.ndarray:
    """Whether one mesh axis is chosen twice among these positions (`_clash`)."""
    return _grid_terms(self.domains, self.mesh, tuple(positions))[1]

  def shards(self, positions) -> np.ndarray:
    """Devices a value whose dims sit at these positions is split over: the product of
    the sizes of the mesh axes chosen, each once (as `mesh_dims` assigns them)."""
    return _grid_terms(self.domains, self.mesh,
                       tuple(q for q in positions if q is not None))[0]

  def edge(self, ttype, src, partial, dst, profile):
    """(seconds, bytes sent, impossible) of one edge over the positions it reads."""
    mine = set()
    for dims in (src, dst):
      if not isinstance(dims, costlib.Layout):
        mine.update(q for q in dims if q is not None)
    if partial is not None:
      mine.update(q for q in partial[1] if q is not None)
    mine = sorted(mine)
    label = {q: k for k, q in enumerate(mine)}

    def relabel(dims):
      if dims is None or isinstance(dims, costlib.Layout):
        return dims
      return tuple(None if q is None else label[q] for q in dims)

    seconds, nbytes, fails = _edge_table(
        ttype.shape, ttype.itemsize, relabel(src),
        None if partial is None else ("r", relabel(partial[1])), relabel(dst),
        tuple(self.domains[q] for q in mine), self.mesh, profile)
    shape = [len(self.domains[q]) if q in label else 1 for q in range(len(self.domains))]
    return seconds.reshape(shape), nbytes.reshape(shape), fails.reshape(shape)


@functools.lru_cache(maxsize=1 << 12)
def _grid_terms(domains, mesh: costlib.MeshSpec, positions: tuple[int, ...]
                ) -> tuple[np.ndarray, np.ndarray]:
  """(shards, clash) of `_Grid` for these positions: the ops of a layer ask the same of
  the same domains. Read-only: shared."""
  shape = [1] * len(domains)
  shards, clash = np.ones(shape, int), np.zeros(shape, bool)
  for a in mesh.axis_names:
    uses = np.zeros(shape, int)  # how many of the positions' choices hold `a`
    for q in positions:
      along = shape.copy()
      along[q] = len(domains[q])
      uses = uses + np.asarray([entry.count(a) for entry in domains[q]]).reshape(along)
    shards = shards * np.where(uses > 0, mesh.size(a), 1)
    clash = clash | (uses > 1)
  for out in (shards, clash):
    out.setflags(write=False)
  return shards, clash


@functools.lru_cache(maxsize=1 << 12)
def _edge_table(shape, itemsize, src, partial, dst, domains, mesh, profile):
  """`_edge_cost` for every choice of `domains` (the edge's own positions, in order):
  (seconds, inf where impossible; bytes sent; impossible). Read-only: shared."""
  size = tuple(len(d) for d in domains)
  # A table has a row per choice of every position, but each side's dims (and the
  # partial axes) depend on their own positions only, and many choices lay both sides
  # out alike: each is worked out once per choice of the positions it reads, each
  # distinct edge once.
  src_of = _per_choice(src, domains, mesh_dims)
  dst_of = _per_choice(dst, domains, mesh_dims)
  part_of = _per_choice(None if partial is None else partial[1], domains,
                        lambda _, axes: _eval_partial(partial, axes))
  costs: dict[tuple, tuple[float, float] | None] = {}
  seconds, nbytes, fails = [], [], []
  for idx in itertools.product(*(range(n) for n in size)):
    key = (src_of(idx), part_of(idx), dst_of(idx))
    edge = costs[key] if key in costs else costs.setdefault(
        key, _edge_cost(shape, itemsize, key[0], key[1], key[2], mesh, profile))
    if edge is None:
      seconds.append(np.inf)
      nbytes.append(0.0)
      fails.append(True)
    else:
      seconds.append(edge[0])
      nbytes.append(edge[1])
      fails.append(False)
  out = (np.array(seconds, float).reshape(size), np.array(nbytes, float).reshape(size),
         np.array(fails, bool).reshape(size))
  for a in out:
    a.setflags(write=False)
  return out


def _per_choice(side, domains, compute):
  """idx -> `compute(side, axes)` for a choice idx of every position, computed once per
  choice of the positions `side` reads. `side`: scope positions (None where a dim
  reads none), a fixed `Layout` (its dims), or None (no partial sums: ())."""
  if side is None:
    return lambda idx: ()
  if isinstance(side, costlib.Layout):
    return lambda idx: side.dims
  used = sorted({q for q in side if q is not None})
  key = operator.itemgetter(*used) if used else (lambda idx: ())
  memo: dict = {}

  def of(idx):
    k = key(idx)
    found = memo.get(k)
    if found is None:
      found = memo[k] = compute(side, tuple(domains[q][i] for q, i in enumerate(idx)))
    return found
  return of


def _divided(n, shards: np.ndarray) -> np.ndarray:
  """n / shards entry by entry, each division Python's on Python numbers (an int over
  an int rounds once, exactly), as one entry at a time divides."""
  return _pairwise(lambda s, _: n / s, shards, 0.0)


def _pairwise(fn, x: np.ndarray, y) -> np.ndarray:
  """fn(x, y) entry by entry (broadcast) on Python numbers, called once per distinct
  pair. Tables are small (a few dozen entries): a dict beats sorting for uniques."""
  x, y = np.broadcast_arrays(x, np.asarray(y, float))
  memo: dict = {}
  out = []
  for pair in zip(x.ravel().tolist(), y.ravel().tolist()):
    found = memo.get(pair)
    if found is None:
      found = memo[pair] = fn(*pair)
    out.append(found)
  return np.array(out, float).reshape(x.shape)


@functools.lru_cache(maxsize=1 << 18)
def _edge_cost(shape, itemsize, src_dims, part, dst_dims, mesh, profile):
  """(seconds, bytes sent) to bring a value from src to dst; None if impossible.

  `part`: axes the value is partial over as it arrives; they are reduced on the way.
  """
  try:
    src_l = costlib.Layout(src_dims, partial=_arriving_partial(src_dims, part))
    dst_l = costlib.Layout(dst_dims)
    steps = costlib.reshard(shape, itemsize, src_l, dst_l, mesh, profile)
  except ValueError:
    return None
  return sum(c.time_s for c in steps), sum(c.bytes_sent_per_device for c in steps)


def _clash(axes: Iterable[tuple[str, ...]]) -> bool:
  """Whether one mesh axis appears twice among these factors' axes."""
  used = [a for entry in axes for a in entry]
  return len(used) != len(set(used))


def _arriving_partial(dims: Sequence[tuple[str, ...]], part: Sequence[str]
                      ) -> tuple[str, ...]:
  """The partial axes a value in these dims can hold: a mesh axis marks a dim split or
  partial sums, never both (the producer's own table prices that choice as inf)."""
  split = {a for d in dims for a in d}
  return tuple(a for a in part if a not in split)


def _eval_partial(expr, axes: Sequence[tuple[str, ...]]) -> tuple[str, ...]:
  """The mesh axes a partial expression (scope positions) holds under a choice."""
  if expr is None:
    return ()
  return tuple(sorted({a for q in expr[1] if q is not None for a in axes[q]}))


def mesh_dims(positions: Sequence[int | None],
          axes: Sequence[tuple[str, ...]]) -> tuple[tuple[str, ...], ...]:
  """Per-dim mesh axes of a value whose dims sit at these scope positions; an axis
  splits only the first dim that asks for it."""
  dims, seen = [], set()
  for q in positions:
    entry = tuple(a for a in axes[q] if a not in seen) if q is not None else ()
    seen.update(entry)
    dims.append(entry)
  return tuple(dims)


def _dead_and_unwritten(problem: Problem, cache: dict
                        ) -> tuple[frozenset[int], frozenset[int]]:
  """(ops XLA removes, values that never reach memory) of the top level and of every
  scan body the view searches (a body fuses as the top level does)."""
  g = problem.graph
  kept = top_level(g, cache, copies=problem.view.copies)
  if not problem.view.loops:
    return kept.dead, frozenset(kept.fused)
  dead, unwritten = set(kept.dead), set(kept.fused)
  for loop in problem.view.loops:
    region = scan_region(g, g.ops[loop])
    body = list(g.region_ops(region.index))
    live = live_ops(g, body, region.outputs)
    dead |= {op.index for op in body} - live
    unwritten |= fused_values(g, body, live, region.outputs)
  return frozenset(dead), frozenset(unwritten)


def all_tables(problem: Problem, builder: TableBuilder) -> list[Table]:
  """Cost tables of every op, every partial value's reduction and every state carry."""
  weighted = []
  for op in builder.ops:
    w = problem.view.weight.get(op.index, 1)
    weighted += [(t, w) for t in builder.op_tables(op)]
    weighted += [(builder.resolve_table(v), w) for v in op.outputs]
  weighted += [(builder.carry_table(out, inp), n) for out, inp, n in problem.state_pairs]
  # A pass over the whole program, the same for every builder of this view and cuts.
  copies = memo(builder.cache, "cut copies", (problem.graph, problem.view, problem.read_sides),
                lambda: _activation_cut_copies(problem, builder))
  # Inputs standing for a folded layer's copies of theirs (its parameters): the others
  # (a stack every layer slices) are one value, gathered once however many copies read it.
  standing = memo(builder.cache, "inputs standing", (problem.graph, problem.view),
                  lambda: frozenset(problem.cv(i.value) for i in problem.graph.inputs
                                    if problem.cv(i.value) != i.value))
  for v, side in problem.reader_dims:
    if isinstance(side, str):
      w = copies.get((v, side), 1)
    else:
      w = _gathers(problem, [i for i in builder.users.get(v, ())
                             if problem.read_side(i, v) == side],
                   once=side is False and v not in standing)
    weighted.append((builder.cut_table(v, side), w))
  for loop, outer, inner, read in problem.scan_cuts:  # once per iteration
    trips = scan_region(problem.graph, problem.graph.ops[loop]).trip_count
    weighted.append((builder.scan_cut_table(outer, inner, read),
                     trips * problem.view.weight.get(loop, 1)))
  return [t if w == 1 else Table(t.scope, t.value * w, t.comm * w)
          for t, w in weighted if t is not None]


def _gathers(problem: Problem, readers: Sequence[int], once: bool) -> int:
  """How many times a value is brought to `readers` through a cut: once for those
  outside any of the user's checkpoints (the compiler shares one gather among them) and
  once more for each checkpoint with readers inside, which reads it behind its own
  optimization barrier (`Op.barrier`). Each of those once per copy of a folded layer
  (`View.weight`: the value stands for each copy's own), or, `once`, once (one value
  every copy reads)."""
  most: dict[int, int] = {}
  for i in readers:
    b = problem.graph.ops[i].barrier
    most[b] = 1 if once else max(most.get(b, 1), problem.view.weight.get(i, 1))
  return sum(most.values()) or 1


def _stacked_results(problem: Problem) -> frozenset[int]:
  """Body values a scan of the view stacks into its results, other than those a scan
  cut delivers (`Problem.scan_cuts`, read False, which reduce their partial sums on the
  way): each iteration's slice is reduced in the loop, as the compiler does (a scanned
  stack's weight gradients under data parallelism, where gradient clipping reads the
  stack and so no cut is seen)."""
  g = problem.graph
  cut = {inner for _, _, inner, read in problem.scan_cuts if not read}
  return frozenset(inner for loop in problem.view.loops
                   for outer, inner, shift in scan_bindings(g, g.ops[loop])
                   if shift and outer in g.ops[loop].outputs and inner not in cut)


def _activation_cut_copies(problem: Problem, builder: TableBuilder
                           ) -> dict[tuple[int, object], int]:
  """(value, side) -> how many times the program goes through that activation cut.

  Once per copy of the value read on that side, counted on the whole program: an
  encoder output every decoder layer reads is gathered once; the last layer's output,
  read by an interior copy the folded view stands in for, is one more copy of the
  representative's. A loop body's cut runs once per trip.
  """
  g, view = problem.graph, problem.view
  # Searched ops reading through a cut (the others add nothing).
  searched = {op.index for op in builder.ops} & {r for r, _ in problem.read_sides}
  read: dict[tuple[int, object], dict[int, int]] = {}
  for op in Standing(g, view, region=None).where(searched.__contains__):
    rep = view.op_canon.get(op.index, op.index)
    unit = view.weight.get(op.index, 1) if op.region != 0 else 1
    for x, y in zip(op.inputs, g.ops[rep].inputs):
      side = problem.read_sides.get((rep, problem.cv(y)))
      if side is not None:
        seen = read.setdefault((problem.cv(y), side), {})
        seen[x] = max(seen.get(x, 0), unit)
  return {key: sum(seen.values()) for key, seen in read.items()}


def evaluate_tables(tables: Iterable[Table], choice_idx: Mapping[int, int]) -> tuple[float, float]:
  t = b = 0.0
  for table in tables:
    idx = tuple(choice_idx.get(c, 0) for c in table.scope)
    t += float(table.value[idx])
    b += float(table.comm[idx])
  return t, b
