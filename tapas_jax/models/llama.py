"""LLaMA style decoder in flax linen: RMSNorm, rotary positions, SwiGLU MLP,
grouped-query attention, untied embedding and head, no biases.

The q/k/v/o projections are plain `nn.Dense` layers reshaped to heads (2-D
kernels), unlike `gpt.py`'s `DenseGeneral` (3-D kernels), so the planner sees
both layouts.

Example:
  >>> from tapas_jax.models import llama
  >>> module = llama.Llama(llama.CONFIGS["tiny"])
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from tapas_jax.models import gpt
from tapas_jax.models import training


ATTENTIONS = ("plain", "chunked")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shape of a LLaMA model.

  Attributes:
    vocab_size: number of tokens.
    seq_len: context length of a batch.
    num_layers: transformer blocks.
    num_heads: query heads; `d_model` must divide by it.
    num_kv_heads: key/value heads (grouped-query attention); must divide `num_heads`.
    d_model: residual width.
    d_ff: SwiGLU hidden width.
    rope_theta: base of the rotary embedding frequencies.
    norm_eps: RMSNorm epsilon.
    dtype: activation (compute) dtype name.
    param_dtype: parameter dtype name; None: `dtype` (MaxText's `weight_dtype`: its
      recipes compute in bfloat16 and keep float32 weights).
    scan_layers: stack blocks with `nn.scan` (one folded layer in the jaxpr).
    attention: "plain" (scores and probabilities of `[length, length]` per head, kept
      for the backward) or "chunked" (`chunked_attention`: query blocks in a loop,
      each rematerialised, so no `[length, length]` tensor outlives a block: the
      JAX-level counterpart of a flash/splash attention kernel's memory).
    attention_chunk: query block length for "chunked"; must divide `seq_len`.
  """

  vocab_size: int = 32000
  seq_len: int = 2048
  num_layers: int = 32
  num_heads: int = 32
  num_kv_heads: int = 32
  d_model: int = 4096
  d_ff: int = 11008
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  dtype: str = "float32"
  param_dtype: str | None = None
  scan_layers: bool = False
  attention: str = "plain"
  attention_chunk: int = 512

  def __post_init__(self):
    if self.attention not in ATTENTIONS:
      raise ValueError(f"attention={self.attention!r} is not one of {ATTENTIONS}")
    if self.attention == "chunked" and (self.attention_chunk <= 0
                                        or self.seq_len % self.attention_chunk):
      raise ValueError(f"attention_chunk={self.attention_chunk} must be positive and divide "
                       f"seq_len={self.seq_len}; pick a divisor of seq_len")
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model={self.d_model} must divide by num_heads={self.num_heads}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must divide by "
                       f"num_kv_heads={self.num_kv_heads}")

  @property
  def weight_dtype(self) -> str:
    return self.param_dtype or self.dtype

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


CONFIGS = {
    "tiny": LlamaConfig(vocab_size=256, seq_len=32, num_layers=2, num_heads=4,
                        num_kv_heads=2, d_model=64, d_ff=128),
    "llama3-8b": LlamaConfig(vocab_size=128256, seq_len=8192, num_layers=32, num_heads=32,
                             num_kv_heads=8, d_model=4096, d_ff=14336,
                             rope_theta=500000.0),
    "llama3-70b": LlamaConfig(vocab_size=128256, seq_len=8192, num_layers=80, num_heads=64,
                              num_kv_heads=8, d_model=8192, d_ff=28672,
                              rope_theta=500000.0),
}


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding (the "rotate half" layout).

  Args:
    x: `[batch, length, heads, head_dim]`; `head_dim` must be even.
    positions: `[length]` integer positions.
    theta: frequency base.

  Returns:
    `x` rotated by position, same shape and dtype; computed in float32.
  """
  head_dim = x.shape[-1]
  freqs = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]
  angles = jnp.concatenate([angles, angles], axis=-1)[None, :, None, :]
  x32 = x.astype(jnp.float32)
  first, second = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-second, first], axis=-1)
  return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Causal grouped-query attention.

  Args:
    q: `[batch, length, num_heads, head_dim]`.
    k: `[batch, length, num_kv_heads, head_dim]`.
    v: like `k`.

  Returns:
    `[batch, length, num_heads * head_dim]`.
  """
  batch, length, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  q = q.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
  scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / jnp.sqrt(head_dim).astype(q.dtype)
  causal = jnp.tril(jnp.ones((length, length), dtype=bool))
  scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
  weights = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgqs,bskd->bqkgd", weights, v)
  return out.reshape(batch, length, num_heads * head_dim)


