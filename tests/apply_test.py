"""apply: a plan runs as searched: the same numbers as unsharded, XLA's collectives as
predicted, state kept where the plan stores it, and clear errors on a mismatch."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import styles  # tests/styles.py: train steps in common library styles
import tapas_jax as tapas
from tapas_jax import baselines, fences, fold, measure, models, trace

MESH = {"data": 2, "model": 4}


def is_spec(x):
  return isinstance(x, PartitionSpec)


@functools.lru_cache(maxsize=None)
def planned(family, kind):
  """(model, plan) for a tiny zoo model: searched, under a memory budget, or a baseline."""
  m = models.get_model(family, "tiny")
  args = (m.train_step(), m.abstract_state(), m.batch_spec(8))
  if kind in baselines.BASELINES:
    return m, baselines.baseline(kind, *args, mesh=MESH, device="cpu", family=family)
  free = tapas.search(*args, mesh=MESH, device="cpu")
  if kind == "search":
    return m, free
  # Halfway between the leanest plan the search reaches and the free one.
  with pytest.raises(tapas.InfeasibleBudgetError) as floor:
    tapas.search(*args, mesh=MESH, device="cpu", memory_budget=1.0)
  budget = (floor.value.leanest_bytes + free.stats.predicted_memory_bytes) / 2
  plan = tapas.search(*args, mesh=MESH, device="cpu", memory_budget=budget)
  assert plan.stats.predicted_memory_bytes <= budget
  return m, plan


CASES = [("gpt", "search"), ("gpt", "budget"), ("gpt", "fsdp"), ("gpt", "megatron"),
         ("llama", "search"), ("llama", "budget"), ("llama_nnx", "search"), ("t5", "search"),
         ("moe", "search"), ("vit", "search"), ("resnet", "search")]


@pytest.mark.parametrize("family,kind", CASES)
def test_applied_step_computes_the_same_numbers(family, kind, two_steps):
  m, plan = planned(family, kind)
  if kind == "fsdp":
    assert any(layer.use_specs for layer in plan.layers), \
        "FSDP stores parameters apart from their use: apply must gather them"
  _, _, (s1, _), _ = two_steps(plan, m, 8)
  # The next state comes out where the plan stores it.
  mesh = tapas.make_mesh(MESH)
  for leaf, spec in zip(jax.tree.leaves(s1), jax.tree.leaves(plan.in_specs[0],
                                                             is_leaf=is_spec)):
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), spec


@pytest.mark.parametrize("family,kind", [("gpt", "budget"), ("t5", "search")])
def test_the_compiled_step_keeps_the_programs_op_names(family, kind):
  """The compiled program's op names (`metadata.op_name`, which profilers show) name the
  step and the modules that made each op, as the step jitted on its own does: apply
  binds each equation it re-interprets (or recomputes) under the equation's own name
  stack, not under a bare "jit(run)/dot_general"."""
  m, plan = planned(family, kind)
  args = (m.abstract_state(), m.batch_spec(8))

  def module_scopes(jitted):
    text = jitted.lower(*args).compile().as_text()
    return set(re.findall(r'op_name="jit\(train_step\)/(?:transpose\()?jvp\(\w+\)\)?/'
                          r'([\w/]+)/[^/"]+"', text))

  own = module_scopes(jax.jit(m.train_step()))
  assert len(own) > 10, own
  applied = module_scopes(tapas.apply(plan, m.train_step()))
  assert own <= applied, sorted(own - applied)


@pytest.mark.parametrize("family,kind,remat", [("gpt", "fsdp", "nothing_saveable"),
                                               ("llama", "search", None)])
def test_each_layers_backward_waits_for_the_gradients_of_the_layer_above(
    family, kind, remat, two_steps):
  """On a profile whose compiler reduces gradients as they are made (h100, the TPUs),
  the plan has each unrolled layer's backward hand its cotangent down through one
  barrier with the layer above's gradients (`tapas_jax.fences`): one per layer but the
  top one (nothing above it is pending) and the lowest (it hands down to no layer).
  The TPU compiler otherwise makes every layer's weight gradients after the whole
  backward at scale (BENCHMARKS.md); the numbers stay the unsharded step's."""
  layers = 4
  m = models.get_model(family, "tiny", num_layers=layers)
  args = (m.train_step(), m.abstract_state(), m.batch_spec(8))
  if kind == "search":
    plan = tapas.search(*args, mesh=MESH, device="h100")
  else:
    plan = baselines.baseline(kind, *args, mesh=MESH, device="h100", family=family,
                              remat=remat)
  assert plan.gradient_fences
  assert not tapas.search(*args, mesh=MESH, device="cpu").gradient_fences  # XLA:CPU's
  # combiner holds every gradient to the end, as the cpu profile's memory model does.

  def barriers(p):
    text = tapas.apply(p, m.train_step()).lower(*args[1:]).as_text()
    return text.count("stablehlo.optimization_barrier")

  assert barriers(plan) - barriers(dataclasses.replace(plan, gradient_fences=False)) \
      == layers - 2
  two_steps(plan, m, 8)


