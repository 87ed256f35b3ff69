"""Learnable synthetic batches, so a demo or a smoke run shows the loss fall.

The zoo's `make_batch` draws uniform random tokens and labels: well-formed, but there
is nothing to learn, so the loss stays at log(vocab). These batches have the same
keys, shapes and dtypes and hold a pattern a model picks up in a few dozen steps:

- token streams (`inputs`/`targets`, plus `decoder_inputs` for encoder-decoders):
  every row walks one fixed cycle of `period` distinct tokens from a random phase, so
  the next token is a function of the current one;
- images (`images`/`labels`): each class has a fixed random prototype image, and an
  example is its class prototype plus noise.

The pattern depends on the config only (a fixed key), the draw on `rng`, so batches of
different steps differ but teach the same thing.

Example:
  >>> import jax
  >>> from tapas_jax import models
  >>> from tapas_jax.models import synthetic
  >>> m = models.get_model("gpt", "tiny")
  >>> batch = synthetic.learnable_batch(m, jax.random.key(0), 2)
  >>> bool((batch["inputs"][:, 1:] == batch["targets"][:, :-1]).all())
  True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tapas_jax.models.training import ZooModel

__all__ = ["learnable_batch"]

_PATTERN_KEY = 20260101  # the pattern is fixed; only the draw depends on the caller's rng


def _cycle(vocab: int, period: int, low: int) -> jax.Array:
  """`period` distinct tokens in [low, vocab), in a fixed random order."""
  order = jax.random.permutation(jax.random.key(_PATTERN_KEY), vocab - low) + low
  return order[:min(period, vocab - low)]


def _walk(cycle: jax.Array, rng: jax.Array, batch_size: int, length: int) -> jax.Array:
  """`batch_size` rows of `length` tokens, each following `cycle` from a random phase."""
  phase = jax.random.randint(rng, (batch_size, 1), 0, cycle.shape[0])
  return cycle[(phase + jnp.arange(length)[None, :]) % cycle.shape[0]]


def learnable_batch(model: ZooModel, rng: jax.Array, batch_size: int,
                    period: int = 16) -> dict:
  """A batch shaped like `model.make_batch(rng, batch_size)` with a learnable pattern.

  Args:
    model: a zoo model; its batch keys say which pattern fits (see the module doc).
    rng: a PRNG key; the draw (phases, labels, noise) depends on it.
    batch_size: examples in the batch.
    period: distinct tokens in the cycle of token streams.

  Raises:
    ValueError: a batch layout this module does not know (the message lists the keys).
  """
  spec = model.batch_spec(batch_size)
  keys = set(spec)
  if keys == {"images", "labels"}:
    images, labels = spec["images"], spec["labels"]
    num_classes = int(model.config.num_classes)
    protos = jax.random.normal(jax.random.key(_PATTERN_KEY),
                               (num_classes, *images.shape[1:]), images.dtype)
    label_rng, noise_rng = jax.random.split(rng)
    y = jax.random.randint(label_rng, labels.shape, 0, num_classes).astype(labels.dtype)
    noise = jax.random.normal(noise_rng, images.shape, images.dtype)
    return {"images": protos[y] + 0.5 * noise, "labels": y}
  vocab = int(getattr(model.config, "vocab_size", 0))
  if keys == {"inputs", "targets"} and vocab:
    length = spec["inputs"].shape[1]
    tokens = _walk(_cycle(vocab, period, 0), rng, batch_size, length + 1)
    dtype = spec["inputs"].dtype
    return {"inputs": tokens[:, :-1].astype(dtype), "targets": tokens[:, 1:].astype(dtype)}
  if keys == {"inputs", "decoder_inputs", "targets"} and vocab:
    enc_len, dec_len = spec["inputs"].shape[1], spec["targets"].shape[1]
    # Token 0 starts the decoder, so the cycle avoids it; the targets continue the
    # encoder's stream where it stops.
    tokens = _walk(_cycle(vocab, period, 1), rng, batch_size, enc_len + dec_len)
    dtype = spec["inputs"].dtype
    targets = tokens[:, enc_len:].astype(dtype)
    return {"inputs": tokens[:, :enc_len].astype(dtype),
            "decoder_inputs": jnp.pad(targets[:, :-1], ((0, 0), (1, 0))),
            "targets": targets}
  raise ValueError(f"learnable_batch: no synthetic pattern for a {model.name!r} batch "
                   f"with keys {sorted(keys)}; known layouts: images+labels, "
                   "inputs+targets, inputs+decoder_inputs+targets (with config.vocab_size)")
