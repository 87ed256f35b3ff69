"""The public surface is small and pinned."""

import jax
import jax.numpy as jnp
import pytest

import tapas_jax as tapas


def test_public_api_is_pinned():
  assert sorted(tapas.__all__) == [
      "Folded", "Graph", "InfeasibleBudgetError", "MeshError", "Plan", "TraceError", "apply",
      "fold", "make_mesh", "models", "place", "search", "trace"]
  for name in tapas.__all__:
    assert hasattr(tapas, name), name


def test_stage_functions_are_importable_from_their_modules():
  from tapas_jax.fold import fold
  from tapas_jax.trace import trace
  graph = trace(lambda x: jnp.sum(x * 2), jax.ShapeDtypeStruct((4, 4), jnp.float32))
  folded = fold(graph)
  assert isinstance(graph, tapas.Graph) and isinstance(folded, tapas.Folded)
  assert [op.primitive for op in graph.ops] == ["mul", "reduce_sum"]
  assert folded.graph is graph
  assert tapas.trace.trace is trace and tapas.fold.fold is fold


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
