"""Sharding rules: each op as an einsum over dimension *factors* (search stage input).

A rule names one factor per independent dimension of an op's iteration space and
says which dim of which operand and result each factor indexes, like the letters of
an einsum: `dot_general` on (B, M, K) x (K, N) is `bmk,kn->bmn` with `k` summed.
The solver picks a tuple of mesh axes for each factor (every mesh axis used at most
once per op); that choice fixes the layout every operand must arrive in and the
layout every result leaves in:

* operand i, dim d: split over the axes of `inputs[i][d]`; None = kept whole.
* result j, dim d: split over the axes of `outputs[j][d]`, and *partial* (an
  un-reduced sum) over the axes of every factor in `reduce` (the consumer edge pays
  the all-reduce or reduce-scatter; `combine` says whether partials are summed or
  max/min/prod-combined).
* a factor an operand lacks: that operand is replicated along its axes (each device
  computes its own slice of the result from the full operand).

The solver's cost tables turn a choice into these layouts
(`tapas_jax.solver.tables.TableBuilder.op_layouts`); a mesh axis splits only the first
dim of a tensor that asks for it (`tables.mesh_dims`).

Invariants every rule keeps (checked by `OpRule.__post_init__`): a factor that
indexes an operand but no result is in `reduce`; a `reduce` factor indexes no
result; a factor indexes at most one dim of a tensor; size-1 dims are None.

Splits must be even: the product of the mesh axis sizes a factor uses must divide
`factor_sizes[f]`. For almost every factor that size is the dim it indexes; the
exception is `reshape`, whose factor across a split or merged dim has size
gcd(input dim, output dim), smaller than one of them (see `_reshape`).

Rules are plain functions `(params, in_shapes, out_shapes) -> OpRule` registered by
primitive name in `RULES` (the record and the registry: `tapas_jax.op_rule`); `params`
are the jaxpr equation's own param values (`Op.raw_params`). Params that are JAX
objects (dimension numbers) are read only through the parsers of
`tapas_jax._jax_internals` (`jx.gather_dims(params)`, ...).
A primitive without a rule is kept replicated, with one warning.

Beside each rule, `register(..., facts=Facts(...))` states what else the pipeline
knows of the primitive: whether XLA fuses it into its readers, runs it in place, or
whether it contracts (`tapas_jax.op_rule.Facts`). Callers ask `facts(primitive)`;
a primitive nobody registered gets `DEFAULT_FACTS` (written out, its own buffer, no
contraction).

A rule that fails (raises) on an equation also leaves it replicated with one warning,
so one odd equation cannot stop a search. To see the failure instead, turn on strict
mode: `with rules.strict_rules(): ...`, or set the environment variable
`TAPAS_STRICT_RULES=1` (the test suite does, in `tests/conftest.py`).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tapas_jax import rules
  >>> from tapas_jax.trace import trace
  >>> g = trace(lambda x, w: x @ w, jax.ShapeDtypeStruct((8, 4), jnp.float32),
  ...           jax.ShapeDtypeStruct((4, 16), jnp.float32))
  >>> r = rules.rule_for(g, g.ops[0])
  >>> r.einsum(), r.flops
  ('ac,cb->ab', 1024)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence

from tapas_jax import _jax_internals as jx
# The record and the registry; their names stay importable from here.
from tapas_jax.op_rule import (COMBINES, DEFAULT_FACTS, FACTS, RULES, STRICT_ENV,  # noqa: F401
                               Dims, Facts, OpRule, RuleFn, Shape, default_rule, facts,
                               is_strict, register, rule_for, rule_of, strict_rules)
from tapas_jax.op_rule import Factors as _Factors
from tapas_jax.op_rule import elements as _size
from tapas_jax.op_rule import norm_axis as _norm_axis
from tapas_jax.op_rule import unsplit as _unsplit

__all__ = ["DEFAULT_FACTS", "ELEMENTWISE", "FACTS", "Facts", "IDENTITY", "OpRule", "RULES",
           "STRICT_ENV", "Shape", "default_precision_contraction", "default_rule", "facts",
           "is_strict", "register", "rule_for", "rule_of", "strict_rules"]


# -- elementwise and identity-like ------------------------------------------------


def _aligned(shape: Shape, ref: Shape, ref_dims: Dims) -> Dims:
  """Dims of an operand broadcast against `ref` (trailing-aligned, numpy style)."""
  if len(shape) > len(ref):
    return (None,) * len(shape)
  lead = len(ref) - len(shape)
  return tuple(ref_dims[lead + d] if size == ref[lead + d] else None
               for d, size in enumerate(shape))


# Elementwise maps XLA fuses into their readers and duplicates into each of them.
_ELEMENTWISE = (
    # arithmetic
    "abs", "ceil", "clamp", "complex", "conj", "floor", "imag",
    "integer_pow", "is_finite", "max", "min", "mul", "mulhi", "neg", "nextafter", "real",
    "round", "sign", "square", "sub",
    "one_minus_square",  # jax >= 0.11: the derivative of tanh, 1 - x**2
    "igamma_grad_a",
    # comparisons, logic, bits
    "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "shift_left",
    "eq_to", "lt_to", "le_to",  # total-order comparisons (`jnp.searchsorted`'s)
    "shift_right_arithmetic", "shift_right_logical", "population_count", "clz",
    # selection and conversion
    "select_n", "convert_element_type", "bitcast_convert_type",
)
# Sums: as elementwise, and an all-reduce of partial operands can run once after them.
_SUMS = ("add", "add_any")
# Elementwise maps XLA fuses but does not duplicate into several readers (its
# IsExpensive list): math and special functions.
_TRANSCENDENTAL = (
    "acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "cos", "cosh",
    "exp", "exp2", "expm1", "log", "log1p", "log2", "logistic", "pow", "rem", "rsqrt",
    "sin", "sinh", "sqrt", "tan", "tanh",
    "bessel_i0e", "bessel_i1e", "digamma", "erf_inv", "igamma", "igammac",
    "lgamma", "polygamma", "regularized_incomplete_beta", "zeta", "random_gamma_grad",
    # counter-based RNG is elementwise in its counters, so dropout masks can shard
    "threefry2x32",
)
# Expensive on the TPU too (`Facts.costly`): written where a dot and another op read them;
# a float divide only where the value read is bf16 (`Facts.costly_narrow`).
_COSTLY = ("erf", "erfc")
_COSTLY_NARROW = ("div",)
# Same maps, but pure data movement (no FLOPs); these three copy their operand (the
# marks JAX puts on the residuals a user's remat saves), as reduce_precision does.
_COPIES = ("copy", "copy_p", "optimization_barrier")
_IDENTITY = ("stop_gradient", "device_put", "sharding_constraint", "pvary",
             "reshard",  # `jax.sharding.reshard` (shard_map emits it under jax >= 0.12)
             "name")  # `jax.ad_checkpoint.checkpoint_name`: tags a value for remat policies
# Public names: every elementwise and every identity-like primitive.
ELEMENTWISE = (_ELEMENTWISE + _SUMS + _TRANSCENDENTAL + _COSTLY + _COSTLY_NARROW
               + ("reduce_precision",))
IDENTITY = _COPIES + _IDENTITY

# Facts shared by groups of rules (`Facts`; the default: written out, own buffer).
_FUSES = Facts(fusible=True)
_SUM = Facts(fusible=True, sums=True)
_MOVE = Facts(fusible=True, moves=True)
_SELECTS = Facts(fusible=True, selects=True)
_FUSES_ONCE = Facts(fusible=True, expensive=True)
_COSTLY_FACTS = Facts(fusible=True, expensive=True, costly=True)
_COSTLY_NARROW_FACTS = Facts(fusible=True, expensive=True, costly_narrow=True)
_COPY = Facts(fusible=True, copies=True)
_ROOT = Facts(fusion_root=True)
_IN_PLACE = Facts(in_place=True)
_CONTRACTS = Facts(contracts=True)


@register(*_ELEMENTWISE, facts=_FUSES)
@register(*_SUMS, facts=_SUM)
@register(*_TRANSCENDENTAL, facts=_FUSES_ONCE)
@register(*_COSTLY, facts=_COSTLY_FACTS)
@register(*_COSTLY_NARROW, facts=_COSTLY_NARROW_FACTS)
@register("reduce_precision", facts=_COPY)
def _elementwise(params, ins, outs, flops: bool = True) -> OpRule:
  """One factor per output dim; broadcast (size-1) and scalar operand dims stay None."""
  del params
  ref = outs[0]
  f = _Factors()
  ref_dims = tuple(f.new(s) for s in ref)
  return f.rule([_aligned(s, ref, ref_dims) for s in ins],
                [_aligned(s, ref, ref_dims) for s in outs],
                flops=_size(ref) if flops else 0)


@register("polynomial")  # jax >= 0.12: sum_k coeffs[k] * x**k (gelu's erf), broadcasting
def _polynomial(params, ins, outs) -> OpRule:
  """Elementwise in x and its coefficient arrays; Horner's rule: a mul and an add per
  coefficient."""
  rule = _elementwise(params, ins, outs)
  return dataclasses.replace(rule, flops=2 * max(len(ins) - 1, 1) * _size(outs[0]))


@register(*_IDENTITY, facts=_FUSES)
@register(*_COPIES, facts=_COPY)
def _identity(params, ins, outs) -> OpRule:
  """Operand i flows to result i unchanged (optimization_barrier has several)."""
  if len(ins) == len(outs) and all(a == b for a, b in zip(ins, outs)):
    f = _Factors()
    dims = [tuple(f.new(s) for s in shape) for shape in outs]
    return f.rule(dims, dims)
  return _elementwise(params, ins, outs, flops=False)


# -- contractions -----------------------------------------------------------------


@register("dot_general", facts=_CONTRACTS)
def _dot_general(params, ins, outs) -> OpRule:
  """Batch factors on both sides and the result, free factors, contracting = reduce.

  Result dims are ordered batch, lhs free, rhs free (the dot_general convention).
  """
  lhs, rhs = ins[0], ins[1]
  dn = jx.dot_dims(params)
  f, lhs_dims, rhs_dims, out_dims, contracting = _dot(lhs, rhs, dn)
  flops = 2 * _size(outs[0]) * math.prod(lhs[ld] for ld in dn.lhs_contracting)
  return f.rule([lhs_dims, rhs_dims], [out_dims], reduce=contracting, flops=flops)


@register("ragged_dot_general", facts=_CONTRACTS)
def _ragged_dot_general(params, ins, outs) -> OpRule:
  """`jax.lax.ragged_dot` (a mixture of experts' grouped matmul) as its dot_general,
  the dims the groups cut kept whole: the ragged lhs dim (and the rhs dim it pairs
  with), the rhs group dim, the result's group dim (in front, where the ragged dim is
  contracted) and `group_sizes`. The others split as a dot's (the experts' hidden dim
  as a column-parallel matmul's)."""
  rd = jx.ragged_dot_dims(params)
  lhs, rhs = ins[0], ins[1]
  f, lhs_dims, rhs_dims, out_dims, contracting = _dot(lhs, rhs, rd.dot, rd.lhs_ragged,
                                                      rd.rhs_group)
  out_dims = [None] * (rd.lhs_ragged in rd.dot.lhs_contracting) + out_dims
  if len(out_dims) != len(outs[0]):
    raise ValueError(f"ragged_dot_general: result rank {len(outs[0])} does not follow "
                     f"its dimension numbers {rd}")
  free = math.prod(s for d, s in enumerate(rhs) if d not in {
      *rd.dot.rhs_contracting, *rd.dot.rhs_batch, *rd.rhs_group})
  return f.rule([lhs_dims, rhs_dims, [None] * len(ins[2])], [out_dims], reduce=contracting,
                flops=2 * _size(lhs) * free)  # each lhs row meets one group's rhs