def test_partial_sums_only_sums_read_pass_the_fences_where_the_compiler_adds_first(
    libtpu, two_steps):
  """T5's decoder layers each add their cross-attention's part to the encoder output's
  gradient. A partial sum through a fence's barrier is reduced before it, one
  all-reduce per layer and projection; the TPU compiler, left to it, adds them up and
  reduces once, as the model costs it (`Plan.sums_past_fences`). Megatron on
  v5p:2x2x1 (libtpu 0.0.42.1): bytes sent 1.000 of the prediction, 0.920 with the sums
  fenced. The numbers stay the unsharded step's."""
  del libtpu
  m = models.get_model("t5", "tiny")
  args = (m.train_step(), m.abstract_state(), m.batch_spec(8))
  plan = baselines.baseline("megatron", *args, mesh={"data": 2, "model": 2},
                            device="tpu-v5p", family="t5")
  assert plan.gradient_fences and plan.sums_past_fences
  assert not baselines.baseline("megatron", *args, mesh={"data": 2, "model": 2},
                                device="h100", family="t5").sums_past_fences
  sent = {p.sums_past_fences: tapas.verify(p, *args, topology="v5p:2x2x1",
                                           donate_argnums=0).comm_ratio
          for p in (plan, dataclasses.replace(plan, sums_past_fences=False))}
  assert sent[True] == pytest.approx(1.0, abs=0.01) and sent[False] < 0.95, sent
  on_eight = baselines.baseline("megatron", *args, mesh=MESH, device="tpu-v5p", family="t5")
  assert on_eight.sums_past_fences
  two_steps(on_eight, m, 8)  # on the 8 CPU devices


def test_a_weight_gradient_summed_into_an_accumulator_still_waits_at_its_fence():
  """A layer's results read only by sums stay out of the barrier only where they go
  on to a layer below (T5's encoder-output gradient); a weight gradient added into an
  accumulator goes only to the state, and keeps its fence."""
  m = models.get_model("gpt", "tiny", num_layers=4)
  loss_fn = m.loss_fn()

  def accumulate(params, acc, batch):
    grads = jax.grad(lambda p: loss_fn(p, {}, batch)[0])(params)
    return params, jax.tree.map(lambda a, g: a + g, acc, grads)

  params = m.abstract_state().params
  graph = trace.trace(accumulate, params, params, m.batch_spec(8))
  folded = fold.fold(graph)
  summed = lambda v: bool(graph.consumers.get(v)) and all(  # noqa: E731
      graph.ops[r].primitive in ("add", "add_any") for r in graph.consumers[v])
  fenced = fences.Fences(graph, folded, {}).at
  assert fences.Fences(graph, folded, {}, left_out=summed).at == fenced
  assert any(results and all(map(summed, results)) for _, results in fenced.values())
  m5 = models.get_model("t5", "tiny")
  g5 = trace.trace(m5.train_step(), m5.abstract_state(), m5.batch_spec(8))
  f5 = fold.fold(g5)
  summed5 = lambda v: bool(g5.consumers.get(v)) and all(  # noqa: E731
      g5.ops[r].primitive in ("add", "add_any") for r in g5.consumers[v])
  results = lambda at: sum(len(r) for _, r in at.values())  # noqa: E731
  assert results(fences.Fences(g5, f5, {}, left_out=summed5).at) < results(
      fences.Fences(g5, f5, {}).at)


