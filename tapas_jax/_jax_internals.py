"""Every use of JAX internals in tapas_jax lives here, and nowhere else.

Jaxpr data structures are semi-public (`jax.extend.core`) and move between
releases; the rest of the package talks to them only through these helpers.
Supported: the current jax release line and the one before (0.12 and 0.11), and the
oldest line tested (0.10, the newest jax on Python 3.11).

Equation params that are JAX objects (gather, scatter and conv dimension numbers)
or whose names move between releases (scan's consts and carries) are parsed here
into small frozen dataclasses of plain ints (`DotDims`, `ConvDims`, `GatherDims`,
`ScatterDims`, `ScanCounts`); no other module reads their fields.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tapas_jax import _jax_internals as jx
  >>> jaxpr = jax.make_jaxpr(lambda e, i: e[i])(jnp.ones((16, 4)), jnp.zeros(3, jnp.int32))
  >>> eqn = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "gather"][0]
  >>> dims = jx.gather_dims(eqn.params)
  >>> dims.collapsed_slice_dims, dims.offset_dims, dims.slice_sizes
  ((0,), (1,), (1, 4))
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import re
from typing import Any, Iterator, Mapping

import jax
from jax._src import source_info_util
import numpy as np

try:  # public home since jax 0.4.3x
  from jax.extend import core as _core
except ImportError:  # pragma: no cover - very old jax
  from jax import core as _core  # type: ignore

ClosedJaxpr = _core.ClosedJaxpr
Jaxpr = _core.Jaxpr
Literal = _core.Literal

# Params that carry a loop trip count: an equation with one of these is a loop even
# when its body's types match its operands (a scan over carries only).
_TRIP_COUNT_PARAMS = ("length", "num_iterations", "trip_count")


def is_literal(atom: Any) -> bool:
  return isinstance(atom, Literal)


def literal_value(atom: Any) -> Any:
  return atom.val


def aval_of(atom: Any) -> tuple[tuple[int, ...], str]:
  """(shape, dtype name) of a jaxpr atom; tokens and other non-arrays get ((), kind)."""
  aval = atom.aval
  shape = getattr(aval, "shape", None)
  dtype = getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return (), type(aval).__name__
  return tuple(map(int, shape)), _dtype_name(dtype)


def type_key(atom: Any) -> Any:
  """A key equal for atoms of one `aval_of`, cheaper to make: the aval's kind, its own
  shape and dtype, unconverted (`aval_of` only where the key is new)."""
  aval = atom.aval
  return type(aval), getattr(aval, "shape", None), getattr(aval, "dtype", None)


# dtype -> its name: asked once per value traced, and numpy computes `dtype.name` anew
# on every read (a tenth of the walk of an 8B train step).
_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
  try:
    return _DTYPE_NAMES[dtype]
  except (KeyError, TypeError):  # not seen yet, or unhashable
    pass
  try:
    name = np.dtype(dtype).name
  except TypeError:  # not a numpy dtype (a PRNG key's, say)
    name = str(dtype)
  try:
    _DTYPE_NAMES[dtype] = name
  except TypeError:
    pass
  return name


def name_stack_of(eqn: Any) -> Any:
  """An equation's name-stack object (`name_stack_text` gives its text)."""
  return eqn.source_info.name_stack


def name_stack_text(stack: Any) -> str:
  return str(stack)


# -- name-stack syntax ------------------------------------------------------------

# Name-stack components JAX itself pushes, naming no module: `jax.checkpoint`'s
# transpose runs the recomputed forward under "rematted_computation" (jax 0.4 - 0.12).
GENERATED_SCOPES = frozenset({"rematted_computation"})
# A transform's wrapper around a component: "jvp(GPT)", "transpose(jvp(GPT))".
_WRAPPER = re.compile(r"^[\w.\-]*\((.*)\)$")


def is_transposed(name_stack: str) -> bool:
  """Whether an op is a backward (transposed) op of a differentiated program.

  >>> is_transposed("transpose(jvp(GPT))/Block_1"), is_transposed("jvp(GPT)/Block_1")
  (True, False)
  """
  return "transpose(" in name_stack


