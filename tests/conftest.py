"""Test harness: 8 fake CPU devices, set before anything imports jax."""

import os

# Must run before the first `import jax` anywhere in the test session.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The TPU compiler tests (tapas.verify, libtpu ahead of time, no TPU attached) load libtpu
# in this process and in the launcher's subprocesses: without this, the first holds
# libtpu's lockfile (/tmp/libtpu_lockfile) and the others fail to load it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# A sharding rule that fails raises in tests instead of replicating its op with a
# warning (`tapas_jax.rules.strict_rules`); tests of the fallback turn it off locally.
os.environ["TAPAS_STRICT_RULES"] = "1"

import jax  # noqa: E402
import numpy as np  # noqa: E402
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


def _two_steps(plan, model, batch_size):
  """Two train steps of `model` under `plan` (through `tapas.apply`) next to the
  unsharded step; asserts the losses agree. Returns (step, placed args, sharded states
  after steps 1 and 2, unsharded states after steps 1 and 2)."""
  import tapas_jax as tapas  # noqa: PLC0415 - after the device flags above

  state = model.init(jax.random.key(0))
  batch = model.make_batch(jax.random.key(1), batch_size)
  step = tapas.apply(plan, model.train_step())
  placed = tapas.place(plan, state, batch)
  s1, out1 = step(*placed)
  s2, out2 = step(s1, placed[1])
  ref = jax.jit(model.train_step())
  r1, ref1 = ref(state, batch)
  r2, ref2 = ref(r1, batch)
  np.testing.assert_allclose(out1["loss"], ref1["loss"], rtol=2e-6)
  np.testing.assert_allclose(out2["loss"], ref2["loss"], rtol=2e-5)
  return step, placed, (s1, s2), (r1, r2)


@pytest.fixture
def libtpu():
  """libtpu, for the TPU compiler tests (ahead of time, no TPU attached); where it cannot
  be loaded they skip, saying so."""
  return pytest.importorskip(
      "libtpu", reason="libtpu cannot be loaded (pip install 'tapas_jax[tpu]'): the TPU "
      "compiler tests are skipped")


@pytest.fixture
def two_steps():
  """`_two_steps`: a plan applied for two steps, checked against the unsharded step."""
  return _two_steps


def _small_row_on_and_off(family, layout, field, **verify_kwargs):
  """A small-zoo baseline on v5p:2x2x1 (data 2 x model 2, batch 8): its predicted bytes
  with the `tpu-v5p` profile's `field` on and off, and the TPU compiler's record of it
  (state donated, in the compiler's layouts). Returns ({True: bytes, False: bytes},
  `tapas.verify`'s record)."""
  import dataclasses  # noqa: PLC0415

  import tapas_jax as tapas  # noqa: PLC0415 - after the device flags above
  from tapas_jax import baselines, cost, models  # noqa: PLC0415

  config, trimmed = models.SMALL[family]
  m = models.get_model(family, config, **trimmed)
  args = (m.train_step(), m.abstract_state(), m.batch_spec(8))
  plans = {on: baselines.baseline(layout, *args, mesh={"data": 2, "model": 2}, family=family,
                                  device=dataclasses.replace(cost.get_profile("tpu-v5p"),
                                                             **{field: on}))
           for on in (True, False)}
  got = tapas.verify(plans[True], args[0], *args[1:], topology="v5p:2x2x1", donate_argnums=0,
                     layouts="auto", **verify_kwargs)
  return {on: p.stats.predicted_memory_bytes for on, p in plans.items()}, got


@pytest.fixture
def small_row_on_and_off(libtpu):
  """`_small_row_on_and_off`: a small-zoo row predicted with a profile field on and off,
  judged by the TPU compiler (skipped where libtpu cannot load)."""
  del libtpu
  return _small_row_on_and_off