@pytest.mark.parametrize("style", sorted(styles.STYLES))
def test_every_style_gets_a_fence_per_layer_boundary_of_its_backward(style):
  """However the library writes its blocks (remat, per-op names, pytree modules, vmap
  over stacked weights, a CNN), each unrolled layer's backward but the lowest hands
  down one cotangent and leaves its gradients for the update; a scanned stack (one
  loop) gets none."""
  p = styles.STYLES[style](4)
  graph = trace.trace(p.step, p.state, p.batch)
  folded = fold.fold(graph)
  at = fences.Fences(graph, folded, {}).at
  if any(i.trip_count > 1 for i in folded.instances):
    assert not at
    return
  assert len(folded.instances) == 4 and len(at) == 3
  assert all(len(down) == 1 and results for down, results in at.values())


def _compiled(plan, step, state, batch, constrained):
  if constrained:
    jitted = tapas.apply(plan, step)
  else:
    mesh = tapas.make_mesh(MESH)
    jitted = jax.jit(step, in_shardings=jax.tree.map(lambda s: NamedSharding(mesh, s),
                                                     plan.in_specs, is_leaf=is_spec))
  return measure.measure(jitted.lower(state, batch).compile(), 8)


def test_xla_follows_a_plan_that_stores_parameters_apart_from_their_use():
  # GPT-2 small width, short sequences, batch 2: the state dominates memory and a
  # tight budget (half the unconstrained plan's memory; at 70% splitting the MLP over
  # `model` is enough) stores parameters split over an axis and gathers them for use
  # (ZeRO).
  m = models.get_model("gpt", "gpt2-small", num_layers=2, seq_len=64, vocab_size=50304)
  step, state, batch = m.train_step(), m.abstract_state(), m.batch_spec(2)
  free = tapas.search(step, state, batch, mesh=MESH, device="h100")
  plan = tapas.search(step, state, batch, mesh=MESH, device="h100",
                      memory_budget=0.5 * free.stats.predicted_memory_bytes)
  assert any(layer.use_specs for layer in plan.layers)
  applied = _compiled(plan, step, state, batch, constrained=True)
  bare = _compiled(plan, step, state, batch, constrained=False)
  predicted = plan.stats.predicted_comm_bytes
  # XLA follows the plan through `apply`; with in_shardings alone it does something
  # else. Measured at batch 8 before the roofline: 29.3 MiB applied vs 30.0 predicted,
  # in_shardings alone 50.3; at batch 2 with the roofline: 23.1 applied, in_shardings
  # alone 15.9 (XLA spreads the storage layout into the compute, which here sends less).
  assert applied.comm_bytes["total"] == pytest.approx(predicted, rel=0.1)
  assert bare.comm_bytes["total"] != pytest.approx(applied.comm_bytes["total"], rel=0.2)


