"""Focused checks of the T5 and ViT zoo models (tiny configs, CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tapas_jax import models
from tapas_jax.models import t5
from tapas_jax.models import vit


def _buckets(relative, bidirectional, num_buckets=32, max_distance=128):
  return np.asarray(t5.relative_position_bucket(jnp.asarray(relative), bidirectional,
                                                num_buckets, max_distance))


@pytest.mark.parametrize("bidirectional", [True, False])
def test_bucket_zero_for_distance_zero(bidirectional):
  assert _buckets(np.array([0]), bidirectional)[0] == 0


@pytest.mark.parametrize("bidirectional", [True, False])
def test_buckets_in_range_and_saturate(bidirectional):
  relative = np.arange(-1000, 1001)
  buckets = _buckets(relative, bidirectional)
  assert buckets.min() >= 0 and buckets.max() < 32
  # Every distance at or beyond max_distance into the past shares the last bucket.
  past = buckets[relative <= -128]
  assert (past == past[0]).all()


@pytest.mark.parametrize("sign", [-1, 1])
def test_bidirectional_buckets_monotone_in_distance(sign):
  distance = np.arange(0, 500)
  buckets = _buckets(sign * distance, True)
  assert (np.diff(buckets[1:]) >= 0).all()
  assert buckets[1] > buckets[0]
  # Exact buckets for small distances: each gets its own.
  assert len(set(buckets[:8].tolist())) == 8


def test_bidirectional_separates_past_and_future():
  past = set(_buckets(-np.arange(1, 300), True).tolist())
  future = set(_buckets(np.arange(1, 300), True).tolist())
  assert not past & future


def test_causal_buckets_have_no_future():
  future = _buckets(np.arange(1, 300), False)
  assert (future == 0).all()
  past = _buckets(-np.arange(0, 500), False)
  assert (np.diff(past) >= 0).all()
  assert past.max() == 31  # the causal stack uses all its buckets on the past


def _t5_tiny():
  cfg = t5.CONFIGS["tiny"]
  module = t5.T5(cfg)
  batch = t5.make_batch(cfg, jax.random.key(1), 2)
  variables = module.init(jax.random.key(0), batch["inputs"], batch["decoder_inputs"])
  return cfg, module, variables, batch


def test_t5_decoder_is_causal():
  cfg, module, variables, batch = _t5_tiny()
  logits = module.apply(variables, batch["inputs"], batch["decoder_inputs"])
  assert logits.shape == (2, cfg.dec_len, cfg.vocab_size)
  j = cfg.dec_len // 2
  changed = batch["decoder_inputs"].at[:, j].set((batch["decoder_inputs"][:, j] + 1)
                                                  % cfg.vocab_size)
  logits2 = module.apply(variables, batch["inputs"], changed)
  np.testing.assert_allclose(logits[:, :j], logits2[:, :j], atol=1e-5)
  assert not np.allclose(logits[:, j:], logits2[:, j:], atol=1e-5)


def test_t5_encoder_sees_whole_input():
  cfg, module, variables, batch = _t5_tiny()
  logits = module.apply(variables, batch["inputs"], batch["decoder_inputs"])
  changed = batch["inputs"].at[:, -1].set((batch["inputs"][:, -1] + 1) % cfg.vocab_size)
  logits2 = module.apply(variables, changed, batch["decoder_inputs"])
  # Every decoder position attends to the last encoder token via cross-attention.
  diff = np.abs(np.asarray(logits - logits2)).max(axis=(0, 2))
  assert (diff > 1e-6).all()


def test_t5_head_width_independent_of_d_model():
  m = models.get_model("t5", "tiny", num_heads=2, d_kv=8, tie_embeddings=False)
  params = jax.eval_shape(lambda r: m.init_variables(r)[0], jax.random.key(0))
  attn = params["decoder"]["layers_0"]["CrossAttention"]
  assert attn["query"]["kernel"].shape == (64, 16)
  assert attn["out"]["kernel"].shape == (16, 64)
  assert params["logits_dense"]["kernel"].shape == (64, 256)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_vit_logits_come_from_class_token(scan_layers):
  cfg = models.override(vit.CONFIGS["tiny"], scan_layers=scan_layers)
  module = vit.ViT(cfg)
  batch = vit.make_batch(cfg, jax.random.key(1), 3)
  variables = module.init(jax.random.key(0), batch["images"])
  logits = module.apply(variables, batch["images"])
  assert logits.shape == (3, cfg.num_classes)
  features = module.apply(variables, batch["images"], method=vit.ViT.features)
  assert features.shape == (3, 1 + cfg.num_patches, cfg.d_model)
  head = variables["params"]["head"]
  np.testing.assert_allclose(logits, features[:, 0] @ head["kernel"] + head["bias"],
                             atol=1e-5)
  # Not mean pooling: the class token and the average patch give different logits.
  pooled = features[:, 1:].mean(axis=1) @ head["kernel"] + head["bias"]
  assert not np.allclose(logits, pooled, atol=1e-3)
