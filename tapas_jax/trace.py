"""Stage 1, trace: a JAX callable and its arguments -> `Graph`, the project's IR.

One `Op` per jaxpr equation, with its primitive, normalized params, typed inputs and
outputs, the flax name stack, and a canonical `signature` that is blind to variable
names, weight values and name stacks. Call-like equations (`jit`, custom_jvp/vjp,
remat: one sub-jaxpr whose types match the call) are inlined, so a layer looks the
same whether or not someone wrapped it in `jax.jit`. Loops and branches (`scan`,
`while`, `cond`) stay as one op each, with their bodies in nested `Region`s; a scan
keeps its trip count. Sub-jaxprs are found by type in equation params, not by a list
of primitive names. The walk itself (equation order and sites, what is inlined) is
`_jax_internals.walk_eqns`, shared with `apply`, which re-runs the program by it.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tapas_jax.trace import trace
  >>> g = trace(lambda w, x: jnp.tanh(x @ w), jax.ShapeDtypeStruct((4, 8), jnp.float32),
  ...           jax.ShapeDtypeStruct((2, 4), jnp.float32))
  >>> [op.primitive for op in g.ops]
  ['dot_general', 'tanh']
  >>> g.inputs[0].path
  'arg0'
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import gc
import functools
import hashlib
import itertools
import math
import re
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import numpy as np

from tapas_jax import _jax_internals as jx
from tapas_jax.errors import TapasError

__all__ = ["Graph", "GraphInput", "Op", "Region", "TensorType", "TopWiring", "TraceError",
           "collector_paused", "ranges", "trace"]


class TraceError(TapasError, ValueError):
  """A function or its arguments could not be traced."""


@dataclasses.dataclass(frozen=True)
class TensorType:
  """Shape and dtype of one value."""

  shape: tuple[int, ...]
  dtype: str

  # Derived once per type (a frozen value; the graph shares one object per shape and
  # dtype): the search reads them for every value it prices.
  @functools.cached_property
  def size(self) -> int:
    return math.prod(self.shape)

  @functools.cached_property
  def itemsize(self) -> int:
    try:
      return np.dtype(self.dtype).itemsize
    except TypeError:
      return 0

  @functools.cached_property
  def nbytes(self) -> int:
    return self.size * self.itemsize

  @functools.cached_property
  def _text(self) -> str:
    return f"{self.dtype}[{','.join(map(str, self.shape))}]"

  def __str__(self) -> str:
    return self._text


@dataclasses.dataclass(frozen=True)
class GraphInput:
  """A leaf of the traced function's arguments.

  Attributes:
    value: the value id it binds.
    path: pytree key path, e.g. "params/Block_3/MLP/fc1/kernel".
    arg: index of the positional argument it belongs to.
    logical_axes: per dim, the logical axis name the program gives it (flax's
      `nn.with_logical_partitioning` / `nnx.with_partitioning` boxes: "embed", "mlp",
      ...; None where unnamed); empty when the leaf is not in such a box.
  """

  value: int
  path: str
  arg: int
  logical_axes: tuple[str | None, ...] = ()


@dataclasses.dataclass(frozen=True)
class Op:
  """One jaxpr equation.

  Attributes:
    index: position in `Graph.ops`.
    primitive: primitive name, e.g. "dot_general".
    params: normalized params as sorted (name, canonical text) pairs; sub-jaxprs
      appear as the fingerprint of their region.
    inputs: value ids read (literals included, see `Graph.literals`).
    outputs: value ids written.
    name_stack: flax/JAX name stack, parent stacks prefixed.
    region: id of the `Region` holding this op; 0 is the top level.
    signature: canonical hash of primitive, params and input/output types.
    subregions: regions of a loop or branch op (its bodies), else ().
    site: where the equation sits: top-level equation index, then for each nesting
      level (param name, jaxpr index, equation index) flattened.
    raw_params: the equation's own param values (jaxprs left out), for sharding rules
      that need dimension numbers and axes as objects rather than text.
    barrier: which of the user's differentiated `jax.checkpoint` calls the op was
      inlined from (1, 2, ...; 0: none). JAX lowers such a call behind an optimization
      barrier on its operands, so the compiler gathers a sharded operand again for the
      recomputation and backward inside it, rather than reusing the forward's gather.
  """

  index: int
  primitive: str
  params: tuple[tuple[str, str], ...]
  inputs: tuple[int, ...]
  outputs: tuple[int, ...]
  name_stack: str
  region: int
  signature: str
  subregions: tuple[int, ...] = ()
  site: tuple[Any, ...] = ()
  raw_params: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False,
                                                    repr=False)
  barrier: int = dataclasses.field(default=0, compare=False)

  @classmethod
  def made(cls, **fields: Any) -> Op:
    """`Op(**fields)`, every field given, without the frozen `__init__`'s setattr per
    field: the walk makes an op per equation (2.0 against 0.3 us an op)."""
    if len(fields) != len(cls.__dataclass_fields__):  # what `dataclasses.fields` reads
      raise TypeError(f"Op.made: missing {sorted(set(cls.__dataclass_fields__) - set(fields))}")
    op = object.__new__(cls)
    op.__dict__.update(fields)
    return op


@dataclasses.dataclass(frozen=True)
class Region:
  """A nested jaxpr that is not inlined: a loop body, a loop condition or a branch.

  Attributes:
    index: id; 0 is the top level.
    kind: "top" or "<primitive>.<param>", e.g. "scan.jaxpr", "while.body_jaxpr".
    parent: enclosing region id (-1 for the top level).
    op: index of the op that owns it (-1 for the top level).
    trip_count: iterations of a counted loop (scan), None when unknown or not a loop.
    inputs: value ids bound to the body's parameters.
    outputs: value ids the body returns.
    fingerprint: canonical hash of the body (ops and wiring).
  """

  index: int
  kind: str
  parent: int
  op: int
  trip_count: int | None
  inputs: tuple[int, ...]
  outputs: tuple[int, ...]
  fingerprint: str


@dataclasses.dataclass(frozen=True, eq=False)
class TopWiring:
  """The top-level ops' wiring as arrays (`Graph.top_wiring`), built once per graph:
  folding reads them, and so do the search's passes over every op.

  Attributes:
    index: per top-level op, its `Op.index`.
    row: per op of the graph (`Op.index`), its position in the top level, else -1.
    values: every top-level op's inputs then outputs (literals and scalars included),
      flattened in program order: op top[t]'s are values[starts[t]:starts[t + 1]].
    starts: where each op's values start in `values`, then the end.
    num_inputs: per top-level op, how many inputs it reads (its outputs follow them).
    num_outputs: per top-level op, how many outputs it writes.
    positions: per entry of `values`, the position in the top level of its op.
    read: per entry of `values`, whether its op reads it (else writes it).
  """

  index: np.ndarray
  row: np.ndarray
  values: np.ndarray
  starts: np.ndarray
  num_inputs: np.ndarray
  num_outputs: np.ndarray
  positions: np.ndarray
  read: np.ndarray

  @classmethod
  def of(cls, graph: Graph) -> TopWiring:
    top = graph.region_ops(0)
    index = np.fromiter((op.index for op in top), np.int64, len(top))
    row = np.full(len(graph.ops), -1, np.int64)
    row[index] = np.arange(len(top))
    # Every op's inputs then outputs, flattened in program order (C loops: per-op
    # Python here was a good part of folding).
    inputs = [op.inputs for op in top]
    outputs = [op.outputs for op in top]
    values = np.fromiter(itertools.chain.from_iterable(
        itertools.chain.from_iterable(zip(inputs, outputs))), np.int64)
    num_inputs = np.fromiter(map(len, inputs), np.int64, len(top))
    num_outputs = np.fromiter(map(len, outputs), np.int64, len(top))
    lengths = num_inputs + num_outputs
    return cls(index=index, row=row, values=values,
               starts=np.concatenate([[0], np.cumsum(lengths)]), num_inputs=num_inputs,
               num_outputs=num_outputs, positions=np.repeat(np.arange(len(top)), lengths),
               read=np.repeat(np.tile([True, False], len(top)),
                              np.stack([num_inputs, num_outputs], 1).ravel()))


def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
  """starts[k], starts[k] + 1, ... starts[k] + counts[k] - 1 for every k, in a row: the
  entries of chosen ops in `TopWiring.values` (their inputs: `starts`, `num_inputs`)."""
  ends = np.cumsum(counts)
  return np.repeat(starts - (ends - counts), counts) + np.arange(int(ends[-1]) if len(ends)
                                                                  else 0)


def mask(size: int, ids: Iterable[int]) -> np.ndarray:
  """A boolean array of `size` entries, true at `ids` (op or value ids)."""
  ids = ids if isinstance(ids, np.ndarray) else np.fromiter(ids, np.int64)
  out = np.zeros(size, bool)
  out[ids] = True
  return out


@dataclasses.dataclass(frozen=True)
class Graph:
  """The traced program.

  Attributes:
    ops: every op, bodies of loops included; `region` says where each sits.
    types: `types[v]` is the `TensorType` of value id v.
    literals: value ids that are literals or closed-over constants.
    inputs: the graph inputs, one per argument leaf, in flattening order.
    outputs: value ids of the function's outputs, flattened.
    output_paths: pytree key path of each output.
    regions: region 0 is the top level, then loop bodies and branches.
    num_args: number of arguments: the positional ones, then the keyword ones in
      sorted name order.
    trace_s: seconds spent in `jax.make_jaxpr`.
    walk_s: seconds spent building this graph from the jaxpr (and flattening the
      arguments for `jax.make_jaxpr`, and handing what both made to the collector:
      `collector_paused`).
  """

  ops: tuple[Op, ...]
  types: tuple[TensorType, ...]
  literals: frozenset[int]
  inputs: tuple[GraphInput, ...]
  outputs: tuple[int, ...]
  output_paths: tuple[str, ...]
  regions: tuple[Region, ...]
  num_args: int
  trace_s: float = 0.0
  walk_s: float = 0.0

  @functools.cached_property
  def top_wiring(self) -> TopWiring:
    """The top-level ops' wiring as arrays (`TopWiring`)."""
    return TopWiring.of(self)

  @functools.cached_property
  def producer(self) -> dict[int, int]:
    """value id -> index of the op writing it (graph inputs and literals absent)."""
    return {v: op.index for op in self.ops for v in op.outputs}

  @functools.cached_property
  def consumers(self) -> dict[int, tuple[int, ...]]:
    """value id -> indices of the ops reading it, in program order."""
    out: dict[int, list[int]] = {}
    for op in self.ops:
      for v in op.inputs:
        out.setdefault(v, []).append(op.index)
    return {v: tuple(ops) for v, ops in out.items()}

  @functools.cached_property
  def output_set(self) -> frozenset[int]:
    """The program's output value ids, for membership tests."""
    return frozenset(self.outputs)

  @functools.cached_property
  def input_path(self) -> dict[int, str]:
    """value id -> key path, for graph inputs."""
    return {i.value: i.path for i in self.inputs}

  @functools.cached_property
  def carried(self) -> tuple[tuple[int, int], ...]:
    """(output position, input position) of outputs that are the next value of an input:
    the same path after the output's leading tuple index, and the same type (a train
    step's new state)."""
    by_path = {i.path: k for k, i in enumerate(self.inputs)}
    types, inputs, out = self.types, self.inputs, []
    for k, (v, path) in enumerate(zip(self.outputs, self.output_paths)):
      _, cut, rest = path.partition("/")
      j = by_path.get(rest) if cut else None
      if j is not None and ((t := types[inputs[j].value]) is types[v] or t == types[v]):
        out.append((k, j))
    return tuple(out)

  @functools.cached_property
  def _ops_by_region(self) -> dict[int, tuple[Op, ...]]:
    # Every stage asks for the top level: one pass over the ops serves them all.
    out: dict[int, list[Op]] = {}
    for op in self.ops:
      out.setdefault(op.region, []).append(op)
    return {r: tuple(ops) for r, ops in out.items()}

  def region_ops(self, region: int = 0) -> tuple[Op, ...]:
    """The ops directly inside `region`, in program order."""
    return self._ops_by_region.get(region, ())

  def summary(self) -> str:
    top = self.region_ops(0)
    loops = [r for r in self.regions[1:] if r.trip_count]
    lines = [f"Graph: {len(self.ops)} ops ({len(top)} top level), {len(self.inputs)} "
             f"inputs, {len(self.outputs)} outputs, {len(self.regions) - 1} nested regions"]
    for r in loops:
      lines.append(f"  loop {r.kind} x{r.trip_count}: "
                   f"{sum(1 for op in self.ops if op.region == r.index)} ops")
    return "\n".join(lines)


