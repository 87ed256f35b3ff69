"""The public surface is small and pinned."""

import os
import pathlib
import subprocess
import sys

import jax
import pytest

import tapas_jax as tapas
import tapas_jax.fold
import tapas_jax.trace

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_public_api_is_pinned():
  assert sorted(tapas.__all__) == [
      "Folded", "Graph", "InfeasibleBudgetError", "MeshError", "Plan", "PlanStats",
      "TraceError", "apply", "fold", "make_mesh", "models", "place", "search", "trace"]
  for name in tapas.__all__:
    assert hasattr(tapas, name), name


def test_stage_functions_are_importable_from_their_modules():
  assert callable(tapas_jax.trace.trace) and callable(tapas_jax.fold.fold)
  assert tapas.trace.trace is tapas_jax.trace.trace and tapas.fold.fold is tapas_jax.fold.fold


def _python(code: str) -> str:
  """Runs `code` in a fresh interpreter on this checkout; returns its stdout."""
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=120, check=False)
  assert done.returncode == 0, done.stderr
  return done.stdout.strip()


def test_import_tapas_jax_loads_no_flax_or_optax():
  # The zoo (flax, optax) loads on first use of `tapas.models`; the library does not
  # need either.
  code = "import tapas_jax, sys; print('flax' in sys.modules, 'optax' in sys.modules)"
  assert _python(code) == "False False"
  every_module = """
import importlib, pkgutil, sys
import tapas_jax, tapas_jax.solver
names = [m.name for pkg in (tapas_jax, tapas_jax.solver)  # not walk_packages: it imports
         for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + ".")]  # the zoo
for name in names:
  if name != "tapas_jax.models":
    importlib.import_module(name)
print(len(names) > 10, [m for m in ("flax", "optax") if m in sys.modules])
"""
  assert _python(every_module) == "True []"


def test_models_loads_lazily_and_is_the_zoo():
  code = """
import sys
import tapas_jax as tapas
assert "tapas_jax.models" not in sys.modules and "models" in dir(tapas)
zoo = tapas.models
from tapas_jax import models
assert zoo is models is sys.modules["tapas_jax.models"]
print("gpt" in models.FAMILIES, "flax" in sys.modules)
"""
  assert _python(code) == "True True"
  with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
    tapas.no_such_thing  # noqa: B018


def test_make_mesh_gives_auto_axes():
  mesh = tapas.make_mesh({"data": 2, "model": 4})
  assert dict(mesh.shape) == {"data": 2, "model": 4}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  assert tapas.mesh.check_auto(mesh) is mesh


def test_make_mesh_wrong_size_says_how_to_fix():
  with pytest.raises(tapas.MeshError, match=r"need 6 devices, 8 are available.*multiply"):
    tapas.make_mesh({"data": 2, "model": 3})


def test_explicit_mesh_is_rejected_with_a_fix():
  explicit = jax.make_mesh((2, 4), ("data", "model"),
                           axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  with pytest.raises(tapas.MeshError, match="not AxisType.Auto.*tapas_jax.make_mesh"):
    tapas.mesh.check_auto(explicit)
