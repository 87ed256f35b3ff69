"""Stage 5, apply: a `Plan` -> a jitted function that XLA partitions the plan's way.

`apply` jits the function with the plan's `in_specs` as `in_shardings`, keeps each
state output where its input was, and re-interprets the program's jaxpr so that every
`plan.constraints` entry becomes a `jax.lax.with_sharding_constraint` on the operand
it names. Input shardings alone are enough for tensor-parallel plans (XLA propagates
them), but not where a value is read in another layout than it is stored in (ZeRO:
parameters stored split over `data` and gathered for use): without the constraint XLA
spreads the storage layout into the compute.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import tapas_jax as tapas
  >>> def loss(w, x):
  ...   return jnp.sum(jnp.tanh(x @ w) ** 2)
  >>> w, x = jnp.ones((64, 64)), jnp.ones((256, 64))
  >>> plan = tapas.search(loss, w, x, mesh={"data": 8}, device="cpu")
  >>> step = tapas.apply(plan, loss)
  >>> w, x = tapas.place(plan, w, x)
  >>> bool(jnp.allclose(step(w, x), loss(w, x)))
  True
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec

from tapas_jax import _jax_internals as jx
from tapas_jax import fences as fencelib
from tapas_jax import fold as foldlib
from tapas_jax import options
from tapas_jax import plan as planlib
from tapas_jax import plan_file
from tapas_jax import rules as ruleslib
from tapas_jax import trace as tracelib
from tapas_jax import solver
from tapas_jax.mesh import MeshError, axes_difference, make_mesh

__all__ = ["apply", "place", "place_as_planned", "remat_policy"]


def _is_spec(x) -> bool:
  return isinstance(x, PartitionSpec)


def _mesh_for(plan: planlib.Plan, mesh: Any, where: str) -> jax.sharding.Mesh:
  """The mesh given, else the one set by `jax.set_mesh`, else `make_mesh` of the plan's
  axes; whichever it is must have the plan's axis names and sizes."""
  if not isinstance(plan, planlib.Plan):
    raise options.OptionError(f"{where}: the first argument must be a tapas Plan (from "
                              f"tapas.search or Plan.load), got {type(plan).__name__}.")
  if mesh is None:
    current = jx.current_mesh()
    if current is None:
      return make_mesh(dict(plan.mesh_axes))
    mesh, source = current, "the mesh set by jax.set_mesh"
  else:
    source = "the mesh given"
    if not isinstance(mesh, jax.sharding.Mesh):
      raise MeshError(f"{where}: mesh={mesh!r:.80} is a {type(mesh).__name__}; pass a "
                      "jax.sharding.Mesh (tapas.make_mesh(plan.mesh_axes)) or None.")
  axes = options.mesh_axes(mesh, where)
  if axes != dict(plan.mesh_axes):
    raise MeshError(f"{where}: the plan was searched for mesh {dict(plan.mesh_axes)}, but "
                    f"{source} has axes {axes} ({axes_difference(dict(plan.mesh_axes), axes)}). "
                    "Search again on this mesh, or use a mesh with the plan's axis names "
                    "and sizes.")
  return mesh


class _Call:
  """The arguments of one call, flattened as the plan's program takes them: the
  positional ones, then the keyword ones in sorted name order."""

  def __init__(self, plan: planlib.Plan, args: Sequence[Any], kwargs: Mapping[str, Any],
               where: str):
    names = sorted(kwargs)
    if len(args) != len(plan.in_specs) or names != sorted(plan.kwargs_specs):
      def shape(n, kw):
        return f"{n} positional argument(s)" + (f" and keyword(s) {kw}" if kw else "")
      raise ValueError(
          f"{where}: plan {plan.name!r} was searched for another program, called with "
          f"{shape(len(plan.in_specs), sorted(plan.kwargs_specs))}; got "
          f"{shape(len(args), names)}. Call it as it was searched, or search again "
          "(keyword arguments: tapas.search(fn, *args, kwargs={...}, mesh=...)).")
    self.names = names
    self.values = tuple(args) + tuple(kwargs[n] for n in names)
    self.where = [f"argument {i}" for i in range(len(args))] + \
        [f"keyword argument {n!r}" for n in names]
    self.specs = tuple(
        plan_file.bind_specs(s, a, w, plan.name) for s, a, w in
        zip(tuple(plan.in_specs) + tuple(plan.kwargs_specs[n] for n in names),
            self.values, self.where))

  def shardings(self, mesh) -> tuple[Any, ...]:
    return tuple(jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)
                 for specs in self.specs)


