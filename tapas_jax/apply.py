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

from typing import Any, Callable, Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from tapas_jax import _jax_internals as jx
from tapas_jax import plan as planlib
from tapas_jax import trace as tracelib
from tapas_jax.mesh import MeshError, check_auto, make_mesh

__all__ = ["apply", "place"]


def _mesh_for(plan: planlib.Plan, mesh: Any) -> jax.sharding.Mesh:
  if mesh is None:
    return make_mesh(dict(plan.mesh_axes))
  check_auto(mesh)
  axes = {str(k): int(v) for k, v in dict(mesh.shape).items()}
  if axes != dict(plan.mesh_axes):
    raise MeshError(f"apply: the plan was searched for mesh {dict(plan.mesh_axes)}, but "
                    f"the mesh given has axes {axes}. Search again on this mesh, or pass "
                    "a mesh with the plan's axis names and sizes.")
  return mesh


def _shardings(plan: planlib.Plan, mesh) -> tuple[Any, ...]:
  is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
  return tuple(jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)
               for specs in plan.in_specs)


def place(plan: planlib.Plan, *args: Any, mesh: Any = None) -> tuple[Any, ...]:
  """Puts each argument where the plan wants it (`jax.device_put` per leaf).

  Args:
    plan: from `tapas.search` or a baseline.
    *args: the arrays, one pytree per positional argument, as searched.
    mesh: a `jax.sharding.Mesh` with the plan's axes; default: `make_mesh` of them.

  Returns:
    The placed arguments, as a tuple.
  """
  mesh = _mesh_for(plan, mesh)
  if len(args) != len(plan.in_specs):
    raise ValueError(f"place: the plan has specs for {len(plan.in_specs)} positional "
                     f"arguments, got {len(args)}")
  return tuple(jax.device_put(a, s) for a, s in zip(args, _shardings(plan, mesh)))


def apply(plan: planlib.Plan, fn: Callable[..., Any], *, mesh: Any = None,
          donate_argnums: int | Sequence[int] = ()) -> Callable[..., Any]:
  """`fn` jitted to run as the plan says.

  Args:
    plan: from `tapas.search` (or a baseline) for this `fn` and these argument shapes.
    fn: the function searched, e.g. `train_step(state, batch)`.
    mesh: a `jax.sharding.Mesh` (Auto axes) with the plan's axes; default: `make_mesh`
      of them over the local devices.
    donate_argnums: passed to `jax.jit` (donate the state to update it in place).

  Returns:
    A `jax.jit`-wrapped function with `fn`'s signature (and `.lower`). Arguments of
    another structure, or a program other than the one searched, raise ValueError.
    Calls to `jax.jit`-ed and `custom_jvp`/`custom_vjp` functions inside `fn` are
    evaluated inline (that is how constraints reach into them), so apply the step you
    run, with its gradients taken inside it, rather than differentiating the result.

  Raises:
    MeshError: the mesh has other axes than the plan, or Explicit axes.
  """
  mesh = _mesh_for(plan, mesh)
  pins: dict[tuple, list[tuple[int, NamedSharding]]] = {}
  for c in plan.constraints:
    pins.setdefault(tuple(c.site), []).append((c.slot, NamedSharding(mesh, c.spec)))
  in_shardings = _shardings(plan, mesh)

  def run(*args):
    # The jaxpr of the abstract arguments, exactly as `search` traced it (real arrays
    # may carry weak types that would add or drop equations and shift every site).
    graph, closed, out_shape = tracelib.trace_with_jaxpr(fn, *args)
    _check_program(plan, graph)
    jaxpr, consts = jx.open_jaxpr(closed)
    outs = _interpret(jaxpr, consts, jax.tree.leaves(args), (), pins, {})
    # The next state stays where its input is stored, so the next step moves nothing.
    flat_in = jax.tree.leaves(in_shardings)
    for k, j in graph.carried:
      outs[k] = jax.lax.with_sharding_constraint(outs[k], flat_in[j])
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  jitted = jax.jit(run, in_shardings=in_shardings, donate_argnums=donate_argnums)
  return _Applied(plan, jitted)


class _Applied:
  """The jitted step, with the arguments' structure checked against the plan first
  (jit's own message for a mismatch does not say which plan or what to do)."""

  def __init__(self, plan: planlib.Plan, jitted):
    self.plan, self.jitted = plan, jitted

  def _check(self, args) -> None:
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    if len(args) != len(self.plan.in_specs):
      raise ValueError(f"apply: plan {self.plan.name!r} was searched for another program "
                       f"with {len(self.plan.in_specs)} positional arguments; got "
                       f"{len(args)}. Search again on what you run.")
    for i, (arg, specs) in enumerate(zip(args, self.plan.in_specs)):
      want = jax.tree.structure(specs, is_leaf=is_spec)
      if jax.tree.structure(arg) != want:
        raise ValueError(
            f"apply: plan {self.plan.name!r} was searched for another program: argument "
            f"{i} has pytree structure {jax.tree.structure(arg)}, the plan has specs for "
            f"{want}. Search again with tapas.search(fn, *args, mesh=...) on what you run.")

  def __call__(self, *args):
    self._check(args)
    return self.jitted(*args)

  def lower(self, *args):
    self._check(args)
    return self.jitted.lower(*args)


def _check_program(plan: planlib.Plan, graph) -> None:
  if graph.regions[0].fingerprint != plan.fingerprint:
    raise ValueError(
        f"apply: plan {plan.name!r} was searched for another program (fingerprint "
        f"{plan.fingerprint}, this one {graph.regions[0].fingerprint}): the function, "
        "its argument shapes or dtypes, or its static options differ. Search again with "
        "tapas.search(fn, *args, mesh=...) on what you run.")


def _interpret(jaxpr, consts, args, site: tuple, pins: Mapping, memo: dict) -> list[Any]:
  """Evaluates a jaxpr, pinning the operands `pins` names; inlines call-like equations
  exactly as `trace` does, so equation sites match `Op.site`."""
  env: dict = {}

  def read(atom):
    return jx.literal_value(atom) if jx.is_literal(atom) else env[atom]

  env.update(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for i, eqn in enumerate(jaxpr.eqns):
    here = site + (i,)
    invals = [read(a) for a in eqn.invars]
    for slot, sharding in pins.get(here, ()):
      invals[slot] = _pinned(invals[slot], sharding, memo)
    subs = list(jx.sub_jaxprs(eqn))
    if len(subs) == 1 and tracelib.is_call_like(eqn, subs[0][2]):
      key, idx, sub = subs[0]
      body, body_consts = jx.open_jaxpr(sub)
      outs = _interpret(body, body_consts, invals, here + (key, idx), pins, memo)
    else:
      outs = jx.bind_eqn(eqn, invals)
    env.update(zip(eqn.outvars, outs))
  return [read(a) for a in jaxpr.outvars]


def _pinned(value, sharding: NamedSharding, memo: dict):
  # One constraint per value and layout: every reader shares the gathered copy.
  key = (id(value), sharding.spec)
  if key not in memo:
    memo[key] = (value, jax.lax.with_sharding_constraint(value, sharding))
  return memo[key][1]
