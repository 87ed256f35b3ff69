"""Tests for the LLaMA family and the nnx twins of GPT and LLaMA."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tapas_jax.models import gpt
from tapas_jax.models import gpt_nnx
from tapas_jax.models import llama
from tapas_jax.models import llama_nnx

_TWINS = {
    "gpt": (gpt, gpt_nnx),
    "llama": (llama, llama_nnx),
}


def _linen_module(family: str, config):
  return gpt.GPT(config) if family == "gpt" else llama.Llama(config)


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("family", sorted(_TWINS))
def test_linen_and_nnx_give_same_loss(family, scan_layers):
  linen_lib, nnx_lib = _TWINS[family]
  config = dataclasses.replace(linen_lib.CONFIGS["tiny"], scan_layers=scan_layers)
  batch = linen_lib.make_batch(config, jax.random.key(1), 2)
  module = _linen_module(family, config)
  variables = module.init(jax.random.key(0), batch["inputs"])
  linen_loss, _ = linen_lib.loss(module, variables, batch)

  nnx_module = nnx_lib.from_linen(variables["params"], config)
  nnx_loss = nnx_lib.loss(nnx_module, batch)

  np.testing.assert_allclose(nnx_loss, linen_loss, rtol=1e-5)
  assert float(linen_loss) == pytest.approx(np.log(config.vocab_size), rel=0.2)


def test_from_linen_rejects_mismatched_params():
  config = gpt.CONFIGS["tiny"]
  batch = gpt.make_batch(config, jax.random.key(1), 1)
  variables = gpt.GPT(config).init(jax.random.key(0), batch["inputs"])
  with pytest.raises(ValueError, match="do not match"):
    gpt_nnx.from_linen(variables["params"], dataclasses.replace(config, num_layers=3))
  with pytest.raises(ValueError, match="shape"):
    gpt_nnx.from_linen(variables["params"], dataclasses.replace(config, d_model=32))


def test_rope_depends_only_on_relative_position():
  head_dim = 16
  q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, head_dim))
  def rope(x, pos):
    return llama.apply_rope(x, jnp.array([pos]), 10000.0)[0, 0, 0]
  def dot(m, n):
    return jnp.dot(rope(q, m), rope(k, n))
  np.testing.assert_allclose(dot(3, 1), dot(10, 8), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dot(0, 5), dot(20, 25), rtol=1e-5, atol=1e-5)
  assert not np.allclose(dot(3, 1), dot(3, 2), rtol=1e-3)
  # Position 0 is the identity, and rotation keeps the norm.
  np.testing.assert_allclose(rope(q, 0), q[0, 0, 0], rtol=1e-6)
  np.testing.assert_allclose(jnp.linalg.norm(rope(q, 7)), jnp.linalg.norm(q), rtol=1e-5)


def test_gqa_equals_attention_with_repeated_kv_heads():
  q = jax.random.normal(jax.random.key(0), (2, 8, 4, 16))
  k, v = jax.random.normal(jax.random.key(1), (2, 2, 8, 2, 16))
  grouped = llama.attention(q, k, v)
  full = llama.attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2))
  np.testing.assert_allclose(grouped, full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [4, 8, 16])
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_chunked_attention_equals_attention_forward_and_grads(chunk, num_kv_heads):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (2, 16, 4, 8))
  k, v = (jax.random.normal(x, (2, 16, num_kv_heads, 8)) for x in keys[1:3])
  probe = jax.random.normal(keys[3], (2, 16, 32))

  def loss(fn):
    return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)) * probe)

  chunked = lambda q, k, v: llama.chunked_attention(q, k, v, chunk)  # noqa: E731
  np.testing.assert_allclose(chunked(q, k, v), llama.attention(q, k, v), rtol=1e-5,
                             atol=1e-6)
  want = jax.grad(loss(llama.attention), argnums=(0, 1, 2))(q, k, v)
  got = jax.grad(loss(chunked), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_chunked_attention_keeps_no_scores_sized_residual():
  # What the backward keeps of the forward: no [length, length] tensor per head.
  q = jax.ShapeDtypeStruct((1, 64, 2, 4), jnp.float32)
  f = lambda q: jnp.sum(llama.chunked_attention(q, q, q, 8))  # noqa: E731
  _, residuals = jax.vjp(f, jnp.zeros(q.shape, q.dtype))
  sizes = [x.size for x in jax.tree.leaves(residuals)]
  assert max(sizes) < 64 * 64, sizes
  _, plain = jax.vjp(lambda q: jnp.sum(llama.attention(q, q, q)), jnp.zeros(q.shape))
  assert max(x.size for x in jax.tree.leaves(plain)) >= 2 * 64 * 64


@pytest.mark.parametrize("family", ["llama", "llama_nnx"])
def test_chunked_llama_gives_the_plain_loss(family):
  from tapas_jax import models  # noqa: PLC0415
  m = models.get_model(family, "tiny")
  c = models.get_model(family, "tiny", attention="chunked", attention_chunk=8)
  state = m.init(jax.random.key(0))
  batch = m.make_batch(jax.random.key(1), 2)
  want, _ = m.loss_fn()(state.params, state.model_state, batch)
  got, _ = c.loss_fn()(state.params, state.model_state, batch)
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("fields,match", [
    (dict(attention="flash"), "attention='flash' is not one of"),
    (dict(attention="chunked", attention_chunk=5), "attention_chunk=5 must be positive and "
     "divide seq_len=32"),
])
def test_llama_rejects_bad_attention_options(fields, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(llama.CONFIGS["tiny"], **fields)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_llama_runs_with_any_kv_head_count(num_kv_heads):
  config = dataclasses.replace(llama.CONFIGS["tiny"], num_kv_heads=num_kv_heads)
  batch = llama.make_batch(config, jax.random.key(1), 2)
  variables = llama.Llama(config).init(jax.random.key(0), batch["inputs"])
  head_dim = config.d_model // config.num_heads
  kernel = variables["params"]["Block_0"]["Attention"]["k_proj"]["kernel"]
  assert kernel.shape == (config.d_model, num_kv_heads * head_dim)
  logits = llama.Llama(config).apply(variables, batch["inputs"])
  assert logits.shape == (2, config.seq_len, config.vocab_size)
  assert bool(jnp.all(jnp.isfinite(logits)))


def test_llama_rejects_bad_kv_heads():
  with pytest.raises(ValueError, match="num_kv_heads"):
    dataclasses.replace(llama.CONFIGS["tiny"], num_kv_heads=3)


def test_llama_is_causal():
  config = llama.CONFIGS["tiny"]
  tokens = llama.make_batch(config, jax.random.key(1), 1)["inputs"]
  module = llama.Llama(config)
  variables = module.init(jax.random.key(0), tokens)
  changed = tokens.at[0, -1].set((tokens[0, -1] + 1) % config.vocab_size)
  before, after = module.apply(variables, tokens), module.apply(variables, changed)
  np.testing.assert_allclose(before[:, :-1], after[:, :-1], rtol=1e-5, atol=1e-5)
  assert not np.allclose(before[:, -1], after[:, -1])


@pytest.mark.parametrize("family", ["llama", "llama_nnx"])
def test_llama_computes_in_dtype_with_weights_in_param_dtype(family):
  from tapas_jax import models  # noqa: PLC0415
  m = models.get_model(family, "tiny", dtype="bfloat16", param_dtype="float32")
  params = jax.eval_shape(lambda r: m.init_variables(r)[0], jax.random.key(0))
  assert {str(x.dtype) for x in jax.tree.leaves(params)} == {"float32"}
  batch = m.batch_spec(2)
  jaxpr = jax.make_jaxpr(lambda p, b: m.loss_fn()(p, {}, b)[0])(params, batch)
  dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
  assert dots and all(str(v.aval.dtype) == "bfloat16" for e in dots for v in e.invars)