def test_a_statistic_into_state_stored_apart_is_sliced_where_it_is_stored():
  """ResNet's searched plan stores the batch statistics' running means split over the
  mesh and computes them whole: XLA must slice the new statistic at the update, not
  carry the split back into the convolutions (which sent 0.63 MiB at tiny, 42 MiB at
  small widths, for a plan predicted to send ~nothing)."""
  m = models.get_model("resnet", "tiny")
  args = (m.train_step(), m.abstract_state(), m.batch_spec(8))
  plan = tapas.search(*args, mesh=MESH, device="h100")
  stored = {tuple(s) for s in jax.tree.leaves(plan.in_specs[0].model_state,
                                              is_leaf=is_spec)}
  assert (("data", "model"),) in stored, stored
  got = _compiled(plan, *args, constrained=True)
  assert got.comm_bytes["total"] == pytest.approx(plan.stats.predicted_comm_bytes,
                                                  abs=1024), got.comm_bytes


def test_apply_rejects_another_program():
  m, plan = planned("gpt", "search")
  other = models.get_model("gpt", "tiny", num_layers=3)
  step = tapas.apply(plan, other.train_step())
  with pytest.raises(ValueError, match="searched for another program"):
    step.lower(other.abstract_state(), other.batch_spec(8))
  # Same structure, other shapes: caught by the program's fingerprint.
  same = tapas.apply(plan, m.train_step())
  with pytest.raises(ValueError, match="searched for another program.*fingerprint"):
    same.lower(m.abstract_state(), m.batch_spec(16))


def test_apply_rejects_a_mesh_with_other_axes():
  _, plan = planned("gpt", "search")
  with pytest.raises(tapas.MeshError, match=r"searched for mesh .*'model': 4"):
    tapas.apply(plan, lambda s, b: s, mesh=tapas.make_mesh({"data": 8}))
  with pytest.raises(tapas.MeshError, match="not AxisType.Auto"):
    tapas.apply(plan, lambda s, b: s, mesh=jax.make_mesh(
        (2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2))


def _losses(plan, m, *, mesh_ctx=None, kwargs=False):
  """Loss of one applied step and of the plain jitted step, on the same data."""
  state = m.init(jax.random.key(0))
  batch = m.make_batch(jax.random.key(1), 8)
  ref = jax.jit(m.train_step())(state, batch)[1]["loss"]
  if mesh_ctx is not None:
    with jax.set_mesh(mesh_ctx):
      return _losses(plan, m, kwargs=kwargs)[0], ref
  step = tapas.apply(plan, m.train_step())
  if kwargs:
    (state,), kw = tapas.place(plan, state, kwargs={"batch": batch})
    return step(state, **kw)[1]["loss"], ref
  return step(*tapas.place(plan, state, batch))[1]["loss"], ref


def test_a_plan_searched_outside_a_mesh_context_runs_inside_one_and_back():
  m, outside = planned("gpt", "search")
  mesh = tapas.make_mesh(MESH)
  got, ref = _losses(outside, m, mesh_ctx=mesh)
  np.testing.assert_allclose(got, ref, rtol=2e-6)
  with jax.set_mesh(mesh):
    inside = tapas.search(m.train_step(), m.abstract_state(), m.batch_spec(8), mesh=mesh,
                          device="cpu")
    # Lowering under the mesh context, as most JAX code runs.
    tapas.apply(outside, m.train_step()).lower(m.abstract_state(), m.batch_spec(8))
  assert inside.fingerprint == outside.fingerprint
  got, ref = _losses(inside, m)
  np.testing.assert_allclose(got, ref, rtol=2e-6)


def test_keyword_arguments_are_searched_applied_and_placed():
  m = models.get_model("gpt", "tiny")
  plan = tapas.search(m.train_step(), m.abstract_state(), kwargs={"batch": m.batch_spec(8)},
                      mesh=MESH, device="cpu")
  _, positional = planned("gpt", "search")
  assert plan.kwargs_specs["batch"] == positional.in_specs[1]
  assert plan.in_specs == positional.in_specs[:1]
  got, ref = _losses(plan, m, kwargs=True)
  np.testing.assert_allclose(got, ref, rtol=2e-6)
  # Passed positionally, or the other way round, as jax.jit takes either.
  step = tapas.apply(plan, m.train_step())
  want = step.lower(m.abstract_state(), batch=m.batch_spec(8)).as_text()
  assert step.lower(m.abstract_state(), m.batch_spec(8)).as_text() == want
  step = tapas.apply(positional, m.train_step())
  assert step.lower(m.abstract_state(), batch=m.batch_spec(8)).as_text() == \
      step.lower(m.abstract_state(), m.batch_spec(8)).as_text()
  # A function whose signature cannot say: the call must look as searched.
  step = tapas.apply(plan, lambda *a, **k: m.train_step()(*a, **k))
  with pytest.raises(ValueError, match=r"called with 1 positional argument\(s\) and "
                     r"keyword\(s\) \['batch'\]; got 2 positional"):
    step.lower(m.abstract_state(), m.batch_spec(8))


@pytest.mark.parametrize("layouts", ["default", "auto"])
def test_an_argument_committed_elsewhere_is_named_with_the_fix(layouts):
  m, plan = planned("gpt", "search")
  state = m.init(jax.random.key(0))
  batch = m.make_batch(jax.random.key(1), 8)
  mesh = tapas.make_mesh(MESH)
  (state,) = tapas.place(plan, state, batch)[:1]
  wrong = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("model")))
  assert plan.in_specs[1]["inputs"] != PartitionSpec("model")
  with pytest.raises(ValueError, match=r"argument 1 at path 'inputs' is committed to "
                     r"NamedSharding.*'model'.*the plan stores it as .*tapas.place\(plan"):
    tapas.apply(plan, m.train_step(), layouts=layouts)(state, wrong)


