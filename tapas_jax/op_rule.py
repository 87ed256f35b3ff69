"""The record a sharding rule returns (`OpRule`: an op as an einsum over dimension
factors), what else the pipeline knows of a primitive (`Facts`: fusion, in place,
contraction), the registry of both by primitive name (`RULES`, `FACTS`, `register`,
`facts`), and strict mode (`strict_rules`: whether a rule that fails raises).

The rules themselves, one per primitive, with their facts beside them, and their
lookup (`rule_for`) are in `tapas_jax.rules`, which fills `RULES` and `FACTS` and
re-exports these names. A primitive nobody registered gets the one
conservative default, `DEFAULT_FACTS` (as it gets `default_rule`).

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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

__all__ = ["COMBINES", "DEFAULT_FACTS", "FACTS", "RULES", "STRICT_ENV", "Dims", "Factors",
           "Facts", "OpRule", "RuleFn", "Shape", "default_rule", "elements", "facts",
           "is_strict", "norm_axis", "register", "strict_rules", "unsplit"]

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

  def __post_init__(self):
    n = len(self.factor_sizes)
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
