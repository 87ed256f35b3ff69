"""Models written with equinox and Keras 3 (on JAX) themselves, as their guides write
them, folded, planned and run (`tests/styles.py` imitates their idioms; this holds the
real libraries, which move on their own).

* equinox: `eqx.nn` modules (per-example, `vmap`ped over the batch), the model split
  with `eqx.partition` / `eqx.combine`, `eqx.filter_value_and_grad`, optax; a stack of
  blocks as a Python list, and one built with `eqx.filter_vmap` and run by `lax.scan`.
* Keras 3: a functional transformer and a residual CNN with batch norm, trained through
  `model.stateless_call` with optax (Keras' guide to a custom JAX training loop).

Each: unique layers and the share of ops in layers (the transformer and CNN targets of
`tests/fold_test.py`), and the plan unbudgeted and under a tight budget running as the
unsharded step does. SGD, not Adam: Adam's first step turns the rounding noise of a
gradient that is zero in exact arithmetic (a conv bias before batch norm, an attention
key's bias) into a full step of either sign, in both programs alike.
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is imported

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import tapas_jax as tapas  # noqa: E402

MESH = {"data": 2, "model": 4}


@dataclasses.dataclass(frozen=True)
class Sizes:
  """A model's sizes: tiny here; `scripts/bench_libraries.py` builds the same programs
  at width."""

  vocab: int = 64
  seq: int = 16
  width: int = 32
  batch: int = 8
  layers: int = 4


TINY = Sizes()


def _tokens(z: Sizes):
  t = jax.random.randint(jax.random.key(1), (z.batch, z.seq + 1), 0, z.vocab)
  return t[:, :-1], t[:, 1:]


def _xent(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# -- equinox ----------------------------------------------------------------------


class _EqxBlock(eqx.Module):
  attn: eqx.nn.MultiheadAttention
  norm1: eqx.nn.LayerNorm
  norm2: eqx.nn.LayerNorm
  mlp: eqx.nn.MLP

  def __init__(self, width, key):
    k1, k2 = jax.random.split(key)
    self.attn = eqx.nn.MultiheadAttention(4, width, key=k1)
    self.norm1, self.norm2 = eqx.nn.LayerNorm(width), eqx.nn.LayerNorm(width)
    self.mlp = eqx.nn.MLP(width, width, 2 * width, 1, activation=jax.nn.gelu, key=k2)

  def __call__(self, x):  # one example: [seq, width]
    h = jax.vmap(self.norm1)(x)
    seq = x.shape[0]
    x = x + self.attn(h, h, h, mask=jnp.tril(jnp.ones((seq, seq), bool)))
    return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class _EqxLM(eqx.Module):
  embed: eqx.nn.Embedding
  blocks: list
  head: eqx.nn.Linear

  def __init__(self, z: Sizes, key):
    keys = jax.random.split(key, z.layers + 2)
    self.embed = eqx.nn.Embedding(z.vocab, z.width, key=keys[0])
    self.blocks = [_EqxBlock(z.width, k) for k in keys[2:]]
    self.head = eqx.nn.Linear(z.width, z.vocab, key=keys[1])

  def __call__(self, tokens):
    x = jax.vmap(self.embed)(tokens)
    for block in self.blocks:
      x = block(x)
    return jax.vmap(self.head)(x)


class _EqxScannedLM(_EqxLM):
  """The blocks stacked by `eqx.filter_vmap` and run by `lax.scan` (equinox's advice
  for compile time)."""

  blocks: _EqxBlock

  def __init__(self, z: Sizes, key):
    keys = jax.random.split(key, z.layers + 2)
    self.embed = eqx.nn.Embedding(z.vocab, z.width, key=keys[0])
    self.blocks = eqx.filter_vmap(lambda k: _EqxBlock(z.width, k))(keys[2:])
    self.head = eqx.nn.Linear(z.width, z.vocab, key=keys[1])

  def __call__(self, tokens):
    params, static = eqx.partition(self.blocks, eqx.is_array)
    x, _ = jax.lax.scan(lambda x, p: (eqx.combine(p, static)(x), None),
                        jax.vmap(self.embed)(tokens), params)
    return jax.vmap(self.head)(x)


def _equinox(model_class, z: Sizes):
  model = model_class(z, jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_array)
  opt = optax.sgd(0.1)

  def loss(p, batch):
    inputs, targets = batch
    return _xent(jax.vmap(eqx.combine(p, static))(inputs), targets)

  def step(state, batch):
    p, opt_state = state
    value, grads = eqx.filter_value_and_grad(loss)(p, batch)
    updates, opt_state = opt.update(grads, opt_state, p)
    return (eqx.apply_updates(p, updates), opt_state), value
  return step, (params, opt.init(params)), _tokens(z)


# -- Keras 3 on JAX ----------------------------------------------------------------


def _keras_transformer(z: Sizes):
  tokens = keras.Input((z.seq,), dtype="int32")
  x = keras.layers.Embedding(z.vocab, z.width)(tokens)
  for _ in range(z.layers):
    h = keras.layers.LayerNormalization()(x)
    x = keras.layers.Add()([x, keras.layers.MultiHeadAttention(4, z.width // 4)(
        h, h, use_causal_mask=True)])
    h = keras.layers.Dense(2 * z.width, activation="gelu")(
        keras.layers.LayerNormalization()(x))
    x = keras.layers.Add()([x, keras.layers.Dense(z.width)(h)])
  return keras.Model(tokens, keras.layers.Dense(z.vocab)(x)), _tokens(z)


def _keras_cnn(z: Sizes):
  """(The CNN's image and channel sizes are its own: only its depth and batch scale.)"""
  images = keras.Input((16, 16, 3))
  x = keras.layers.Conv2D(16, 3, padding="same")(images)
  for _ in range(z.layers):
    h = keras.layers.Conv2D(16, 3, padding="same")(x)
    h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
    x = keras.layers.Add()([x, h])
  out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(x))
  batch = (jax.random.normal(jax.random.key(5), (z.batch, 16, 16, 3)),
           jax.random.randint(jax.random.key(6), (z.batch,), 0, 10))
  return keras.Model(images, out), batch


