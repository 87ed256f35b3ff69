"""Every docstring example in the package runs (8 fake CPU devices, as in conftest)."""

import doctest
import importlib
import sys

import pytest

MODULES = ["tapas_jax", "tapas_jax.errors", "tapas_jax._jax_internals", "tapas_jax.trace",
           "tapas_jax.repeats", "tapas_jax.fold", "tapas_jax.cost", "tapas_jax.profiles",
           "tapas_jax.op_rule",
           "tapas_jax.rules", "tapas_jax.mesh", "tapas_jax.api", "tapas_jax.plan",
           "tapas_jax.solver.views", "tapas_jax.solver.problem", "tapas_jax.solver.sequence",
           "tapas_jax.solver.eliminate",
           "tapas_jax.solver.solve", "tapas_jax.options", "tapas_jax.plan_file",
           "tapas_jax.plan_records",
           "tapas_jax.solver.fusion", "tapas_jax.solver.loop_casts", "tapas_jax.solver.remat",
           "tapas_jax.solver.reductions",
           "tapas_jax.solver.experts",
           "tapas_jax.solver.result", "tapas_jax.solver.plan_terms", "tapas_jax.solver.layouts",
           "tapas_jax.baselines", "tapas_jax.apply", "tapas_jax.measure", "tapas_jax.verify",
           "tapas_jax.shard", "tapas_jax.shard_flax",
           "tapas_jax.models", "tapas_jax.models.training", "tapas_jax.models.synthetic",
           "tapas_jax.models.data"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
  importlib.import_module(name)
  result = doctest.testmod(sys.modules[name], optionflags=doctest.ELLIPSIS)
  assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
  assert result.attempted > 0 or name in ("tapas_jax.models.training",)
