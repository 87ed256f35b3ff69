"""The model zoo: every tiny config trains, every big config is described abstractly."""

import jax
import numpy as np
import pytest

from tapas_jax import models

# (family, named config, published parameter count). Within 2%.
PUBLISHED_PARAMS = [
    ("gpt", "gpt2-small", 124e6),
    ("gpt", "gpt3-175b", 175e9),
    ("llama", "llama3-8b", 8.03e9),
    ("llama", "llama3-70b", 70.6e9),
    # The T5 paper rounds to "11B"; the released checkpoint holds 11.3B (also the count
    # of the published shape: 24+24 layers, d_model 1024, 128 heads x 128, d_ff 65536).
    ("t5", "t5-11b", 11.3e9),
    ("t5", "t5-base", 223e6),
    ("vit", "vit-b16", 86.6e6),
    ("vit", "vit-h14", 632e6),
    ("resnet", "resnet-50", 25.6e6),
]


@pytest.mark.parametrize("name", models.FAMILIES)
def test_tiny_config_trains_and_loss_goes_down(name):
  m = models.get_model(name, "tiny")
  state = m.init(jax.random.key(0))
  batch = m.make_batch(jax.random.key(1), 4)
  step = jax.jit(m.train_step())
  losses = []
  for _ in range(3):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert np.all(np.isfinite(losses)), losses
  assert losses[2] < losses[1] < losses[0], losses
  assert int(state.step) == 3


@pytest.mark.parametrize("name,config,published", PUBLISHED_PARAMS)
def test_param_count_matches_published(name, config, published):
  count = models.get_model(name, config).param_count()
  assert abs(count - published) / published < 0.02, f"{name}/{config}: {count:,}"


@pytest.mark.parametrize("name,config", [
    (name, config) for name in models.FAMILIES
    for config in models.get_family(name).configs if config != "tiny"
])
def test_every_named_config_builds_abstractly(name, config):
  state = models.get_model(name, config).abstract_state()
  leaves = jax.tree.leaves(state)
  assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  # Adam keeps two moments per parameter: the optimizer state outweighs the params.
  n_params = sum(x.size for x in jax.tree.leaves(state.params))
  n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state))
  assert n_opt >= 2 * n_params


def test_unknown_model_lists_choices():
  with pytest.raises(ValueError, match="choose one of: .*gpt.*llama"):
    models.get_model("gtp")


def test_unknown_config_lists_choices():
  with pytest.raises(ValueError, match="choose one of: tiny, gpt2-small"):
    models.get_model("gpt", "gpt2-huge")


def test_unknown_field_lists_valid_fields():
  with pytest.raises(ValueError, match=r"\['num_layer'\].*valid fields: .*num_layers"):
    models.get_model("gpt", "tiny", num_layer=3)


def test_scan_layers_matches_unrolled_parameter_count():
  unrolled = models.get_model("gpt", "tiny", num_layers=3).param_count()
  scanned = models.get_model("gpt", "tiny", num_layers=3, scan_layers=True).param_count()
  assert unrolled == scanned