def is_primal(name_stack: str) -> bool:
  """Whether an op is a primal (forward) op of a differentiated program: under a
  `jvp(...)` and not transposed. An op outside any differentiation (an optimizer
  update, a plain forward call) is neither primal nor transposed.

  >>> is_primal("jvp(GPT)/Block_1"), is_primal("transpose(jvp(GPT))/Block_1"), is_primal("adam")
  (True, False, False)
  """
  return "jvp(" in name_stack and not is_transposed(name_stack)


def scope_of(name_stack: str) -> tuple[str, ...]:
  """Module path of a name stack, transforms and JAX's own scopes stripped.

  The backward of a rematerialised block (`nn.remat`, `jax.checkpoint`) sits under its
  call's stack twice, once transposed ("transpose(jvp(GPT))/jvp(GPT)/Block_1"), and
  its recomputed forward also under "rematted_computation": both are the block's path.

  >>> scope_of("transpose(jvp(GPT))/Block_1/MLP/fc2")
  ('GPT', 'Block_1', 'MLP', 'fc2')
  >>> scope_of("transpose(jvp(GPT))/jvp(GPT)/rematted_computation/Block_1/MLP")
  ('GPT', 'Block_1', 'MLP')
  """
  parts, wrapped = [], []
  for comp in name_stack.split("/"):
    was_wrapped = False
    while (m := _WRAPPER.match(comp)) is not None:
      comp, was_wrapped = m.group(1), True
    if comp and comp not in GENERATED_SCOPES:
      parts.append(comp)
      wrapped.append(was_wrapped)
  return tuple(_drop_reentry(parts, wrapped))


def _drop_reentry(parts: list[str], wrapped: list[bool]) -> list[str]:
  """Drops a copy of the path's own prefix that restarts at a transformed component
  (a transform wrapper mid-stack only comes from a call re-entering its stack)."""
  k = 1
  while 2 * k <= len(parts):
    if wrapped[k] and parts[k:2 * k] == parts[:k]:
      del parts[k:2 * k], wrapped[k:2 * k]
      k = 1
    else:
      k += 1
  return parts


def is_recompute_barrier(eqn: Any) -> bool:
  """Whether an equation is a differentiated `jax.checkpoint` (primitive "remat2" on
  jax 0.10, "checkpoint" on others) whose recomputation must not be merged with the
  forward it repeats: JAX lowers it behind an optimization barrier on its operands."""
  params = eqn.params
  return bool(params.get("differentiated")) and bool(params.get("prevent_cse")) and (
      "policy" in params)


def open_jaxpr(jaxpr: Any) -> tuple[Any, tuple[Any, ...]]:
  """(open jaxpr, consts) for either a `ClosedJaxpr` or an open `Jaxpr`."""
  if isinstance(jaxpr, ClosedJaxpr):
    return jaxpr.jaxpr, tuple(jaxpr.consts)
  return jaxpr, ()


def sub_jaxprs(eqn: Any) -> list[tuple[str, int, Any]]:
  """(param name, index, jaxpr) for every jaxpr found in an equation's params.

  Found generically, by type, so new higher-order primitives need no code here. A list
  built in a loop: asked of every equation, where a generator's resumptions cost a
  third of it.
  """
  found = []
  for key, value in eqn.params.items():
    if isinstance(value, (ClosedJaxpr, Jaxpr)):
      found.append((key, 0, value))
    elif isinstance(value, (tuple, list)):
      for i, item in enumerate(value):
        if isinstance(item, (ClosedJaxpr, Jaxpr)):
          found.append((key, i, item))
  return found


def is_call_like(eqn: Any, sub: Any) -> bool:
  """Whether an equation only calls its one sub-jaxpr (jit, custom_jvp/vjp, remat):
  same operand and result types, no trip count. Such calls are inlined."""
  if trip_count(eqn) is not None:
    return False
  body, _ = open_jaxpr(sub)
  if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
    return False
  return (all(aval_of(a) == aval_of(b) for a, b in zip(body.invars, eqn.invars))
          and all(aval_of(a) == aval_of(b) for a, b in zip(body.outvars, eqn.outvars)))