@pytest.mark.parametrize("family", ["gpt", "moe"])
def test_the_state_in_the_compilers_layout_computes_the_same_numbers(family):
  # layouts="auto": the carried state's layouts are the
  # compiler's. On XLA:CPU they are the default ones; this pins the path: two steps
  # through the compiled program, the next state taken back as it comes out.
  m, plan = planned(family, "search")
  state = m.init(jax.random.key(0))
  batch = m.make_batch(jax.random.key(1), 8)
  ref = jax.jit(m.train_step())
  losses, r = [], state
  for _ in range(3):
    r, out = ref(r, batch)
    losses.append(out["loss"])
  traced = []

  def counted(*args):
    traced.append(len(args))
    return m.train_step()(*args)

  step = tapas.apply(plan, counted, donate_argnums=0, layouts="auto")
  placed = tapas.place(plan, state, batch)
  first = [x for x in jax.tree.leaves(placed[0]) if x.ndim >= 2]
  s1, out1 = step(*placed)
  s2, out2 = step(s1, placed[1])
  # One trace of the step: the laid-out program reuses the one that found the state.
  assert traced == [2]
  np.testing.assert_allclose(out1["loss"], losses[0], rtol=2e-6)
  np.testing.assert_allclose(out2["loss"], losses[1], rtol=2e-5)
  mesh = tapas.make_mesh(MESH)
  for leaf, spec in zip(jax.tree.leaves(s2), jax.tree.leaves(plan.in_specs[0],
                                                             is_leaf=is_spec)):
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), spec
  # The state was donated: the first call's inputs are gone, updated in place.
  assert all(x.is_deleted() for x in first)
  # Inside another trace the default layouts hold and the numbers are the same.
  _, out3 = jax.jit(step)(s2, placed[1])
  np.testing.assert_allclose(out3["loss"], losses[2], rtol=5e-5)


def test_an_unknown_layouts_value_is_refused():
  m, plan = planned("gpt", "search")
  with pytest.raises(tapas.TapasError, match=r"layouts=.tiled'.*'auto'"):
    tapas.apply(plan, m.train_step(), layouts="tiled")


# -- a kernel run on shards the program fixes (jax.shard_map) ----------------------


