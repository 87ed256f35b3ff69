"""Every error class of tapas_jax shares one base, `tapas.TapasError`, and keeps the
built-in base its callers catch."""

import importlib
import inspect
import pathlib

import jax
import jax.numpy as jnp
import pytest

import tapas_jax as tapas

PACKAGE = pathlib.Path(tapas.__file__).parent


def _error_classes() -> dict[str, type]:
  """module.Class -> class, for every exception class defined in the package."""
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    module = importlib.import_module(name)
    for cls_name, cls in inspect.getmembers(module, inspect.isclass):
      if issubclass(cls, BaseException) and cls.__module__ == name:
        out[f"{name}.{cls_name}"] = cls
  return out


ERRORS = _error_classes()


def test_the_package_defines_the_errors_it_documents():
  # The scan reads every module: it finds the errors users meet.
  assert {"tapas_jax.trace.TraceError", "tapas_jax.options.MeshError",
          "tapas_jax.plan_file.PlanFileError", "tapas_jax.solver.budget.InfeasibleBudgetError",
          "tapas_jax.verify.LibtpuMissingError"} <= set(ERRORS)


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_every_error_subclasses_tapas_error(name):
  assert issubclass(ERRORS[name], tapas.TapasError), (
      f"{name} must subclass tapas_jax.errors.TapasError (keep its built-in base too)")


@pytest.mark.parametrize("error, base", [
    (tapas.TraceError, ValueError), (tapas.MeshError, ValueError),
    (tapas.InfeasibleBudgetError, ValueError),
    ("tapas_jax.options.OptionError", ValueError),
    ("tapas_jax.plan_file.PlanFileError", ValueError),
    ("tapas_jax.models.data.DataError", ValueError),
    ("tapas_jax.verify.LibtpuMissingError", ImportError),
])
def test_errors_keep_their_builtin_base(error, base):
  if isinstance(error, str):
    module, cls = error.rsplit(".", 1)
    error = getattr(importlib.import_module(module), cls)
  assert issubclass(error, base) and issubclass(error, tapas.TapasError)


def test_one_except_clause_catches_a_bad_option_and_a_bad_trace():
  caught = []
  for call in (lambda: tapas.search(lambda x: x, jnp.ones(4), mesh={"data": 0}),
               lambda: tapas.trace.trace(lambda x: x.nope, jax.ShapeDtypeStruct((2,),
                                                                             jnp.float32))):
    try:
      call()
    except tapas.TapasError as e:
      caught.append(type(e).__name__)
  assert caught == ["MeshError", "TraceError"]