def place(plan: planlib.Plan, *args: Any, mesh: Any = None,
          kwargs: Mapping[str, Any] | None = None) -> Any:
  """Puts each argument where the plan wants it (`jax.device_put` per leaf).

  Args:
    plan: from `tapas.search`, a baseline or `Plan.load`.
    *args: the arrays, one pytree per positional argument, as searched.
    mesh: a `jax.sharding.Mesh` with the plan's axes; default: the mesh set by
      `jax.set_mesh`, else `make_mesh` of the plan's axes.
    kwargs: the keyword arguments, for a plan searched with `kwargs=`.

  Returns:
    The placed positional arguments as a tuple; with `kwargs`, the pair
    `(args, kwargs)`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import tapas_jax as tapas
    >>> f = lambda w, x: jnp.sum(x @ w)
    >>> w, x = jnp.ones((8, 8)), jnp.ones((64, 8))
    >>> plan = tapas.search(f, w, kwargs={"x": x}, mesh={"data": 8}, device="cpu")
    >>> (w,), kw = tapas.place(plan, w, kwargs={"x": x})
    >>> kw["x"].sharding.spec == plan.kwargs_specs["x"]
    True
  """
  mesh = _mesh_for(plan, mesh, "place")
  given = options.kwargs(kwargs, "place")
  call = _Call(plan, args, given, "place")
  placed = tuple(jax.device_put(a, s) for a, s in zip(call.values, call.shardings(mesh)))
  if kwargs is None:
    return placed[:len(args)]
  return placed[:len(args)], dict(zip(call.names, placed[len(args):]))


def apply(plan: planlib.Plan, fn: Callable[..., Any], *, mesh: Any = None,
          donate_argnums: int | Sequence[int] = (),
          donate_argnames: str | Sequence[str] = (),
          layouts: str = "default") -> Callable[..., Any]:
  """`fn` jitted to run as the plan says.

  Args:
    plan: from `tapas.search` (or a baseline, or `Plan.load`) for this `fn` and these
      argument shapes.
    fn: the function searched, e.g. `train_step(state, batch)`.
    mesh: a `jax.sharding.Mesh` (Auto axes) with the plan's axes; default: the mesh
      set by `jax.set_mesh` when `apply` is called, else `make_mesh` of the plan's axes
      over the local devices.
    donate_argnames: arguments to donate by name, as for `jax.jit`: the plan's keyword
      arguments, or `fn`'s parameters searched positionally.
    donate_argnums: positional arguments to donate, as for `jax.jit` (donate the
      state to update it in place).
    layouts: the in-memory layouts of the state (donated arguments of rank 2 and more
      that `fn` returns the next value of): "default", JAX's; "auto", the compiler's
      (`Layout.AUTO`). On TPU, JAX's make the compiler copy each kernel and its Adam
      moments into the update's layout and back, which "auto" avoids (BENCHMARKS.md,
      "The state in the compiler's layouts"). The first call puts the state into the
      compiled layouts (`jax.device_put`, donating it); inside another trace JAX's hold.

  Returns:
    A `jax.jit`-wrapped function with `fn`'s signature (and `.lower`); keyword
    arguments work as with `jax.jit` when the plan was searched with them
    (`search(..., kwargs={...})`). Arguments of another structure, or a program other
    than the one searched, raise ValueError; arguments already committed to other
    shardings than the plan's raise ValueError naming them (`tapas.place` fixes it).
    Calls to `jax.jit`-ed and `custom_jvp`/`custom_vjp` functions inside `fn` are
    evaluated inline (that is how constraints reach into them), so apply the step you
    run, with its gradients taken inside it, rather than differentiating the result.

  Raises:
    MeshError: the mesh has other axes than the plan, or Explicit axes.
  """
  mesh = _mesh_for(plan, mesh, "apply")
  if not callable(fn):
    raise options.OptionError(f"apply: fn must be callable, got {type(fn).__name__}; "
                              "pass the step searched: tapas.apply(plan, step).")
  donate = options.donate_argnums(donate_argnums, len(plan.in_specs))
  donate += _donated_names(plan, fn, donate_argnames)
  auto = options.layouts(layouts, "apply") == "auto"
  return _Applied(plan, fn, mesh, tuple(sorted(set(donate))), auto)