def _runs_as_unsharded(plan, step, state, x, mesh=None):
  """The applied step's loss and next state are the unsharded step's."""
  want_state, want_loss = jax.jit(step)(state, x)
  got_state, got_loss = tapas.apply(plan, step, mesh=mesh)(*tapas.place(plan, state, x,
                                                                        mesh=mesh))
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
  for got, want in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_a_shard_mapped_kernel_gets_its_shards_and_computes_the_same_numbers():
  mesh = styles.auto_mesh((2, 2), ("data", "model"), jax.devices()[:4])
  step, state, x = styles.shard_mapped_attention(mesh)
  plan = tapas.search(step, *jax.eval_shape(lambda *a: a, state, x),
                      mesh={"data": 2, "model": 2}, device="tpu-v5p")
  # The shard_map reads its operands with the batch on data and the heads on model:
  # the plan makes them there (priced as whole reads, the batch was left unsplit and the
  # shard_map's operands gathered whole).
  decisions = {d.name: d.axes for d in plan.decisions}
  assert decisions["batch"] == ("data",), plan.summary()
  _runs_as_unsharded(plan, step, state, x, mesh=mesh)


def test_a_shard_map_on_a_mesh_of_its_own_is_priced_whole_and_runs():
  """A shard_map over the step's devices on a mesh of its own (`{'d': 4}` under a
  `data x model` plan), which JAX runs: its shards name no axis of the plan's."""
  import optax  # noqa: PLC0415 - the test extra's, as the zoo's

  own = styles.auto_mesh((4,), ("d",), jax.devices()[:4])
  scale = jax.shard_map(lambda h: h * jax.lax.psum(jnp.mean(h), "d"), mesh=own,
                        in_specs=PartitionSpec("d"), out_specs=PartitionSpec("d"))
  opt = optax.sgd(0.1)

  def step(state, x):
    w, opt_state = state
    value, grads = jax.value_and_grad(lambda w: jnp.mean(scale(jnp.tanh(x @ w)) ** 2))(w)
    updates, opt_state = opt.update(grads, opt_state, w)
    return (optax.apply_updates(w, updates), opt_state), value

  w = jax.random.normal(jax.random.key(0), (64, 64)) / 8
  state, x = (w, opt.init(w)), jax.random.normal(jax.random.key(1), (16, 64))
  with pytest.warns(UserWarning, match=r"'shard_map' at .* runs on mesh \{'d': 4\}, the "
                    r"search's is \{'data': 2, 'model': 2\}: its operands and results are "
                    r"priced whole"):
    plan = tapas.search(step, state, x, mesh={"data": 2, "model": 2}, device="cpu")
  mesh = styles.auto_mesh((2, 2), ("data", "model"), jax.devices()[:4])
  _runs_as_unsharded(plan, step, state, x, mesh=mesh)


def test_a_shard_map_traced_on_other_devices_than_the_step_is_named():
  mesh = styles.auto_mesh((2, 2), ("data", "model"), jax.devices()[:4])
  step, state, x = styles.shard_mapped_attention(mesh)
  plan = tapas.search(step, state, x, mesh={"data": 2, "model": 2}, device="cpu")
  other = styles.auto_mesh((2, 2), ("data", "model"), jax.devices()[4:])
  with pytest.raises(ValueError, match=r"traced on mesh .* \(on cpu devices \[0, 1, 2, 3\]\).*"
                     r"runs on .* devices \[4, 5, 6, 7\]\. Build the shard_map's mesh"):
    tapas.apply(plan, step, mesh=other)(*tapas.place(plan, state, x, mesh=other))


def test_a_shard_map_on_the_mesh_jax_set_mesh_sets_runs_as_unsharded():
  """`jax.shard_map` without `mesh=` takes the mesh `jax.set_mesh` sets; the plan is
  searched and applied inside it."""
  mesh = styles.auto_mesh((2, 2), ("data", "model"), jax.devices()[:4])
  step, state, x = styles.shard_mapped_attention(None, seq=64, head_dim=32, width=128)
  with jax.set_mesh(mesh):
    plan = tapas.search(step, state, x, mesh={"data": 2, "model": 2}, device="cpu")
    _runs_as_unsharded(plan, step, state, x)