# -- argument checking ------------------------------------------------------------


def key_path_str(path: Sequence[Any]) -> str:
  """'params/Block_3/MLP/fc1/kernel' from a pytree key path."""
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)


def _abstract_leaf(leaf: Any, where: str) -> jax.ShapeDtypeStruct:
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return leaf
  if isinstance(leaf, (bool, int, float, complex, np.number, np.bool_)):
    return jax.ShapeDtypeStruct((), jax.numpy.asarray(leaf).dtype)
  shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
  if shape is None or dtype is None:
    raise TraceError(
        f"trace: {where} is a {type(leaf).__name__} ({leaf!r:.60}), not an array. Pass "
        "jax/numpy arrays or jax.ShapeDtypeStruct leaves (jax.eval_shape gives them "
        "without allocating); mark non-array options static with functools.partial.")
  return jax.ShapeDtypeStruct(tuple(shape), dtype)


def abstract_args(args: Sequence[Any], names: Sequence[str] = ()
                  ) -> tuple[tuple[Any, ...], list[tuple[int, str]]]:
  """Arguments as `jax.ShapeDtypeStruct` pytrees, and (argument index, key path) per leaf.

  Args:
    args: positional arguments, then keyword arguments' values.
    names: the keyword arguments' names, for the last `len(names)` entries of `args`;
      their leaves' paths start with the name ("batch/inputs").
  """
  abstract, paths = [], []
  first_kw = len(args) - len(names)
  for i, arg in enumerate(args):
    flat, treedef = jax.tree_util.tree_flatten_with_path(arg)
    leaves = []
    for path, leaf in flat:
      p = key_path_str(path)
      if i >= first_kw:
        p = f"{names[i - first_kw]}/{p}" if p else names[i - first_kw]
      p = p or f"arg{i}"
      where = (f"argument {i}" if i < first_kw else f"keyword argument "
               f"{names[i - first_kw]!r}") + f" at path '{p}'"
      leaves.append(_abstract_leaf(leaf, where))
      paths.append((i, p))
    abstract.append(jax.tree_util.tree_unflatten(treedef, leaves))
  return tuple(abstract), paths


