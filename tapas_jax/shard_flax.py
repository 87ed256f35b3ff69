"""`tapas.shard` on flax module classes: parameters created sharded, by a plan that
costs training (forward, backward and the optimizer update), not just the forward.

The plan of a module is searched on a default train step,

    (params, opt_state, state, *inputs) -> (params, opt_state, state, loss)

with `loss = loss_fn(outputs, *inputs)` (default: the mean of squares of the
outputs' floating leaves; its gradient has the outputs' shape, as a cross-entropy's
would) and `optimizer` (default `optax.adamw(1e-3)`) applied to the gradients. Give
your own with `tapas.shard(MyModule, loss_fn=..., optimizer=...)`.

linen: `Sharded = tapas.shard(MyModule)` is a subclass of `MyModule`:
  - `Sharded(...).init(rngs, *inputs)` searches the plan on abstract shapes
    (`jax.eval_shape`: nothing allocated) and runs `jax.jit(init,
    out_shardings=plan)`: every variable is made where the plan stores it, never
    whole on one device first;
  - `.apply(variables, *inputs, mutable=False, **static_kwargs)` is a jitted call
    whose variables and inputs enter in the plan's layouts (moved there if they are
    elsewhere) and whose inside is constrained by `forward_plan`: the train plan's
    mesh axes per dimension class, applied to the forward's own program (no new
    search: a forward-only search would pick layouts that ignore backward and the
    optimizer; classes no input reaches stay unsplit);
  - `.plan_for(variables, *inputs)` gives the `ModulePlan` (plan and shardings).
  The plan is for the shapes `init` gets, or for `example_inputs=` when given: init
  with a batch of one and the plan is one for a batch of one. `apply` on other
  shapes searches their plan, and moves variables stored otherwise on every call.
  Used as a submodule of another module it is the plain module: only the top-level
  `init`/`apply` are sharded.

nnx: `Sharded = tapas.shard(MyModule, example_inputs=(...))` is a subclass of
`MyModule` whose construction `Sharded(..., rngs=nnx.Rngs(0))` searches the plan on
`example_inputs` (arrays or `jax.ShapeDtypeStruct`s, or a function of the abstract
module that returns them: an nnx constructor sees no inputs), then builds the module
under `jax.jit` with the plan's `out_shardings` (`nnx.split` state in, state out) and
merges it. The `Rngs` passed advance as an unsharded construction would. A call
`model(*inputs)` on concrete arrays runs jitted and constrained by `forward_plan` (as
linen's `apply`; keyword arguments are static), and writes back the non-Param state
it changes; inside your own jit or `tapas.shard` step (traced values) it is the plain
call and that program's plan governs. `Sharded.plan` / `Sharded.module_plan` are the
last plan made.

Optimizer state: `optax` made eagerly from sharded params follows their shardings
(zeros_like keeps a concrete array's sharding; so does `nnx.Optimizer`); under
`jax.jit` it does not (jax 0.10.2: the moments come out on one device), so use
`optimizer_state(optimizer, params)`, which jits `optimizer.init` with the params'
shardings as `out_shardings`.

Not supported: linen `init`/`apply` with `rngs=` (dropout), `method=` or
`capture_intermediates=`, and modules whose forward needs rngs during the search
(run the plain module inside your own `@tapas.shard` train step instead); sharding
a submodule on its own; a label-aware default loss (give `loss_fn`).

Example:
  >>> import jax, jax.numpy as jnp
  >>> import flax.linen as nn
  >>> import tapas_jax as tapas
  >>> @tapas.shard(mesh={"data": 8}, device="cpu")
  ... class MLP(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     return nn.Dense(4)(nn.relu(nn.Dense(32)(x)))
  >>> x = jnp.ones((64, 16))
  >>> variables = MLP().init(jax.random.key(0), x)
  >>> MLP().apply(variables, x).shape
  (64, 4)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tapas_jax import _jax_internals as jx
from tapas_jax import api
from tapas_jax import plan as planlib
from tapas_jax import solver
from tapas_jax.api import SearchOptions
from tapas_jax.apply import apply as apply_plan
from tapas_jax.apply import place_as_planned as _place
from tapas_jax.mesh import resolve_mesh

__all__ = ["ModulePlan", "default_loss", "optimizer_state", "shard_class", "shard_linen",
           "shard_nnx"]


@dataclasses.dataclass(frozen=True)
class ModulePlan:
  """A module's plan and the `NamedSharding`s it puts each part of the step in.

  Attributes:
    plan: the searched `Plan` of the default (or given) train step.
    mesh: the mesh it runs on.
    params: shardings of the trainable parameters (linen `params`, nnx `Param`s).
    opt_state: shardings of the optimizer state.
    state: shardings of the other variables (linen collections, nnx non-Param state).
    inputs: shardings of the inputs, one pytree per positional input.
    optimizer: the optimizer the plan was searched with.
  """

  plan: planlib.Plan
  mesh: jax.sharding.Mesh
  params: Any
  opt_state: Any
  state: Any
  inputs: tuple[Any, ...]
  optimizer: optax.GradientTransformation


def default_loss(outputs: Any, *inputs: Any) -> jax.Array:
  """Mean of squares of the outputs' floating-point leaves, summed over leaves.

  Example:
    >>> float(default_loss(jnp.array([1.0, 3.0])))
    5.0
  """
  del inputs
  leaves = [x for x in jax.tree.leaves(outputs) if jnp.issubdtype(jnp.result_type(x),
                                                                  jnp.floating)]
  if not leaves:
    raise TypeError("tapas.shard: the module's outputs have no floating-point leaf to "
                    "build the default loss from; pass loss_fn=(outputs, *inputs) -> "
                    "scalar")
  return sum(jnp.mean(jnp.square(x.astype(jnp.float32))) for x in leaves)


def optimizer_state(optimizer: optax.GradientTransformation, params: Any) -> Any:
  """`optimizer.init(params)` under jit, each moment sharded like its parameter.

  Leaves that mirror a parameter (Adam's `mu`, `nu`) get its sharding; the rest (step
  counts) are replicated on the params' mesh.

  Example:
    >>> import optax
    >>> import tapas_jax as tapas
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = tapas.make_mesh({"data": 8})
    >>> w = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("data")))
    >>> state = optimizer_state(optax.adam(1e-3), {"w": w})
    >>> state[0].mu["w"].sharding.spec
    P('data',)
  """
  shardings = jax.tree.map(lambda x: x.sharding, params)
  mesh = next((s.mesh for s in jax.tree.leaves(shardings) if isinstance(s, NamedSharding)),
              None)
  if mesh is None:
    raise ValueError("optimizer_state: no parameter carries a NamedSharding; place the "
                     "params first (e.g. with a tapas.shard module's init)")
  abstract = jax.eval_shape(optimizer.init, params)
  out = optax.tree_map_params(optimizer, lambda _, s: s, abstract, shardings,
                              transform_non_params=lambda _: NamedSharding(
                                  mesh, PartitionSpec()))
  return jax.jit(optimizer.init, out_shardings=out)(params)


def shard_class(cls: type, search: SearchOptions, *, loss_fn: Callable | None = None,
                optimizer: optax.GradientTransformation | None = None,
                example_inputs: Any = None) -> type:
  """`tapas.shard` of a module class: linen or nnx (see the module docstring).

  Raises:
    TypeError: `cls` is not a flax module class, or an option does not fit it.
  """
  if issubclass(cls, nn.Module):
    return shard_linen(cls, search, loss_fn=loss_fn, optimizer=optimizer,
                       example_inputs=example_inputs)
  if issubclass(cls, nnx.Module):
    return shard_nnx(cls, search, loss_fn=loss_fn, optimizer=optimizer,
                     example_inputs=example_inputs)
  raise TypeError(f"shard: class {cls.__name__} is not a flax.linen.Module or "
                  f"flax.nnx.Module subclass; shard functions with @tapas.shard and "
                  "other classes' methods by sharding the function you jit")


# -- the plan of a module ------------------------------------------------------------


def _train_step(forward: Callable, loss_fn: Callable, optimizer) -> Callable:
  """The default train step over `forward(params, state, *inputs) -> (outputs, state)`."""

  def train_step(params, opt_state, state, *inputs):
    def loss(p):
      outputs, new_state = forward(p, state, *inputs)
      return loss_fn(outputs, *inputs), new_state

    (value, state), grads = jax.value_and_grad(loss, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, state, value

  return train_step


def _signature(tree: Any) -> Hashable:
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves)


def _abstract(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                      tree)


def _module_plan(cache: dict, key: Hashable, search: SearchOptions, forward: Callable,
                 params, state, inputs: Sequence[Any], loss_fn, optimizer) -> ModulePlan:
  """The cached or newly searched plan of the train step over abstract arguments."""
  mesh = resolve_mesh(search.mesh)
  key = (key, _signature(params), _signature(state), _signature(tuple(inputs)), mesh)
  if key in cache:
    return cache[key]
  optimizer = optimizer if optimizer is not None else optax.adamw(1e-3)
  opt_state = jax.eval_shape(optimizer.init, params)
  step = _train_step(forward, loss_fn or default_loss, optimizer)
  plan = search.search(step, (params, opt_state, state, *inputs), mesh)
  named = plan.shardings(mesh)
  cache[key] = ModulePlan(plan=plan, mesh=mesh, params=named[0], opt_state=named[1],
                          state=named[2], inputs=tuple(named[3:]), optimizer=optimizer)
  return cache[key]


def forward_plan(module_plan: ModulePlan, forward: Callable, params, state,
                 inputs: Sequence[Any], fold: bool = True) -> planlib.Plan:
  """The plan of a forward-only call, taken from the train step's plan.

  Every input keeps the layout the train plan stores it in; each dimension class of
  the forward takes the mesh axes the train plan gives an input dim in that class
  (as the compute uses it: a parameter stored split over `data` but used gathered is
  used gathered here too). No search runs: the forward follows the training layout,
  and `apply` pins what it implies (reads in another layout than stored, contraction
  results) inside the call. Classes no input reaches stay unsplit.
  """
  args = (params, state, *inputs)
  prepared = api.prepare(forward, args, mesh=module_plan.mesh, device=module_plan.plan.device,
                         batch_axes=None, fold=fold, sequence_parallel=False)
  problem, graph = prepared.problem, prepared.graph
  is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
  train = module_plan.plan
  stored = [s for specs in (train.in_specs[0], train.in_specs[2], *train.in_specs[3:])
            for s in jax.tree.leaves(specs, is_leaf=is_spec)]
  if len(stored) != len(graph.inputs):
    raise ValueError(f"forward_plan: the train plan has {len(stored)} parameter, state and "
                     f"input specs, the forward {len(graph.inputs)} inputs")
  used = dict(train.use_specs)
  layout = solver.layout_choice(
      problem, stored={i.path: spec for i, spec in zip(graph.inputs, stored)},
      used={i.path: used.get(i.path, spec) if i.arg == 0 else spec
            for i, spec in zip(graph.inputs, stored)})
  solution = solver.evaluate(problem, layout)
  return planlib.make_plan(prepared.folded, solution, args, search_s=prepared.prepare_s,
                           name=f"{train.name} (forward)")


# -- linen ---------------------------------------------------------------------------


def _split_collections(variables) -> tuple[Any, dict]:
  variables = dict(variables)
  if "params" not in variables:
    raise ValueError(f"shard: the module made no 'params' collection (it has "
                     f"{sorted(variables)}); there is nothing to train or shard")
  params = variables.pop("params")
  return params, variables


def shard_linen(cls: type, search: SearchOptions, *, loss_fn: Callable | None = None,
                optimizer: optax.GradientTransformation | None = None,
                example_inputs: Any = None) -> type:
  """A subclass of the linen module `cls` whose `init` and `apply` follow a plan.

  `example_inputs` (optional): the inputs to plan for, when `init` gets others (a
  batch of one, say): arrays or ShapeDtypeStructs, or a function of the module
  returning them.
  """
  cache: dict = {}
  forwards: dict = {}  # (id of a ModulePlan, static kwargs) -> the applied forward

  class Sharded(cls):  # type: ignore[misc, valid-type]

    def _forward(self, kwargs, mutable: Any = True):
      """`(params, state, *inputs) -> (outputs, state)`; `mutable` as for apply (the
      train step may update every collection)."""
      def forward(params, state, *inputs):
        variables = {"params": params, **state}
        names = list(state) if mutable is True else list(mutable or ())
        if names:
          out, new = super(Sharded, self).apply(variables, *inputs, mutable=names,
                                                **kwargs)
          return out, {**state, **new}
        return super(Sharded, self).apply(variables, *inputs, **kwargs), state
      return forward

    def plan_for(self, variables: Any, *inputs: Any, **kwargs: Any) -> ModulePlan:
      """The `ModulePlan` for these variables and inputs (arrays or abstract)."""
      params, state = _split_collections(_abstract(variables))
      return _module_plan(cache, (self, _static(kwargs)), search, self._forward(kwargs),
                          params, state, _abstract(inputs), loss_fn, optimizer)

    def _init_jit(self, rngs, inputs, kwargs):
      base_init = super(Sharded, self).init
      variables = jax.eval_shape(lambda r, *i: base_init(r, *i, **kwargs), rngs, *inputs)
      planned = inputs
      if example_inputs is not None:
        planned = example_inputs(self) if callable(example_inputs) else example_inputs
      plan = self.plan_for(variables, *planned, **kwargs)
      jitted = jax.jit(lambda r, *i: _split_collections(base_init(r, *i, **kwargs)),
                       out_shardings=(plan.params, plan.state))
      return plan, jitted

    def init(self, rngs, *inputs, **kwargs):
      """Variables made where the plan stores them (`jax.jit` with out_shardings).

      Keyword arguments are static options of `__call__` (hashable); `method=`,
      `mutable=` and `rngs=` (beyond the init rngs) are not supported.
      """
      _check_kwargs("init", kwargs)
      _, jitted = self._init_jit(rngs, inputs, kwargs)
      params, state = jitted(rngs, *inputs)
      return {"params": params, **state}

    def lower_init(self, rngs, *inputs, **kwargs):
      """The `jax.stages.Lowered` sharded init (read its memory analysis)."""
      _check_kwargs("init", kwargs)
      _, jitted = self._init_jit(rngs, inputs, kwargs)
      return jitted.lower(rngs, *inputs)

    def apply(self, variables, *inputs, mutable: Any = False, **kwargs):
      """`Module.apply`, jitted and constrained by `forward_plan`.

      Args:
        variables: as `init` returns them (moved to the plan's layouts if elsewhere).
        *inputs: positional inputs of `__call__`.
        mutable: False, True or collection names, as for linen's apply: with it, the
          result is `(outputs, updated collections)`.
        **kwargs: static (hashable) keyword options of `__call__`.
      """
      _check_kwargs("apply", kwargs)
      names = tuple(sorted(set(variables) - {"params"})) if mutable is True else \
          tuple(mutable or ())
      plan = self.plan_for(variables, *inputs, **kwargs)
      params, state = _split_collections(variables)
      key = (id(plan), _static(kwargs), names)  # plans live in `cache`: ids stay theirs
      if key not in forwards:
        forwards[key] = apply_plan(self.forward_plan_for(variables, *inputs, mutable=names,
                                                         **kwargs),
                                   self._forward(kwargs, names), mesh=plan.mesh)
      out, new = forwards[key](_place(params, plan.params), _place(state, plan.state),
                               *(_place(x, s) for x, s in zip(inputs, plan.inputs)))
      return (out, {n: new[n] for n in names}) if mutable else out

    def forward_plan_for(self, variables: Any, *inputs: Any, mutable: Any = False,
                         **kwargs: Any) -> planlib.Plan:
      """The plan `apply` runs with (see `forward_plan`)."""
      plan = self.plan_for(variables, *inputs, **kwargs)
      return forward_plan(plan, self._forward(kwargs, mutable),
                          *_split_collections(_abstract(variables)), _abstract(inputs),
                          fold=search.config.fold)

  Sharded.__name__, Sharded.__qualname__ = cls.__name__, cls.__qualname__
  Sharded.__module__, Sharded.__doc__ = cls.__module__, cls.__doc__
  return Sharded


def _check_kwargs(where: str, kwargs: dict) -> None:
  bad = sorted(set(kwargs) & {"method", "mutable", "rngs", "capture_intermediates"}
               - ({"mutable"} if where == "apply" else set()))
  if bad:
    raise TypeError(f"tapas.shard module {where}: {bad} are not supported; call the "
                    f"plain module's {where} inside your own @tapas.shard step instead")
  _static(kwargs)


def _static(kwargs: dict) -> Hashable:
  try:
    key = tuple(sorted(kwargs.items()))
    hash(key)
  except TypeError:
    raise TypeError(f"tapas.shard module: keyword arguments {sorted(kwargs)} are static "
                    f"options and must be hashable; pass arrays positionally") from None
  return key


# -- nnx -----------------------------------------------------------------------------


def shard_nnx(cls: type, search: SearchOptions, *, loss_fn: Callable | None = None,
              optimizer: optax.GradientTransformation | None = None,
              example_inputs: Any = None) -> type:
  """A subclass of the nnx module `cls` constructed with its state sharded."""
  if example_inputs is None:
    raise TypeError(f"shard: nnx module {cls.__name__} needs example_inputs=(...) (arrays "
                    f"or jax.ShapeDtypeStructs, one per positional argument of __call__, "
                    f"or a function of the abstract module returning them): its "
                    f"constructor sees no inputs, and the plan needs their shapes")
  cache: dict = {}
  base_meta = type(cls)

  class Meta(base_meta):  # type: ignore[misc, valid-type]

    def __call__(klass, *args, **kwargs):
      return _construct(klass, lambda a, k: base_meta.__call__(klass, *a, **k), args,
                        kwargs, cache, search, loss_fn, optimizer, example_inputs)

  forwards: dict = {}  # (id of a ModulePlan, static kwargs) -> the applied forward

  def __call__(self, *inputs, **kwargs):
    """The module's call; outside a trace, jitted and constrained by `forward_plan`."""
    graphdef, params, rest = nnx.split(self, nnx.Param, ...)
    leaves = jax.tree.leaves((params, rest, inputs))
    if any(jx.is_tracer(x) for x in leaves):
      # Inside the caller's jit or tapas.shard step: that program's plan governs.
      return super(Sharded, self).__call__(*inputs, **kwargs)
    plan, _, applied = _planned_call(graphdef, params, rest, inputs, kwargs)
    out, rest = applied(_place(params, plan.params), _place(rest, plan.state),
                        *(_place(x, s) for x, s in zip(inputs, plan.inputs)))
    nnx.update(self, rest)
    return out

  def forward_plan_for(self, *inputs, **kwargs) -> planlib.Plan:
    """The plan a call on these inputs runs with (see `forward_plan`)."""
    graphdef, params, rest = nnx.split(self, nnx.Param, ...)
    return _planned_call(graphdef, params, rest, inputs, kwargs)[1]

  def _planned_call(graphdef, params, rest, inputs, kwargs):
    """(ModulePlan, forward Plan, applied forward) of a call, cached."""
    _check_kwargs("call", kwargs)
    forward = _nnx_forward(graphdef, kwargs)
    plan = _module_plan(cache, graphdef, search, forward, _abstract(params),
                        _abstract(rest), _abstract(inputs), loss_fn, optimizer)
    key = (id(plan), _static(kwargs))  # plans live in `cache`: ids stay theirs
    if key not in forwards:
      fwd = forward_plan(plan, forward, _abstract(params), _abstract(rest),
                         _abstract(inputs), fold=search.config.fold)
      forwards[key] = (fwd, apply_plan(fwd, forward, mesh=plan.mesh))
    return (plan, *forwards[key])

  Sharded = Meta(cls.__name__, (cls,), {"__module__": cls.__module__,
                                        "__qualname__": cls.__qualname__,
                                        "__doc__": cls.__doc__, "__call__": __call__,
                                        "forward_plan_for": forward_plan_for})
  Sharded.plan = None
  Sharded.module_plan = None
  return Sharded


def _nnx_forward(graphdef, kwargs) -> Callable:
  def forward(params, state, *inputs):
    module = nnx.merge(graphdef, params, state)
    out = module(*inputs, **kwargs)
    return out, nnx.split(module, nnx.Param, ...)[2]
  return forward


def _construct(klass, create, args, kwargs, cache, search, loss_fn, optimizer,
               example_inputs):
  """`klass(*args, **kwargs)` built under jit with the plan's out_shardings."""
  arg_graph, arg_state = nnx.split((args, kwargs))
  made: dict = {}

  def build(state):
    a, k = nnx.merge(arg_graph, state)
    module = create(a, k)
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    made["graphdef"] = graphdef
    return params, rest, nnx.split((a, k))[1]

  params, rest, _ = jax.eval_shape(build, arg_state)
  graphdef = made["graphdef"]
  inputs = example_inputs
  if callable(inputs):
    inputs = inputs(nnx.merge(graphdef, params, rest))
  inputs = _abstract(tuple(inputs))

  plan = _module_plan(cache, graphdef, search, _nnx_forward(graphdef, {}), params, rest,
                      inputs, loss_fn, optimizer)
  replicated = NamedSharding(plan.mesh, PartitionSpec())
  out_shardings = (plan.params, plan.state,
                   jax.tree.map(lambda _: replicated, arg_state))
  params, rest, arg_state = jax.jit(build, out_shardings=out_shardings)(arg_state)
  nnx.update((args, kwargs), arg_state)  # the caller's Rngs advance, as unsharded
  klass.plan, klass.module_plan = plan.plan, plan
  return nnx.merge(graphdef, params, rest)
