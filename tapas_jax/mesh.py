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

import math
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh

from tapas_jax import options
from tapas_jax.options import MeshError, check_auto

__all__ = ["MeshError", "axes_difference", "check_auto", "default_mesh", "make_mesh",
           "resolve_mesh"]


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


def default_mesh(devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """The mesh `tapas.shard` uses when none is given: `{"data": n // m, "model": m}`.

  `m` is the largest divisor of the device count `n` with `m * m <= n` (8 devices:
  data 4 x model 2; a prime count: one `data` axis). Two axes let the search combine
  a split of the batch with a split of the weights (data x tensor parallel, or ZeRO
  over `data`), which one axis cannot; and `shard` lets the search put the batch on
  either axis, so the names are labels and a plan can still use all `n` devices for
  the batch. It spans `jax.devices()` (every process's devices, as a multi-host jit
  needs), and every axis is `AxisType.Auto`.

  Example:
    >>> dict(default_mesh().shape)   # 8 devices
    {'data': 4, 'model': 2}
  """
  devices = list(devices if devices is not None else jax.devices())
  n = len(devices)
  m = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
  axes = {"data": n // m, "model": m} if m > 1 else {"data": n}
  return make_mesh(axes, devices)


def resolve_mesh(mesh: Any) -> jax.sharding.Mesh:
  """The concrete mesh to plan and run on (see `tapas_jax.api.SearchOptions.mesh`).

  Raises:
    MeshError: the mesh (given or from context) has Explicit axes, or a dict of sizes
      does not match the device count.
  """
  if mesh is None:
    mesh = jax.sharding.get_mesh()
    if mesh.empty:
      return default_mesh()
  if isinstance(mesh, Mapping):
    return make_mesh(dict(mesh))
  if not isinstance(mesh, jax.sharding.Mesh):
    raise MeshError(f"shard: mesh= must be a jax.sharding.Mesh or a dict of axis sizes, "
                    f"got {type(mesh).__name__}; build one with tapas_jax.make_mesh(...)")
  return check_auto(mesh)


def axes_difference(want: Mapping[str, int], have: Mapping[str, int]) -> str:
  """The first way mesh axes `have` differ from `want`, for an error message.

  Example:
    >>> axes_difference({"data": 2, "model": 4}, {"data": 2, "model": 2})
    "axis 'model' has size 2, the plan's 4"
  """
  for name, size in want.items():
    if name not in have:
      return f"no axis {name!r}"
    if have[name] != size:
      return f"axis {name!r} has size {have[name]}, the plan's {size}"
  extra = [n for n in have if n not in want]
  if extra:
    return f"extra axis {extra[0]!r}"
  return f"axis order {list(have)}, the plan's {list(want)}"