def walk_eqns(jaxpr: Any, site: tuple = ()
              ) -> Iterator[tuple[tuple, Any, list[tuple[str, int, Any]],
                                  tuple[str, int, Any] | None]]:
  """The one walk of an open jaxpr that `trace` (building ops) and `apply` (running
  the program with its layouts pinned) share, so that their equation sites agree.

  Yields, per equation in order, (site, equation, its sub-jaxprs as `sub_jaxprs`
  gives them, the one sub-jaxpr it only calls or None). An equation's site is
  `site + (i,)`; the equations of a sub-jaxpr (key, idx) of it are walked by the
  caller at `site + (i, key, idx)`. A call-like equation (`is_call_like`) is inlined
  by both; any other is one op (with regions for its sub-jaxprs) or one bind.

  >>> import jax, jax.numpy as jnp
  >>> closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * 2)(1.0)
  >>> [(site, eqn.primitive.name, call is not None)
  ...  for site, eqn, _, call in walk_eqns(closed.jaxpr)]
  [((0,), 'jit', True), ((1,), 'mul', False)]
  """
  for i, eqn in enumerate(jaxpr.eqns):
    subs = sub_jaxprs(eqn)
    call = subs[0] if len(subs) == 1 and is_call_like(eqn, subs[0][2]) else None
    yield site + (i,), eqn, subs, call


def trip_count(eqn: Any) -> int | None:
  for key in _TRIP_COUNT_PARAMS:
    value = eqn.params.get(key)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
      return int(value)
  return None


def is_jaxpr_param(value: Any) -> bool:
  if isinstance(value, (ClosedJaxpr, Jaxpr)):
    return True
  return isinstance(value, (tuple, list)) and any(
      isinstance(v, (ClosedJaxpr, Jaxpr)) for v in value)


def cost_flops(cost: Any) -> float:
  """The FLOPs of a `cost_analysis()` result: a dict on jax 0.10 - 0.12, a list of
  one dict per program on older lines; 0 where the backend gives no estimate.

  >>> cost_flops({"flops": 8.0}), cost_flops([{"flops": 8.0}]), cost_flops(None)
  (8.0, 8.0, 0.0)
  """
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return float((cost or {}).get("flops", 0.0))


def memory_peak(stats: Any) -> int:
  """The compiler's own peak of live buffers per device (`memory_analysis()`'s
  `peak_memory_in_bytes`: arguments and temporaries live together at the worst point
  of its buffer assignment), 0 where the backend or jaxlib line gives none.

  >>> memory_peak(None)
  0
  """
  return int(getattr(stats, "peak_memory_in_bytes", 0) or 0)


def current_mesh() -> Any:
  """The concrete mesh `jax.set_mesh` set, or None: `get_mesh` gives an empty mesh
  (or, on some lines, an abstract one without devices) where none is set; inside
  `jax.jit`, where only the abstract mesh is known, None."""
  try:
    mesh = jax.sharding.get_mesh()
  except ValueError:  # "`get_mesh` can only be used outside of `jax.jit`" (jax >= 0.11)
    return None
  if mesh is None or getattr(mesh, "empty", True) or not hasattr(mesh, "devices"):
    return None
  return mesh


def make_jaxpr(fn: Any, *args: Any) -> tuple[Any, Any]:
  """(ClosedJaxpr, output shape pytree) of `fn(*args)`."""
  return jax.make_jaxpr(fn, return_shape=True)(*args)


def source_of(eqn: Any) -> Any:
  """Context in which what is bound carries this equation's name stack (under the one
  current) and traceback, as `jax.core.eval_jaxpr` binds each equation: the compiled
  program's op names (`metadata.op_name`, which profilers show) and source lines stay the
  user's, "jvp(GPT)/Block_0/attn/dot_general" rather than a bare "dot_general"."""
  info = eqn.source_info
  return source_info_util.user_context(
      info.traceback, name_stack=source_info_util.current_name_stack() + info.name_stack)