def _axis_names(box: Any) -> tuple[str | None, ...] | None:
  """The per-dim axis names of a metadata box (flax linen `Partitioned`: `names`; an
  nnx `Variable`: `out_sharding` or `sharding_names` metadata), found by duck typing so
  no flax import is needed."""
  names = getattr(box, "names", None)
  if names is None and callable(getattr(box, "get_metadata", None)):
    meta = box.get_metadata()
    names = next((meta[k] for k in ("out_sharding", "sharding_names", "sharding")
                  if isinstance(meta.get(k), tuple)), None)
  if not isinstance(names, tuple) or not names:
    return None
  if not all(n is None or isinstance(n, str) for n in names):
    return None
  return names


def logical_axes(args: Sequence[Any]) -> list[tuple[str | None, ...]]:
  """Per argument leaf (in `abstract_args` order), the logical axis names of its dims."""
  out = []
  for arg in args:
    boxed = jax.tree_util.tree_leaves(arg, is_leaf=lambda x: _axis_names(x) is not None)
    for node in boxed:
      names = _axis_names(node)
      inner = len(jax.tree_util.tree_leaves(node)) if names is not None else 1
      out += [names or ()] * inner
  return out


def flat_call(fn: Callable[..., Any], num_positional: int, names: Sequence[str]
              ) -> Callable[..., Any]:
  """`fn` taking its keyword arguments' values positionally, after the positional ones
  (jit's `in_shardings` only reach positional arguments)."""
  if not names:
    return fn

  def call(*flat):
    return fn(*flat[:num_positional], **dict(zip(names, flat[num_positional:])))

  return call


