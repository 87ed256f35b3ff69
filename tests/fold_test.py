"""fold: layer instances, unique layers and glue, with and without names."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

from tapas_jax import models
from tapas_jax.fold import Folded, fold, scope_of
from tapas_jax.trace import Graph, trace

import styles  # tests/styles.py: train steps in common library styles

F32 = jnp.float32


def sds(*shape, dtype=F32):
  return jax.ShapeDtypeStruct(shape, dtype)


@functools.lru_cache(maxsize=None)
def train_graph(name: str, **overrides) -> Graph:
  m = models.get_model(name, "tiny", **overrides)
  return trace(m.train_step(), m.abstract_state(), m.batch_spec(2))


@functools.lru_cache(maxsize=None)
def style_graph(style: str, layers: int) -> Graph:
  p = styles.STYLES[style](layers)
  return trace(p.step, p.state, p.batch)


def in_layers(f: Folded) -> float:
  """Share of top-level ops inside layer instances."""
  return sum(len(i.ops) for i in f.instances) / f.num_ops


def layer_shape(f: Folded) -> list[tuple[int, int]]:
  """(instances, repeats) per unique layer."""
  return [(len(u.instances), u.repeats) for u in f.unique_layers]


# model, overrides, expected (instances, repeats) per unique layer, under names.
ZOO_CASES = [
    ("gpt", dict(num_layers=4), [(4, 4)]),
    ("gpt", dict(num_layers=3, scan_layers=True), [(1, 3)]),
    ("llama", dict(num_layers=3), [(3, 3)]),
    ("t5", dict(num_encoder_layers=3, num_decoder_layers=3), [(3, 3), (3, 3)]),
    ("moe", dict(num_layers=6), [(3, 3), (3, 3)]),
    ("resnet", dict(stage_sizes=(3, 3)), [(2, 2), (2, 2)]),
    ("vit", dict(num_layers=3), [(3, 3)]),
]


@pytest.mark.parametrize("name,overrides,expected", ZOO_CASES,
                         ids=[f"{c[0]}-{'-'.join(map(str, c[1].values()))}" for c in ZOO_CASES])
def test_zoo_train_steps_fold_by_names(name, overrides, expected):
  f = fold(train_graph(name, **overrides))
  assert f.method == "names"
  assert layer_shape(f) == expected
  # Every top-level op is in exactly one instance or glue segment.
  owned = [i for inst in f.instances for i in inst.ops] + [i for s in f.glue for i in s.ops]
  assert sorted(owned) == [op.index for op in f.graph.region_ops(0)]


# Every way a block is rematerialised: nn.remat (no policy, names saved, dots saved,
# names offloaded to host, on a submodule), nnx.remat, jax.checkpoint on a pytree module;
# then names that do not delimit layers (Keras numbers every op) and a named CNN.
FOLDING_STYLES = ["linen_remat", "linen_remat_names", "linen_remat_dots",
                  "linen_remat_offload", "linen_inner_remat", "nnx_remat", "pytree_vit",
                  "keras_transformer", "keras_resnet", "cnn_batchnorm"]
TARGET = {"transformer": 0.85, "cnn": 0.75}  # share of ops in layer instances


@pytest.mark.parametrize("style", FOLDING_STYLES)
def test_styles_fold_to_the_targets_at_any_depth(style):
  kind = styles.STYLES[style](1).kind
  unique = []
  for layers in (4, 12):
    f = fold(style_graph(style, layers))
    assert len(f.instances) == layers, f.summary()
    assert in_layers(f) >= TARGET[kind], f.summary()
    unique.append(len(f.unique_layers))
  assert unique[1] <= unique[0], "unique layers grow with depth"


@pytest.mark.parametrize("style", ["nnx_remat", "pytree_vit", "keras_transformer",
                                   "keras_resnet"])
def test_structurally_folded_styles_have_one_unique_layer_at_any_depth(style):
  """Every block of these styles is the same computation: one unique layer, whose
  instances all hold the same ops, the optimizer's passes over all leaves included."""
  for layers in (4, 12):
    f = fold(style_graph(style, layers))
    assert f.method == "structure" and layer_shape(f) == [(layers, layers)], f.summary()
    assert len({len(i.ops) for i in f.instances}) == 1


