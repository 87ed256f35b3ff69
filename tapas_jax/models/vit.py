"""Vision Transformer in flax linen: conv patch embedding, class token, learned
positions, pre-LayerNorm encoder with GELU MLP, classification head on the
class token.

Example:
  >>> from tapas_jax.models import vit
  >>> module = vit.ViT(vit.CONFIGS["tiny"])
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from tapas_jax.models import training


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  """Shape of a ViT model.

  Attributes:
    image_size: height and width of the (square) input image.
    patch_size: side of a square patch; `image_size` must divide by it.
    num_classes: classifier outputs.
    num_layers: transformer blocks.
    num_heads: attention heads; `d_model` must divide by it.
    d_model: residual width.
    d_ff: MLP hidden width.
    channels: input image channels.
    dtype: activation and parameter dtype name.
    scan_layers: stack blocks with `nn.scan` (one folded layer in the jaxpr).
  """

  image_size: int = 224
  patch_size: int = 16
  num_classes: int = 1000
  num_layers: int = 12
  num_heads: int = 12
  d_model: int = 768
  d_ff: int = 3072
  channels: int = 3
  dtype: str = "float32"
  scan_layers: bool = False

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2


CONFIGS = {
    "tiny": ViTConfig(image_size=32, patch_size=8, num_classes=10, num_layers=2,
                      num_heads=4, d_model=64, d_ff=128),
    "vit-b16": ViTConfig(),
    "vit-h14": ViTConfig(patch_size=14, num_layers=32, num_heads=16, d_model=1280,
                         d_ff=5120),
}


class Attention(nn.Module):
  config: ViTConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    head_dim = cfg.d_model // cfg.num_heads
    def dense(name):
      return nn.DenseGeneral((cfg.num_heads, head_dim), dtype=cfg.dtype,
                             param_dtype=cfg.dtype, name=name)
    q, k, v = dense("query")(x), dense("key")(x), dense("value")(x)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(cfg.dtype)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return nn.DenseGeneral(cfg.d_model, axis=(-2, -1), dtype=cfg.dtype,
                           param_dtype=cfg.dtype, name="out")(out)


class MLP(nn.Module):
  config: ViTConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    h = nn.Dense(cfg.d_ff, dtype=cfg.dtype, param_dtype=cfg.dtype, name="fc1")(x)
    h = nn.gelu(h)
    return nn.Dense(cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.dtype, name="fc2")(h)


class Block(nn.Module):
  config: ViTConfig

  @nn.compact
  def __call__(self, x, _=None):
    cfg = self.config
    def ln(name):
      return nn.LayerNorm(dtype=cfg.dtype, param_dtype=cfg.dtype, name=name)
    x = x + Attention(cfg, name="Attention")(ln("ln1")(x))
    x = x + MLP(cfg, name="MLP")(ln("ln2")(x))
    return x, None


class ViT(nn.Module):
  """`ViT(config)(images) -> logits (B, num_classes)`, from the class token."""
  config: ViTConfig

  def setup(self):
    cfg = self.config
    p = cfg.patch_size
    self.embedding = nn.Conv(cfg.d_model, (p, p), strides=(p, p), padding="VALID",
                             dtype=cfg.dtype, param_dtype=cfg.dtype)
    self.cls = self.param("cls", nn.initializers.zeros, (1, 1, cfg.d_model),
                          jnp.dtype(cfg.dtype))
    self.pos_embedding = self.param("pos_embedding", nn.initializers.normal(0.02),
                                    (1, cfg.num_patches + 1, cfg.d_model),
                                    jnp.dtype(cfg.dtype))
    if cfg.scan_layers:
      stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=cfg.num_layers)
      self.layers = stack(cfg)
    else:
      for i in range(cfg.num_layers):  # Named by attribute: params["Block_{i}"].
        setattr(self, f"Block_{i}", Block(cfg))
    self.ln_f = nn.LayerNorm(dtype=cfg.dtype, param_dtype=cfg.dtype)
    self.head = nn.Dense(cfg.num_classes, dtype=cfg.dtype, param_dtype=cfg.dtype)

  def features(self, images):
    """The encoded sequence `(B, 1 + num_patches, d_model)`; index 0 is the class token."""
    cfg = self.config
    x = self.embedding(images.astype(cfg.dtype))
    x = x.reshape(x.shape[0], -1, cfg.d_model)
    cls = jnp.broadcast_to(self.cls, (x.shape[0], 1, cfg.d_model))
    x = jnp.concatenate([cls, x], axis=1) + self.pos_embedding
    if cfg.scan_layers:
      x, _ = self.layers(x, None)
    else:
      for i in range(cfg.num_layers):
        x, _ = getattr(self, f"Block_{i}")(x)
    return self.ln_f(x)

  def __call__(self, images):
    return self.head(self.features(images)[:, 0])


def make_batch(config: ViTConfig, rng: jax.Array, batch_size: int) -> dict:
  image_rng, label_rng = jax.random.split(rng)
  shape = (batch_size, config.image_size, config.image_size, config.channels)
  return {"images": jax.random.normal(image_rng, shape, jnp.dtype(config.dtype)),
          "labels": jax.random.randint(label_rng, (batch_size,), 0, config.num_classes)}


def loss(module: ViT, variables: dict, batch: dict):
  logits = module.apply(variables, batch["images"])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), batch["labels"]).mean(), {}


FAMILY = training.Family(name="vit", framework="linen", configs=CONFIGS,
                         make_module=ViT, make_batch=make_batch, loss=loss,
                         inputs=lambda batch: (batch["images"],))