def _keras(build, z: Sizes):
  model, batch = build(z)
  opt = optax.sgd(0.1)
  trainable = [v.value for v in model.trainable_variables]
  non_trainable = [v.value for v in model.non_trainable_variables]

  def loss(trainable, non_trainable, inputs, targets):
    logits, non_trainable = model.stateless_call(trainable, non_trainable, inputs,
                                                 training=True)
    return _xent(logits, targets), non_trainable

  def step(state, batch):
    trainable, non_trainable, opt_state = state
    (value, non_trainable), grads = jax.value_and_grad(loss, has_aux=True)(
        trainable, non_trainable, *batch)
    updates, opt_state = opt.update(grads, opt_state, trainable)
    return (optax.apply_updates(trainable, updates), non_trainable, opt_state), value
  return step, (trainable, non_trainable, opt.init(trainable)), batch


# (name, program at given sizes, share of top-level ops in layer instances at least;
# None: a scanned stack, one loop)
CASES = [
    ("equinox", lambda z: _equinox(_EqxLM, z), 0.85),
    ("equinox_scan", lambda z: _equinox(_EqxScannedLM, z), None),
    ("keras_transformer", lambda z: _keras(_keras_transformer, z), 0.85),
    ("keras_cnn", lambda z: _keras(_keras_cnn, z), 0.75),
]


def program(name: str, sizes: Sizes = TINY):
  """(step, state, batch) of the case `name` at `sizes`."""
  return next(make for case, make, _ in CASES if case == name)(sizes)


@pytest.mark.parametrize("name,make,in_layers", CASES, ids=[c[0] for c in CASES])
def test_a_library_model_folds_plans_and_runs_as_unsharded(name, make, in_layers):
  step, state, batch = make(TINY)
  folded = tapas.fold.fold(tapas.trace.trace(step, state, batch))
  assert len(folded.unique_layers) == 1, (name, folded.summary())
  if in_layers is not None:
    top = len(folded.graph.region_ops(0))
    assert sum(len(i.ops) for i in folded.instances) / top >= in_layers, folded.summary()
    assert len(folded.instances) == TINY.layers, folded.summary()
  free = tapas.search(step, state, batch, mesh=MESH, device="h100")
  tight = tapas.search(step, state, batch, mesh=MESH, device="h100",
                       memory_budget=0.6 * free.stats.predicted_memory_bytes)
  want_state, want_loss = jax.jit(step)(state, batch)
  for plan in (free, tight):
    got_state, got_loss = tapas.apply(plan, step)(*tapas.place(plan, state, batch))
    np.testing.assert_allclose(got_loss, want_loss, rtol=2e-5)
    for got, want in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
