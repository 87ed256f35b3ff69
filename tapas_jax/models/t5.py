"""T5 (v1.0 style) encoder-decoder in flax linen: shared token embedding, RMS
LayerNorm, bucketed relative position bias, ReLU MLP, no biases, tied LM head.

The relative position bias is one `(num_buckets, num_heads)` table per stack
(`encoder/relpos_bias`, `decoder/relpos_bias`), computed once at the stack level
and passed to every layer. That is what T5 does (the first layer owns the table
and later layers reuse its output); only the parameter's path differs.
Attention logits are not scaled by `1/sqrt(d_kv)`: as in T5 the scale is folded
into the query initializer. There is no dropout and no padding mask.

Example:
  >>> from tapas_jax.models import t5
  >>> module = t5.T5(t5.CONFIGS["tiny"])
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from tapas_jax.models import training


@dataclasses.dataclass(frozen=True)
class T5Config:
  """Shape of a T5 model.

  Attributes:
    vocab_size: number of tokens (shared by encoder, decoder and LM head).
    enc_len: encoder input length.
    dec_len: decoder input / target length.
    num_encoder_layers: encoder blocks.
    num_decoder_layers: decoder blocks.
    num_heads: attention heads.
    d_model: residual width.
    d_kv: width of one head; `num_heads * d_kv` need not equal `d_model`.
    d_ff: MLP hidden width.
    num_buckets: relative position buckets per stack.
    max_distance: distance from which all positions share the last bucket.
    dtype: activation and parameter dtype name.
    tie_embeddings: use the token embedding as the LM head (T5 v1.0).
  """

  vocab_size: int = 32128
  enc_len: int = 512
  dec_len: int = 128
  num_encoder_layers: int = 12
  num_decoder_layers: int = 12
  num_heads: int = 12
  d_model: int = 768
  d_kv: int = 64
  d_ff: int = 3072
  num_buckets: int = 32
  max_distance: int = 128
  dtype: str = "float32"
  tie_embeddings: bool = True


CONFIGS = {
    "tiny": T5Config(vocab_size=256, enc_len=32, dec_len=16, num_encoder_layers=2,
                     num_decoder_layers=2, num_heads=4, d_model=64, d_kv=16, d_ff=128),
    "t5-base": T5Config(),
    "t5-11b": T5Config(num_encoder_layers=24, num_decoder_layers=24, num_heads=128,
                       d_model=1024, d_kv=128, d_ff=65536),
}


def relative_position_bucket(relative_position: jax.Array, bidirectional: bool = True,
                             num_buckets: int = 32, max_distance: int = 128) -> jax.Array:
  """Maps `key_position - query_position` to a bucket in `[0, num_buckets)`.

  Small distances get one bucket each; larger ones share log-spaced buckets up to
  `max_distance`, beyond which everything lands in the last bucket. Bidirectional
  stacks spend half the buckets on keys after the query. Causal stacks put every
  key after the query in bucket 0 (the masked ones; same as distance 0).

  Args:
    relative_position: int array of `key_position - query_position`.
    bidirectional: False for the causal decoder.
    num_buckets: total buckets.
    max_distance: distance at and beyond which the last bucket is used.

  Returns:
    int32 array of buckets, shaped like `relative_position`.
  """
  n = -relative_position.astype(jnp.int32)
  bucket = jnp.zeros_like(n)
  if bidirectional:
    num_buckets //= 2
    bucket = bucket + (n < 0).astype(jnp.int32) * num_buckets
    n = jnp.abs(n)
  else:
    n = jnp.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  log_ratio = (jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact)
               / math.log(max_distance / max_exact))
  large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(jnp.int32)
  large = jnp.minimum(large, num_buckets - 1)
  return bucket + jnp.where(is_small, n, large)


class T5LayerNorm(nn.Module):
  """RMS norm: scale only, no bias, no mean subtraction; computed in float32."""
  dtype: str = "float32"
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.dtype(self.dtype))
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    return x32.astype(self.dtype) * scale


class RelativePositionBias(nn.Module):
  """`(1, heads, q_len, k_len)` additive attention bias from bucketed distances."""
  config: T5Config
  bidirectional: bool

  @nn.compact
  def __call__(self, q_len: int, k_len: int):
    cfg = self.config
    table = self.param("rel_embedding", nn.initializers.normal(1.0),
                       (cfg.num_buckets, cfg.num_heads), jnp.dtype(cfg.dtype))
    relative = jnp.arange(k_len)[None, :] - jnp.arange(q_len)[:, None]
    buckets = relative_position_bucket(relative, self.bidirectional, cfg.num_buckets,
                                       cfg.max_distance)
    return jnp.transpose(table[buckets], (2, 0, 1))[None]


class Attention(nn.Module):
  """Multi-head attention with `d_kv`-wide heads; bias and mask are additive/boolean."""
  config: T5Config

  @nn.compact
  def __call__(self, x, memory, bias=None, mask=None):
    cfg = self.config
    inner = cfg.num_heads * cfg.d_kv
    # T5 does not scale logits by 1/sqrt(d_kv); the query init carries it instead.
    query_init = nn.initializers.variance_scaling(1.0 / cfg.d_kv, "fan_in", "truncated_normal")
    def dense(name, **kw):
      return nn.Dense(inner, use_bias=False, dtype=cfg.dtype,
                      param_dtype=cfg.dtype, name=name, **kw)
    def heads(y):
      return y.reshape(y.shape[:-1] + (cfg.num_heads, cfg.d_kv))
    q = heads(dense("query", kernel_init=query_init)(x))
    k = heads(dense("key")(memory))
    v = heads(dense("value")(memory))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    if bias is not None:
      scores = scores + bias.astype(scores.dtype)
    if mask is not None:
      scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(cfg.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    out = out.reshape(out.shape[:-2] + (inner,))
    return nn.Dense(cfg.d_model, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.dtype,
                    name="out")(out)


class MLP(nn.Module):
  """ReLU feed-forward `wo(relu(wi(x)))` without biases."""
  config: T5Config

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    h = nn.Dense(cfg.d_ff, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.dtype,
                 name="wi")(x)
    h = nn.relu(h)
    return nn.Dense(cfg.d_model, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.dtype,
                    name="wo")(h)


class EncoderLayer(nn.Module):
  config: T5Config

  @nn.compact
  def __call__(self, x, bias):
    cfg = self.config
    h = T5LayerNorm(cfg.dtype, name="pre_self_attention_norm")(x)
    x = x + Attention(cfg, name="SelfAttention")(h, h, bias=bias)
    h = T5LayerNorm(cfg.dtype, name="pre_mlp_norm")(x)
    return x + MLP(cfg, name="MLP")(h)


class DecoderLayer(nn.Module):
  config: T5Config

  @nn.compact
  def __call__(self, x, encoded, bias, causal):
    cfg = self.config
    h = T5LayerNorm(cfg.dtype, name="pre_self_attention_norm")(x)
    x = x + Attention(cfg, name="SelfAttention")(h, h, bias=bias, mask=causal)
    h = T5LayerNorm(cfg.dtype, name="pre_cross_attention_norm")(x)
    x = x + Attention(cfg, name="CrossAttention")(h, encoded)
    h = T5LayerNorm(cfg.dtype, name="pre_mlp_norm")(x)
    return x + MLP(cfg, name="MLP")(h)


class Encoder(nn.Module):
  config: T5Config

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    length = x.shape[1]
    bias = RelativePositionBias(cfg, bidirectional=True, name="relpos_bias")(length, length)
    for i in range(cfg.num_encoder_layers):
      x = EncoderLayer(cfg, name=f"layers_{i}")(x, bias)
    return T5LayerNorm(cfg.dtype, name="final_norm")(x)


class Decoder(nn.Module):
  config: T5Config

  @nn.compact
  def __call__(self, x, encoded):
    cfg = self.config
    length = x.shape[1]
    bias = RelativePositionBias(cfg, bidirectional=False, name="relpos_bias")(length, length)
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    for i in range(cfg.num_decoder_layers):
      x = DecoderLayer(cfg, name=f"layers_{i}")(x, encoded, bias, causal)
    return T5LayerNorm(cfg.dtype, name="final_norm")(x)


class T5(nn.Module):
  """`T5(config)(inputs, decoder_inputs) -> logits (B, dec_len, vocab)`."""
  config: T5Config

  @nn.compact
  def __call__(self, inputs, decoder_inputs):
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.dtype,
                     embedding_init=nn.initializers.normal(1.0), name="token_embedder")
    encoded = Encoder(cfg, name="encoder")(embed(inputs))
    x = Decoder(cfg, name="decoder")(embed(decoder_inputs), encoded)
    if cfg.tie_embeddings:
      # T5 v1.0 rescales before the tied projection.
      return embed.attend(x * jnp.asarray(cfg.d_model ** -0.5, cfg.dtype))
    return nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.dtype,
                    name="logits_dense")(x)


def make_batch(config: T5Config, rng: jax.Array, batch_size: int) -> dict:
  """Random tokens; `decoder_inputs` are the targets shifted right after a 0 start token."""
  enc_rng, dec_rng = jax.random.split(rng)
  inputs = jax.random.randint(enc_rng, (batch_size, config.enc_len), 1, config.vocab_size)
  targets = jax.random.randint(dec_rng, (batch_size, config.dec_len), 1, config.vocab_size)
  decoder_inputs = jnp.pad(targets[:, :-1], ((0, 0), (1, 0)))
  return {"inputs": inputs, "decoder_inputs": decoder_inputs, "targets": targets}


def loss(module: T5, variables: dict, batch: dict):
  logits = module.apply(variables, batch["inputs"], batch["decoder_inputs"])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), batch["targets"]).mean(), {}


FAMILY = training.Family(name="t5", framework="linen", configs=CONFIGS,
                         make_module=T5, make_batch=make_batch, loss=loss,
                         inputs=lambda batch: (batch["inputs"], batch["decoder_inputs"]))