def _donated_names(plan: planlib.Plan, fn, names: str | Sequence[str]) -> tuple[int, ...]:
  """Positions, in the flat arguments the jitted program takes, of the named ones."""
  names = (names,) if isinstance(names, str) else tuple(names)
  if not all(isinstance(n, str) for n in names):
    raise options.OptionError(f"apply: donate_argnames={names!r} must be a name or a "
                              "sequence of names.")
  try:
    params = [p.name for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  except (TypeError, ValueError):
    params = []
  positional = params[:len(plan.in_specs)]
  keywords = sorted(plan.kwargs_specs)
  out = []
  for name in names:
    if name in keywords:
      out.append(len(plan.in_specs) + keywords.index(name))
    elif name in positional:
      out.append(positional.index(name))
    else:
      raise options.OptionError(
          f"apply: donate_argnames names {name!r}, which is not an argument of the plan "
          f"(positional {positional or len(plan.in_specs)}, keywords {keywords}).")
  return tuple(out)


class _Applied:
  """The jitted step, its arguments checked against the plan first (jit's own messages
  for a mismatch do not say which plan or what to do). One `jax.jit` per argument
  structure: a loaded plan's specs take the structure of the arguments they meet."""

  def __init__(self, plan: planlib.Plan, fn, mesh, donate: tuple[int, ...],
               auto_layouts: bool = False):
    self.plan, self.fn, self.mesh, self.donate, self.auto_layouts = (plan, fn, mesh, donate,
                                                                     auto_layouts)
    self.pins: dict[tuple, list[tuple[int, NamedSharding]]] = {}
    for c in plan.constraints:
      self.pins.setdefault(tuple(c.site), []).append((c.slot, NamedSharding(mesh, c.spec)))
    self._steps: dict[Any, _Structure] = {}

  def _prepare(self, args, kwargs) -> tuple[tuple, _Structure]:
    args, kwargs = _as_searched(self.fn, self.plan, args, kwargs)
    self.in_mesh_context = jx.current_mesh() is not None  # for `_check_program`'s hint
    names = tuple(sorted(kwargs))
    values = tuple(args) + tuple(kwargs[n] for n in names)
    # Checking and binding the specs walks every leaf: once per argument structure.
    key = (len(args), names, tuple(jax.tree.structure(v) for v in values))
    if key not in self._steps:
      call = _Call(self.plan, args, kwargs, "apply")
      step = self._steps[key] = _Structure(names, call.shardings(self.mesh), call.where)
      step.jitted = self._jit(step, len(args))
    return values, self._steps[key]

  def _jit(self, step: _Structure, num_positional: int):
    plan, fn, pins, names, mesh = self.plan, self.fn, self.pins, step.names, self.mesh

    def run(*flat):
      # The jaxpr of the abstract arguments, exactly as `search` traced it (real arrays
      # may carry weak types that would add or drop equations and shift every site).
      graph, closed, out_shape = tracelib.trace_with_jaxpr(
          fn, *flat[:num_positional], kwargs=dict(zip(names, flat[num_positional:])))
      _check_program(plan, graph, self.in_mesh_context)
      step.traced = (graph.carried, jax.tree.structure(out_shape))
      jaxpr, consts = jx.open_jaxpr(closed)
      # The layers, for the plan's remat and the backward's order: folded once.
      folded = foldlib.fold(graph) if plan.remat or plan.gradient_fences else None
      remat = _Recompute.of(plan, graph, folded, pins)
      fences = _fences(plan, graph, folded, pins)
      with jx.shard_maps_on(mesh):  # a user's shard_map: on the step's mesh, or an error
        outs = _interpret(jaxpr, consts, jax.tree.leaves(flat), (), pins, {}, remat, fences=fences)
      if fences is not None:
        outs = fences.read(outs)
      # The next state stays where its input is stored, so the next step moves nothing.
      flat_in = jax.tree.leaves(step.shardings)
      for k, j in graph.carried:
        outs[k] = jax.lax.with_sharding_constraint(outs[k], flat_in[j])
      return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    # Named as the step: "jit(train_step)" in the compiled program's op names and dumps.
    run.__name__ = run.__qualname__ = getattr(fn, "__name__", "run")
    return jax.jit(run, in_shardings=step.shardings, donate_argnums=self.donate)

  def _laid_out_for(self, step: _Structure, values) -> _LaidOut:
    """The step with the state's layouts left to the compiler, once per structure."""
    if step.laid_out is None:
      if step.traced is None:  # which outputs carry which inputs: `run` records it
        step.jitted.trace(*values)
      step.laid_out = _LaidOut.of(step.jitted.__wrapped__, values, step.shardings,
                                  *step.traced, self.donate)
    return step.laid_out

  def __call__(self, *args, **kwargs):
    values, step = self._prepare(args, kwargs)
    call = step.jitted
    try:
      # Layouts are a compiled program's: inside another trace the default ones hold.
      if self.auto_layouts and not any(jx.is_tracer(x) for x in jax.tree.leaves(values)):
        laid_out = self._laid_out_for(step, values)
        call, values = laid_out.compiled, laid_out.relayout(values)
      return call(*values)
    except ValueError as e:
      found = _committed_elsewhere(step.where, values, step.shardings)
      if found is None:
        raise
      raise ValueError(found) from e

  def lower(self, *args, **kwargs):
    values, step = self._prepare(args, kwargs)
    if self.auto_layouts:
      return self._laid_out_for(step, values).lower()
    return step.jitted.lower(*values)


@dataclasses.dataclass
class _Structure:
  """The step jitted for one structure of arguments."""
  names: tuple[str, ...]  # the keyword arguments, sorted: after the positional ones
  shardings: tuple[Any, ...]  # per argument, the plan's
  where: tuple[str, ...]  # per argument, its name in messages
  jitted: Any = None
  traced: tuple | None = None  # (carried (output, input) leaf pairs, the output tree)
  laid_out: _LaidOut | None = None


@dataclasses.dataclass
class _LaidOut:
  """A step whose carried state the compiler lays out (`Layout.AUTO` in and out): the
  donated inputs of rank 2 and more whose next value the step returns."""
  jitted: Any
  abstract: tuple[Any, ...]
  auto: tuple[int, ...]  # flat input leaves laid out by the compiler

  @classmethod
  def of(cls, run, values, shardings, carried, out_tree, donate) -> _LaidOut:
    flat_in, in_tree = jax.tree.flatten(shardings)
    leaves = jax.tree.leaves(values)
    starts = np.cumsum([0] + [len(jax.tree.leaves(s)) for s in shardings])
    donated = {j for i in donate for j in range(starts[i], starts[i + 1])}
    pairs = [(k, j) for k, j in carried if j in donated and getattr(leaves[j], "ndim", 0) > 1]
    formats = list(flat_in)
    outs: list[Any] = [None] * out_tree.num_leaves
    for k, j in pairs:
      formats[j] = outs[k] = Format(Layout.AUTO, flat_in[j])
    auto = tuple(sorted({j for _, j in pairs}))
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=flat_in[j],
                                     weak_type=getattr(x, "weak_type", False))
                if j in auto else x for j, x in enumerate(leaves)]
    jitted = jax.jit(run, in_shardings=jax.tree.unflatten(in_tree, formats),
                     out_shardings=jax.tree.unflatten(out_tree, outs),
                     donate_argnums=donate)
    return cls(jitted, tuple(jax.tree.unflatten(jax.tree.structure(values), abstract)), auto)

  def lower(self):
    return self.jitted.lower(*self.abstract)

  @functools.cached_property
  def compiled(self):
    return self.lower().compile()

  def relayout(self, values: tuple) -> tuple:
    """The state put into the compiled layouts where it is elsewhere (the first call); an
    array on other shardings is left for the call to refuse, naming it."""
    leaves, tree = jax.tree.flatten(values)
    want = jax.tree.leaves(self.compiled.input_formats[0])
    for j in self.auto:
      x, fmt = leaves[j], want[j]
      if not isinstance(x, jax.Array):
        leaves[j] = jax.device_put(x, fmt)
      elif (x.format.layout != fmt.layout
            and x.sharding.is_equivalent_to(fmt.sharding, x.ndim)):
        leaves[j] = jax.device_put(x, fmt, donate=True)
    return jax.tree.unflatten(tree, leaves)


