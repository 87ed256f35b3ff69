"""LLaMA style decoder in flax nnx: the same model as `llama.py`, written as an
`nnx.Module`.

Attribute names mirror the linen module names (`embed`, `norm`, `lm_head`; per
block `attention_norm`, `Attention`, `mlp_norm`, `MLP`), with the blocks in
`blocks` (an `nnx.List`) or, with `scan_layers`, stacked in `layers`, so
`from_linen` loads a linen `llama.Llama`'s weights one to one.

Example:
  >>> from flax import nnx
  >>> from tapas_jax.models import llama, llama_nnx
  >>> module = llama_nnx.Llama(llama.CONFIGS["tiny"], rngs=nnx.Rngs(0))
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tapas_jax.models import gpt_nnx
from tapas_jax.models import llama
from tapas_jax.models import training

LlamaConfig = llama.LlamaConfig
CONFIGS = llama.CONFIGS
make_batch = llama.make_batch
lm_loss = llama.lm_loss


def _dense(config: LlamaConfig, in_features: int, out_features: int,
           rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(in_features, out_features, use_bias=False,
                    dtype=jnp.dtype(config.dtype),
                    param_dtype=jnp.dtype(config.weight_dtype), rngs=rngs)


def _norm(config: LlamaConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
  return nnx.RMSNorm(config.d_model, epsilon=config.norm_eps,
                     dtype=jnp.dtype(config.dtype),
                     param_dtype=jnp.dtype(config.weight_dtype), rngs=rngs)


class Attention(nnx.Module):

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    cfg = config
    self.config = cfg
    self.q_proj = _dense(cfg, cfg.d_model, cfg.num_heads * cfg.head_dim, rngs)
    self.k_proj = _dense(cfg, cfg.d_model, cfg.num_kv_heads * cfg.head_dim, rngs)
    self.v_proj = _dense(cfg, cfg.d_model, cfg.num_kv_heads * cfg.head_dim, rngs)
    self.o_proj = _dense(cfg, cfg.num_heads * cfg.head_dim, cfg.d_model, rngs)

  def __call__(self, x):
    cfg = self.config
    batch, length, _ = x.shape
    q = self.q_proj(x).reshape(batch, length, cfg.num_heads, cfg.head_dim)
    k = self.k_proj(x).reshape(batch, length, cfg.num_kv_heads, cfg.head_dim)
    v = self.v_proj(x).reshape(batch, length, cfg.num_kv_heads, cfg.head_dim)
    positions = jnp.arange(length)
    q = llama.apply_rope(q, positions, cfg.rope_theta)
    k = llama.apply_rope(k, positions, cfg.rope_theta)
    return self.o_proj(llama.attend(cfg, q, k, v))


class MLP(nnx.Module):

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.gate_proj = _dense(config, config.d_model, config.d_ff, rngs)
    self.up_proj = _dense(config, config.d_model, config.d_ff, rngs)
    self.down_proj = _dense(config, config.d_ff, config.d_model, rngs)

  def __call__(self, x):
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.attention_norm = _norm(config, rngs)
    self.Attention = Attention(config, rngs=rngs)
    self.mlp_norm = _norm(config, rngs)
    self.MLP = MLP(config, rngs=rngs)

  def __call__(self, x):
    x = x + self.Attention(self.attention_norm(x))
    return x + self.MLP(self.mlp_norm(x))


class Llama(nnx.Module):
  """LLaMA decoder; `__call__(tokens) -> logits`."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    cfg = config
    self.config = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=jnp.dtype(cfg.dtype),
                           param_dtype=jnp.dtype(cfg.weight_dtype), rngs=rngs)
    blocks = gpt_nnx.make_blocks(Block, cfg, rngs)
    if cfg.scan_layers:
      self.layers = blocks
    else:
      self.blocks = blocks
    self.norm = _norm(cfg, rngs)
    self.lm_head = _dense(cfg, cfg.d_model, cfg.vocab_size, rngs)

  def __call__(self, tokens):
    cfg = self.config
    x = self.embed(tokens)
    blocks = self.layers if cfg.scan_layers else self.blocks
    x = gpt_nnx.run_blocks(blocks, x, cfg.scan_layers)
    return self.lm_head(self.norm(x))


def from_linen(linen_params: Any, config: LlamaConfig,
               rngs: nnx.Rngs | None = None) -> Llama:
  """An nnx `Llama` holding the weights of a linen `llama.Llama` with the same config.

  Args:
    linen_params: the linen `params` collection (or `{"params": ...}`).
    config: the config both models were built with.
    rngs: rngs for the (overwritten) initial weights; defaults to `nnx.Rngs(0)`.
  """
  return gpt_nnx.load_linen_params(make_module(config, rngs or nnx.Rngs(0)), linen_params)


def make_module(config: LlamaConfig, rngs: nnx.Rngs) -> Llama:
  return Llama(config, rngs=rngs)


def loss(module: Llama, batch: dict) -> jax.Array:
  return lm_loss(module(batch["inputs"]), batch["targets"])


FAMILY = training.Family(name="llama_nnx", framework="nnx", configs=CONFIGS,
                         make_module=make_module, make_batch=make_batch, loss=loss)
