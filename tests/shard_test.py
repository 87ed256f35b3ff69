"""tapas.shard: jax.jit with a searched plan, on functions and flax module classes.

Functions: keyword arguments, static and donated arguments, `.lower`, a plan searched
once per abstract signature. Modules: parameters made sharded (never whole on one
device), training through a sharded step gives the unsharded losses, optimizer state
follows the parameters' shardings.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import tapas_jax as tapas
from tapas_jax import api, models, shard_flax, solver
from tapas_jax.models import gpt_nnx
from tapas_jax.shard import default_mesh

MESH = {"data": 2, "model": 4}


@pytest.fixture
def searches(monkeypatch):
  """Counts calls of tapas.search (every plan shard makes goes through it)."""
  calls = []
  real = api.search

  def counting(fn, *args, **kwargs):
    calls.append(kwargs.get("mesh"))
    return real(fn, *args, **kwargs)

  monkeypatch.setattr(api, "search", counting)
  return calls


def sgd_step(w, x, *, act="tanh", lr=0.1):
  """One SGD step of a two-matrix model on a quadratic loss."""
  def loss(w):
    h = {"tanh": jnp.tanh, "relu": jax.nn.relu}[act](x @ w["a"])
    return jnp.mean((h @ w["b"]) ** 2)
  value, grads = jax.value_and_grad(loss)(w)
  return jax.tree.map(lambda p, g: p - lr * g, w, grads), value


def weights(key, d=64, h=128):
  k1, k2 = jax.random.split(key)
  return {"a": jax.random.normal(k1, (d, h)) / 8, "b": jax.random.normal(k2, (h, d)) / 8}


# -- functions -----------------------------------------------------------------------


def test_function_matches_jit_with_keywords_statics_and_donation(searches):
  step = tapas.shard(sgd_step, mesh=MESH, device="cpu", static_argnames="act",
                     donate_argnums=0)
  ref = jax.jit(sgd_step, static_argnames="act")
  w, x = weights(jax.random.key(0)), jax.random.normal(jax.random.key(1), (256, 64))
  w_ref, w_run = w, jax.tree.map(jnp.copy, w)
  for _ in range(3):
    w_ref, loss_ref = ref(w_ref, x, act="tanh", lr=0.05)
    donated = w_run
    w_run, loss = step(w_run, x, act="tanh", lr=0.05)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
  assert len(searches) == 1, "one abstract signature: one search"
  for a, b in zip(jax.tree.leaves(w_run), jax.tree.leaves(w_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # Donated: the input buffers were given to the step (placed where the plan wanted).
  assert all(leaf.is_deleted() for leaf in jax.tree.leaves(donated))
  # A static value is part of the signature: a new plan, and the other activation.
  _, relu_loss = step(w_run, x, act="relu", lr=0.05)
  _, relu_ref = ref(w_ref, x, act="relu", lr=0.05)
  np.testing.assert_allclose(relu_loss, relu_ref, rtol=1e-5)
  assert len(searches) == 2


def test_plan_is_cached_per_abstract_signature(searches):
  step = tapas.shard(sgd_step, mesh=MESH, device="cpu")
  w = weights(jax.random.key(0))
  small, big = jnp.ones((64, 64)), jnp.ones((512, 64))
  plan = step.plan_for(w, small)
  assert step.plan_for(w, x=small) is plan, "a keyword binds to the same parameter"
  assert step.plan_for(jax.eval_shape(lambda: w), jax.ShapeDtypeStruct((64, 64),
                                                                       jnp.float32)) is plan
  assert step.plan_for(w, small, lr=0.5) is step.plan_for(w, small, lr=0.1)
  assert len(searches) == 2  # without and with lr: one more dynamic argument
  bigger = step.plan_for(w, big)
  assert bigger is not plan and len(searches) == 3
  assert len(plan.in_specs) == 2 and len(step.plan_for(w, small, lr=0.1).in_specs) == 3
  step(w, big)
  assert step.plan is bigger and len(searches) == 3


def test_lower_compiles_the_planned_program():
  step = tapas.shard(sgd_step, mesh=MESH, device="cpu", static_argnames="act")
  w = jax.eval_shape(lambda: weights(jax.random.key(0)))
  x = jax.ShapeDtypeStruct((1024, 64), jnp.float32)
  compiled = step.lower(w, x, act="relu").compile()
  plan = step.plan
  mesh = tapas.make_mesh(MESH)
  want = jax.tree.map(lambda s: NamedSharding(mesh, s), plan.in_specs,
                      is_leaf=lambda s: isinstance(s, P))
  got = compiled.input_shardings[0]
  for g, s, a in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves((w, x))):
    assert g.is_equivalent_to(s, len(a.shape)), (g, s)
  assert any(s != P() and any(s) for s in jax.tree.leaves(
      plan.in_specs, is_leaf=lambda s: isinstance(s, P))), "something is split"


def test_every_search_option_reaches_the_search(monkeypatch):
  seen = {}
  real_build, real_solve = solver.build_problem, solver.solve

  def build(graph, mesh, profile, batch_axes, **kw):
    seen.update(batch_axes=batch_axes, links=mesh.axis_links, device=profile.name,
                sequence_cuts=kw["sequence_cuts"],
                unfolded=kw["view"] == solver.unfolded_view(graph))
    return real_build(graph, mesh, profile, batch_axes, **kw)

  def solve(problem, **kw):
    seen.update({k: kw[k] for k in ("reuse", "solver", "time_limit", "memory_budget")})
    return real_solve(problem, **kw)

  monkeypatch.setattr(solver, "build_problem", build)
  monkeypatch.setattr(solver, "solve", solve)
  step = tapas.shard(sgd_step, mesh=MESH, device="h100", memory_budget="1GiB",
                     batch_axes="data", fold=False, solver="ilp", time_limit=30.0,
                     links={"data": "inter", "model": "intra"}, sequence_parallel=False)
  w, x = weights(jax.random.key(0)), jax.random.normal(jax.random.key(1), (32, 64))
  got = step(w, x)
  assert seen == dict(batch_axes=("data",), links=("inter", "intra"), device="h100",
                      sequence_cuts=False, unfolded=True, reuse=False, solver="ilp",
                      time_limit=30.0, memory_budget=2.0**30)
  assert step.plan.stats.solver_status == "optimal"
  want = sgd_step(w, x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_mesh_from_context_else_default(searches):
  f = tapas.shard(lambda w, x: jnp.sum(jnp.tanh(x @ w)), device="cpu")
  w, x = jnp.ones((64, 64)), jnp.ones((256, 64))
  f(w, x)
  assert dict(f.plan.mesh_axes) == {"data": 4, "model": 2}
  assert dict(default_mesh().shape) == {"data": 4, "model": 2}
  with jax.set_mesh(tapas.make_mesh({"data": 8})):
    np.testing.assert_allclose(f(w, x), jnp.sum(jnp.tanh(x @ w)), rtol=1e-6)
  assert dict(f.plan.mesh_axes) == {"data": 8}
  assert len(searches) == 2, "another mesh, another plan"


def test_composes_with_grad_and_jit():
  f = tapas.shard(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2), mesh=MESH, device="cpu")
  g = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)  # noqa: E731
  w = jax.random.normal(jax.random.key(0), (64, 64)) / 8
  x = jax.random.normal(jax.random.key(1), (256, 64))
  ref = jax.grad(g)(w, x)
  # float32 sums over the batch in another order: tolerance scaled by the gradient.
  np.testing.assert_allclose(jax.grad(f)(w, x), ref, rtol=1e-5,
                             atol=1e-5 * float(jnp.abs(ref).max()))
  np.testing.assert_allclose(jax.jit(f)(w, x), g(w, x), rtol=1e-5)


def test_bare_decorator_and_varargs():
  @tapas.shard
  def total(*arrays, **named):
    return sum(jnp.sum(a) for a in arrays) + sum(jnp.sum(2 * v) for v in named.values())

  out = total(jnp.ones(8), jnp.ones(16), extra=jnp.ones(4))
  assert float(out) == 32.0
  assert len(total.plan.in_specs) == 3


@pytest.mark.parametrize("make,error,match", [
    (lambda: tapas.shard(sgd_step, static_argnames="nope"), ValueError, "name no parameter"),
    (lambda: tapas.shard(sgd_step, loss_fn=len), TypeError, "apply to flax module classes"),
    (lambda: tapas.shard(sgd_step, stattic_argnums=1), TypeError, "unknown option"),
    (lambda: tapas.shard(int), TypeError, "not a flax.linen.Module or flax.nnx.Module"),
    (lambda: tapas.shard(3), TypeError, "expected a function"),
    (lambda: tapas.shard(sgd_step, static_argnums=0, donate_argnums=0), ValueError,
     "both static and donated"),
])
def test_bad_options_say_what_is_wrong(make, error, match):
  with pytest.raises(error, match=match):
    make()


def test_bad_calls_say_what_is_wrong():
  step = tapas.shard(sgd_step, static_argnames="act", device="cpu")
  w, x = weights(jax.random.key(0)), jnp.ones((8, 64))
  with pytest.raises(TypeError, match=r"sgd_step\(w, x.*missing"):
    step(w)
  with pytest.raises(TypeError, match="static argument act of sgd_step must be hashable"):
    step(w, x, act=["tanh"])
  explicit = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  with pytest.raises(tapas.MeshError, match="not AxisType.Auto"):
    tapas.shard(sgd_step, mesh=explicit)
  with pytest.raises(tapas.MeshError, match="need 6 devices"):
    tapas.shard(sgd_step, mesh={"data": 6})
  with pytest.raises(TypeError, match="argument x is not a pytree of arrays.*static"):
    step(w, "tanh")


def test_method_binds_its_instance():
  class Scaled:
    def __init__(self, k):
      self.k = k

    @functools.partial(tapas.shard, static_argnums=0, mesh=MESH, device="cpu")
    def __call__(self, x):
      return self.k * jnp.sum(x)

    def __hash__(self):
      return hash(self.k)

    def __eq__(self, other):
      return self.k == other.k

  assert float(Scaled(3.0)(jnp.ones(16))) == 48.0


# -- flax linen ----------------------------------------------------------------------


class MLP(nn.Module):
  hidden: int = 1024

  @nn.compact
  def __call__(self, x):
    return nn.Dense(64)(nn.relu(nn.Dense(self.hidden)(x)))


def nbytes(tree):
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def assert_split(tree, large=2**18):
  """Every array of `large` bytes or more is stored split: each device holds less."""
  checked = 0
  for leaf in jax.tree.leaves(tree):
    if leaf.nbytes >= large:
      shard_bytes = max(s.data.nbytes for s in leaf.addressable_shards)
      assert shard_bytes < leaf.nbytes, (leaf.shape, leaf.sharding)
      checked += 1
  assert checked, "no large array to check"


@functools.lru_cache(maxsize=None)
def budgeted_linen():
  """A linen MLP sharded under a budget below its replicated params + adam state."""
  x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  params = jax.eval_shape(MLP().init, jax.random.key(0), x)["params"]
  return tapas.shard(MLP, mesh=MESH, device="cpu", memory_budget=2 * nbytes(params))


def test_linen_init_is_sharded_and_never_whole_on_one_device():
  sharded = budgeted_linen()()
  x = jax.random.normal(jax.random.key(1), (64, 64))
  variables = sharded.init(jax.random.key(0), x)
  plan = sharded.plan_for(variables, x)
  full = nbytes(variables["params"])
  assert plan.plan.stats.predicted_memory_bytes <= 2 * full
  assert_split(variables)
  for leaf, want in zip(jax.tree.leaves(variables["params"]), jax.tree.leaves(plan.params)):
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
  # The compiled init neither returns nor builds the parameters whole on a device.
  memory = sharded.lower_init(jax.random.key(0), x).compile().memory_analysis()
  assert memory.output_size_in_bytes < 0.5 * full
  assert memory.temp_size_in_bytes < 0.5 * full
  # Same numbers as the plain module's init.
  plain = MLP().init(jax.random.key(0), x)
  for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(plain)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(sharded.apply(variables, x), MLP().apply(plain, x), rtol=1e-5,
                             atol=1e-6)


def test_linen_trains_through_shard_with_the_unsharded_losses():
  sharded = budgeted_linen()()
  key_x, key_y = jax.random.split(jax.random.key(2))
  x, y = jax.random.normal(key_x, (64, 64)), jax.random.normal(key_y, (64, 64))
  optimizer = optax.sgd(0.05)

  def train_step(params, opt_state, x, y):
    def loss(p):
      return jnp.mean((MLP().apply({"params": p}, x) - y) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  params = sharded.init(jax.random.key(0), x)["params"]
  opt_state = shard_flax.optimizer_state(optimizer, params)
  step = tapas.shard(train_step, mesh=MESH, device="cpu", donate_argnums=(0, 1))
  ref_params = MLP().init(jax.random.key(0), x)["params"]
  ref_state = optimizer.init(ref_params)
  ref = jax.jit(train_step)
  for _ in range(3):
    params, opt_state, loss = step(params, opt_state, x, y)
    ref_params, ref_state, ref_loss = ref(ref_params, ref_state, x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_optimizer_state_follows_param_shardings():
  sharded = budgeted_linen()()
  x = jnp.ones((64, 64))
  params = sharded.init(jax.random.key(0), x)["params"]
  optimizer = optax.adamw(1e-3, weight_decay=0.1)
  for state in (shard_flax.optimizer_state(optimizer, params),  # jitted
                optimizer.init(params)):                        # eager
    mu, nu = state[0].mu, state[0].nu
    for p, m, v in zip(jax.tree.leaves(params), jax.tree.leaves(mu), jax.tree.leaves(nu)):
      assert m.sharding.is_equivalent_to(p.sharding, p.ndim), (m.sharding, p.sharding)
      assert v.sharding.is_equivalent_to(p.sharding, p.ndim)
    assert_split(mu)


def test_linen_module_plan_costs_backward_and_optimizer():
  sharded = budgeted_linen()()
  x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  variables = jax.eval_shape(MLP().init, jax.random.key(0), x)
  plan = sharded.plan_for(variables, x)
  assert len(plan.plan.in_specs) == 4  # params, optimizer state, other variables, input
  assert plan.plan.stats.predicted_state_bytes > 0
  adam_like = jax.tree.leaves(plan.opt_state)
  assert len(adam_like) == 1 + 2 * len(jax.tree.leaves(variables["params"]))


class Norm(nn.Module):
  """Keyword options of __call__ (static) and a mutable collection."""

  @nn.compact
  def __call__(self, x, *, train=False):
    h = nn.Dense(32)(x)
    return nn.BatchNorm(use_running_average=not train)(h)


def test_linen_static_keywords_and_mutable_collections():
  sharded = tapas.shard(Norm, mesh=MESH, device="cpu")()
  x = jax.random.normal(jax.random.key(1), (16, 8))
  variables = sharded.init(jax.random.key(0), x, train=False)
  plain = Norm().init(jax.random.key(0), x, train=False)
  assert set(variables) == {"params", "batch_stats"}
  for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(plain)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(sharded.apply(variables, x, train=False),
                             Norm().apply(plain, x, train=False), rtol=1e-5, atol=1e-6)
  out, stats = sharded.apply(variables, x, train=True, mutable=["batch_stats"])
  ref_out, ref_stats = Norm().apply(plain, x, train=True, mutable=["batch_stats"])
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(ref_stats)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # As in linen, updating a collection not marked mutable is an error, not a no-op.
  with pytest.raises(tapas.TraceError, match="collection \"batch_stats\" is immutable"):
    sharded.apply(variables, x, train=True)
  with pytest.raises(TypeError, match=r"\['method'\] are not supported"):
    sharded.apply(variables, x, method="encode")


def test_linen_plans_for_example_inputs_not_the_init_batch(searches):
  batch = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  sharded = tapas.shard(MLP, mesh=MESH, device="cpu", example_inputs=(batch,))()
  one = jnp.ones((1, 64))
  variables = sharded.init(jax.random.key(0), one)
  assert len(searches) == 1
  plan = sharded.plan_for(variables, batch)
  assert len(searches) == 1, "init planned for example_inputs"
  for leaf, want in zip(jax.tree.leaves(variables["params"]), jax.tree.leaves(plan.params)):
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
  x = jax.random.normal(jax.random.key(1), (64, 64))
  np.testing.assert_allclose(sharded.apply(variables, x),
                             MLP().apply(MLP().init(jax.random.key(0), one), x),
                             rtol=1e-5, atol=1e-6)
  assert len(searches) == 1


def test_module_loss_and_optimizer_can_be_given():
  seen = []

  def loss_fn(outputs, x):
    seen.append((outputs.shape, x.shape))
    return jnp.mean(jnp.abs(outputs - x[:, :64]))

  sharded = tapas.shard(MLP, mesh=MESH, device="cpu", loss_fn=loss_fn,
                        optimizer=optax.sgd(0.1, momentum=0.9))()
  x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
  variables = jax.eval_shape(MLP().init, jax.random.key(0), x)
  plan = sharded.plan_for(variables, x)
  assert seen == [((64, 64), (64, 128))], "the step searched calls the given loss"
  # SGD with momentum keeps one trace per parameter and no step count.
  assert len(jax.tree.leaves(plan.opt_state)) == len(jax.tree.leaves(variables["params"]))
  assert plan.optimizer is not None and sharded.plan_for(variables, x) is plan


def test_zoo_gpt_linen_init_and_apply():
  m = models.get_model("gpt", "tiny")
  module = m.family.make_module(m.config)
  sharded = tapas.shard(type(module), mesh=MESH, device="cpu")(m.config)
  batch = m.make_batch(jax.random.key(1), 8)
  variables = sharded.init(jax.random.key(0), batch["inputs"])
  plain = module.init(jax.random.key(0), batch["inputs"])
  np.testing.assert_allclose(sharded.apply(variables, batch["inputs"]),
                             module.apply(plain, batch["inputs"]), rtol=1e-5, atol=1e-5)
  plan = sharded.plan_for(variables, batch["inputs"])
  for leaf, want in zip(jax.tree.leaves(variables["params"]), jax.tree.leaves(plan.params)):
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
  # apply runs a forward plan that stores everything as the train plan does, and pins
  # the layouts that follow from it inside the call.
  forward = sharded.forward_plan_for(variables, batch["inputs"])
  assert forward.in_specs[0] == plan.plan.in_specs[0]
  assert forward.in_specs[2:] == plan.plan.in_specs[3:]
  assert forward.constraints


def test_a_forward_plan_reads_every_layer_instance_as_the_train_plan_does():
  """Under a budget the train plan stores weights split and gathers them for use; the
  forward plan reads every instance's weights that way, not only the first's (which
  left the others' dimension classes clashing: an infinite predicted step)."""
  m = models.get_model("gpt", "tiny")
  module = m.family.make_module(m.config)
  sharded = tapas.shard(type(module), mesh=MESH, device="cpu", memory_budget="2MiB")(m.config)
  batch = m.make_batch(jax.random.key(1), 8)
  variables = sharded.init(jax.random.key(0), batch["inputs"])
  train = sharded.plan_for(variables, batch["inputs"]).plan
  per_instance = sum(la.instances * len(la.use_specs) for la in train.layers)
  assert per_instance > len([ps for la in train.layers for ps in la.use_specs]), \
      "the case needs a layer of several instances read in another layout"
  assert len(train.use_specs) == per_instance
  forward = sharded.forward_plan_for(variables, batch["inputs"])
  assert np.isfinite(forward.stats.predicted_step_s)
  assert 0 < forward.stats.predicted_step_s < train.stats.predicted_step_s
  np.testing.assert_allclose(sharded.apply(variables, batch["inputs"]),
                             module.apply(module.init(jax.random.key(0), batch["inputs"]),
                                          batch["inputs"]), rtol=1e-5, atol=1e-5)


# -- flax nnx ------------------------------------------------------------------------


class NnxMLP(nnx.Module):

  def __init__(self, din, hidden, *, rngs):
    self.fc1 = nnx.Linear(din, hidden, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, din, rngs=rngs)

  def __call__(self, x):
    return self.fc2(nnx.relu(self.fc1(x)))


def test_nnx_construction_is_sharded_and_matches_unsharded():
  params = nnx.state(nnx.eval_shape(lambda: NnxMLP(64, 1024, rngs=nnx.Rngs(0))), nnx.Param)
  Sharded = tapas.shard(NnxMLP, mesh=MESH, device="cpu", memory_budget=2 * nbytes(params),
                        example_inputs=(jax.ShapeDtypeStruct((64, 64), jnp.float32),))
  rngs, ref_rngs = nnx.Rngs(0), nnx.Rngs(0)
  model = Sharded(64, 1024, rngs=rngs)
  ref = NnxMLP(64, 1024, rngs=ref_rngs)
  assert isinstance(model, Sharded) and isinstance(model, NnxMLP)
  state = nnx.state(model, nnx.Param)
  assert_split(state)
  for leaf, want in zip(jax.tree.leaves(state), jax.tree.leaves(Sharded.module_plan.params)):
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(nnx.state(ref, nnx.Param))):
    np.testing.assert_array_equal(a, b)
  # The caller's Rngs advanced as the plain construction advances them.
  assert int(rngs.default.count[...]) == int(ref_rngs.default.count[...])
  x = jax.random.normal(jax.random.key(1), (64, 64))
  # atol: a 1024-term f32 contraction summed in another order (split over `model`)
  # moves outputs near zero by about 1e-6.
  np.testing.assert_allclose(model(x), ref(x), rtol=1e-5, atol=1e-5)  # forward plan
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(model, x), ref(x), rtol=1e-5,
                             atol=1e-5)  # traced: the plain call
  # nnx.Optimizer builds its state eagerly: the moments follow the params.
  opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  moments = nnx.state(opt, nnx.OptState)
  assert_split(moments)


