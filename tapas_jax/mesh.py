"""Device meshes the planner can steer: every axis `AxisType.Auto`.

`jax.make_mesh` defaults to Explicit axes, on which `with_sharding_constraint` is only
an assertion and cannot guide GSPMD/Shardy. Plans therefore need Auto axes.

Example:
  >>> import tapas_jax as tapas
  >>> mesh = tapas.make_mesh({"data": 2, "model": 4})   # needs 8 devices
  >>> dict(mesh.shape)
  {'data': 2, 'model': 4}
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh

from tapas_jax import options
from tapas_jax.options import MeshError

__all__ = ["MeshError", "check_auto", "make_mesh"]


def make_mesh(axes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A `Mesh` with the given axis sizes, all axes `AxisType.Auto`.

  Args:
    axes: axis name -> size, outermost first, e.g. `{"data": 2, "model": 4}`.
    devices: devices to use; default all of `jax.devices()`.

  Raises:
    MeshError: the sizes do not multiply to the number of devices, a size is not a
      positive int, or a name is not a string.

  Example:
    >>> make_mesh({"data": 8}).axis_names
    ('data',)
  """
  if not isinstance(axes, Mapping):
    raise MeshError(f"make_mesh: axes={axes!r:.80} is a {type(axes).__name__}; pass a dict "
                    "of axis sizes, e.g. {'data': 2, 'model': 4}.")
  axes = options.mesh_axes(axes, "make_mesh")
  devices = list(devices if devices is not None else jax.devices())
  total = 1
  for size in axes.values():
    total *= size
  if total != len(devices):
    raise MeshError(
        f"make_mesh: axes {dict(axes)} need {total} devices, {len(devices)} are available "
        f"({devices[0].platform}). Change the axis sizes so they multiply to "
        f"{len(devices)}, or on CPU set XLA_FLAGS=--xla_force_host_platform_device_count="
        f"{total} before importing jax.")
  return jax.make_mesh(tuple(axes.values()), tuple(axes), devices=devices,
                       axis_types=(AxisType.Auto,) * len(axes))


def check_auto(mesh: Mesh) -> Mesh:
  """Returns `mesh` if every axis is Auto; else a `MeshError` that says how to fix it."""
  types = getattr(mesh, "axis_types", None) or ()
  explicit = [n for n, t in zip(mesh.axis_names, types) if t != AxisType.Auto]
  if explicit:
    raise MeshError(
        f"mesh axes {explicit} are not AxisType.Auto ({[str(t) for t in types]}); sharding "
        "constraints on Explicit axes are only checks and cannot steer the compiler. "
        "Build the mesh with tapas_jax.make_mesh(...) or pass "
        "axis_types=(jax.sharding.AxisType.Auto,) * n to jax.make_mesh.")
  return mesh
