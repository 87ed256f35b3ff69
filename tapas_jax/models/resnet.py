"""ResNet v1.5 (bottleneck blocks, stride on the 3x3 conv) in flax linen.

Convolutions have no bias and are followed by `nn.BatchNorm`, whose running
statistics live in the mutable `batch_stats` collection: the training loss runs in
train mode (batch statistics, updated running averages returned as the new model
state) and `__call__` defaults to eval mode (running averages).

Example:
  >>> from tapas_jax.models import resnet
  >>> module = resnet.ResNet(resnet.CONFIGS["tiny"])
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from tapas_jax.models import training


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  """Shape of a ResNet.

  Attributes:
    stage_sizes: bottleneck blocks per stage; stage `s` has `num_filters * 2**s`
      filters (times 4 at its output) and every stage after the first halves the
      resolution in its first block.
    num_filters: filters of the stem and of the first stage.
    num_classes: classifier outputs.
    image_size: height and width of the square input images.
    dtype: activation and parameter dtype name.
  """

  stage_sizes: tuple[int, ...] = (3, 4, 6, 3)
  num_filters: int = 64
  num_classes: int = 1000
  image_size: int = 224
  dtype: str = "float32"


CONFIGS = {
    "tiny": ResNetConfig(stage_sizes=(1, 1), num_filters=8, num_classes=10, image_size=32),
    # 25,557,032 params (plus 53,120 batch_stats), as the reference ResNet-50.
    "resnet-50": ResNetConfig(),
}


class Bottleneck(nn.Module):
  """1x1 -> 3x3 (strided) -> 1x1 bottleneck with a projection shortcut on shape change."""

  filters: int
  strides: int = 1
  dtype: str = "float32"

  @nn.compact
  def __call__(self, x, train: bool = False):
    def conv(features, kernel, name, strides=1):
      return nn.Conv(
          features, (kernel, kernel), (strides, strides), padding="SAME", use_bias=False,
          dtype=self.dtype, param_dtype=self.dtype, name=name)
    def norm(name, scale_init=nn.initializers.ones):
      return nn.BatchNorm(
          use_running_average=not train, momentum=0.9, epsilon=1e-5, dtype=self.dtype,
          param_dtype=self.dtype, scale_init=scale_init, name=name)
    y = nn.relu(norm("bn1")(conv(self.filters, 1, "conv1")(x)))
    y = nn.relu(norm("bn2")(conv(self.filters, 3, "conv2", self.strides)(y)))
    # Zero-init the last scale so each block starts as the identity.
    y = norm("bn3", nn.initializers.zeros)(conv(4 * self.filters, 1, "conv3")(y))
    if x.shape != y.shape:
      x = norm("bn_proj")(conv(4 * self.filters, 1, "conv_proj", self.strides)(x))
    return nn.relu(x + y)


class ResNet(nn.Module):
  config: ResNetConfig

  @nn.compact
  def __call__(self, images, train: bool = False):
    cfg = self.config
    x = nn.Conv(cfg.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False,
                dtype=cfg.dtype, param_dtype=cfg.dtype, name="conv_init")(images)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                     dtype=cfg.dtype, param_dtype=cfg.dtype, name="bn_init")(x)
    x = nn.max_pool(nn.relu(x), (3, 3), strides=(2, 2), padding="SAME")
    for s, size in enumerate(cfg.stage_sizes):
      for b in range(size):
        strides = 2 if s > 0 and b == 0 else 1
        x = Bottleneck(cfg.num_filters * 2**s, strides, cfg.dtype,
                       name=f"stage{s}_block{b}")(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(cfg.num_classes, dtype=cfg.dtype, param_dtype=cfg.dtype, name="head")(x)


def make_batch(config: ResNetConfig, rng: jax.Array, batch_size: int) -> dict:
  image_rng, label_rng = jax.random.split(rng)
  shape = (batch_size, config.image_size, config.image_size, 3)
  return {"images": jax.random.normal(image_rng, shape, jnp.dtype(config.dtype)),
          "labels": jax.random.randint(label_rng, (batch_size,), 0, config.num_classes)}


def loss(module: ResNet, variables: dict, batch: dict):
  """Mean cross entropy in train mode; returns the updated `batch_stats`."""
  logits, state = module.apply(variables, batch["images"], train=True,
                               mutable=["batch_stats"])
  xent = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), batch["labels"]).mean()
  return xent, {"batch_stats": state["batch_stats"]}


FAMILY = training.Family(name="resnet", framework="linen", configs=CONFIGS,
                         make_module=ResNet, make_batch=make_batch, loss=loss,
                         inputs=lambda batch: (batch["images"],))