def _dot(lhs: Shape, rhs: Shape, dn: jx.DotDims, whole: int | None = None,
         rhs_dropped: Sequence[int] = ()) -> tuple:
  """(factors, lhs dims, rhs dims, result dims, contracting factors) of a dot; the lhs
  dim `whole` (and its rhs pair) unsplit, the rhs dims `rhs_dropped` in no result."""
  f = _Factors()
  lhs_dims: list[int | None] = [None] * len(lhs)
  rhs_dims: list[int | None] = [None] * len(rhs)
  out_dims: list[int | None] = []
  for ld, rd in zip(dn.lhs_batch, dn.rhs_batch):
    lhs_dims[ld] = rhs_dims[rd] = None if ld == whole else f.new(lhs[ld])
    out_dims.append(lhs_dims[ld])
  for shape, dims, skip in ((lhs, lhs_dims, {*dn.lhs_contracting, *dn.lhs_batch}),
                            (rhs, rhs_dims, {*dn.rhs_contracting, *dn.rhs_batch,
                                             *rhs_dropped})):
    for d, size in enumerate(shape):
      if d not in skip:
        dims[d] = None if dims is lhs_dims and d == whole else f.new(size)
        out_dims.append(dims[d])
  contracting = []
  for ld, rd in zip(dn.lhs_contracting, dn.rhs_contracting):
    if ld != whole:
      lhs_dims[ld] = rhs_dims[rd] = f.new(lhs[ld])
      contracting.append(lhs_dims[ld])
  return f, lhs_dims, rhs_dims, out_dims, contracting