def test_nnx_trains_through_shard_with_the_unsharded_losses():
  # example_inputs may be a function of the abstract module.
  Sharded = tapas.shard(NnxMLP, mesh=MESH, device="cpu", example_inputs=lambda m: (
      jax.ShapeDtypeStruct((64, m.fc1.in_features), jnp.float32),))
  model = Sharded(64, 256, rngs=nnx.Rngs(0))
  ref_model = NnxMLP(64, 256, rngs=nnx.Rngs(0))
  optimizer = optax.sgd(0.05)
  x = jax.random.normal(jax.random.key(1), (64, 64))
  y = jax.random.normal(jax.random.key(2), (64, 64))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def train_step(params, opt_state, rest, x, y):
    def loss(p):
      return jnp.mean((nnx.merge(graphdef, p, rest)(x) - y) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  step = tapas.shard(train_step, mesh=MESH, device="cpu")
  opt_state = shard_flax.optimizer_state(optimizer, params)
  _, ref_params, ref_rest = nnx.split(ref_model, nnx.Param, ...)
  ref_state = optimizer.init(ref_params)
  ref = jax.jit(train_step)
  for _ in range(3):
    params, opt_state, loss = step(params, opt_state, rest, x, y)
    ref_params, ref_state, ref_loss = ref(ref_params, ref_state, ref_rest, x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)


def test_nnx_zoo_gpt_constructs_sharded():
  m = models.get_model("gpt_nnx", "tiny")
  batch = m.batch_spec(8)
  Sharded = tapas.shard(gpt_nnx.GPT, mesh=MESH, device="cpu",
                        example_inputs=(batch["inputs"],))
  model = Sharded(m.config, rngs=nnx.Rngs(0))
  ref = gpt_nnx.GPT(m.config, rngs=nnx.Rngs(0))
  tokens = m.make_batch(jax.random.key(1), 8)["inputs"]
  np.testing.assert_allclose(model(tokens), ref(tokens), rtol=1e-5, atol=1e-5)
  for leaf, want in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                        jax.tree.leaves(Sharded.module_plan.params)):
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
  forward = model.forward_plan_for(tokens)
  assert forward.in_specs[0] == Sharded.module_plan.plan.in_specs[0]
  assert forward.constraints


def test_nnx_needs_example_inputs():
  with pytest.raises(TypeError, match="needs example_inputs"):
    tapas.shard(NnxMLP)
  with pytest.raises(TypeError, match="apply to functions"):
    tapas.shard(MLP, donate_argnums=0)
