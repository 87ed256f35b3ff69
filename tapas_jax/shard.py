"""`tapas.shard`: `jax.jit` that searches its own sharding plan.

On a function, `shard` behaves like `jax.jit` (positional and keyword arguments,
`static_argnums`/`static_argnames`, `donate_argnums`/`donate_argnames`, `.lower`); the
first call with a new abstract signature (shapes, dtypes, pytree structure, static
values, mesh) runs `tapas.search` on it, caches the plan and runs it through
`tapas.apply`. On a flax linen or nnx `Module` class it gives a class whose
parameters are created already sharded (see `tapas_jax.shard_flax`).

The mesh: `mesh=` if given; else the one set with `jax.set_mesh`; else `default_mesh()`
over every device.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import tapas_jax as tapas
  >>> @tapas.shard(device="cpu")
  ... def loss(w, x, *, scale=1.0):
  ...   return scale * jnp.sum(jnp.tanh(x @ w) ** 2)
  >>> w, x = jnp.ones((64, 64)), jnp.ones((256, 64))
  >>> bool(jnp.allclose(loss(w, x, scale=2.0), 2 * jnp.sum(jnp.tanh(x @ w) ** 2)))
  True
  >>> dict(loss.plan.mesh_axes)
  {'data': 4, 'model': 2}
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Hashable, Mapping, Sequence

import jax

from tapas_jax import plan as planlib
from tapas_jax.api import SearchOptions
from tapas_jax.apply import apply as apply_plan
from tapas_jax.apply import place_as_planned
from tapas_jax.mesh import default_mesh, resolve_mesh
from tapas_jax.options import SEARCH_OPTIONS, SearchConfig, search_config

__all__ = ["SearchOptions", "ShardedFunction", "default_mesh", "place_as_planned",
           "resolve_mesh", "shard"]

# Options only a function takes, and only a module class takes.
_FUNCTION_OPTIONS = ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames")
_MODULE_OPTIONS = ("loss_fn", "optimizer", "example_inputs")


def shard(target: Any = None, /, *, mesh: Any = None, config: SearchConfig | None = None,
          **options: Any) -> Any:
  """Shards a function or a flax module class by a plan searched on first use.

  Usable bare (`@tapas.shard`) or with options (`@tapas.shard(mesh=..., ...)`).

  Args:
    target: a function, a `flax.linen.Module` subclass or a `flax.nnx.Module` subclass.
    mesh: the mesh to search and run on (`SearchOptions.mesh`); None: the
      `jax.set_mesh` context, else `default_mesh()`.
    config: how to search, as one `tapas_jax.options.SearchConfig`; or
    **options: every search option of `tapas.search` by keyword (`device`,
      `memory_budget`, `batch_axes`, `fold`, `solver`, `links`, `time_limit`,
      `sequence_parallel`, `verify`, `layouts`), not together with `config=`; and for a function:
      `static_argnums`, `static_argnames`, `donate_argnums`, `donate_argnames`, as for
      `jax.jit`. For a module class: `loss_fn`, `optimizer`
      and (nnx, required there) `example_inputs`; see `tapas_jax.shard_flax`.

  Returns:
    For a function, a `ShardedFunction` (callable like the function, with `.lower`,
    `.plan_for(*args, **kwargs)` and `.plan`, the last plan used). For a module class,
    a subclass of it (see `tapas_jax.shard_flax.shard_linen` / `shard_nnx`).

  Raises:
    TypeError: `target` is neither, or an option does not apply to it.
    OptionError: a search option has a bad value (checked here, not at the first call).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> f = shard(lambda w, x: jnp.sum(x @ w), mesh={"data": 8}, device="h100")
    >>> float(f(jnp.ones((16, 8)), jnp.ones((64, 16))))
    8192.0
    >>> f.plan_for(jax.ShapeDtypeStruct((4096, 4096), jnp.float32),     # no allocation
    ...            jax.ShapeDtypeStruct((65536, 4096), jnp.float32)).in_specs
    (P(None, None), P('data', None))
  """
  if mesh is not None:
    resolve_mesh(mesh)  # a wrong mesh fails here, not at the first call
  given = {k: options.pop(k) for k in SEARCH_OPTIONS if k in options}
  search = SearchOptions(mesh=mesh, config=search_config(config, given, "shard"))
  if target is None:
    return functools.partial(_shard, search=search, options=options)
  return _shard(target, search=search, options=options)


def _shard(target: Any, *, search: SearchOptions, options: Mapping[str, Any]) -> Any:
  unknown = sorted(set(options) - set(_FUNCTION_OPTIONS) - set(_MODULE_OPTIONS))
  if unknown:
    raise TypeError(f"shard: unknown option(s) {unknown}; options are mesh, config, "
                    f"{', '.join(SEARCH_OPTIONS)}, and for functions "
                    f"{', '.join(_FUNCTION_OPTIONS)}, for module classes "
                    f"{', '.join(_MODULE_OPTIONS)}")
  if isinstance(target, type):
    from tapas_jax import shard_flax  # noqa: PLC0415 - flax imported only when used
    misplaced = sorted(set(options) & set(_FUNCTION_OPTIONS))
    if misplaced:
      raise TypeError(f"shard: {misplaced} apply to functions, not to module class "
                      f"{target.__name__}")
    return shard_flax.shard_class(target, search, **options)
  if not callable(target):
    raise TypeError(f"shard: expected a function or a flax Module class, got "
                    f"{type(target).__name__}")
  misplaced = sorted(set(options) & set(_MODULE_OPTIONS))
  if misplaced:
    raise TypeError(f"shard: {misplaced} apply to flax module classes, not to functions "
                    f"(a function is searched as it is: give it the loss and optimizer "
                    f"step you run)")
  return ShardedFunction(target, search, **options)


def _as_tuple(x, name: str, kind) -> tuple:
  items = (x,) if isinstance(x, kind) else tuple(x)
  for i in items:
    if not isinstance(i, kind):
      raise TypeError(f"shard: {name} must be {kind.__name__}s, got {i!r}")
  return items


@dataclasses.dataclass(frozen=True)
class _Slot:
  """One argument of a call: a parameter, or one entry of `*args` / `**kwargs`."""

  name: str            # the parameter's name
  sub: Any             # None, an index into *args, or a key of **kwargs
  index: int | None    # position as jax.jit counts static_argnums; None: keyword only

  @property
  def label(self) -> str:
    if self.sub is None:
      return self.name
    return f"{self.name}[{self.sub!r}]"


@dataclasses.dataclass
class _Entry:
  plan: planlib.Plan
  applied: Any
  shardings: tuple[Any, ...]


class ShardedFunction:
  """A function jitted with a plan searched per abstract signature (see `shard`).

  Attributes:
    plan: the plan of the last call (None before the first).
  """

  def __init__(self, fn: Callable[..., Any], search: SearchOptions,
               static_argnums: int | Sequence[int] = (),
               static_argnames: str | Sequence[str] = (),
               donate_argnums: int | Sequence[int] = (),
               donate_argnames: str | Sequence[str] = ()):
    functools.update_wrapper(self, fn)
    self.fn, self.search = fn, search
    self._name = getattr(fn, "__name__", None) or repr(fn)
    self.static_argnums = _as_tuple(static_argnums, "static_argnums", int)
    self.static_argnames = _as_tuple(static_argnames, "static_argnames", str)
    self.donate_argnums = _as_tuple(donate_argnums, "donate_argnums", int)
    self.donate_argnames = _as_tuple(donate_argnames, "donate_argnames", str)
    try:
      self._signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without one: positional arguments only
      self._signature = None
    if self._signature is not None:
      names = set(self._signature.parameters)
      has_var_kw = any(p.kind is p.VAR_KEYWORD for p in self._signature.parameters.values())
      for option in ("static_argnames", "donate_argnames"):
        missing = [n for n in getattr(self, option) if n not in names]
        if missing and not has_var_kw:
          raise ValueError(f"shard: {option} {missing} name no parameter of "
                           f"{getattr(fn, '__name__', fn)}{self._signature}")
    both = set(self.static_argnums) & set(self.donate_argnums)
    if both:
      raise ValueError(f"shard: arguments {sorted(both)} are both static and donated")
    self._entries: dict[Hashable, _Entry] = {}
    self.plan: planlib.Plan | None = None

  # -- binding ---------------------------------------------------------------

  def _slots(self, args, kwargs) -> list[tuple[_Slot, Any]]:
    """Every argument of this call, in signature order, numbered as jax.jit numbers
    `static_argnums` (parameters in signature order, then the entries of `*args`)."""
    if self._signature is None:
      if kwargs:
        raise TypeError(f"shard: {self._name} has no signature to bind keyword "
                        f"arguments {sorted(kwargs)} to; pass them positionally")
      return [(_Slot("args", i, i), a) for i, a in enumerate(args)]
    try:
      bound = self._signature.bind(*args, **kwargs)
    except TypeError as e:
      raise TypeError(f"{self._name}{self._signature}: {e}") from None
    parameters = self._signature.parameters
    positional = [n for n, p in parameters.items()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    out = []
    for name, value in bound.arguments.items():
      kind = parameters[name].kind
      if kind is inspect.Parameter.VAR_POSITIONAL:
        out += [(_Slot(name, i, len(positional) + i), v) for i, v in enumerate(value)]
      elif kind is inspect.Parameter.VAR_KEYWORD:
        out += [(_Slot(name, k, None), v) for k, v in value.items()]
      else:
        out.append((_Slot(name, None, positional.index(name) if name in positional
                          else None), value))
    return out

  def _selected(self, slot: _Slot, nums: tuple[int, ...], names: tuple[str, ...],
                count: int) -> bool:
    wanted = {n % count if n < 0 and count else n for n in nums}
    key = slot.sub if slot.index is None and slot.sub is not None else slot.name
    return (slot.index is not None and slot.index in wanted) or key in names

  def _split(self, args, kwargs):
    """(key, dynamic values, their abstract values, the function of the dynamic values,
    donated positions among them)."""
    slots = self._slots(args, kwargs)
    count = sum(1 for s, _ in slots if s.index is not None)
    statics, dynamic, donated, layout = {}, [], [], []
    for slot, value in slots:
      if self._selected(slot, self.static_argnums, self.static_argnames, count):
        try:
          hash(value)
        except TypeError:
          raise TypeError(f"shard: static argument {slot.label} of {self._name} must "
                          f"be hashable, got {type(value).__name__}") from None
        statics[slot] = value
        layout.append((slot, True, value))
      else:
        if self._selected(slot, self.donate_argnums, self.donate_argnames, count):
          donated.append(len(dynamic))
        dynamic.append(value)
        layout.append((slot, False, None))
    abstract = _abstract(dynamic, [s.label for s, st, _ in layout if not st])
    key = (tuple(layout), jax.tree.structure(abstract),
           tuple((a.shape, a.dtype) for a in jax.tree.leaves(abstract)))
    return key, dynamic, abstract, self._closed(slots, statics), tuple(donated)

  def _closed(self, slots, statics) -> Callable[..., Any]:
    """fn of the dynamic arguments only, positionally (what search and apply see)."""
    fn, signature = self.fn, self._signature

    def closed(*values):
      it = iter(values)
      full = [(slot, statics[slot] if slot in statics else next(it)) for slot, _ in slots]
      if signature is None:
        return fn(*(v for _, v in full))
      arguments: dict[str, Any] = {}
      for slot, value in full:
        kind = signature.parameters[slot.name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
          arguments[slot.name] = arguments.get(slot.name, ()) + (value,)
        elif kind is inspect.Parameter.VAR_KEYWORD:
          arguments.setdefault(slot.name, {})[slot.sub] = value
        else:
          arguments[slot.name] = value
      bound = inspect.BoundArguments(signature, arguments)
      return fn(*bound.args, **bound.kwargs)

    # Trace errors and plan reports name the user's function.
    closed.__name__ = getattr(fn, "__name__", "fn")
    closed.__qualname__ = getattr(fn, "__qualname__", closed.__name__)
    return closed

  # -- planning --------------------------------------------------------------

  def _entry(self, args, kwargs):
    mesh = resolve_mesh(self.search.mesh)
    key, dynamic, abstract, closed, donated = self._split(args, kwargs)
    key = key + (mesh,)
    if key not in self._entries:
      plan = self.search.search(closed, abstract, mesh)
      applied = apply_plan(plan, closed, mesh=mesh, donate_argnums=donated,
                           layouts=self.search.config.layouts)
      self._entries[key] = _Entry(plan, applied, plan.shardings(mesh))
    entry = self._entries[key]
    self.plan = entry.plan
    return entry, dynamic, abstract

  def plan_for(self, *args: Any, **kwargs: Any) -> planlib.Plan:
    """The plan for these arguments (searched now if this signature is new).

    Arrays or `jax.ShapeDtypeStruct`s; `plan.in_specs` has one entry per dynamic
    argument, in signature order, static ones left out.
    """
    return self._entry(args, kwargs)[0].plan

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    entry, dynamic, _ = self._entry(args, kwargs)
    return entry.applied(*(place_as_planned(v, s) for v, s in zip(dynamic, entry.shardings)))

  def lower(self, *args: Any, **kwargs: Any) -> Any:
    """`jax.jit(...).lower` of the planned program (arrays or ShapeDtypeStructs)."""
    entry, _, abstract = self._entry(args, kwargs)
    return entry.applied.lower(*abstract)

  def __get__(self, obj, objtype=None):
    # A decorated method binds its instance as the first (positional) argument, as
    # jax.jit's does; mark it static if it is not a pytree of arrays.
    return self if obj is None else functools.partial(self, obj)

  def __repr__(self) -> str:
    return f"<tapas.shard of {self.fn!r}: {len(self._entries)} plan(s)>"


def _abstract(values: Sequence[Any], labels: Sequence[str]) -> list[Any]:
  """ShapeDtypeStructs of the dynamic arguments, strongly typed as `apply` traces them
  (a Python scalar and an array of its dtype share a plan)."""
  out = []
  strong = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
  for value, label in zip(values, labels):
    try:
      out.append(jax.tree.map(strong, jax.eval_shape(lambda v: v, value)))
    except TypeError:
      kinds = sorted({type(x).__name__ for x in jax.tree.leaves(value)
                      if not hasattr(x, "shape") and not isinstance(x, (bool, int, float,
                                                                        complex))})
      raise TypeError(f"shard: argument {label} is not a pytree of arrays (it holds "
                      f"{', '.join(kinds) or 'a non-array'}); mark it static with "
                      f"static_argnums= or static_argnames=") from None
  return out


