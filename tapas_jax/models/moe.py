"""Mixture-of-experts decoder LM in flax linen (GShard / Switch style).

The model is the GPT decoder of `gpt` (learned positions, pre-LayerNorm, tied
embeddings) whose blocks alternate a dense MLP (even index) and a top-2 MoE MLP
(odd index). The MoE layer routes with a one-hot dispatch tensor under a fixed
expert capacity: each sequence of the batch is one routing group, tokens beyond an
expert's capacity are dropped (their residual passes through), and the experts run
as one batched matmul over an explicit expert dimension. A load-balancing auxiliary
loss is sown into the "intermediates" collection and added to the LM loss.

Example:
  >>> from tapas_jax.models import moe
  >>> module = moe.MoETransformer(moe.CONFIGS["tiny"])
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from tapas_jax.models import gpt
from tapas_jax.models import training


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """Shape of an MoE decoder.

  Attributes:
    vocab_size: number of tokens.
    seq_len: context length (also the number of learned positions and the
      routing group size).
    num_layers: transformer blocks; odd-indexed ones are MoE blocks.
    num_heads: attention heads; `d_model` must divide by it.
    d_model: residual width.
    d_ff: hidden width of the dense MLP and of each expert.
    num_experts: experts per MoE layer.
    top_k: experts each token is sent to.
    capacity_factor: expert capacity is
      `ceil(top_k * seq_len * capacity_factor / num_experts)` tokens per group.
    aux_loss_coef: weight of the load-balancing loss in the training loss.
    activation: MLP and expert nonlinearity, "gelu" or "relu".
    dtype: activation and parameter dtype name (the router runs in float32).
  """

  vocab_size: int = 32000
  seq_len: int = 1024
  num_layers: int = 12
  num_heads: int = 12
  d_model: int = 768
  d_ff: int = 3072
  num_experts: int = 8
  top_k: int = 2
  capacity_factor: float = 1.25
  aux_loss_coef: float = 0.01
  activation: str = "gelu"
  dtype: str = "float32"

  @property
  def hidden(self) -> int:
    """Dense MLP width, named as `gpt.MLP` expects."""
    return self.d_ff

  def capacity(self, group_size: int) -> int:
    """Tokens each expert takes from a routing group of `group_size` tokens."""
    return max(1, math.ceil(self.top_k * group_size * self.capacity_factor / self.num_experts))


CONFIGS = {
    "tiny": MoEConfig(vocab_size=256, seq_len=32, num_layers=4, num_heads=4, d_model=64,
                      d_ff=128, num_experts=4),
    # 6,679,689,984 params (6.68B): 12 dense + 12 MoE blocks; each MoE layer holds
    # 64 * 2 * 1024 * 4096 = 537M expert weights. About 0.44B are active per token.
    "moe-64e": MoEConfig(vocab_size=32000, seq_len=2048, num_layers=24, num_heads=16,
                         d_model=1024, d_ff=4096, num_experts=64),
}


def top_k_routing(logits: jax.Array, top_k: int, capacity: int):
  """GShard top-k routing with a fixed capacity per expert.

  Slots are filled in priority order: every token's first choice before any
  token's second choice, and within a choice in token order. An assignment that
  finds its expert full is dropped.

  Args:
    logits: (groups, tokens, experts) router logits.
    top_k: experts per token.
    capacity: slots per expert per group.

  Returns:
    `(dispatch, combine, aux_loss)`: `dispatch` is a (groups, tokens, experts,
    capacity) 0/1 tensor in the dtype of `logits`; `combine` is `dispatch` times the
    token's gate for that expert (the softmax of its top-k logits), so a token's
    combine weights sum to 1, or less when assignments were dropped; `aux_loss` is
    the Switch load-balancing loss `E * sum_e f_e * p_e` (f_e: fraction of tokens
    whose first choice is e; p_e: mean router probability of e), 1 when balanced.
  """
  num_experts = logits.shape[-1]
  top_logits, top_index = jax.lax.top_k(logits, top_k)          # (g, s, k)
  gates = jax.nn.softmax(top_logits, axis=-1)                   # (g, s, k)
  choice = jax.nn.one_hot(top_index, num_experts, dtype=jnp.int32)  # (g, s, k, e)
  # Priority order (k, s): cumulative count per expert gives each slot position.
  by_priority = jnp.swapaxes(choice, 1, 2)                      # (g, k, s, e)
  g, k, s, e = by_priority.shape
  flat = by_priority.reshape(g, k * s, e)
  position = (jnp.cumsum(flat, axis=1) - 1) * flat
  position = jnp.swapaxes(position.reshape(g, k, s, e), 1, 2)   # (g, s, k, e)
  keep = choice * (position < capacity)                         # (g, s, k, e)
  slot = jax.nn.one_hot(jnp.sum(position * keep, axis=-1), capacity,
                        dtype=logits.dtype)                     # (g, s, k, c)
  kept = jnp.sum(keep, axis=-1).astype(logits.dtype)            # (g, s, k): 0 or 1
  expert = choice.astype(logits.dtype)                          # (g, s, k, e)
  dispatch = jnp.einsum("gske,gskc->gsec", expert, slot * kept[..., None])
  combine = jnp.einsum("gske,gskc->gsec", expert, slot * (kept * gates)[..., None])
  probs = jax.nn.softmax(logits, axis=-1)
  first_fraction = jnp.mean(choice[:, :, 0, :].astype(logits.dtype), axis=(0, 1))
  mean_prob = jnp.mean(probs, axis=(0, 1))
  aux_loss = num_experts * jnp.sum(first_fraction * mean_prob)
  return dispatch, combine, aux_loss


class MoE(nn.Module):
  """Top-k MoE MLP over an explicit expert dimension.

  Params: `router` (Dense d_model -> num_experts), `wi` (E, d_model, d_ff),
  `wo` (E, d_ff, d_model). Sows its auxiliary loss as `intermediates/aux_loss`.
  """

  config: MoEConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    groups, group_size, d_model = x.shape
    num_experts = cfg.num_experts
    capacity = cfg.capacity(group_size)
    logits = nn.Dense(num_experts, dtype=jnp.float32, param_dtype=cfg.dtype,
                      name="router")(x)
    dispatch, combine, aux_loss = top_k_routing(logits, cfg.top_k, capacity)
    self.sow("intermediates", "aux_loss", aux_loss)
    init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    wi = self.param("wi", init, (num_experts, d_model, cfg.d_ff), dtype)
    wo = self.param("wo", init, (num_experts, cfg.d_ff, d_model), dtype)
    expert_in = jnp.einsum("gsec,gsd->egcd", dispatch.astype(dtype), x)
    expert_in = expert_in.reshape(num_experts, groups * capacity, d_model)
    h = gpt._ACTIVATIONS[cfg.activation](jnp.einsum("ecd,edf->ecf", expert_in, wi))
    expert_out = jnp.einsum("ecf,efd->ecd", h, wo)
    expert_out = expert_out.reshape(num_experts, groups, capacity, d_model)
    return jnp.einsum("gsec,egcd->gsd", combine.astype(dtype), expert_out)


class Block(nn.Module):
  """Pre-LayerNorm block: attention, then a dense MLP or an MoE MLP."""

  config: MoEConfig
  use_moe: bool = False

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    def ln(name):
      return nn.LayerNorm(dtype=cfg.dtype, param_dtype=cfg.dtype, name=name)
    x = x + gpt.Attention(cfg, name="Attention")(ln("ln1")(x))
    if self.use_moe:
      x = x + MoE(cfg, name="MoE")(ln("ln2")(x))
    else:
      x = x + gpt.MLP(cfg, name="MLP")(ln("ln2")(x))
    return x


class MoETransformer(nn.Module):
  config: MoEConfig

  @nn.compact
  def __call__(self, tokens):
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.dtype,
                     name="wte")
    positions = self.param("wpe", nn.initializers.normal(0.02), (cfg.seq_len, cfg.d_model),
                           jnp.dtype(cfg.dtype))
    x = embed(tokens) + positions[: tokens.shape[1]]
    for i in range(cfg.num_layers):
      x = Block(cfg, use_moe=i % 2 == 1, name=f"Block_{i}")(x)
    x = nn.LayerNorm(dtype=cfg.dtype, param_dtype=cfg.dtype, name="ln_f")(x)
    return embed.attend(x)


def make_batch(config: MoEConfig, rng: jax.Array, batch_size: int) -> dict:
  return gpt.make_batch(config, rng, batch_size)


def loss(module: MoETransformer, variables: dict, batch: dict):
  """LM loss plus `aux_loss_coef` times the mean auxiliary loss of the MoE layers."""
  logits, state = module.apply(variables, batch["inputs"], mutable=["intermediates"])
  aux = jax.tree.leaves(state.get("intermediates", {}))
  aux_loss = sum(aux) / len(aux) if aux else 0.0
  lm = gpt.lm_loss(logits, batch["targets"])
  return lm + module.config.aux_loss_coef * aux_loss, {}


FAMILY = training.Family(name="moe", framework="linen", configs=CONFIGS,
                         make_module=MoETransformer, make_batch=make_batch, loss=loss)