def default_precision_contraction(op) -> bool:
  """Whether `op` (a `trace.Op`) is a dot_general or a convolution at DEFAULT precision
  (no `precision`, or DEFAULT for both operands): one a TPU runs as a single bf16 pass,
  whatever the operands' type."""
  if not facts(op.primitive).contracts:
    return False
  precision = op.raw_params.get("precision")
  if precision is None:
    return True
  parts = precision if isinstance(precision, tuple | list) else (precision,)
  return all(x is None or str(x).upper().endswith("DEFAULT") for x in parts)


@register("conv_general_dilated", facts=_CONTRACTS)
def _conv(params, ins, outs) -> OpRule:
  """Batch and output features pass, input features are contracted, spatial unsplit.

  Specs are (batch, feature, *spatial) for lhs/out and (out feature, in feature,
  *spatial) for rhs, read from `dimension_numbers`, so the weight-gradient convs of
  the backward pass (which put the image batch in the lhs *feature* slot) come out
  as `N` contracted: the kernel gradient is partial over the data axes.

  Grouped convs: with feature_group_count > 1 the features are unsplit, except the
  depthwise case (groups == in features == out features), where one factor runs
  through lhs features, rhs out features and out features. With batch_group_count
  > 1 (per-group weight gradients) the batch and output-feature dims are unsplit.
  """
  lhs, rhs, out = ins[0], ins[1], outs[0]
  dn = jx.conv_dims(params, len(lhs))
  ls, rs, os_ = dn.lhs_spec, dn.rhs_spec, dn.out_spec
  groups, batch_groups = dn.feature_group_count, dn.batch_group_count
  f = _Factors()
  lhs_dims: list[int | None] = [None] * len(lhs)
  rhs_dims: list[int | None] = [None] * len(rhs)
  out_dims: list[int | None] = [None] * len(out)
  reduce = []
  if batch_groups == 1:
    lhs_dims[ls[0]] = out_dims[os_[0]] = f.new(lhs[ls[0]])
  if groups == 1:
    lhs_dims[ls[1]] = rhs_dims[rs[1]] = f.new(lhs[ls[1]])
    reduce.append(lhs_dims[ls[1]])
    if batch_groups == 1:
      rhs_dims[rs[0]] = out_dims[os_[1]] = f.new(rhs[rs[0]])
  elif groups == lhs[ls[1]] == rhs[rs[0]] and rhs[rs[1]] == 1 and batch_groups == 1:
    lhs_dims[ls[1]] = rhs_dims[rs[0]] = out_dims[os_[1]] = f.new(lhs[ls[1]])
  kernel_spatial = math.prod(rhs[d] for d in rs[2:])
  flops = 2 * _size(out) * kernel_spatial * rhs[rs[1]]
  return f.rule([lhs_dims, rhs_dims], [out_dims], reduce=reduce, flops=flops)