def chunked_attention(q: jax.Array, k: jax.Array, v: jax.Array, chunk: int) -> jax.Array:
  """Causal grouped-query attention computed one block of `chunk` queries at a time.

  Equal to `attention` (same arithmetic per query row). Each block's scores against
  every key are made, used and dropped inside a `lax.map` step, and the step is
  `jax.checkpoint`ed, so the backward pass recomputes them block by block: only the
  block's inputs are saved. At most `[chunk, length]` scores per head exist at a time
  instead of `[length, length]` (what flash/splash attention kernels achieve in one
  fused kernel; this is the same memory behaviour in plain JAX, without their causal
  block skipping).

  Args:
    q: `[batch, length, num_heads, head_dim]`.
    k: `[batch, length, num_kv_heads, head_dim]`.
    v: like `k`.
    chunk: query block length; must divide `length`.

  Returns:
    `[batch, length, num_heads * head_dim]`.

  Example:
    >>> q = k = v = jnp.ones((1, 8, 2, 4))
    >>> chunked_attention(q, k, v, chunk=4).shape
    (1, 8, 8)
  """
  batch, length, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  if chunk <= 0 or length % chunk:
    raise ValueError(f"chunked_attention: chunk={chunk} must be positive and divide the "
                     f"sequence length {length}")
  blocks = length // chunk
  q = q.reshape(batch, blocks, chunk, num_kv_heads, num_heads // num_kv_heads, head_dim)
  q = jnp.moveaxis(q, 1, 0)  # the loop runs over query blocks
  scale = jnp.sqrt(head_dim).astype(q.dtype)

  @jax.checkpoint
  def block(args):
    qb, first = args
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qb, k) / scale
    # The mask as an additive [chunk, length] bias: a `where` against a scalar would be
    # hoisted out of the loop as a scores-sized constant.
    causal = (first + jnp.arange(chunk))[:, None] >= jnp.arange(length)[None, :]
    scores = scores + jnp.where(causal, 0.0, jnp.finfo(scores.dtype).min).astype(scores.dtype)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bkgqs,bskd->bqkgd", weights, v)

  out = jax.lax.map(block, (q, jnp.arange(blocks) * chunk))
  return jnp.moveaxis(out, 0, 1).reshape(batch, length, num_heads * head_dim)


def attend(config: LlamaConfig, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """The config's attention (`attention` or `chunked_attention`) of rotated q, k, v."""
  if config.attention == "chunked":
    return chunked_attention(q, k, v, config.attention_chunk)
  return attention(q, k, v)


class Attention(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    def dense(features, name):
      return nn.Dense(features, use_bias=False, dtype=cfg.dtype,
                      param_dtype=cfg.weight_dtype, name=name)
    batch, length, _ = x.shape
    q = dense(cfg.num_heads * cfg.head_dim, "q_proj")(x)
    k = dense(cfg.num_kv_heads * cfg.head_dim, "k_proj")(x)
    v = dense(cfg.num_kv_heads * cfg.head_dim, "v_proj")(x)
    q = q.reshape(batch, length, cfg.num_heads, cfg.head_dim)
    k = k.reshape(batch, length, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(batch, length, cfg.num_kv_heads, cfg.head_dim)
    positions = jnp.arange(length)
    q = apply_rope(q, positions, cfg.rope_theta)
    k = apply_rope(k, positions, cfg.rope_theta)
    return dense(cfg.d_model, "o_proj")(attend(cfg, q, k, v))


class MLP(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    def dense(features, name):
      return nn.Dense(features, use_bias=False, dtype=cfg.dtype,
                      param_dtype=cfg.weight_dtype, name=name)
    h = nn.silu(dense(cfg.d_ff, "gate_proj")(x)) * dense(cfg.d_ff, "up_proj")(x)
    return dense(cfg.d_model, "down_proj")(h)


class Block(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x, _=None):
    cfg = self.config
    def norm(name):
      return nn.RMSNorm(epsilon=cfg.norm_eps, dtype=cfg.dtype,
                        param_dtype=cfg.weight_dtype, name=name)
    x = x + Attention(cfg, name="Attention")(norm("attention_norm")(x))
    x = x + MLP(cfg, name="MLP")(norm("mlp_norm")(x))
    return x, None


class Llama(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, tokens):
    cfg = self.config
    x = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.weight_dtype,
                 name="embed")(tokens)
    if cfg.scan_layers:
      stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=cfg.num_layers)
      x, _ = stack(cfg, name="layers")(x, None)
    else:
      for i in range(cfg.num_layers):
        x, _ = Block(cfg, name=f"Block_{i}")(x)
    x = nn.RMSNorm(epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.weight_dtype,
                   name="norm")(x)
    return nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.weight_dtype,
                    name="lm_head")(x)


make_batch = gpt.make_batch
lm_loss = gpt.lm_loss


def loss(module: Llama, variables: dict, batch: dict):
  return lm_loss(module.apply(variables, batch["inputs"]), batch["targets"]), {}


FAMILY = training.Family(name="llama", framework="linen", configs=CONFIGS,
                         make_module=Llama, make_batch=make_batch, loss=loss)
