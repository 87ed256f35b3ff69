"""On a real GPU (marked `gpu`: skipped without one, and CI has none).

What only a GPU can show: the profile `tapas.search` picks for the local generation
(its `device_kind`), `tapas.verify` reading the local runtime's memory limit, and a
searched plan run on the GPU computing what the plain step computes.

Run where a CUDA GPU is attached:
  JAX_PLATFORMS=cuda,cpu python -m pytest -q tests/gpu_test.py
"""

import jax
import pytest

import tapas_jax as tapas
from tapas_jax import api, models

pytestmark = pytest.mark.gpu

# `device_kind` names as NVIDIA's runtime reports them ("NVIDIA H200") -> profile.
_PROFILES = {"H200": "h200", "H100": "h100", "A100": "a100"}


def _gpu_profile() -> str:
  kind = jax.devices("gpu")[0].device_kind
  found = [p for k, p in _PROFILES.items() if k in kind.upper()]
  if not found:
    pytest.skip(f"no device profile for {kind!r}")
  return found[0]


def test_the_local_gpu_generation_picks_its_profile():
  want = _gpu_profile()
  if jax.default_backend() != "gpu":
    pytest.skip("the GPU is not the default backend (JAX_PLATFORMS=cuda,cpu)")
  assert api.default_device() == want


def test_a_searched_plan_runs_on_the_gpu_as_the_plain_step(two_steps):
  if jax.default_backend() != "gpu":
    pytest.skip("the GPU is not the default backend (JAX_PLATFORMS=cuda,cpu)")
  model = models.get_model("gpt", "tiny")
  plan = tapas.search(model.train_step(), model.abstract_state(), model.batch_spec(8),
                      mesh={"data": 1})
  assert plan.device == _gpu_profile()
  two_steps(plan, model, 8)


def test_verify_on_the_gpu_reads_the_runtime_memory_limit():
  if jax.default_backend() != "gpu":
    pytest.skip("the GPU is not the default backend (JAX_PLATFORMS=cuda,cpu)")
  model = models.get_model("gpt", "tiny")
  args = (model.train_step(), model.abstract_state(), model.batch_spec(8))
  plan = tapas.search(*args, mesh={"data": 1})
  r = tapas.verify(plan, *args, donate_argnums=0)
  print(r.summary())
  limit = jax.devices("gpu")[0].memory_stats()["bytes_limit"]
  assert r.compiled and r.error == ""
  assert r.hbm_source == "runtime" and r.hbm_bytes == limit
  assert 0 < r.peak_bytes < limit and r.fits
  assert r.num_devices == 1 and r.target.startswith("local")
