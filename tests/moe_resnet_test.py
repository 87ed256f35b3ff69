"""Focused tests of the MoE routing layer and of ResNet batch statistics."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tapas_jax.models import moe
from tapas_jax.models import resnet


def _routing(groups=2, tokens=16, experts=4, top_k=2, capacity=3, seed=0):
  logits = jax.random.normal(jax.random.key(seed), (groups, tokens, experts))
  dispatch, combine, aux = moe.top_k_routing(logits, top_k, capacity)
  return logits, np.asarray(dispatch), np.asarray(combine), float(aux)


def test_routing_picks_top_k_and_respects_capacity():
  logits, dispatch, combine, aux = _routing(capacity=3)
  top = np.asarray(jax.lax.top_k(logits, 2)[1])
  # Each token goes to at most top_k experts, only ones among its top_k, one slot each.
  per_expert = dispatch.sum(axis=-1)                       # (g, s, e)
  assert set(np.unique(per_expert)) <= {0.0, 1.0}
  assert (per_expert.sum(axis=-1) <= 2).all()
  for g, s, e in zip(*np.nonzero(per_expert)):
    assert e in top[g, s]
  # No expert exceeds its capacity; every slot holds at most one token.
  assert (dispatch.sum(axis=1) <= 1).all()
  # 16 tokens x 2 choices per group, but only 4 experts x 3 slots.
  assert per_expert.sum() <= 2 * 4 * 3
  # Combine weights live where dispatch does, and sum to at most 1 per token.
  assert ((combine > 0) <= (dispatch > 0)).all()
  totals = combine.sum(axis=(2, 3))
  assert (totals <= 1 + 1e-6).all()
  dropped = per_expert.sum(axis=-1) < 2
  assert dropped.any()
  np.testing.assert_allclose(totals[~dropped], 1.0, rtol=1e-6)
  assert (totals[dropped] < 1 - 1e-6).all()
  assert aux > 0


def test_routing_fills_first_choices_before_second_choices():
  # Every token prefers expert 0 then expert 1; capacity 4 of 6 tokens.
  logits = jnp.tile(jnp.array([3.0, 2.0, 0.0, -1.0]), (1, 6, 1))
  dispatch, _, aux = moe.top_k_routing(logits, 2, 4)
  dispatch = np.asarray(dispatch)
  # Tokens 0..3 take expert 0's four slots in order; tokens 4, 5 are dropped there.
  np.testing.assert_array_equal(dispatch[0, :4, 0, :], np.eye(4))
  assert dispatch[0, 4:, 0, :].sum() == 0
  # Second choices are the same tokens in the same order on expert 1.
  np.testing.assert_array_equal(dispatch[0, :4, 1, :], np.eye(4))
  assert dispatch[0, :, 2:, :].sum() == 0
  # All first choices on one expert: f = (1, 0, 0, 0), aux = E * p_0.
  p0 = jax.nn.softmax(logits[0, 0])[0]
  np.testing.assert_allclose(aux, 4 * p0, rtol=1e-6)


def test_routing_drops_nothing_with_enough_capacity():
  _, dispatch, combine, _ = _routing(capacity=16)
  np.testing.assert_array_equal(dispatch.sum(axis=(2, 3)), 2.0)
  np.testing.assert_allclose(combine.sum(axis=(2, 3)), 1.0, rtol=1e-6)


def test_moe_layer_matches_per_token_loop():
  cfg = dataclasses.replace(moe.CONFIGS["tiny"], d_model=16, d_ff=24, num_experts=4,
                            capacity_factor=2.0)  # capacity = group size: no drops.
  layer = moe.MoE(cfg)
  x = jax.random.normal(jax.random.key(0), (2, 8, cfg.d_model))
  variables = layer.init(jax.random.key(1), x)
  out = np.asarray(layer.apply(variables, x))
  assert cfg.capacity(8) == 8

  p = jax.tree.map(np.asarray, variables["params"])
  router_w, router_b = p["router"]["kernel"], p["router"]["bias"]
  assert p["wi"].shape == (4, 16, 24) and p["wo"].shape == (4, 24, 16)
  xs = np.asarray(x).reshape(-1, cfg.d_model)
  expected = np.zeros_like(xs)
  for t, token in enumerate(xs):
    logits = token @ router_w + router_b
    top = np.argsort(-logits)[:2]
    gates = np.exp(logits[top] - logits[top].max())
    gates /= gates.sum()
    for gate, e in zip(gates, top):
      h = np.asarray(jax.nn.gelu(token @ p["wi"][e]))
      expected[t] += gate * (h @ p["wo"][e])
  np.testing.assert_allclose(out.reshape(-1, cfg.d_model), expected, rtol=1e-5, atol=1e-6)


def test_moe_blocks_alternate_and_aux_loss_counts():
  cfg = moe.CONFIGS["tiny"]
  module = moe.MoETransformer(cfg)
  batch = moe.make_batch(cfg, jax.random.key(0), 2)
  variables = module.init(jax.random.key(1), batch["inputs"])
  assert set(variables) == {"params"}
  params = variables["params"]
  for i in range(cfg.num_layers):
    assert ("MoE" if i % 2 else "MLP") in params[f"Block_{i}"]
    assert "Attention" in params[f"Block_{i}"]
  loss, state = moe.loss(module, variables, batch)
  no_aux, _ = moe.loss(moe.MoETransformer(dataclasses.replace(cfg, aux_loss_coef=0.0)),
                       variables, batch)
  assert state == {}
  # One sown aux loss per MoE block; the loss adds coef times their mean.
  _, sown = module.apply(variables, batch["inputs"], mutable=["intermediates"])
  aux = [float(a) for a in jax.tree.leaves(sown)]
  assert len(aux) == cfg.num_layers // 2 and all(a > 0 for a in aux)
  np.testing.assert_allclose(float(loss - no_aux), cfg.aux_loss_coef * np.mean(aux),
                             rtol=1e-3)


def test_resnet_batch_stats_update_in_train_and_are_used_in_eval():
  cfg = resnet.CONFIGS["tiny"]
  module = resnet.ResNet(cfg)
  batch = resnet.make_batch(cfg, jax.random.key(0), 4)
  variables = module.init(jax.random.key(1), batch["images"])
  assert set(variables) == {"params", "batch_stats"}
  evaluate = jax.jit(module.apply)
  train = jax.jit(lambda v, x: module.apply(v, x, train=True, mutable=["batch_stats"]))

  # Train mode (the loss) updates the running statistics.
  _, new_state = jax.jit(lambda v, b: resnet.loss(module, v, b))(variables, batch)
  changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), variables["batch_stats"],
                         new_state["batch_stats"])
  assert all(jax.tree.leaves(changed))

  # Eval mode (the default) reads them: other statistics, other outputs ...
  eval_old = evaluate(variables, batch["images"])
  eval_new = evaluate({**variables, **new_state}, batch["images"])
  assert not np.allclose(eval_old, eval_new)
  # ... and does not depend on the rest of the batch.
  single = evaluate({**variables, **new_state}, batch["images"][:1])
  np.testing.assert_allclose(single, eval_new[:1], rtol=1e-5, atol=1e-5)
  # Train mode normalises with batch statistics, so it does depend on the batch.
  train_full, _ = train(variables, batch["images"])
  train_half, _ = train(variables, batch["images"][:2])
  assert not np.allclose(train_full[:2], train_half, atol=1e-5)
