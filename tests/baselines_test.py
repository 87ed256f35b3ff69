"""baselines: the expert layouts on scanned layer stacks (stacked parameters).

With `scan_layers=True` a layer stack's parameters (and their optimizer state) carry the
layer dim in front. Every baseline must leave that dim whole, name each mesh axis at
most once per spec, split the dims Megatron names behind it, and, applied, compute the
same losses as the unsharded step.
"""

import functools
import warnings

import jax
import pytest
from jax.sharding import PartitionSpec

from tapas_jax import baselines, models

MESHES = {"data2_model4": {"data": 2, "model": 4}, "data8": {"data": 8}}
# 4 layers: the layer dim divides every mesh axis, so nothing but the rule keeps it whole.
LAYERS = 4
SCANNED = ("gpt", "llama", "vit")


@functools.lru_cache(maxsize=None)
def scanned(name):
  return models.get_model(name, "tiny", scan_layers=True, num_layers=LAYERS)


def plan_for(name, kind, mesh, remat=None):
  m = scanned(name)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # nothing here is over the device's memory
    return baselines.baseline(kind, m.train_step(), m.abstract_state(), m.batch_spec(8),
                              mesh=MESHES[mesh], device="cpu", family=name, remat=remat)


def specs_by_path(plan):
  flat = jax.tree_util.tree_flatten_with_path(
      plan.in_specs[0], is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
  return {jax.tree_util.keystr(k): s for k, s in flat}


def _axes(entry):
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("kind", baselines.BASELINES)
@pytest.mark.parametrize("name", SCANNED)
def test_baselines_leave_the_layer_dim_whole_and_name_an_axis_once(name, kind, mesh):
  specs = specs_by_path(plan_for(name, kind, mesh))
  stacked = {p: s for p, s in specs.items() if "['layers']" in p}
  assert stacked
  for path, spec in specs.items():
    axes = [a for e in spec for a in _axes(e)]
    assert len(axes) == len(set(axes)), (path, spec)
  for path, spec in stacked.items():
    assert not spec or spec[0] is None, (path, spec)
  if kind == "fsdp":  # the stack's kernels are still stored split, behind the layer dim
    assert any(any(spec[1:]) for p, spec in stacked.items() if p.endswith("['kernel']"))
  if kind == "megatron" and mesh == "data2_model4":
    # The MLP's hidden dim (column-parallel: dim 1 of an unstacked fc1 / up_proj
    # kernel) is the stacked kernel's dim 2.
    fc1 = {"gpt": "['MLP']['fc1']['kernel']", "vit": "['MLP']['fc1']['kernel']",
           "llama": "['MLP']['up_proj']['kernel']"}[name]
    spec = next(s for p, s in stacked.items() if p.endswith(fc1) and "params" in p)
    assert tuple(spec) == (None, None, "model"), spec


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("kind", baselines.BASELINES)
@pytest.mark.parametrize("name", ("gpt", "llama"))
def test_baselines_on_scanned_stacks_compute_the_unsharded_losses(name, kind, mesh,
                                                                  two_steps):
  two_steps(plan_for(name, kind, mesh), scanned(name), 8)


def test_fsdp_with_remat_on_a_scanned_stack_computes_the_unsharded_losses(two_steps):
  two_steps(plan_for("llama", "fsdp", "data2_model4", remat="nothing_saveable"),
            scanned("llama"), 8)


def test_fsdp_with_remat_on_a_scanned_stack_with_a_loop_in_its_body(two_steps):
  # A chunked attention's lax.map inside each scanned layer: the scan remat recomputes
  # it in the backward loop, so its body's ops are priced again.
  m = models.get_model("llama", "tiny", scan_layers=True, num_layers=LAYERS,
                       attention="chunked", attention_chunk=16)
  args = (m.train_step(), m.abstract_state(), m.batch_spec(8))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    free, full = (baselines.baseline("fsdp", *args, mesh=MESHES["data2_model4"], device="cpu",
                                     family="llama", remat=r) for r in (None, "nothing_saveable"))
  assert full.stats.predicted_step_s > free.stats.predicted_step_s
  assert full.stats.predicted_memory_bytes < free.stats.predicted_memory_bytes
  two_steps(full, m, 8)