def _as_searched(fn, plan: planlib.Plan, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
  """The call's arguments split into positional and keyword ones as the plan was
  searched, where `fn`'s signature says how (`step(state, batch=b)` for a plan of
  `step(state, batch)`, and the reverse), as `jax.jit` accepts both; else unchanged."""
  n, names = len(plan.in_specs), sorted(plan.kwargs_specs)
  if len(args) == n and sorted(kwargs) == names:
    return args, kwargs
  try:
    sig = inspect.signature(fn)
    bound = sig.bind(*args, **kwargs)
  except (TypeError, ValueError):
    return args, kwargs
  params = list(sig.parameters.values())
  if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params
         if p.name in bound.arguments):
    return args, kwargs
  positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY,
                                                     p.POSITIONAL_OR_KEYWORD)][:n]
  if len(positional) < n or any(name not in bound.arguments for name in positional):
    return args, kwargs
  rest = {k: v for k, v in bound.arguments.items() if k not in positional}
  if sorted(rest) != names or any(sig.parameters[k].kind == inspect.Parameter.POSITIONAL_ONLY
                                  for k in rest):
    return args, kwargs
  return tuple(bound.arguments[name] for name in positional), rest


def _committed_elsewhere(names: Sequence[str], values: Sequence[Any],
                         shardings: Sequence[Any]) -> str | None:
  """Names the first argument leaf committed to another sharding than the plan's."""
  for where, value, tree in zip(names, values, shardings):
    leaves = jax.tree_util.tree_flatten_with_path(value)[0]
    for (path, leaf), want in zip(leaves, jax.tree.leaves(tree)):
      have = getattr(leaf, "sharding", None)
      if have is None or not getattr(leaf, "committed", False):
        continue
      if not have.is_equivalent_to(want, leaf.ndim):
        name = tracelib.key_path_str(path) or "(the whole argument)"
        return (f"apply: {where} at path '{name}' is committed to {have}, but the plan "
                f"stores it as {want.spec} on mesh {dict(want.mesh.shape)}. Put the "
                "arguments where the plan wants them first: args = tapas.place(plan, "
                "*args) (with kwargs=... for keyword arguments), or pass uncommitted "
                "arrays.")
  return None