# -- shape ops --------------------------------------------------------------------


@register("broadcast_in_dim", facts=_FUSES)
def _broadcast_in_dim(params, ins, outs) -> OpRule:
  """Operand dims map via broadcast_dimensions; new and expanded dims are output-only."""
  out = outs[0]
  bdims = tuple(params["broadcast_dimensions"])
  f = _Factors()
  out_dims = tuple(f.new(s) for s in out)
  operand = tuple(out_dims[o] if size == out[o] else None
                  for size, o in zip(ins[0], bdims))
  # Trailing operands (dynamic shapes) are scalars.
  return f.rule([operand] + list(_unsplit(ins[1:])), [out_dims])


def _reshape_blocks(a: Shape, b: Shape) -> list[tuple[list[int], list[int]]] | None:
  """Minimal groups of non-1 dims of `a` and `b` with equal products, major to minor."""
  ia = [d for d, s in enumerate(a) if s != 1]
  ib = [d for d, s in enumerate(b) if s != 1]
  blocks, i, j = [], 0, 0
  while i < len(ia) and j < len(ib):
    ga, gb = [ia[i]], [ib[j]]
    pa, pb = a[ia[i]], b[ib[j]]
    i, j = i + 1, j + 1
    while pa != pb:
      if pa < pb and i < len(ia):
        ga.append(ia[i])
        pa *= a[ia[i]]
        i += 1
      elif pb < pa and j < len(ib):
        gb.append(ib[j])
        pb *= b[ib[j]]
        j += 1
      else:
        return None
    blocks.append((ga, gb))
  return blocks if i == len(ia) and j == len(ib) else None