# -- canonical params -------------------------------------------------------------

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# Params that are names or bookkeeping, not semantics.
_IGNORED_PARAMS = frozenset({"name", "debug_info", "source_info", "ctx_mesh",
                             "compiler_options_kvs", "keep_unused", "inline",
                             "donated_invars"})


_PLAIN = frozenset({type(None), bool, int, str})


def _typed(value: Any) -> Any:
  """A value with its type and its items' types: equal keys, equal `_canon` text
  (8 and np.int64(8) are equal and hash alike, and their text differs)."""
  kind = type(value)
  if kind in _PLAIN:  # most params: asked first
    return kind, value
  if isinstance(value, tuple):  # dimension numbers too (named tuples)
    return kind, tuple(map(_typed, value))
  if isinstance(value, (float, np.floating)):  # 0.0 == -0.0
    return kind, repr(value)
  return kind, value


def _canon(value: Any) -> str:
  if value is None or isinstance(value, (bool, int, float, str)):
    return repr(value)
  if isinstance(value, (jax.sharding.Sharding, jax.sharding.PartitionSpec)):
    return _canon_sharding(value)
  if isinstance(value, (tuple, list)):
    return "(" + ",".join(_canon(v) for v in value) + ("," if len(value) == 1 else "") + ")"
  if isinstance(value, np.dtype):
    return value.name
  if isinstance(value, enum.Enum):
    return f"{type(value).__name__}.{value.name}"
  if callable(value) and not hasattr(value, "shape"):
    # Functions in params (custom_jvp rules, thunks) have no stable identity.
    return f"<{type(value).__name__}>"
  if isinstance(value, np.ndarray):
    return f"array{value.shape}{value.dtype}"
  return _ADDRESS.sub("", repr(value))