def bind_eqn(eqn: Any, invals: list[Any]) -> list[Any]:
  """Evaluates one equation on values (tracers or arrays), as `jax.core.eval_jaxpr` does,
  under its own name stack and traceback (`source_of`); inside `shard_maps_on(mesh)`, a
  `jax.shard_map` traced on another mesh is refused with the fix."""
  bound = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(bound, tuple):  # jax < 0.10: (subfuns, params)
    subfuns, params = bound
  else:  # jax >= 0.10: params, sub-functions among them
    subfuns, params = (), bound
  run_mesh = _RUN_MESH.get()
  if run_mesh is not None and shard_map_specs(eqn.params) is not None:
    _check_shard_map_mesh(eqn.params["mesh"], run_mesh)
  ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
  with source_of(eqn), (ctx if ctx is not None else contextlib.nullcontext()):
    out = eqn.primitive.bind(*subfuns, *invals, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


# -- jax.shard_map -----------------------------------------------------------------

_RUN_MESH: contextvars.ContextVar = contextvars.ContextVar("tapas_run_mesh", default=None)


@dataclasses.dataclass(frozen=True)
class ManualSpecs:
  """The layouts a `jax.shard_map` equation reads and makes its values in.

  Attributes:
    mesh_axes: ((axis name, size), ...) of the mesh it was traced with.
    inputs: per operand, per dim, the mesh axes splitting it (a `PartitionSpec` as
      tuples; dims past the spec's length are whole).
    outputs: per result, likewise.
  """

  mesh_axes: tuple[tuple[str, int], ...]
  inputs: tuple[tuple[tuple[str, ...], ...], ...]
  outputs: tuple[tuple[tuple[str, ...], ...], ...]


def shard_map_specs(params: Mapping[str, Any]) -> ManualSpecs | None:
  """`ManualSpecs` of a `jax.shard_map` equation's params (the same names on jax 0.10 -
  0.12: `mesh`, `in_specs`, `out_specs`), or None for any other equation.

  >>> import os, jax
  >>> from jax.sharding import PartitionSpec as P
  >>> mesh = jax.sharding.AbstractMesh((2,), ("x",))
  >>> shard_map_specs({"mesh": mesh, "in_specs": (P("x", None),), "out_specs": (P(),)})
  ManualSpecs(mesh_axes=(('x', 2),), inputs=((('x',), ()),), outputs=((),))
  """
  mesh, ins, outs = params.get("mesh"), params.get("in_specs"), params.get("out_specs")
  if mesh is None or ins is None or outs is None or not hasattr(mesh, "axis_names"):
    return None
  sizes = dict(mesh.shape)
  return ManualSpecs(mesh_axes=tuple((a, int(sizes[a])) for a in mesh.axis_names),
                     inputs=tuple(_spec_axes(p) for p in ins),
                     outputs=tuple(_spec_axes(p) for p in outs))


def _spec_axes(spec: Any) -> tuple[tuple[str, ...], ...]:
  return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e)
               for e in tuple(spec))


@contextlib.contextmanager
def shard_maps_on(mesh: Any) -> Iterator[None]:
  """Within, `bind_eqn` checks that every `jax.shard_map` it runs was traced on the
  devices of `mesh` (the step's), and says how to fix one that was not: JAX's own error
  names neither the shard_map nor the fix."""
  token = _RUN_MESH.set(mesh)
  try:
    yield
  finally:
    _RUN_MESH.reset(token)


def _check_shard_map_mesh(traced: Any, mesh: Any) -> None:
  """Raises where a shard_map was traced on a concrete mesh over other devices than the
  step's (JAX runs it on a mesh of its own only over the step's devices); an abstract
  one JAX checks itself."""
  if not isinstance(traced, jax.sharding.Mesh):
    return
  ids = sorted((d.platform, d.id) for d in traced.devices.flat)
  if ids == sorted((d.platform, d.id) for d in mesh.devices.flat):
    return
  raise ValueError(
      f"a jax.shard_map in the step was traced on mesh {dict(traced.shape)} (on "
      f"{ids[0][0]} devices {[i for _, i in ids]}); the step runs on mesh "
      f"{dict(mesh.shape)} on {mesh.devices.flat[0].platform} devices "
      f"{[d.id for d in mesh.devices.flat]}. Build the shard_map's mesh from the devices "
      "the step runs on: the mesh given to tapas.apply(..., mesh=), or for "
      "tapas.verify(..., topology=T) tapas.tpu_mesh(T, plan.mesh_axes).")


# -- equation params as plain ints ---------------------------------------------------


def _ints(value: Any, what: str) -> tuple[int, ...]:
  try:
    return tuple(int(v) for v in (value if value is not None else ()))
  except (TypeError, ValueError) as e:
    raise ValueError(f"{what}: expected a sequence of ints, got {value!r}") from e


def _param(params: Mapping[str, Any], key: str, primitive: str) -> Any:
  if key not in params:
    raise ValueError(f"{primitive} params carry no {key!r} (got {sorted(params)}); "
                     "this jax release names them differently: teach "
                     "tapas_jax._jax_internals its form")
  return params[key]