@register("reshape", facts=_MOVE)
def _reshape(params, ins, outs) -> OpRule:
  """Only the major-most dim of each block of merged/split dims can be split.

  Group the non-1 dims into minimal blocks with equal products, e.g.
  (B, L, H*D) -> (B, L, H, D) is [B]->[B], [L]->[L], [H*D]->[H, D]. A block that is
  one dim on both sides passes whole. Otherwise splitting the major dim of either
  side k ways cuts the block's flat range into the same k contiguous chunks, so the
  two major dims can share a factor when k divides both: the factor's size is
  gcd(in_major, out_major) (H in the example; H*D -> H, D only splits H, never D).
  Minor dims of a block, size-1 dims, a gcd of 1 and reshapes with a `dimensions`
  permutation stay unsplit.
  """
  a, b = ins[0], outs[0]
  blocks = None if params.get("dimensions") is not None else _reshape_blocks(a, b)
  if blocks is None or 0 in a:
    return default_rule(ins, outs)
  f = _Factors()
  in_dims: list[int | None] = [None] * len(a)
  out_dims: list[int | None] = [None] * len(b)
  for ga, gb in blocks:
    in_dims[ga[0]] = out_dims[gb[0]] = f.new(math.gcd(a[ga[0]], b[gb[0]]))
  return f.rule([in_dims] + list(_unsplit(ins[1:])), [out_dims])


@register("transpose", facts=_MOVE)
def _transpose(params, ins, outs) -> OpRule:
  perm = tuple(params["permutation"])
  f = _Factors()
  in_dims = tuple(f.new(s) for s in ins[0])
  return f.rule([in_dims], [tuple(in_dims[p] for p in perm)])


@register("squeeze", facts=_SELECTS)
def _squeeze(params, ins, outs) -> OpRule:
  rank = len(ins[0])
  gone = {_norm_axis(d, rank) for d in params["dimensions"]}
  f = _Factors()
  in_dims = tuple(None if d in gone else f.new(s) for d, s in enumerate(ins[0]))
  return f.rule([in_dims], [tuple(x for d, x in enumerate(in_dims) if d not in gone)])


@register("expand_dims", facts=_SELECTS)
def _expand_dims(params, ins, outs) -> OpRule:
  rank = len(outs[0])
  new = {_norm_axis(d, rank) for d in params["dimensions"]}
  f = _Factors()
  in_dims = tuple(f.new(s) for s in ins[0])
  kept = iter(in_dims)
  return f.rule([in_dims], [tuple(None if d in new else next(kept) for d in range(rank))])


@register("stack")
def _stack(params, ins, outs) -> OpRule:
  """`jnp.stack`: the operands' dims pass to the result's; the new `axis` dim (one slot
  per operand) stays whole."""
  axis = _norm_axis(params["axis"], len(outs[0]))
  f = _Factors()
  dims = tuple(f.new(s) for s in ins[0])
  return f.rule([dims] * len(ins), [dims[:axis] + (None,) + dims[axis:]])


@register("unstack")
def _unstack(params, ins, outs) -> OpRule:
  """The inverse of `stack` (its transpose, and tuple unpacking of an array): the
  operand's `axis` dim stays whole, every other dim passes to every result."""
  axis = _norm_axis(params["axis"], len(ins[0]))
  f = _Factors()
  dims = tuple(None if d == axis else f.new(s) for d, s in enumerate(ins[0]))
  return f.rule([dims], [dims[:axis] + dims[axis + 1:]] * len(outs))


@register("tile")
def _tile(params, ins, outs) -> OpRule:
  """`jnp.tile` (operand and result of one rank): a dim with one repeat passes; a
  repeated dim is output-only, as broadcast's expanded dims are: each device writes
  its slice of the tiling from the whole operand dim."""
  reps = tuple(int(r) for r in params["reps"])
  a, b = ins[0], outs[0]
  if not len(a) == len(b) == len(reps):
    raise ValueError(f"tile: operand {a}, result {b} and reps {reps} differ in rank")
  f = _Factors()
  in_dims, out_dims = [], []
  for d, r in enumerate(reps):
    shared = f.new(a[d]) if r == 1 else None
    in_dims.append(shared)
    out_dims.append(shared if r == 1 else f.new(b[d]))
  return f.rule([in_dims], [out_dims])


@register("iota", facts=_FUSES)
def _iota(params, ins, outs) -> OpRule:
  """Output-only factors: each device writes its own slice of the ramp."""
  del params
  f = _Factors()
  return f.rule(_unsplit(ins), [tuple(f.new(s) for s in outs[0])])


# -- ops that keep some dims whole ------------------------------------------------