def _canon_sharding(value: Any) -> str:
  """A sharding in equation params, as far as it changes the program.

  Under `jax.set_mesh`, `broadcast_in_dim`, `iota`, `reshape`, `dot_general`,
  `reduce_sum`, ... record `sharding=NamedSharding(AbstractMesh(...), P(None, ...))`
  where they record None without a mesh. A spec that names no axis says nothing (the
  value is laid out as its inputs or XLA decide), and on Auto axes, the only kind a
  plan runs on, a named axis is a hint for the partitioner, not a change in what is
  computed; the mesh itself is the plan's to check, not the program's. So: no axes ->
  "None", else the spec alone.
  """
  spec = value if isinstance(value, jax.sharding.PartitionSpec) else getattr(value, "spec",
                                                                              None)
  if spec is None:
    return "None" if getattr(value, "is_fully_replicated", False) else f"<{type(value).__name__}>"
  entries = tuple(spec)
  if all(e is None or e == () for e in entries):
    return "None"
  return "P" + _canon(tuple(tuple(e) if isinstance(e, (tuple, list)) else e for e in entries))


def _digest(text: str) -> str:
  return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


# -- the walk ---------------------------------------------------------------------


class _Walker:
  """Builds the flat op list; one instance per `trace` call."""

  def __init__(self):
    self.ops: list[Op] = []
    self.types: list[TensorType] = []
    self.literals: set[int] = set()
    self.regions: list[Region | None] = [None]
    self._type_cache: dict[tuple, TensorType] = {}
    self._sig_cache: dict[tuple, str] = {}
    self._params_cache: dict[tuple, tuple[tuple[str, str], ...]] = {}
    self._stacks: dict[int, tuple[Any, str]] = {}
    self._barrier, self._barriers = 0, 0  # the checkpoint call being inlined, and how many

  def new_value(self, atom: Any) -> int:
    try:
      ttype = self._type_cache.get(key := jx.type_key(atom))
    except TypeError:  # an unhashable dtype: keyed by its name
      ttype = self._type_cache.get(key := jx.aval_of(atom))
    if ttype is None:
      ttype = self._type_cache[key] = TensorType(*jx.aval_of(atom))
    self.types.append(ttype)
    return len(self.types) - 1

  def new_literal(self, atom: Any) -> int:
    v = self.new_value(atom)
    self.literals.add(v)
    return v

  def read(self, env: dict, atom: Any) -> int:
    if jx.is_literal(atom):
      return self.new_literal(atom)
    return env[atom]

  def walk(self, jaxpr: Any, env: dict, region: int, stack: str, site: tuple) -> None:
    for here, eqn, subs, call in jx.walk_eqns(jaxpr, site):
      inner = self._name_stack(eqn)
      full = f"{stack}/{inner}" if stack and inner else (stack or inner)
      inputs = tuple(self.read(env, a) for a in eqn.invars)
      if call is not None:
        self._inline(eqn, call, inputs, env, region, full, here)
        continue
      self._emit(eqn, subs, inputs, env, region, full, here)

  def _name_stack(self, eqn: Any) -> str:
    # Equations traced in one scope share one name-stack object; its text is built
    # anew on every read. Kept with the object, so that its id is not reused.
    stack = jx.name_stack_of(eqn)
    known = self._stacks.get(id(stack))
    if known is None:
      known = self._stacks[id(stack)] = (stack, jx.name_stack_text(stack))
    return known[1]

  def _bind_consts(self, body: Any, consts: tuple, env: dict) -> None:
    for var, _ in zip(body.constvars, consts):
      env[var] = self.new_literal(var)

  def _inline(self, eqn, sub, inputs, env, region, stack, site) -> None:
    key, idx, jaxpr = sub
    body, consts = jx.open_jaxpr(jaxpr)
    inner_env: dict = dict(zip(body.invars, inputs))
    self._bind_consts(body, consts, inner_env)
    outer = self._barrier
    if jx.is_recompute_barrier(eqn):
      self._barriers += 1
      self._barrier = self._barriers
    self.walk(body, inner_env, region, stack, site + (key, idx))
    self._barrier = outer
    for outer, inner in zip(eqn.outvars, body.outvars):
      env[outer] = self.read(inner_env, inner)

  def _emit(self, eqn, subs, inputs, env, region, stack, site) -> None:
    index = len(self.ops)
    self.ops.append(None)  # placeholder: bodies are walked first, they need no index
    subregions, fingerprints = [], {}
    for key, idx, jaxpr in subs:
      r = self._walk_region(eqn, key, idx, jaxpr, index, region, stack, site)
      subregions.append(r.index)
      fingerprints.setdefault(key, []).append(r.fingerprint)
    outputs = tuple(self.new_value(a) for a in eqn.outvars)
    for var, v in zip(eqn.outvars, outputs):
      env[var] = v
    params = (self._params(eqn.params) if not fingerprints else tuple(sorted(
        (k, ",".join(fingerprints[k]) if k in fingerprints else _canon(v))
        for k, v in eqn.params.items() if k not in _IGNORED_PARAMS)))
    sig = self._signature(eqn.primitive.name, params, inputs, outputs)
    self.ops[index] = Op.made(
        index=index, primitive=eqn.primitive.name, params=params, inputs=inputs,
        outputs=outputs, name_stack=stack, region=region, signature=sig,
        subregions=tuple(subregions), site=site, barrier=self._barrier,
        # jax's own dict (read, never written); copied only to leave out the jaxprs of
        # an equation that has some
        raw_params=eqn.params if not subs else {
            k: v for k, v in eqn.params.items() if not jx.is_jaxpr_param(v)})

  def _params(self, params: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """`Op.params` of an equation without jaxprs in its params, kept by their values:
    a layer's equations repeat in every copy of it."""
    try:
      key = tuple([(k, _typed(v)) for k, v in params.items()])
      out = self._params_cache.get(key)
    except TypeError:  # an unhashable value (an array)
      key, out = None, None
    if out is None:
      out = tuple(sorted((k, _canon(v)) for k, v in params.items()
                         if k not in _IGNORED_PARAMS))
      if key is not None:
        self._params_cache[key] = out
    return out

  def _walk_region(self, eqn, key, idx, jaxpr, op_index, parent, stack, site) -> Region:
    body, consts = jx.open_jaxpr(jaxpr)
    rid = len(self.regions)
    self.regions.append(None)
    env: dict = {}
    body_inputs = tuple(self.new_value(v) for v in body.invars)
    env.update(zip(body.invars, body_inputs))
    self._bind_consts(body, consts, env)
    first = len(self.ops)
    self.walk(body, env, rid, stack, site + (key, idx))
    outputs = tuple(self.read(env, a) for a in body.outvars)
    ops = [op for op in self.ops[first:] if op.region == rid]
    region = Region(index=rid, kind=f"{eqn.primitive.name}.{key}", parent=parent,
                    op=op_index, trip_count=jx.trip_count(eqn), inputs=body_inputs,
                    outputs=outputs,
                    fingerprint=subgraph_fingerprint(ops, body_inputs, outputs))
    self.regions[rid] = region
    return region

  def _signature(self, primitive, params, inputs, outputs) -> str:
    # Equal types are one `TensorType` object (`new_value`'s cache): its id names the
    # type, and a tuple of ids is cheaper to look up than the text built from them.
    types, literals = self.types, self.literals
    key = (primitive, params, tuple(-id(types[v]) if v in literals else id(types[v])
                                    for v in inputs),
           tuple(id(types[v]) for v in outputs))
    sig = self._sig_cache.get(key)
    if sig is None:
      text = "|".join((
          primitive, repr(params),
          ";".join(f"{'L' if v in literals else ''}{types[v]}" for v in inputs),
          ";".join(str(types[v]) for v in outputs)))
      sig = self._sig_cache[key] = _digest(text)
    return sig


def subgraph_fingerprint(ops: Sequence[Op], inputs: Sequence[int] = (),
                         outputs: Sequence[int] = (),
                         signature: Mapping[int, str] | None = None) -> str:
  """Canonical hash of a list of ops and their wiring, blind to value ids.

  Values made inside are named by (op position, output slot); values from outside by
  order of first use, with declared `inputs` first. Equal fingerprints mean the same
  computation on the same shapes. `signature` (op index -> text) replaces some ops'
  own `signature` (fold's blindness to slice offsets).
  """
  signature = signature or {}
  local: dict[int, str] = {v: f"i{k}" for k, v in enumerate(inputs)}
  parts = []
  for pos, op in enumerate(ops):
    refs = []
    for v in op.inputs:
      ref = local.get(v)
      if ref is None:
        ref = local[v] = f"x{len(local)}"
      refs.append(ref)
    parts.append(f"{signature.get(op.index, op.signature)}({','.join(refs)})")
    for slot, v in enumerate(op.outputs):
      local[v] = f"{pos}.{slot}"
  parts.append("->" + ",".join(local.get(v, "?") for v in outputs))
  return _digest(";".join(parts))


@contextlib.contextmanager
def collector_paused():
  """Python's cyclic garbage collector off while the trace, the walk, the fold and the
  search run (on again after, if it was on).

  Each full collection that their many small allocations trigger walks every live
  object, the whole traced program included, so a deep program paid for its depth
  again in collections (`jax.make_jaxpr` of LLaMA-3-8B's step too; BENCHMARKS.md has
  the figures). What they leave behind is freed by reference counting. On the way out,
  what was made inside and lives on (the traced program, its graph, the problem, the
  plan) is handed to the oldest generation without a look (`gc.freeze` then
  `gc.unfreeze`, microseconds), rather than walked by a young collection that frees
  nothing. Cyclic garbage among it is freed by the next full collection: a few hundred
  of JAX's objects after tracing a `jax.checkpoint`ed step; our stages make none
  (`tests/api_test.py::test_a_search_leaves_no_cycle_holding_its_graph`). Objects
  frozen before (the interpreter's immortal ones, a caller's) are thawed too.
  """
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled:
      gc.freeze()
      gc.unfreeze()
      gc.enable()


def trace(fn: Callable[..., Any], *args: Any, kwargs: Mapping[str, Any] | None = None
          ) -> Graph:
  """Traces `fn(*args, **kwargs)` abstractly into a `Graph`.

  Args:
    fn: any JAX-traceable callable (a train step, a flax apply, a plain function).
    *args: its positional arguments: pytrees of arrays or `jax.ShapeDtypeStruct`.
      Nothing is allocated and nothing runs on a device.
    kwargs: its keyword arguments, likewise. They become graph arguments after the
      positional ones, in sorted name order (as `jax.jit` flattens them), and their
      leaves' paths start with the name.

  Returns:
    The `Graph` with one op per equation, inputs keyed by pytree path.

  Raises:
    TraceError: `fn` is not callable, a leaf is not an array, or tracing failed.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> g = trace(lambda p: jnp.sum(p["w"] ** 2), {"w": jnp.ones((3,))})
    >>> g.inputs[0].path, len(g.ops)
    ('w', 2)
  """
  return trace_with_jaxpr(fn, *args, kwargs=kwargs)[0]


def _make_jaxpr(fn, args, names, abstract, paths) -> tuple[Any, Any]:
  """`jax.make_jaxpr` of fn on the abstract arguments: (closed jaxpr, output shapes); a
  failure re-raised as a `TraceError` naming the arguments' paths and shapes."""
  try:
    return jx.make_jaxpr(flat_call(fn, len(args) - len(names), names), *abstract)
  except Exception as e:  # noqa: BLE001 - re-raised with the arguments named
    shapes = ", ".join(f"{path} {tuple(leaf.shape)}" for (_, path), leaf in
                       zip(paths[:6], jax.tree.leaves(abstract)))
    raise TraceError(f"trace: {getattr(fn, '__name__', fn)!s} failed to trace with "
                     f"{len(abstract)} argument(s) ({shapes}"
                     f"{', ...' if len(paths) > 6 else ''}): {type(e).__name__}: {e}") from e


def trace_with_jaxpr(fn: Callable[..., Any], *args: Any,
                     kwargs: Mapping[str, Any] | None = None) -> tuple[Graph, Any, Any]:
  """`trace`, also returning the closed jaxpr walked and its output shape pytree
  (`apply` re-interprets that very jaxpr, so equation sites match `Op.site`)."""
  if not callable(fn):
    raise TraceError(f"trace: fn must be callable, got {type(fn).__name__} ({fn!r:.60})")
  names = sorted(kwargs or {})
  args = tuple(args) + tuple(kwargs[k] for k in names)
  start = time.perf_counter()
  abstract, paths = abstract_args(args, names)
  # Flattening the arguments is this walk's own work too (16 ms of a 96-layer step's
  # state), counted with it.
  flatten_s = time.perf_counter() - start
  # Tracing and the walk allocate objects per equation, which the graph keeps.
  with collector_paused():
    start = time.perf_counter()
    closed, out_shape = _make_jaxpr(fn, args, names, abstract, paths)
    trace_s = time.perf_counter() - start
    start = time.perf_counter()
    walker = _Walker()
    body, consts = jx.open_jaxpr(closed)
    env: dict = {}
    inputs = []
    axis_names = logical_axes(args)
    if len(axis_names) != len(paths):  # a box flattened unlike its leaves: names unknown
      axis_names = [()] * len(paths)
    for var, (arg, path), axes in zip(body.invars, paths, axis_names):
      v = walker.new_value(var)
      env[var] = v
      axes = axes if len(axes) == len(jx.aval_of(var)[0]) else ()
      inputs.append(GraphInput(value=v, path=path, arg=arg, logical_axes=axes))
    walker._bind_consts(body, consts, env)
    walker.walk(body, env, region=0, stack="", site=())
    outputs = tuple(walker.read(env, a) for a in body.outvars)
    out_paths = tuple(key_path_str(p) or f"out{k}" for k, (p, _) in
                      enumerate(jax.tree_util.tree_flatten_with_path(out_shape)[0]))
    top_ops = [op for op in walker.ops if op.region == 0]
    walker.regions[0] = Region(index=0, kind="top", parent=-1, op=-1, trip_count=None,
                               inputs=tuple(i.value for i in inputs), outputs=outputs,
                               fingerprint=subgraph_fingerprint(
                                   top_ops, [i.value for i in inputs], outputs))
  # Timed past the collector's pause: handing what the trace and the walk made to the
  # oldest generation is counted with the walk.
  graph = Graph(ops=tuple(walker.ops), types=tuple(walker.types),
                literals=frozenset(walker.literals), inputs=tuple(inputs), outputs=outputs,
                output_paths=out_paths, regions=tuple(walker.regions),
                num_args=len(args), trace_s=trace_s,
                walk_s=flatten_s + time.perf_counter() - start)
  return graph, closed, out_shape