@dataclasses.dataclass(frozen=True)
class DotDims:
  """dot_general's dimension numbers: which lhs/rhs dims are contracted, which batched.

  Pairs line up: `lhs_contracting[k]` is contracted with `rhs_contracting[k]`, and
  `lhs_batch[k]` is batched with `rhs_batch[k]`.
  """

  lhs_contracting: tuple[int, ...]
  rhs_contracting: tuple[int, ...]
  lhs_batch: tuple[int, ...]
  rhs_batch: tuple[int, ...]


def dot_dims(params: Mapping[str, Any]) -> DotDims:
  """`DotDims` of a dot_general equation's params.

  Example:
    >>> dot_dims({"dimension_numbers": (((2,), (0,)), ((), ()))})
    DotDims(lhs_contracting=(2,), rhs_contracting=(0,), lhs_batch=(), rhs_batch=())
  """
  dn = _param(params, "dimension_numbers", "dot_general")
  try:
    (lc, rc), (lb, rb) = dn
  except (TypeError, ValueError) as e:
    raise ValueError(f"dot_general dimension_numbers {dn!r}: expected "
                     "((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))") from e
  what = "dot_general dimension_numbers"
  out = DotDims(_ints(lc, what), _ints(rc, what), _ints(lb, what), _ints(rb, what))
  if (len(out.lhs_contracting) != len(out.rhs_contracting)
      or len(out.lhs_batch) != len(out.rhs_batch)):
    raise ValueError(f"{what} {dn!r}: lhs and rhs dims do not pair up")
  return out


@dataclasses.dataclass(frozen=True)
class RaggedDotDims:
  """ragged_dot_general's dimension numbers: a `DotDims`, the one lhs dim split into
  groups of the sizes `group_sizes` holds, and the rhs dims that index the groups (one
  where the ragged dim is not contracted or batched, else none)."""

  dot: DotDims
  lhs_ragged: int
  rhs_group: tuple[int, ...]


def ragged_dot_dims(params: Mapping[str, Any]) -> RaggedDotDims:
  """`RaggedDotDims` of a ragged_dot_general equation's params (`jax.lax.ragged_dot`).

  Example:
    >>> import jax
    >>> rd = jax.lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), [0], [0])
    >>> ragged_dot_dims({"ragged_dot_dimension_numbers": rd}).rhs_group
    (0,)
  """
  rd = _param(params, "ragged_dot_dimension_numbers", "ragged_dot_general")
  what = "ragged_dot_general dimension numbers"
  try:
    dot = dot_dims({"dimension_numbers": rd.dot_dimension_numbers})
    (ragged,) = _ints(rd.lhs_ragged_dimensions, what)
    group = _ints(rd.rhs_group_dimensions, what)
  except (AttributeError, TypeError, ValueError) as e:
    raise ValueError(f"{what} {rd!r}: expected jax.lax.RaggedDotDimensionNumbers with "
                     "one lhs ragged dimension") from e
  return RaggedDotDims(dot, ragged, group)


@dataclasses.dataclass(frozen=True)
class ConvDims:
  """conv_general_dilated's layout and grouping.

  Attributes:
    lhs_spec: lhs dims as (batch, feature, *spatial).
    rhs_spec: kernel dims as (out feature, in feature, *spatial).
    out_spec: result dims as (batch, feature, *spatial).
    feature_group_count: grouped convs (depthwise: groups == features).
    batch_group_count: per-group weight gradients.
  """

  lhs_spec: tuple[int, ...]
  rhs_spec: tuple[int, ...]
  out_spec: tuple[int, ...]
  feature_group_count: int = 1
  batch_group_count: int = 1


def conv_dims(params: Mapping[str, Any], rank: int) -> ConvDims:
  """`ConvDims` of a conv_general_dilated equation's params on operands of `rank`.

  No dimension numbers means lax's default layout: NC..., OI..., NC....

  Example:
    >>> conv_dims({"feature_group_count": 1}, 4).lhs_spec
    (0, 1, 2, 3)
  """
  dn = params.get("dimension_numbers")
  if dn is None:
    lhs = rhs = out = tuple(range(rank))
  else:
    try:  # ConvDimensionNumbers is a (lhs_spec, rhs_spec, out_spec) named tuple
      lhs, rhs, out = (_ints(spec, "conv dimension_numbers") for spec in dn)
    except (TypeError, ValueError) as e:
      raise ValueError(f"conv_general_dilated dimension_numbers {dn!r}: expected "
                       "(lhs_spec, rhs_spec, out_spec) of dim indices") from e
    if not len(lhs) == len(rhs) == len(out) == rank:
      raise ValueError(f"conv_general_dilated dimension_numbers {dn!r} do not fit "
                       f"operands of rank {rank}")
  return ConvDims(lhs, rhs, out,
                  feature_group_count=int(params.get("feature_group_count", 1)),
                  batch_group_count=int(params.get("batch_group_count", 1)))