def _fences(plan: planlib.Plan, graph, folded, pins: Mapping) -> fencelib.Fences | None:
  """The order the plan's memory figures assume for the layers' backward, or None."""
  if not plan.gradient_fences:
    return None
  def summed(v: int) -> bool:  # read only by sums: reduced after them, past the fence
    readers = graph.consumers.get(v, ())
    return bool(readers) and all(ruleslib.facts(graph.ops[r].primitive).sums
                                 for r in readers)
  fences = fencelib.Fences(graph, folded, pins,
                           left_out=summed if plan.sums_past_fences else lambda v: False)
  return fences if fences.at else None


def _check_program(plan: planlib.Plan, graph, in_mesh_context: bool = True) -> None:
  if graph.regions[0].fingerprint == plan.fingerprint:
    return
  here = tuple((i.path, str(graph.types[i.value])) for i in graph.inputs)
  what = "the function or its static options differ"
  if plan.input_types and here != plan.input_types:
    k = next((k for k, (a, b) in enumerate(zip(here, plan.input_types)) if a != b),
             min(len(here), len(plan.input_types)))
    if k >= len(here) or k >= len(plan.input_types):
      what = f"it has {len(here)} input leaves, the plan {len(plan.input_types)}"
    else:
      (path, ttype), (want_path, want_type) = here[k], plan.input_types[k]
      what = (f"input {k} is '{path}' {ttype} here, '{want_path}' {want_type} in the plan"
              if path != want_path else f"input '{path}' is {ttype} here, {want_type} in "
              "the plan")
  raise ValueError(
      f"apply: plan {plan.name!r} was searched for another program: {what} (fingerprint "
      f"{plan.fingerprint}, this one {graph.regions[0].fingerprint}). Search again with "
      "tapas.search(fn, *args, mesh=...) on what you run" + (
          "" if in_mesh_context else "; or, if it was searched inside "
          "`with jax.set_mesh(mesh):`, apply (or verify) it there too: JAX traces a step "
          "inside a mesh context differently") + ".")


def _interpret(jaxpr, consts, args, site: tuple, pins: Mapping, memo: dict,
               remat: "_Recompute | None" = None, given: Mapping | None = None,
               fences: fencelib.Fences | None = None) -> list[Any]:
  """Evaluates a jaxpr, pinning the operands `pins` names; inlines call-like equations
  exactly as `trace` does, so equation sites match `Op.site`. With `remat`, backward
  equations of rematerialised layers read recomputed forward values, and the loops of
  rematerialised scanned stacks run rematerialised; a scan whose body holds pins (a
  stacked parameter gathered one layer per iteration) runs its body re-interpreted.
  `given`: site -> the outputs of the equation there, used instead of running it (saved
  values a recomputation reads). With `fences`, each layer's backward hands its results
  on only once the layer after it has made its own (`tapas_jax.fences`)."""
  env: dict = {}

  def read(atom):
    return jx.literal_value(atom) if jx.is_literal(atom) else env[atom]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for here, eqn, _, call in jx.walk_eqns(jaxpr, site):  # as `trace` walks it
    invals = [read(a) for a in eqn.invars]
    if fences is not None:
      invals = fences.read(invals)
    if remat is not None:  # before the pins: a recomputed copy is read pinned too
      invals = remat.read(here, eqn, invals)
    for slot, sharding in pins.get(here, ()):
      invals[slot] = _pinned(invals[slot], sharding, memo)
    loop = remat.loop(here) if remat is not None else None
    if given and here in given:
      outs = given[here]
    elif call is None and loop is None and not _pins_inside(eqn, here, pins):
      outs = jx.bind_eqn(eqn, invals)
    else:
      with jx.source_of(eqn):  # what runs in its place is named as it is
        outs = _rerun(eqn, invals, here, call, loop, pins, memo, remat, given, fences)
    env.update(zip(eqn.outvars, outs))
    if fences is not None:
      fences.made(here, outs)
  return [read(a) for a in jaxpr.outvars]


def _rerun(eqn, invals, here, call, loop, pins, memo, remat, given, fences) -> list[Any]:
  """What `_interpret` runs in an equation's place: a rematerialised loop, a scan with
  pins in its body, or a call inlined (a user's checkpoint behind a barrier)."""
  if loop is not None:
    return loop.run(here, eqn, invals)
  if call is None or _pins_inside(eqn, here, pins):
    return _scan(eqn, invals, here, pins)
  key, idx, sub = call
  body, body_consts = jx.open_jaxpr(sub)
  if jx.is_recompute_barrier(eqn):
    # Without the barrier JAX lowers a differentiated checkpoint behind, XLA would merge
    # the recomputation with the forward it repeats: the user's memory saving lost.
    invals = _barrier(invals)
  return _interpret(body, body_consts, invals, here + (key, idx), pins, memo, remat,
                    given, fences)