def _pass_except(ins, outs, pinned: Iterable[int], ref: Shape, flops: int = 0) -> OpRule:
  """One factor per dim of `ref` for every tensor of its rank; `pinned` dims stay None.

  Dims whose size differs between those tensors (slices, pads, concatenations,
  windows) are pinned too, so touched dims never split. Tensors of another rank
  (scalar start indices, padding values) stay unsplit.
  """
  rank = len(ref)
  pinned = {_norm_axis(d, rank) for d in pinned}
  same_rank = [s for s in list(ins) + list(outs) if len(s) == rank]
  pinned |= {d for d in range(rank) if len({s[d] for s in same_rank}) > 1}
  f = _Factors()
  factors = tuple(None if d in pinned else f.new(ref[d]) for d in range(rank))

  def dims(shape: Shape) -> Dims:
    return factors if len(shape) == rank else (None,) * len(shape)

  return f.rule([dims(s) for s in ins], [dims(s) for s in outs], flops=flops)


@register("cumsum", "cumprod", "cumlogsumexp", "cummax", "cummin")
def _cumulative(params, ins, outs) -> OpRule:
  return _pass_except(ins, outs, [params["axis"]], ins[0], flops=_size(ins[0]))


@register("fft")
def _fft(params, ins, outs) -> OpRule:
  """`jnp.fft`: the transformed dims (the last `len(fft_lengths)`) stay whole, the
  leading ones pass through; about 5 n log2 n FLOPs per transform of n points."""
  lengths = tuple(params["fft_lengths"])
  rank = len(ins[0])
  n = max(math.prod(lengths), 2)
  flops = 5 * max(_size(ins[0]), _size(outs[0])) * math.ceil(math.log2(n))
  return _pass_except(ins, outs, range(rank - len(lengths), rank), ins[0], flops=flops)


@register("sort")
def _sort(params, ins, outs) -> OpRule:
  """All operands sort together along `dimension` (argsort carries an iota)."""
  n = ins[0][_norm_axis(params["dimension"], len(ins[0]))]
  flops = _size(ins[0]) * max(1, math.ceil(math.log2(max(n, 2))))
  return _pass_except(ins, outs, [params["dimension"]], ins[0], flops=flops)


@register("top_k", "approx_top_k")
def _top_k(params, ins, outs) -> OpRule:
  axis = params.get("axis", params.get("reduction_dimension", -1))
  n = ins[0][_norm_axis(axis, len(ins[0]))]
  flops = _size(ins[0]) * max(1, math.ceil(math.log2(max(n, 2))))
  return _pass_except(ins, outs, [axis], ins[0], flops=flops)


@register("concatenate", facts=_FUSES)
def _concatenate(params, ins, outs) -> OpRule:
  return _pass_except(ins, outs, [params["dimension"]], outs[0])


@register("split")
def _split(params, ins, outs) -> OpRule:
  return _pass_except(ins, outs, [params["axis"]], ins[0])


@register("rev", facts=_MOVE)
def _rev(params, ins, outs) -> OpRule:
  return _pass_except(ins, outs, params["dimensions"], ins[0])


@register("pad", facts=Facts(fusible=True, offset_params=("padding_config",)))
def _pad(params, ins, outs) -> OpRule:
  """Padded dims (any low, high or interior padding, negative included) stay whole."""
  config = params["padding_config"]
  padded = [d for d, cfg in enumerate(config) if any(int(c) for c in cfg)]
  return _pass_except(ins, outs, padded, ins[0])


@register("slice", facts=Facts(fusible=True, selects=True,
                                  offset_params=("start_indices", "limit_indices")))
def _slice(params, ins, outs) -> OpRule:
  """Dims the slice cuts (size changes) stay whole; the size check pins them."""
  del params
  return _pass_except(ins, outs, [], ins[0])


@register("dynamic_slice", facts=_SELECTS)
@register("dynamic_update_slice", facts=_IN_PLACE)
def _dynamic_slice(params, ins, outs) -> OpRule:
  """Dims where the slice (or update) is smaller than the operand stay whole."""
  del params
  return _pass_except(ins, outs, [], ins[0])


def _window_pinned(params, rank: int) -> list[int]:
  """Dims a window op touches: non-trivial window, stride, padding or dilation."""
  trivial = {"window_dimensions": 1, "window_strides": 1, "base_dilation": 1,
             "window_dilation": 1}
  pinned = set()
  for key, unit in trivial.items():
    pinned |= {d for d, v in enumerate(params.get(key) or ()) if v != unit}
  padding = params.get("padding") or ()
  pinned |= {d for d, pad in enumerate(padding) if tuple(pad) != (0, 0)}
  return sorted(d for d in pinned if d < rank)