def test_a_step_searched_inside_jax_set_mesh_and_applied_outside_is_told_where():
  """JAX traces a step inside a mesh context as another program (a mesh-less shard_map
  reads the context's mesh): applied outside it, the error says to apply it inside."""
  mesh = styles.auto_mesh((2, 2), ("data", "model"), jax.devices()[:4])
  step, state, x = styles.shard_mapped_attention(None, seq=64, head_dim=32, width=128)
  with jax.set_mesh(mesh):
    plan = tapas.search(step, state, x, mesh={"data": 2, "model": 2}, device="cpu")
  with pytest.raises(ValueError, match=r"searched inside `with jax.set_mesh\(mesh\):`, "
                     r"apply \(or verify\) it there too"):
    tapas.apply(plan, step, mesh=mesh)(*tapas.place(plan, state, x, mesh=mesh))


def test_a_shard_maps_results_are_pinned_where_the_plan_holds_them_otherwise():
  """FSDP holds the batch over every axis; the shard_map makes its result with the batch
  on data and the heads on model: the readers get the plan's layout pinned, so that XLA
  reshards the result there rather than carrying the kernel's layout on."""
  mesh = styles.auto_mesh((2, 2), ("data", "model"), jax.devices()[:4])
  step, state, x = styles.shard_mapped_attention(mesh, seq=64, head_dim=32, width=128)
  plan = baselines.baseline("fsdp", step, state, x, mesh={"data": 2, "model": 2},
                            device="cpu")
  graph = trace.trace(step, state, x)
  made = {v for op in graph.ops if op.primitive == "shard_map" and op.region == 0
          for v in op.outputs[:1]}
  sites = {(graph.ops[r].site, k) for v in made for r in graph.consumers.get(v, ())
           for k, x_ in enumerate(graph.ops[r].inputs) if x_ == v}
  pinned = [c for c in plan.constraints if (tuple(c.site), c.slot) in sites]
  assert pinned and all(c.spec[0] == ("data", "model") for c in pinned), plan.constraints
  _runs_as_unsharded(plan, step, state, x, mesh=mesh)


def test_a_searched_loop_is_pinned_where_it_reads_and_makes_its_carry(two_steps):
  """A scan's body is searched in place but is no op of its own: its carry was left to
  XLA, which carried a split of positions from the loss head back into the loop (the
  TPU compiler then gathered each layer's stacked weights; verify_test's
  `test_a_searched_scan_body_compiles_as_planned`). Each array the loop reads is pinned
  at the scan in the plan's layout and each of its results where it is read; the step
  computes as unsharded."""
  m = models.get_model("llama", "tiny", scan_layers=True)
  args = (m.train_step(), m.abstract_state(), m.batch_spec(8))
  plan = tapas.search(*args, mesh=MESH, device="tpu-v5p")
  graph = trace.trace(*args)
  pinned = {(tuple(c.site), c.slot) for c in plan.constraints}
  loops = [op for op in graph.ops if op.primitive == "scan" and op.region == 0]
  assert loops
  for op in loops:
    operands = [k for k, x in enumerate(op.inputs)
                if x not in graph.literals and graph.types[x].shape]
    assert all((op.site, k) in pinned for k in operands), op.name_stack
    read = [(graph.ops[r].site, k) for v in op.outputs if graph.types[v].shape
            for r in graph.consumers.get(v, ()) if graph.ops[r].region == 0
            for k, y in enumerate(graph.ops[r].inputs) if y == v]
    assert read and all(site in pinned for site in read), op.name_stack
  two_steps(plan, m, 8)
