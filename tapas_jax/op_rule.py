"""The record a sharding rule returns (`OpRule`: an op as an einsum over dimension
factors), what else the pipeline knows of a primitive (`Facts`: fusion, in place,
contraction), the registry of both by primitive name (`RULES`, `FACTS`, `register`,
`facts`), strict mode (`strict_rules`: whether a rule that fails raises) and the lookup
(`rule_of`, `rule_for`: the registered rule, or the replicated default with one
warning).

The rules themselves, one per primitive, with their facts beside them, are in
`tapas_jax.rules`, which fills `RULES` and `FACTS` and re-exports these names. A
primitive nobody registered gets the one conservative default, `DEFAULT_FACTS` (as it
gets `default_rule`).

Invariants every rule keeps (checked by `OpRule.__post_init__`): a factor that
indexes an operand but no result is in `reduce`; a `reduce` factor indexes no
result; a factor indexes at most one dim of a tensor; size-1 dims are None.

Example:
  >>> from tapas_jax.op_rule import OpRule
  >>> OpRule((8, 4, 16), inputs=((0, 1), (1, 2)), outputs=((0, 2),), reduce=(1,)).einsum()
  'ab,bc->ac'
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
import string
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

__all__ = ["COMBINES", "DEFAULT_FACTS", "FACTS", "RULES", "STRICT_ENV", "Dims", "Factors",
           "Facts", "OpRule", "RuleFn", "Shape", "default_rule", "elements", "facts",
           "is_strict", "norm_axis", "register", "rule_for", "rule_of", "strict_rules",
           "unsplit"]

Shape = tuple[int, ...]
Dims = tuple[int | None, ...]
RuleFn = Callable[[Mapping[str, Any], Sequence[Shape], Sequence[Shape]], "OpRule"]

# How the partial results of a `reduce` factor combine.
COMBINES = ("sum", "max", "min", "prod", "and", "or", "xor")


@dataclasses.dataclass(frozen=True)
class OpRule:
  """Einsum-like sharding rule of one op.

  Attributes:
    factor_sizes: size of each factor (dimension variable). A split over mesh axes
      must divide it evenly.
    inputs: per op input, per dim: factor index, or None = that dim must stay
      unsplit. Scalars (and literals) have no dims.
    outputs: per op output, per dim: factor index or None.
    reduce: factors summed or reduced away (dot_general contracting dims,
      reduce_sum axes, the vocab dim of an embedding gather, the batch dims of an
      embedding-gradient scatter-add): splitting one leaves every output partial
      over its mesh axes.
    flops: total FLOPs of the op, unsharded (dot_general 2*prod(all factors), conv
      2*out_elems*kernel_spatial*in_features_per_group, elementwise: output
      elements, reductions and scans: input elements, data movement: 0).
    combine: how partial outputs of `reduce` factors combine: "sum" (also for
      gather/scatter-add, which are masked lookups summed), "max", "min", "prod",
      "and", "or", "xor". All cost the same all-reduce; the name is for reports
      and for anyone materialising partials by hand.
    fixed_inputs: an op that runs on shards the program fixed (`jax.shard_map`):
      per operand, the mesh axes splitting each dim as it reads it (a
      `PartitionSpec` as tuples, one per dim), or None where the factors say;
      empty: none fixed. A fixed operand's dims are unsplit factors (None).
    fixed_outputs: per result, likewise, as it makes it.
    fixed_mesh: ((axis, size), ...) of the mesh the fixed layouts name; a search on
      other axes drops the fixed layouts (priced whole, one warning). Such an op's
      `flops` are a device's (its body's, run per device on its shards: `rule_for`
      counts them).

  Example:
    >>> r = OpRule(factor_sizes=(8, 4, 16), inputs=((0, 1), (1, 2)),
    ...            outputs=((0, 2),), reduce=(1,), flops=2 * 8 * 4 * 16)
    >>> r.einsum()
    'ab,bc->ac'
  """

  factor_sizes: tuple[int, ...]
  inputs: tuple[Dims, ...]
  outputs: tuple[Dims, ...]
  reduce: tuple[int, ...] = ()
  flops: int = 0
  combine: str = "sum"
  fixed_inputs: tuple[tuple[tuple[str, ...], ...] | None, ...] = ()
  fixed_outputs: tuple[tuple[tuple[str, ...], ...] | None, ...] = ()
  fixed_mesh: tuple[tuple[str, int], ...] = ()

  def __post_init__(self):
    n = len(self.factor_sizes)
    for fixed, group in ((self.fixed_inputs, self.inputs), (self.fixed_outputs,
                                                             self.outputs)):
      if fixed and (len(fixed) != len(group) or any(
          f is not None and (len(f) != len(d) or any(x is not None for x in d))
          for f, d in zip(fixed, group))):
        raise ValueError(f"OpRule: fixed layouts {fixed} must give each tensor's every "
                         f"dim, and those dims be unsplit factors ({group})")
    in_factors, out_factors = set(), set()
    for group, seen in ((self.inputs, in_factors), (self.outputs, out_factors)):
      for dims in group:
        used = [f for f in dims if f is not None]
        if len(used) != len(set(used)) or any(not 0 <= f < n for f in used):
          raise ValueError(f"OpRule: bad factors {dims} for {n} factors: each factor "
                           "indexes at most one dim of a tensor")
        seen.update(used)
    red = set(self.reduce)
    if red & out_factors:
      raise ValueError(f"OpRule: reduce factors {sorted(red & out_factors)} index an "
                       "output")
    if in_factors - out_factors - red:
      raise ValueError(f"OpRule: factors {sorted(in_factors - out_factors - red)} index "
                       "inputs only; add them to reduce or use None")
    if self.combine not in COMBINES:
      raise ValueError(f"OpRule: combine {self.combine!r} is not one of {COMBINES}")

  @property
  def num_factors(self) -> int:
    return len(self.factor_sizes)

  def einsum(self) -> str:
    """The rule as einsum text: one letter per factor, `_` for an unsplittable dim.

    Letters follow factor order; reduce factors are the ones missing on the right.

    Example:
      >>> OpRule((4, 3), inputs=((0, None), (1,)), outputs=((0, 1),)).einsum()
      'a_,b->ab'
    """
    letters = string.ascii_letters
    if self.num_factors > len(letters):
      return f"<{self.num_factors} factors>"

    def text(dims: Dims) -> str:
      return "".join("_" if f is None else letters[f] for f in dims)

    return (",".join(text(d) for d in self.inputs) + "->" +
            ",".join(text(d) for d in self.outputs))

  def fixed_input(self, k: int) -> tuple[tuple[str, ...], ...] | None:
    """The layout operand k is read in where the program fixed it, else None."""
    return self.fixed_inputs[k] if self.fixed_inputs else None

  def fixed_output(self, slot: int) -> tuple[tuple[str, ...], ...] | None:
    """The layout result `slot` is made in where the program fixed it, else None."""
    return self.fixed_outputs[slot] if self.fixed_outputs else None

  def flops_per_device(self, assignment: Mapping[int, Sequence[str]],
                       axis_sizes: Mapping[str, int]) -> float:
    """FLOPs one device runs: every factor splits the iteration space.

    Example:
      >>> r = OpRule((8, 4, 16), ((0, 1), (1, 2)), ((0, 2),), reduce=(1,), flops=1024)
      >>> r.flops_per_device({0: ("data",), 1: ("model",)}, {"data": 2, "model": 4})
      128.0
    """
    shards = math.prod(axis_sizes[a] for axes in assignment.values() for a in axes)
    return self.flops / shards


# -- building rules ---------------------------------------------------------------


class Factors:
  """Hands out factor indices; dims of size <= 1 get None (nothing to split)."""

  def __init__(self):
    self.sizes: list[int] = []

  def new(self, size: int) -> int | None:
    if size <= 1:
      return None
    self.sizes.append(int(size))
    return len(self.sizes) - 1

  def rule(self, inputs: Iterable[Iterable[int | None]],
           outputs: Iterable[Iterable[int | None]], reduce: Iterable[int | None] = (),
           flops: int = 0, combine: str = "sum") -> OpRule:
    return OpRule(factor_sizes=tuple(self.sizes),
                  inputs=tuple(tuple(d) for d in inputs),
                  outputs=tuple(tuple(d) for d in outputs),
                  reduce=tuple(f for f in reduce if f is not None),
                  flops=int(flops), combine=combine)


def elements(shape: Shape) -> int:
  """Elements of a tensor of this shape."""
  return math.prod(shape)


def unsplit(shapes: Sequence[Shape]) -> tuple[Dims, ...]:
  """Every dim of every tensor unsplit (None)."""
  return tuple((None,) * len(s) for s in shapes)


def norm_axis(axis: int, rank: int) -> int:
  """A negative axis counted from the front."""
  return axis + rank if axis < 0 else axis


def default_rule(in_shapes: Sequence[Shape], out_shapes: Sequence[Shape]) -> OpRule:
  """Every dim unsplit: operands replicated, results replicated.

  Example:
    >>> default_rule([(4, 8)], [(8,)]).einsum()
    '__->_'
  """
  return OpRule((), unsplit(in_shapes), unsplit(out_shapes))


@dataclasses.dataclass(frozen=True)
class Facts:
  """What the memory model, the cost model, remat and folding know of a primitive
  besides its sharding rule. The default (every field off) is the conservative one:
  the result is written out to its own buffer and the op marks no layer.

  Attributes:
    fusible: XLA fuses it into its readers (loop fusion) rather than writing its
      result out: elementwise maps and data movement.
    expensive: fusible, but XLA does not duplicate it into several readers (its
      `IsExpensive` list: transcendental ops): with more than one reader its result
      is written out.
    costly: expensive on the TPU too. The TPU compiler recomputes the other expensive
      ops (exp, logistic, tanh) in each fusion that reads them, but writes out a chain
      holding an erf (erfc) read by a dot and by another op: the exact GELU's output,
      read by the forward's and the backward's dots, is the second output of the dot
      making its input (the tanh GELU is recomputed in both).
    costly_narrow: costly where the value the dots read is narrower than 32 bits: the
      TPU compiler recomputes an f32 softmax's divide `e / sum(e)` inside each dot
      reading the probabilities, but writes them where they are bf16, computed so or
      converted so for the dots (a mixed-precision softmax), and read by a dot and
      another op.
    fusion_root: a reduction a fusible op fuses into; its own result is written.
    in_place: XLA runs it in place: the result takes over the buffer of operand 0
      when that is its last use (a scatter into zeros, a dynamic update).
    contracts: a dot or a convolution: a repeated scope that has one is a layer, a
      stacked instance with one is no scanned stack, and `dots_saveable` keeps its
      result.
    copies: an identity copy of its operand (JAX's marks on the residuals a user's
      remat saves).
    offset_params: params that place a slice (or a pad) in its operand: blocks over
      one stacked parameter differ only in them.
    sums: adds its operands: a compiler that reassociates all-reduces reduces partial
      operands once, after the sum.
    moves: only moves its operand's elements (a transpose, a reshape): an all-reduce
      commutes with it.
    selects: its result is some or all of its operand's elements, unchanged (a
      slice, a squeeze): a weight gathered for it is gathered in the type its readers
      take it in (a layer's slice of a stacked f32 kernel read by a dot: in bf16).
    called: its sub-jaxpr is a call run once, not a loop or a branch: `jax.checkpoint`
      under `nothing_saveable` recomputes it like any other op (a `jax.shard_map`, a
      Pallas kernel), where remat keeps a loop's or a branch's results.
    maps_operands: its body's k-th input is its k-th operand and its k-th result the
      body's k-th output (a `jax.shard_map`, on shards of them): what the body makes
      of constants alone, the op makes of them alone.

  Example:
    >>> from tapas_jax import rules  # registers the rules and their facts
    >>> rules.facts("dot_general").contracts, rules.facts("no_such_primitive") == DEFAULT_FACTS
    (True, True)
  """

  fusible: bool = False
  expensive: bool = False
  costly: bool = False
  costly_narrow: bool = False
  fusion_root: bool = False
  in_place: bool = False
  contracts: bool = False
  copies: bool = False
  offset_params: tuple[str, ...] = ()
  sums: bool = False
  moves: bool = False
  selects: bool = False
  called: bool = False
  maps_operands: bool = False


DEFAULT_FACTS = Facts()

RULES: dict[str, RuleFn] = {}
FACTS: dict[str, Facts] = {}


def facts(primitive: str) -> Facts:
  """The facts registered for a primitive, or `DEFAULT_FACTS` for one nobody
  registered (a new JAX primitive, a custom call).

  Example:
    >>> facts("some_new_primitive").fusible
    False
  """
  return FACTS.get(primitive, DEFAULT_FACTS)


def register(*primitives: str, facts: Facts = DEFAULT_FACTS
             ) -> Callable[[RuleFn], RuleFn]:
  """Decorator: registers a rule function, and the primitives' facts, for the named
  primitives.

  Example:
    >>> @register("my_replicated", facts=Facts(fusible=True))
    ... def _replicated(params, ins, outs):
    ...   return default_rule(ins, outs)
    >>> RULES["my_replicated"]({}, [(4,)], [(4,)]).einsum(), FACTS["my_replicated"].fusible
    ('_->_', True)
    >>> del RULES["my_replicated"], FACTS["my_replicated"]
  """
  known = facts

  def deco(fn: RuleFn) -> RuleFn:
    for name in primitives:
      RULES[name] = fn
      FACTS[name] = known
    return fn

  return deco


# Environment variable that turns strict mode on for a whole process ("1").
STRICT_ENV = "TAPAS_STRICT_RULES"
_STRICT: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "tapas_strict_rules", default=None)


def is_strict() -> bool:
  """Whether a failing rule raises (strict) rather than falling back to replicated.

  The innermost `strict_rules` block decides; outside any, `TAPAS_STRICT_RULES=1`.
  """
  inner = _STRICT.get()
  if inner is not None:
    return inner
  return os.environ.get(STRICT_ENV, "").strip() not in ("", "0")


@contextlib.contextmanager
def strict_rules(enabled: bool = True) -> Iterator[None]:
  """Within the block, a rule that fails raises instead of replicating its op.

  For rule authors and tests: the default (non-strict) keeps a search going past an
  equation its rule cannot read, at the price of leaving that op replicated.
  `strict_rules(False)` turns strict mode off inside a strict process.

  Example:
    >>> from tapas_jax import rules
    >>> with strict_rules():
    ...   rules.rule_of("dot_general", {}, [(4, 8), (8, 2)], [(4, 2)])
    Traceback (most recent call last):
    ...
    ValueError: dot_general params carry no 'dimension_numbers' (got []); ...
  """
  token = _STRICT.set(enabled)
  try:
    yield
  finally:
    _STRICT.reset(token)


# -- lookup -----------------------------------------------------------------------

_WARNED: set[str] = set()

def _warn_once(primitive: str, why: str) -> None:
  if primitive not in _WARNED:
    _WARNED.add(primitive)
    warnings.warn(f"tapas_jax.rules: {why} for primitive '{primitive}'; its operands "
                  "and results are kept replicated.", stacklevel=3)


def rule_of(primitive: str, params: Mapping[str, Any], in_shapes: Sequence[Any],
            out_shapes: Sequence[Any], *, loop: bool = False) -> OpRule:
  """The rule of one equation, from its primitive, param values and shapes.

  Args:
    primitive: primitive name, e.g. "dot_general".
    params: the equation's param values (`Op.raw_params`).
    in_shapes: operand shapes: tuples, or anything with `.shape` (`TensorType`,
      `jax.ShapeDtypeStruct`).
    out_shapes: result shapes, likewise.
    loop: the op owns sub-jaxprs the solver handles itself (scan, while, cond):
      without a registered rule it is replicated silently.

  Returns:
    The registered rule, or every dim unsplit (one warning per primitive) when the
    primitive has no rule or its rule fails on these params.

  Raises:
    Exception: in strict mode (`strict_rules`, `TAPAS_STRICT_RULES=1`), whatever the
      rule raised, with a note naming the primitive and shapes.

  Example:
    >>> rule_of("reduce_sum", {"axes": (1,)}, [(8, 4)], [(8,)]).einsum()
    'ab->a'
  """
  ins = [_shape(s) for s in in_shapes]
  outs = [_shape(s) for s in out_shapes]
  fn = RULES.get(primitive)
  if fn is None:
    if not loop:
      _warn_once(primitive, "no sharding rule")
    return default_rule(ins, outs)
  try:
    rule = fn(params, ins, outs)
    _check_arity(rule, ins, outs)
  except Exception as e:  # noqa: BLE001 - an odd equation must not stop the search
    if is_strict():
      e.add_note(f"tapas_jax.rules: the sharding rule of '{primitive}' failed on "
                 f"{ins} -> {outs} (strict mode: {STRICT_ENV} or strict_rules())")
      raise
    _warn_once(primitive, f"the sharding rule failed ({type(e).__name__}: {e})")
    return default_rule(ins, outs)
  return rule


def _shape(s: Any) -> Shape:
  return tuple(int(d) for d in getattr(s, "shape", s))


def _check_arity(rule: OpRule, ins: Sequence[Shape], outs: Sequence[Shape]) -> None:
  ranks = ([len(d) for d in rule.inputs], [len(d) for d in rule.outputs])
  if ranks != ([len(s) for s in ins], [len(s) for s in outs]):
    raise ValueError(f"rule ranks {ranks} do not fit shapes {ins} -> {outs}")


def rule_for(graph: Any, op: Any) -> OpRule:
  """The sharding rule of `op` in `graph` (a `tapas_jax.trace.Graph`).

  Looks the primitive up in `RULES` with the op's `raw_params` and the types of
  its inputs and outputs. Loop and branch ops (`op.subregions`) without a rule are
  replicated silently: the solver handles their bodies itself.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tapas_jax.trace import trace
    >>> g = trace(lambda x: jnp.sum(x, axis=1), jax.ShapeDtypeStruct((8, 4), jnp.float32))
    >>> r = rule_for(g, g.ops[0])
    >>> r.einsum(), r.reduce
    ('ab->a', (1,))
  """
  ins = [graph.types[v] for v in op.inputs]
  outs = [graph.types[v] for v in op.outputs]
  rule = rule_of(op.primitive, getattr(op, "raw_params", None) or {}, ins, outs,
                 loop=bool(op.subregions))
  if rule.fixed_mesh and op.subregions and not rule.flops:
    # Its body runs per device on the shards it fixes: its FLOPs are that body's.
    rule = dataclasses.replace(rule, flops=sum(_body_flops(graph, r) for r in op.subregions))
  return rule


def _body_flops(graph: Any, region: int) -> int:
  """FLOPs of one run of a region's ops (at the shapes they are traced with), by their
  rules (`rule_for`); an op without one adds its body's, times its trip count where it
  has one (a loop), and nothing else."""
  total = 0
  for op in graph.region_ops(region):
    if op.primitive in RULES:
      total += rule_for(graph, op).flops
    else:
      total += sum((graph.regions[r].trip_count or 1) * _body_flops(graph, r)
                   for r in op.subregions)
  return total