@register("reduce_window_max", "reduce_window_min", "reduce_window_sum", "reduce_window")
def _reduce_window(params, ins, outs) -> OpRule:
  """Pooling: dims with a trivial window (batch, channels) pass, spatial stay whole."""
  window = math.prod(params.get("window_dimensions") or (1,))
  return _pass_except(ins, outs, _window_pinned(params, len(ins[0])), ins[0],
                      flops=_size(outs[0]) * window)


@register("select_and_scatter_add", "select_and_gather_add", "select_and_scatter")
def _select_and_scatter(params, ins, outs) -> OpRule:
  """Max-pool gradients: like pooling, keyed on the un-pooled operand's rank."""
  ref = max(list(ins) + list(outs), key=_size)
  window = math.prod(params.get("window_dimensions") or (1,))
  return _pass_except(ins, outs, _window_pinned(params, len(ref)), ref,
                      flops=min(_size(s) for s in ins) * window)


# -- reductions -------------------------------------------------------------------


def _reduction(params, ins, outs, combine: str | None) -> OpRule:
  """Kept dims pass; reduced dims are `reduce` factors, or None when `combine` is None."""
  shape = ins[0]
  axes = {_norm_axis(a, len(shape)) for a in params["axes"]}
  f = _Factors()
  in_dims, out_dims, reduced = [], [], []
  for d, size in enumerate(shape):
    if d in axes:
      in_dims.append(f.new(size) if combine else None)
      reduced.append(in_dims[-1])
    else:
      in_dims.append(f.new(size))
      out_dims.append(in_dims[-1])
  return f.rule([in_dims], [out_dims], reduce=reduced, flops=_size(shape),
                combine=combine or "sum")


_REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min",
               "reduce_prod": "prod", "reduce_and": "and", "reduce_or": "or",
               "reduce_xor": "xor"}
for _name, _combine in _REDUCTIONS.items():
  # A fusible op fuses into a reduction (the fusion's root); not into reduce_xor.
  register(_name, facts=DEFAULT_FACTS if _name == "reduce_xor" else _ROOT)(
      functools.partial(_reduction, combine=_combine))


@register("argmax", "argmin", facts=_ROOT)
def _arg_reduction(params, ins, outs) -> OpRule:
  """The searched dim stays whole: partial (value, index) pairs are not a sum."""
  return _reduction(params, ins, outs, None)


# -- gather and scatter -----------------------------------------------------------