def _pins_inside(eqn, site: tuple, pins: Mapping) -> bool:
  """Whether a scan's body holds pinned operands (a stacked parameter gathered there,
  one layer per iteration, rather than the whole stack before the loop)."""
  body = site + ("jaxpr", 0)
  return ("jaxpr" in eqn.params and "length" in eqn.params
          and jx.scan_counts(eqn.params) is not None
          and any(k[:len(body)] == body for k in pins))


def _scan(eqn, invals: list[Any], site: tuple, pins: Mapping) -> list[Any]:
  """A scan run with `jax.lax.scan` on its own body, re-interpreted with the pins."""
  counts = jx.scan_counts(eqn.params)
  nc, ncarry = counts.num_consts, counts.num_carry
  body, body_consts = jx.open_jaxpr(eqn.params["jaxpr"])
  consts = invals[:nc]

  def step(carry, x):
    outs = _interpret(body, body_consts, list(consts) + list(carry) + list(x),
                      site + ("jaxpr", 0), pins, {})
    return list(outs[:ncarry]), list(outs[ncarry:])

  carry, ys = jax.lax.scan(step, list(invals[nc:nc + ncarry]), list(invals[nc + ncarry:]),
                           length=eqn.params["length"], reverse=eqn.params["reverse"])
  return list(carry) + list(ys)


def _barrier(values: list[Any]) -> list[Any]:
  """`values` through one `jax.lax.optimization_barrier` (arrays only; literals and
  Python scalars pass as they are), as JAX lowers a differentiated checkpoint."""
  arrays = [k for k, v in enumerate(values) if isinstance(v, jax.Array) or jx.is_tracer(v)]
  out = list(values)
  for k, v in zip(arrays, jax.lax.optimization_barrier([values[k] for k in arrays])):
    out[k] = v
  return out


def _pinned(value, sharding: NamedSharding, memo: dict):
  # One constraint per value and layout: every reader shares the gathered copy.
  key = (id(value), sharding.spec)
  if key not in memo:
    memo[key] = (value, jax.lax.with_sharding_constraint(value, sharding))
  return memo[key][1]


class _Recompute:
  """The plan's rematerialisation, done while the program is re-interpreted.

  The program already holds its backward pass, so `jax.checkpoint` cannot be wrapped
  around a layer any more; this does what its partial evaluation would have done. Each
  forward equation a rematerialised layer recomputes is remembered as it runs (with
  the values it read); at the layer's first backward read of such a value, the
  equations run again on the saved values they read, and the backward reads the new
  copies. As `jax.checkpoint(prevent_cse=True)` does, the saved values pass through
  `jax.lax.optimization_barrier` first, so XLA cannot merge the copies with the
  originals (which would undo the remat); the barrier also takes the backward
  equation's other operands (the cotangent), so the recomputation cannot start before
  the backward reaches the layer.
  """

  def __init__(self, graph, remats, pins, scans=()):
    self.graph, self.remats, self.pins = graph, remats, pins
    self.loops: dict[tuple, _ScanRecompute] = {}
    for r, region in scans:
      s = _ScanRecompute(graph, r, region, pins)
      self.loops[graph.ops[r.forward].site] = self.loops[graph.ops[r.backward].site] = s
    self.capture = {graph.ops[i].site: i for r in remats for i in r.recompute}
    self.readers: dict[tuple, tuple[int, list[tuple[int, int]]]] = {}
    for k, r in enumerate(remats):
      for b, slot in r.reads + r.param_reads:
        self.readers.setdefault(graph.ops[b].site, (k, []))[1].append(
            (slot, graph.ops[b].inputs[slot]))
    self.params = [set(r.params) for r in remats]
    self.seen: dict[int, tuple[Any, list[Any]]] = {}
    self.done: dict[int, dict[int, Any]] = {}
    # Per instance, id of a parameter as stored -> its copy behind the barrier: read by
    # the recomputation and the backward alike, so pinned it is gathered once more
    # there, not kept gathered from the forward (`InstanceRemat.params`).
    self.kept: dict[int, dict[int, Any]] = {}

  @classmethod
  def of(cls, plan: planlib.Plan, graph, folded, pins) -> "_Recompute | None":
    if not plan.remat:
      return None
    names = {u.name: u.index for u in folded.unique_layers}
    remats = []
    for layer, policy in plan.remat:
      if layer not in names:
        raise ValueError(f"apply: plan {plan.name!r} rematerialises layer {layer!r}, but "
                         f"this program's unique layers are {sorted(names)}. Search again "
                         "on this program.")
      remats += solver.layer_remats(folded, names[layer], policy)
    scans = [r for r in remats if isinstance(r, solver.ScanRemat)]
    return cls(graph, [r for r in remats if r not in scans], pins,
               [(r, solver.scan_region(graph, graph.ops[r.forward])) for r in scans])

  def loop(self, site: tuple) -> "_ScanRecompute | None":
    """The rematerialised scanned stack whose forward or backward loop sits here."""
    return self.loops.get(site)

  def read(self, site: tuple, eqn, invals: list[Any]) -> list[Any]:
    """The operands an equation reads: recomputed copies where the plan says so."""
    if site in self.capture:
      self.seen[self.capture[site]] = (eqn, list(invals))
    if site not in self.readers:
      return invals
    k, switched = self.readers[site]
    invals = list(invals)
    mine = {slot for slot, _ in switched}
    others = [j for j, x in enumerate(invals) if j not in mine and isinstance(x, jax.Array)]
    if k not in self.done:
      copies, anchors = self._recompute(k, [invals[j] for j in others])
      self.done[k] = copies
      for j, x in zip(others, anchors):
        invals[j] = x
    kept = self.kept[k]
    fresh = {id(invals[slot]): invals[slot] for slot, v in switched
             if v in self.params[k] and id(invals[slot]) not in kept}
    if fresh:  # parameters the recomputation did not read: behind a barrier here
      copies, anchors = jax.lax.optimization_barrier(
          (list(fresh.values()), [invals[j] for j in others]))
      kept.update(zip(fresh, copies))
      for j, x in zip(others, anchors):
        invals[j] = x
    for slot, v in switched:
      invals[slot] = kept[id(invals[slot])] if v in self.params[k] else self.done[k][v]
    return invals

  def _recompute(self, k: int, anchors: list[Any]) -> tuple[dict[int, Any], list[Any]]:
    g, r = self.graph, self.remats[k]
    mine = set(r.recompute)
    saved: dict[int, Any] = {}
    for p in r.recompute:
      _, vals = self.seen[p]
      for v, x in zip(g.ops[p].inputs, vals):
        if g.producer.get(v) not in mine and isinstance(x, jax.Array):
          saved.setdefault(id(x), x)
    kept, anchors = jax.lax.optimization_barrier((list(saved.values()), list(anchors)))
    kept = dict(zip(saved, kept))
    self.kept[k] = kept
    copies: dict[int, Any] = {}
    for p in r.recompute:
      eqn, vals = self.seen[p]
      op = g.ops[p]
      ins = [copies[v] if g.producer.get(v) in mine else kept.get(id(x), x)
             for v, x in zip(op.inputs, vals)]
      for slot, sharding in self.pins.get(op.site, ()):
        ins[slot] = jax.lax.with_sharding_constraint(ins[slot], sharding)
      outs = (_scan(eqn, ins, op.site, self.pins) if _pins_inside(eqn, op.site, self.pins)
              else jx.bind_eqn(eqn, ins))  # a loop reruns as it ran: pinned inside
      copies.update(zip(op.outputs, outs))
    return copies, list(anchors)


