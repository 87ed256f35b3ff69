"""Learnable synthetic batches: the zoo's batch layout, holding a pattern to learn."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tapas_jax import models
from tapas_jax.models import synthetic

FAMILIES = ["gpt", "gpt_nnx", "llama", "llama_nnx", "moe", "t5", "vit", "resnet"]


def _layout(tree):
  return jax.tree.map(lambda x: (x.shape, x.dtype), tree)


@pytest.mark.parametrize("name", FAMILIES)
def test_same_layout_as_the_zoo_batch(name):
  m = models.get_model(name, "tiny")
  got = jax.eval_shape(lambda k: synthetic.learnable_batch(m, k, 4), jax.random.key(0))
  assert _layout(got) == _layout(m.batch_spec(4))


@pytest.mark.parametrize("name", ["gpt", "llama", "moe", "t5"])
def test_next_token_is_a_function_of_the_current_one(name):
  m = models.get_model(name, "tiny")
  batch = jax.tree.map(np.asarray, synthetic.learnable_batch(m, jax.random.key(3), 16))
  if "decoder_inputs" in batch:  # the targets continue the encoder's stream
    stream = np.concatenate([batch["inputs"], batch["targets"]], axis=1)
    np.testing.assert_array_equal(batch["decoder_inputs"][:, 1:], batch["targets"][:, :-1])
    assert (batch["decoder_inputs"][:, 0] == 0).all() and (stream > 0).all()
  else:
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    stream = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
  successor = {}
  for a, b in zip(stream[:, :-1].ravel(), stream[:, 1:].ravel()):
    assert successor.setdefault(int(a), int(b)) == int(b)
  assert len(successor) == 16  # the whole cycle shows up, not one repeated token
  assert (stream < m.config.vocab_size).all()


@pytest.mark.parametrize("name", ["vit", "resnet"])
def test_images_cluster_by_label(name):
  m = models.get_model(name, "tiny")
  batch = synthetic.learnable_batch(m, jax.random.key(5), 64)
  x = np.asarray(batch["images"]).reshape(64, -1)
  y = np.asarray(batch["labels"])
  assert y.min() >= 0 and y.max() < m.config.num_classes and len(set(y.tolist())) > 3
  means = {c: x[y == c].mean(0) for c in set(y.tolist())}
  # Every image lies nearer its own class mean than any other class mean.
  for xi, yi in zip(x, y):
    dist = {c: np.linalg.norm(xi - mu) for c, mu in means.items()}
    assert min(dist, key=dist.get) == yi


def test_draws_differ_by_rng_and_repeat_with_it():
  m = models.get_model("gpt", "tiny")
  a, b, c = (synthetic.learnable_batch(m, jax.random.key(k), 8) for k in (1, 1, 2))
  np.testing.assert_array_equal(a["inputs"], b["inputs"])
  assert not np.array_equal(a["inputs"], c["inputs"])


def test_unknown_layout_names_its_keys():
  m = models.get_model("gpt", "tiny")
  odd = dataclasses.replace(m.family, make_batch=lambda c, r, n: {"x": jnp.zeros((n, 2))})
  with pytest.raises(ValueError, match=r"keys \['x'\]"):
    synthetic.learnable_batch(dataclasses.replace(m, family=odd), jax.random.key(0), 2)