@register("gather")
def _gather(params, ins, outs) -> OpRule:
  """Derived from the gather's dimension numbers (`jx.GatherDims`; indices' last dim
  is the index vector).

  * index batch dims pass to the result's batch dims (and to the operand's
    `operand_batching_dims`, take_along_axis style);
  * operand dims sliced whole (and not indexed) pass to the result's offset dims;
    partially sliced offset dims are output-only (each device slices its part from
    a replicated operand);
  * collapsed, indexed operand dims (the vocab dim of an embedding lookup, the
    class dim of a loss's label gather) are `reduce`: each device looks up only
    the rows it holds, zero elsewhere, and the partial results sum;
  * everything else (the index vector dim, partially sliced indexed dims) is None.
  """
  dn = jx.gather_dims(params)
  operand, indices, out = ins[0], ins[1], outs[0]
  slice_sizes = dn.slice_sizes
  f = _Factors()
  op_dims: list[int | None] = [None] * len(operand)
  idx_dims: list[int | None] = [None] * len(indices)
  out_dims: list[int | None] = [None] * len(out)
  out_batch = [d for d in range(len(out)) if d not in dn.offset_dims]
  for k, od in zip(range(len(indices) - 1), out_batch):
    idx_dims[k] = out_dims[od] = f.new(out[od])
    if k in dn.start_indices_batching_dims:
      od_operand = dn.operand_batching_dims[dn.start_indices_batching_dims.index(k)]
      if operand[od_operand] == out[od]:
        op_dims[od_operand] = idx_dims[k]
      else:
        idx_dims[k] = out_dims[od] = None
  window = [d for d in range(len(operand))
            if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
  for d, od in zip(window, dn.offset_dims):
    out_dims[od] = f.new(out[od])
    if slice_sizes[d] == operand[d] and d not in dn.start_index_map:
      op_dims[d] = out_dims[od]
  reduce = []
  for d in dn.collapsed_slice_dims:
    if d in dn.start_index_map:
      op_dims[d] = f.new(operand[d])
      reduce.append(op_dims[d])
  return f.rule([op_dims, idx_dims], [out_dims], reduce=reduce)


def _scatter(params, ins, outs, summing: bool) -> OpRule:
  """Derived from `jx.ScatterDims`; inputs are (operand, indices, updates).

  * operand batching dims pass through operand, indices, updates and result;
  * operand window dims the updates cover whole (and not indexed) pass;
  * inserted, indexed operand dims (the vocab dim of an embedding gradient) pass
    on operand and result: each device applies only the updates landing in its
    rows, so indices and updates are replicated along them;
  * scatter-add only: the other index batch dims (batch and sequence of an
    embedding gradient) are `reduce`: each device scatters its own updates and the
    partial results sum. The operand then counts once (one device adds it, the
    others add zero), which the partitioner does for free;
  * everything else stays None (overwrite/mul/min/max scatters never reduce).
  """
  dn = jx.scatter_dims(params)
  operand, indices, updates = ins[0], ins[1], ins[2]
  f = _Factors()
  op_dims: list[int | None] = [None] * len(operand)
  idx_dims: list[int | None] = [None] * len(indices)
  upd_dims: list[int | None] = [None] * len(updates)
  reduce = []
  upd_scatter = [d for d in range(len(updates)) if d not in dn.update_window_dims]
  for k, ud in enumerate(upd_scatter):
    if k in dn.scatter_indices_batching_dims:
      od = dn.operand_batching_dims[dn.scatter_indices_batching_dims.index(k)]
      if operand[od] == updates[ud]:
        op_dims[od] = idx_dims[k] = upd_dims[ud] = f.new(updates[ud])
    elif summing:
      idx_dims[k] = upd_dims[ud] = f.new(updates[ud])
      reduce.append(idx_dims[k])
  window = [d for d in range(len(operand))
            if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
  for d, ud in zip(window, dn.update_window_dims):
    if updates[ud] == operand[d] and d not in dn.scatter_dims_to_operand_dims:
      op_dims[d] = upd_dims[ud] = f.new(operand[d])
  for d in dn.inserted_window_dims:
    if d in dn.scatter_dims_to_operand_dims:
      op_dims[d] = f.new(operand[d])
  extra = _unsplit(ins[3:])
  return f.rule([op_dims, idx_dims, upd_dims, *extra], [op_dims] * len(outs),
                reduce=reduce,
                flops=_size(updates) if summing else 0)


# scatter-sub is not in place (the memory model counts its operand and result apart).
register("scatter-add", facts=_IN_PLACE)(functools.partial(_scatter, summing=True))
register("scatter-sub")(functools.partial(_scatter, summing=True))
register("scatter", "scatter-mul", "scatter-min", "scatter-max", facts=_IN_PLACE)(
    functools.partial(_scatter, summing=False))


# -- jax.shard_map: shards the program fixed -------------------------------------


@register("shard_map", facts=Facts(called=True, maps_operands=True))
def _shard_map(params, ins, outs) -> OpRule:
  """Its operands read and its results made in the layouts its specs name (dims past a
  spec's length whole), on the mesh it names: the body runs per device on those
  shards, which no plan splits further (`OpRule.fixed_inputs`). Its FLOPs, a device's,
  are its body's, which `rule_for` reads off the traced body."""
  specs = jx.shard_map_specs(params)
  rule = default_rule(ins, outs)
  if specs is None:
    return rule

  def padded(spec, shape):
    return tuple(spec[:len(shape)]) + ((),) * (len(shape) - len(spec))
  return dataclasses.replace(
      rule, fixed_inputs=tuple(padded(p, s) for p, s in zip(specs.inputs, ins)),
      fixed_outputs=tuple(padded(p, s) for p, s in zip(specs.outputs, outs)),
      fixed_mesh=specs.mesh_axes)


@register("pallas_call", facts=Facts(called=True))
def _pallas_call(params, ins, outs) -> OpRule:
  """A kernel: run whole where it is called (no plan splits it; on TPU it runs inside a
  `jax.shard_map`, whose shards are then its operands); its FLOPs as its author
  estimated them (`pl.CostEstimate`), none where not."""
  cost = params.get("cost_estimate")
  return dataclasses.replace(default_rule(ins, outs),
                             flops=int(getattr(cost, "flops", 0) or 0))


# -- lookup -----------------------------------------------------------------------

# Primitives known to have no useful split: kept replicated without a warning.
_REPLICATED = ("rng_bit_generator", "rng_uniform", "random_bits", "random_seed",
               "random_wrap", "random_unwrap", "random_fold_in", "random_split",
               "random_clone", "create_token", "after_all",
               # `jax.debug.print` / `jax.debug.callback`: XLA gathers what they read.
               "debug_print", "debug_callback")


def _replicated(params, ins, outs) -> OpRule:
  del params
  return default_rule(ins, outs)


register(*_REPLICATED)(_replicated)