class _ScanRecompute:
  """One scanned stack's rematerialisation (`solver.ScanRemat`), done on its two
  loops as `jax.checkpoint` around the scan's body would have done it.

  The forward loop runs its body as before but writes out only the residuals kept (and
  the carries the recomputation reads, stacked); the backward loop's body first runs
  the forward body again on its iteration's slice of what was kept, the kept residuals
  standing in for the equations that made them, and reads the dropped residuals from
  there. Each loop is run with `jax.lax.scan` on the same body jaxprs, so the numbers
  are the program's own.
  """

  def __init__(self, graph, r, region, pins: Mapping):
    self.graph, self.r, self.region, self.pins = graph, r, region, pins
    self.f_eqn = None
    self.forward_site = graph.ops[r.forward].site
    self.backward_site = graph.ops[r.backward].site
    # The forward loop's operands and stacked carries, for the backward's recompute.
    self.consts, self.xs, self.init, self.stacked = [], [], [], []

  def run(self, site: tuple, eqn, invals: list[Any]) -> list[Any]:
    if site == self.forward_site:
      return self._forward(eqn, invals)
    return self._backward(eqn, invals)

  @staticmethod
  def _parts(eqn):
    counts = jx.scan_counts(eqn.params)
    body, body_consts = jx.open_jaxpr(eqn.params["jaxpr"])
    return counts.num_consts, counts.num_carry, body, body_consts

  def _forward(self, eqn, invals):
    nc, ncarry, body, body_consts = self._parts(eqn)
    self.f_eqn = eqn
    self.consts, self.init = invals[:nc], invals[nc:nc + ncarry]
    self.xs = invals[nc + ncarry:]
    dropped = {s for _, s in self.r.dropped}
    keep = [s for s in range(ncarry, len(eqn.outvars)) if s not in dropped]
    consts, carries = self.consts, self.r.carries

    def step(carry, x):
      outs = _interpret(body, body_consts, list(consts) + list(carry) + list(x),
                        self.forward_site + ("jaxpr", 0), self.pins, {})
      return list(outs[:ncarry]), [outs[s] for s in keep] + [carry[c] for c in carries]

    carry, ys = jax.lax.scan(step, list(self.init), list(self.xs),
                             length=eqn.params["length"], reverse=eqn.params["reverse"])
    self.stacked = ys[len(keep):]
    outs: list[Any] = list(carry) + [None] * (len(eqn.outvars) - ncarry)
    for s, y in zip(keep, ys):
      outs[s] = y
    return outs

  def _backward(self, eqn, invals):
    g, r = self.graph, self.r
    nc, ncarry, body, body_consts = self._parts(eqn)
    fnc, fncarry, fbody, fbody_consts = self._parts(self.f_eqn)
    fr = self.region
    carry_in = fr.inputs[fnc:fnc + fncarry]
    consts, xs = invals[:nc], invals[nc + ncarry:]
    fconsts, fxs, init, stacked = self.consts, self.xs, self.init, self.stacked
    # An operand both loops read is taken as the backward reads it (a recomputed copy
    # where the layer around the loop is rematerialised too): the forward's own copy
    # need not live until the backward.
    fop, bop = g.ops[r.forward], g.ops[r.backward]
    mine = {v: invals[j] for j, v in enumerate(bop.inputs) if v not in g.literals}
    fin = [mine.get(v, x) for v, x in zip(fop.inputs, list(fconsts) + list(init) + list(fxs))]
    fconsts, fxs = fin[:fnc], fin[fnc + fncarry:]
    kept = [j for j, _ in r.kept]
    # Saved values the recomputation reads: the kept residuals' slices, standing in for
    # the body equations (or the body inputs) that made them.
    kept_values = {fr.outputs[s]: n for n, (_, s) in enumerate(r.kept)}
    dropped = [(j, s) for j, s in r.dropped]

    def step(carry, x):
      bx, fx, kx, cx = x
      fin_carry = []
      for c, v in enumerate(carry_in):
        if c in r.carries:
          fin_carry.append(cx[r.carries.index(c)])
        elif v in kept_values:
          fin_carry.append(kx[kept_values[v]])
        else:  # not read by anything recomputed
          fin_carry.append(jax.numpy.zeros_like(init[c]))
      given = {}
      for v, n in kept_values.items():
        p = g.producer.get(v)
        if p is not None and g.ops[p].region == fr.index and len(g.ops[p].outputs) == 1:
          given[g.ops[p].site] = [kx[n]]
      fouts = _interpret(fbody, fbody_consts, list(fconsts) + fin_carry + list(fx),
                         self.forward_site + ("jaxpr", 0), self.pins, {}, given=given)
      xs_in = list(bx)
      for j, s in dropped:
        xs_in[j - nc - ncarry] = fouts[s]
      outs = _interpret(body, body_consts, list(consts) + list(carry) + xs_in,
                        self.backward_site + ("jaxpr", 0), self.pins, {})
      return list(outs[:ncarry]), list(outs[ncarry:])

    bx = [None if j + nc + ncarry in {d for d, _ in dropped} else x
          for j, x in enumerate(xs)]
    kx = [invals[j] for j in kept]
    # The dropped slots travel as zero-size placeholders: scan wants arrays.
    placeholder = jax.numpy.zeros((eqn.params["length"], 0))
    bx = [placeholder if x is None else x for x in bx]
    carry, ys = jax.lax.scan(step, list(invals[nc:nc + ncarry]),
                             (bx, list(fxs), kx, list(stacked)),
                             length=eqn.params["length"], reverse=eqn.params["reverse"])
    return list(carry) + list(ys)


