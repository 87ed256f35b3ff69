"""Test harness: 8 fake CPU devices, set before anything imports jax."""

import os

# Must run before the first `import jax` anywhere in the test session.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A sharding rule that fails raises in tests instead of replicating its op with a
# warning (`tapas_jax.rules.strict_rules`); tests of the fallback turn it off locally.
os.environ["TAPAS_STRICT_RULES"] = "1"

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
  del config
  cpus = len(jax.devices("cpu"))
  assert cpus == 8, (f"tests need 8 fake CPU devices, got {cpus}: XLA_FLAGS was set "
                     "after jax initialised its backend")


def pytest_collection_modifyitems(config, items):
  del config
  has_gpu = any(d.platform == "gpu" for d in jax.devices())
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords and not has_gpu:
      item.add_marker(skip)
