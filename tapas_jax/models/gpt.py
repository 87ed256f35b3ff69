"""GPT-2 style decoder in flax linen: learned positions, pre-LayerNorm, GELU MLP,
tied input/output embeddings.

Example:
  >>> from tapas_jax.models import gpt
  >>> module = gpt.GPT(gpt.CONFIGS["tiny"])
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from tapas_jax.models import training


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Shape of a GPT model.

  Attributes:
    vocab_size: number of tokens.
    seq_len: context length (also the number of learned positions).
    num_layers: transformer blocks.
    num_heads: attention heads; `d_model` must divide by it.
    d_model: residual width.
    d_ff: MLP hidden width; 0 means 4 * d_model.
    activation: MLP nonlinearity, "gelu" or "relu".
    dtype: activation and parameter dtype name.
    scan_layers: stack blocks with `nn.scan` (one folded layer in the jaxpr).
  """

  vocab_size: int = 50257
  seq_len: int = 1024
  num_layers: int = 12
  num_heads: int = 12
  d_model: int = 768
  d_ff: int = 0
  activation: str = "gelu"
  dtype: str = "float32"
  scan_layers: bool = False

  @property
  def hidden(self) -> int:
    return self.d_ff or 4 * self.d_model


CONFIGS = {
    "tiny": GPTConfig(vocab_size=256, seq_len=32, num_layers=2, num_heads=4, d_model=64),
    "gpt2-small": GPTConfig(),
    "gpt2-medium": GPTConfig(num_layers=24, num_heads=16, d_model=1024),
    "gpt2-xl": GPTConfig(num_layers=48, num_heads=25, d_model=1600),
    "gpt3-6.7b": GPTConfig(seq_len=2048, num_layers=32, num_heads=32, d_model=4096),
    "gpt3-175b": GPTConfig(seq_len=2048, num_layers=96, num_heads=96, d_model=12288),
}

_ACTIVATIONS = {"gelu": nn.gelu, "relu": nn.relu}


class Attention(nn.Module):
  config: GPTConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    head_dim = cfg.d_model // cfg.num_heads
    def dense(name):
      return nn.DenseGeneral((cfg.num_heads, head_dim), dtype=cfg.dtype,
                             param_dtype=cfg.dtype, name=name)
    q, k, v = dense("query")(x), dense("key")(x), dense("value")(x)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(cfg.dtype)
    length = x.shape[1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return nn.DenseGeneral(cfg.d_model, axis=(-2, -1), dtype=cfg.dtype,
                           param_dtype=cfg.dtype, name="out")(out)


class MLP(nn.Module):
  config: GPTConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    h = nn.Dense(cfg.hidden, dtype=cfg.dtype, param_dtype=cfg.dtype, name="fc1")(x)
    h = _ACTIVATIONS[cfg.activation](h)
    return nn.Dense(cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.dtype, name="fc2")(h)


class Block(nn.Module):
  config: GPTConfig

  @nn.compact
  def __call__(self, x, _=None):
    cfg = self.config
    def ln(name):
      return nn.LayerNorm(dtype=cfg.dtype, param_dtype=cfg.dtype, name=name)
    x = x + Attention(cfg, name="Attention")(ln("ln1")(x))
    x = x + MLP(cfg, name="MLP")(ln("ln2")(x))
    return x, None


class GPT(nn.Module):
  config: GPTConfig

  @nn.compact
  def __call__(self, tokens):
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.dtype,
                     name="wte")
    positions = self.param("wpe", nn.initializers.normal(0.02), (cfg.seq_len, cfg.d_model),
                           jnp.dtype(cfg.dtype))
    x = embed(tokens) + positions[: tokens.shape[1]]
    if cfg.scan_layers:
      stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=cfg.num_layers)
      x, _ = stack(cfg, name="layers")(x, None)
    else:
      for i in range(cfg.num_layers):
        x, _ = Block(cfg, name=f"Block_{i}")(x)
    x = nn.LayerNorm(dtype=cfg.dtype, param_dtype=cfg.dtype, name="ln_f")(x)
    return embed.attend(x)


def make_batch(config: GPTConfig, rng: jax.Array, batch_size: int) -> dict:
  tokens = jax.random.randint(rng, (batch_size, config.seq_len + 1), 0, config.vocab_size)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross entropy, computed in float32."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets).mean()


def loss(module: GPT, variables: dict, batch: dict):
  return lm_loss(module.apply(variables, batch["inputs"]), batch["targets"]), {}


FAMILY = training.Family(name="gpt", framework="linen", configs=CONFIGS,
                         make_module=GPT, make_batch=make_batch, loss=loss)