def remat_policy(plan: planlib.Plan, layer: str):
  """The `jax.checkpoint` policy a plan gives a unique layer, or None (no remat).

  `tapas.apply` already rematerialises the plan's layers in the program it runs; this
  is for building a model with the plan's choice yourself (`nn.remat(Block,
  policy=...)`, `jax.checkpoint(f, policy=...)`).

  Example:
    >>> import jax.numpy as jnp
    >>> import tapas_jax as tapas
    >>> plan = tapas.search(lambda w, x: jnp.sum(x @ w), jnp.ones((8, 8)),
    ...                     jnp.ones((64, 8)), mesh={"data": 8}, device="cpu")
    >>> print(tapas.remat_policy(plan, "Block"))  # no budget: no remat
    None
  """
  policy = dict(plan.remat).get(layer)
  return None if policy is None else getattr(jax.checkpoint_policies, policy)


def place_as_planned(tree: Any, shardings: Any) -> Any:
  """Concrete arrays moved to their planned sharding (jit refuses a committed array in
  another one); tracers, scalars and abstract values pass: jit's in_shardings take them.

  Example:
    >>> import jax.numpy as jnp
    >>> s = NamedSharding(make_mesh({"data": 8}), PartitionSpec("data"))
    >>> place_as_planned({"x": jnp.ones(16)}, {"x": s})["x"].sharding == s
    True
  """
  def move(x, s):
    if isinstance(x, jax.Array) and not jx.is_tracer(x) and \
        not x.sharding.is_equivalent_to(s, x.ndim):
      return jax.device_put(x, s)
    return x
  return jax.tree.map(move, tree, shardings)