def _two_kinds_step(kinds, opt):
  """A no-name Adam or momentum step over blocks of two kinds (gelu width 32, relu
  width 48) in the order `kinds` gives."""
  net = _plain_net([jax.nn.relu if k else jax.nn.gelu for k in kinds])
  blocks = [{"w1": sds(16, w), "b1": sds(w), "w2": sds(w, 16)}
            for w in (48 if k else 32 for k in kinds)]
  params = (sds(16, 16), blocks)

  def step(p, s, x):
    updates, s = opt.update(jax.grad(net)(p, x), s, p)
    return optax.apply_updates(p, updates), s

  return trace(step, params, jax.eval_shape(opt.init, params), sds(8, 16))


@pytest.mark.parametrize("opt", ["adam", "sgd"])
@pytest.mark.parametrize("order", ["runs", "alternating"])
def test_unique_layers_are_the_distinct_blocks_at_any_depth(opt, order):
  """Two runs of two block kinds fold to two unique layers, six blocks as four
  do; alternating kinds fold to one unique layer of a pair. Adam's bias corrections
  (one elementwise pass over every leaf, mu then nu) join the blocks they belong to."""
  optimizer = {"adam": optax.adam(1e-3), "sgd": optax.sgd(1e-3, momentum=0.9)}[opt]
  for n in (4, 12):
    kinds = [0] * (n // 2) + [1] * (n // 2) if order == "runs" else [k % 2 for k in range(n)]
    f = fold(_two_kinds_step(kinds, optimizer))
    expected = [(n // 2, n // 2)] * 2 if order == "runs" else [(n // 2, n // 2)]
    assert layer_shape(f) == expected, f.summary()
    for u in f.unique_layers:
      assert len({len(f.instances[i].ops) for i in u.instances}) == 1
    assert in_layers(f) >= 0.8, f.summary()


@pytest.mark.parametrize("style", ["keras_transformer", "keras_resnet"])
def test_structure_takes_over_from_names_that_number_every_op(style):
  f = fold(style_graph(style, 4))
  assert f.method == "structure" and len(f.unique_layers) == 1, f.summary()
  # An instance is a whole block: all its numbered dense or conv layers, not one of them.
  per_block = {"keras_transformer": 6, "keras_resnet": 2}[style]
  for inst in f.instances:
    numbered = {c for i in inst.ops for c in scope_of(f.graph.ops[i].name_stack)
                if re.fullmatch(r"(dense|conv2d)(_\d+)?", c)}
    assert len(numbered) == per_block, (inst.name, sorted(numbered))


def test_blocks_over_one_stacked_parameter_fold_despite_their_slice_offsets():
  """`stacked[i]` slices differ only in where they start: one computation per block."""
  for layers in (4, 12):
    f = fold(style_graph("stacked_vmap", layers))
    assert len(f.instances) == layers, f.summary()
    assert in_layers(f) >= TARGET["transformer"], f.summary()
    # The first block of the backward pass starts each stacked gradient's chain of sums
    # (one sum fewer), yet is the same layer.
    assert len(f.unique_layers) == 1, f.summary()


@pytest.mark.parametrize("style", ["keras_transformer", "keras_resnet", "stacked_vmap"])
def test_structurally_folded_styles_plan_to_the_unsharded_numbers(style):
  assert fold(style_graph(style, 3)).method == "structure"
  styles.assert_plan_runs_like_unsharded(styles.STYLES[style](3), {"data": 2, "model": 4})


# The styles not planned and run elsewhere (`test_structurally_folded_styles_...` above;
# rules_test's `PLANNED_STYLES`: linen_remat_names, nnx_remat, pytree_vit).
@pytest.mark.parametrize("style", ["linen_remat", "linen_remat_dots", "linen_remat_offload",
                                   "linen_inner_remat", "linen_scan_remat", "cnn_batchnorm"])
def test_every_other_style_plans_to_the_unsharded_numbers(style):
  styles.assert_plan_runs_like_unsharded(styles.STYLES[style](3), {"data": 2, "model": 4})


@pytest.mark.parametrize("style", ["linen_remat", "linen_remat_names", "linen_inner_remat"])
def test_remat_instance_holds_forward_recomputation_and_backward(style):
  f = fold(style_graph(style, 4))
  assert f.method == "names" and len(f.unique_layers) == 1
  g = f.graph
  for k, inst in enumerate(f.instances):
    stacks = [g.ops[i].name_stack for i in inst.ops]
    block = f"Block_{k}/"
    assert any(s.startswith("jvp(") and block in s for s in stacks)
    assert any("rematted_computation" in s and block in s for s in stacks)
    assert any(s.startswith("transpose(") and "rematted_computation" not in s and block in s
               for s in stacks)
    assert not any(f"Block_{j}/" in s for s in stacks for j in range(4) if j != k)


def test_remat_inside_scan_is_one_instance_of_both_scans():
  for layers in (4, 12):
    f = fold(style_graph("linen_scan_remat", layers))
    (inst,) = f.instances
    assert inst.trip_count == layers and len(f.unique_layers) == 1
    loops = [i for i in inst.ops if f.graph.ops[i].primitive == "scan"]
    assert len(loops) == 2, "the forward and the backward scan"
    # The embedding, head and loss are glue, not part of the scanned layer.
    assert not any("wte" in f.graph.ops[i].name_stack for i in inst.ops)


def test_heterogeneous_layers_get_readable_distinct_names():
  t5 = fold(train_graph("t5", num_encoder_layers=3, num_decoder_layers=3))
  assert [u.name for u in t5.unique_layers] == ["encoder/layers", "decoder/layers"]
  moe = fold(train_graph("moe", num_layers=6))
  assert [u.name for u in moe.unique_layers] == ["Block[MLP]", "Block[MoE]"]
  assert [moe.instances[i].name for i in moe.unique_layers[1].instances] == [
      "MoETransformer/Block_1", "MoETransformer/Block_3", "MoETransformer/Block_5"]


def test_instance_holds_forward_backward_and_optimizer_ops():
  f = fold(train_graph("gpt", num_layers=4))
  g = f.graph
  for k, inst in enumerate(f.instances):
    stacks = [g.ops[i].name_stack for i in inst.ops]
    assert any(s.startswith(f"jvp(GPT)/Block_{k}") for s in stacks)
    assert any(s.startswith(f"transpose(jvp(GPT))/Block_{k}") for s in stacks)
    assert any(s == "" for s in stacks), "optax update ops have no name stack"
    read = {g.input_path.get(v) for i in inst.ops for v in g.ops[i].inputs}
    assert f"params/Block_{k}/MLP/fc1/kernel" in read
    assert f"opt_state/0/mu/Block_{k}/MLP/fc1/kernel" in read
    assert f"opt_state/0/nu/Block_{k}/Attention/query/kernel" in read
    assert not any(p and f"Block_{j}/" in p for p in read for j in range(4) if j != k)


@pytest.mark.parametrize("layers", [2, 4, 8])
def test_unique_layers_do_not_grow_with_depth(layers):
  f = fold(train_graph("gpt", num_layers=layers))
  assert layer_shape(f) == [(layers, layers)]
  # Every top-level op is glue or in exactly one instance: the search looks at the
  # glue and one instance, so the ratio is (glue + L * layer) / (glue + layer).
  (unique,) = f.unique_layers
  glue = [i for seg in f.glue for i in seg.ops]
  in_layers = [i for inst in f.instances for i in inst.ops]
  assert sorted(glue + in_layers) == sorted(op.index for op in f.graph.region_ops(0))
  assert all(len(inst.ops) == unique.num_ops for inst in f.instances)
  assert f.fold_ratio == pytest.approx(
      (len(glue) + layers * unique.num_ops) / (len(glue) + unique.num_ops), rel=1e-12)


@pytest.mark.parametrize("name,overrides", [
    ("gpt", dict(num_layers=4)), ("llama", dict(num_layers=3)), ("vit", dict(num_layers=3))])
def test_structure_alone_finds_the_same_layers_as_names(name, overrides):
  g = train_graph(name, **overrides)
  by_names, by_structure = fold(g), fold(g, use_names=False)
  assert by_structure.method == "structure"
  assert layer_shape(by_structure) == layer_shape(by_names)
  assert ([len(i.ops) for i in by_structure.instances]
          == [len(i.ops) for i in by_names.instances])


@pytest.mark.parametrize("name", ["gpt_nnx", "llama_nnx"])
def test_nnx_models_fold_without_name_stacks(name):
  f = fold(train_graph(name, num_layers=4))
  assert f.method == "structure"  # nnx puts no module paths in the jaxpr
  assert layer_shape(f) == [(4, 4)]


def _plain_net(acts):
  """An input projection, then a Python loop of residual MLP blocks; no names anywhere.

  The projection makes the first block's input differentiable, as an embedding does:
  otherwise its backward pass would skip the input cotangent and differ from the rest.
  """
  def net(params, x):
    x = x @ params[0]
    for k, p in enumerate(params[1]):
      h = acts[k](x @ p["w1"] + p["b1"])
      x = x + h @ p["w2"]
    return jnp.mean(x ** 2)
  return net


def _plain_params(n, d=16, h=32, dtype=F32, odd=None):
  return sds(d, d), _plain_blocks(n, d, h, dtype, odd)


def _plain_blocks(n, d, h, dtype, odd):
  out = []
  for k in range(n):
    dd = odd[1] if odd and k == odd[0] else h
    out.append({"w1": sds(d, dd, dtype=dtype), "b1": sds(dd, dtype=dtype),
                "w2": sds(dd, d, dtype=dtype)})
  return out


@pytest.mark.parametrize("mode", ["forward", "grad", "sgd_step"])
def test_plain_jax_loop_without_names_folds_structurally(mode):
  n = 6
  net = _plain_net([jax.nn.gelu] * n)
  params, x = _plain_params(n), sds(8, 16)
  fn = {
      "forward": net,
      "grad": jax.grad(net),
      "sgd_step": lambda p, x: optax.apply_updates(p, jax.tree.map(
          lambda g: -0.1 * g, jax.grad(net)(p, x))),
  }[mode]
  f = fold(trace(fn, params, x))
  assert f.method == "structure"
  assert layer_shape(f) == [(n, n)]
  if mode == "sgd_step":  # the update of block k's weights sits in instance k
    g = f.graph
    for k, inst in enumerate(f.instances):
      read = {g.input_path.get(v) for i in inst.ops for v in g.ops[i].inputs} - {None}
      assert {p for p in read if p.startswith("1/")} == {f"1/{k}/w1", f"1/{k}/b1", f"1/{k}/w2"}


def test_one_block_with_another_activation_does_not_fold():
  n = 6
  acts = [jax.nn.gelu] * n
  acts[3] = jax.nn.relu
  f = fold(trace(jax.grad(_plain_net(acts)), _plain_params(n), sds(8, 16)))
  # The five gelu blocks fold; the relu block (the only `max` ops) stays out of them.
  assert layer_shape(f) == [(5, 5)]
  in_layers = {f.graph.ops[i].primitive for inst in f.instances for i in inst.ops}
  assert "max" not in in_layers and ("erf" in in_layers or "tanh" in in_layers)
  glue = {f.graph.ops[i].primitive for seg in f.glue for i in seg.ops}
  assert "max" in glue


def test_flax_layer_with_another_activation_does_not_fold():
  base = train_graph("gpt", num_layers=4)
  relu = train_graph("gpt", num_layers=4, activation="relu")
  assert (fold(base).unique_layers[0].fingerprint
          != fold(relu).unique_layers[0].fingerprint)


@pytest.mark.parametrize("what", ["shape", "dtype"])
def test_layers_differing_in_shape_or_dtype_do_not_fold(what):
  n = 4
  if what == "shape":
    params = _plain_params(n, odd=(2, 48))
  else:
    params = _plain_params(n)
    params[1][2] = jax.tree.map(lambda s: sds(*s.shape, dtype=jnp.bfloat16), params[1][2])
  f = fold(trace(_plain_net([jnp.tanh] * n), params, sds(8, 16)))
  assert not any(len(u.instances) == n for u in f.unique_layers)


def test_layers_differing_only_in_values_fold_together():
  n = 4
  net = _plain_net([jnp.tanh] * n)
  w_in, blocks = _plain_params(n)
  concrete = (jnp.ones(w_in.shape), [{k: jnp.full(s.shape, float(i + 1)) for k, s in p.items()}
                                     for i, p in enumerate(blocks)])
  f = fold(trace(net, concrete, jnp.ones((8, 16))))
  assert layer_shape(f) == [(n, n)]


def test_summary_reports_layers_and_ratio():
  text = fold(train_graph("gpt", num_layers=4)).summary()
  assert "4 layer instances of 1 unique layer(s)" in text
  assert "'Block'" in text and "fold ratio" in text and "GPT/Block_3" in text


def test_summary_counts_instances_not_the_iterations_of_a_loop_inside_them():
  class Chunked(nn.Module):
    """A block whose MLP runs over 8 sequence chunks in a `lax.scan`."""

    @nn.compact
    def __call__(self, x):
      w = self.param("w", nn.initializers.lecun_normal(), (16, 16))
      h = nn.Dense(16, name="proj")(x)
      _, ys = jax.lax.scan(lambda c, xc: (c, jnp.tanh(xc @ w)), None, h.reshape(8, -1, 16))
      return x + ys.reshape(x.shape)

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(2):
        x = Chunked(name=f"Chunked_{i}")(x)
      return x.sum()

  x = sds(2, 32, 16)
  params = jax.eval_shape(lambda: Net().init(jax.random.key(0), jnp.zeros(x.shape)))
  f = fold(trace(jax.grad(lambda p, x: Net().apply(p, x), argnums=(0, 1)), params, x))
  assert layer_shape(f) == [(2, 2)]
  assert all(i.trip_count == 1 for i in f.instances)
  assert "ops x 2 instance(s) [" in f.summary()
  # A scanned stack is one instance running its loop's iterations.
  scanned = fold(train_graph("gpt", num_layers=3, scan_layers=True))
  assert "ops x 1 instance(s), 3 runs (counted loops)" in scanned.summary()


@pytest.mark.parametrize("stack,scope", [
    ("transpose(jvp(GPT))/Block_1/MLP/fc2", ("GPT", "Block_1", "MLP", "fc2")),
    ("jvp()", ()),
    # nn.remat(Block): the backward sits under the call's stack twice, the recomputed
    # forward also under JAX's "rematted_computation".
    ("transpose(jvp(LM))/jvp(LM)/Block_3/ln1", ("LM", "Block_3", "ln1")),
    ("transpose(jvp(LM))/jvp(LM)/rematted_computation/Block_3/ln1", ("LM", "Block_3", "ln1")),
    # nn.remat on a submodule: the re-entered prefix is two components long.
    ("transpose(jvp(LM))/Block_2/jvp(LM)/Block_2/MLP/fc1", ("LM", "Block_2", "MLP", "fc1")),
    # Plain jax.checkpoint, no names.
    ("transpose(jvp(jvp()))/rematted_computation", ()),
    # A module really named like its parent stays.
    ("jvp(LM)/LM/Block_0", ("LM", "LM", "Block_0")),
])
def test_scope_of_strips_transforms_and_remat_reentry(stack, scope):
  assert scope_of(stack) == scope