@dataclasses.dataclass(frozen=True)
class GatherDims:
  """gather's dimension numbers and slice sizes (see `jax.lax.GatherDimensionNumbers`).

  The indices' last dim is the index vector. The batching dims are empty on jax
  releases before they existed.
  """

  offset_dims: tuple[int, ...]
  collapsed_slice_dims: tuple[int, ...]
  start_index_map: tuple[int, ...]
  operand_batching_dims: tuple[int, ...]
  start_indices_batching_dims: tuple[int, ...]
  slice_sizes: tuple[int, ...]


def gather_dims(params: Mapping[str, Any]) -> GatherDims:
  """`GatherDims` of a gather equation's params (example in the module docstring)."""
  dn = _param(params, "dimension_numbers", "gather")
  fields = [f.name for f in dataclasses.fields(GatherDims)][:-1]
  values = {f: _ints(getattr(dn, f, ()), f"gather dimension_numbers.{f}") for f in fields}
  return GatherDims(**values, slice_sizes=_ints(_param(params, "slice_sizes", "gather"),
                                                "gather slice_sizes"))


@dataclasses.dataclass(frozen=True)
class ScatterDims:
  """scatter's dimension numbers (see `jax.lax.ScatterDimensionNumbers`).

  The indices' last dim is the index vector. The batching dims are empty on jax
  releases before they existed.
  """

  update_window_dims: tuple[int, ...]
  inserted_window_dims: tuple[int, ...]
  scatter_dims_to_operand_dims: tuple[int, ...]
  operand_batching_dims: tuple[int, ...]
  scatter_indices_batching_dims: tuple[int, ...]


def scatter_dims(params: Mapping[str, Any]) -> ScatterDims:
  """`ScatterDims` of a scatter (scatter-add, ...) equation's params.

  Example:
    >>> import jax
    >>> dn = jax.lax.ScatterDimensionNumbers(update_window_dims=(1,),
    ...     inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,))
    >>> scatter_dims({"dimension_numbers": dn}).inserted_window_dims
    (0,)
  """
  dn = _param(params, "dimension_numbers", "scatter")
  return ScatterDims(**{f.name: _ints(getattr(dn, f.name, ()),
                                      f"scatter dimension_numbers.{f.name}")
                        for f in dataclasses.fields(ScatterDims)})


@dataclasses.dataclass(frozen=True)
class ScanCounts:
  """How a scan's operands split: consts first, then carries, then scanned inputs;
  results are carries, then stacked outputs."""

  num_consts: int
  num_carry: int


def scan_counts(params: Mapping[str, Any]) -> ScanCounts | None:
  """`ScanCounts` of a scan equation's params; None where the release does not say.

  jax 0.11 dropped `num_consts`/`num_carry`: there the operands' flat tree `ft_in`
  (consts, carry, xs) says it, where it unpacks; else callers tell operands apart by
  shape.

  Example:
    >>> scan_counts({"num_consts": 1, "num_carry": 2, "length": 8})
    ScanCounts(num_consts=1, num_carry=2)
    >>> scan_counts({"length": 8}) is None
    True
  """
  consts, carry = params.get("num_consts"), params.get("num_carry")
  if (consts is None or carry is None) and "ft_in" in params:
    try:
      parts = params["ft_in"].unpack()
      consts, carry = (len(list(p.vals)) for p in parts[:2])
    except (AttributeError, TypeError, ValueError):
      return None
  if consts is None or carry is None:
    return None
  return ScanCounts(int(consts), int(carry))


def is_tracer(x: Any) -> bool:
  """Whether x is a traced value (inside jit, grad, ...) rather than a concrete array."""
  return isinstance(x, jax.core.Tracer)
