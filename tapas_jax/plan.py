"""Stage 4, plan: what the search decided, in terms a JAX user applies.

A `Plan` holds one pytree of `PartitionSpec` per positional argument (`in_specs`), the
class-to-axes choice behind it, the strategy of each unique layer (the specs of its
parameters), the predicted cost and the timings of each stage.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import tapas_jax as tapas
  >>> plan = tapas.search(lambda w, x: jnp.sum(x @ w),
  ...                     jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
  ...                     jax.ShapeDtypeStruct((65536, 4096), jnp.float32),
  ...                     mesh={"data": 8}, device="h100")
  >>> plan.in_specs[1], plan.stats["num_equations"]
  (P('data', None), 2)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jax.sharding import PartitionSpec

__all__ = ["Constraint", "LayerStrategy", "Plan"]


@dataclasses.dataclass(frozen=True)
class LayerStrategy:
  """How one unique layer is sharded: the specs of the parameters its instance reads.

  Attributes:
    name: the unique layer's name ("Block", "encoder/layers", "glue").
    instances: how many instances use it.
    param_specs: (path of a parameter read by its first instance, PartitionSpec it is
      stored in).
    use_specs: (path, PartitionSpec) for those of its parameters the compute reads in
      another layout than they are stored in (ZeRO-3: stored split over `data`, gathered
      for use); the gather happens once per step.
  """

  name: str
  instances: int
  param_specs: tuple[tuple[str, PartitionSpec], ...]
  use_specs: tuple[tuple[str, PartitionSpec], ...] = ()


@dataclasses.dataclass(frozen=True)
class Constraint:
  """A layout the applied program pins on one operand of one equation.

  Where a value is read in another layout than it is made or stored in (a parameter
  stored split over `data` and used gathered; a gradient made for the compute and
  reduced into the update's layout), `apply` feeds the reading equation
  `with_sharding_constraint(value, spec)`.

  Attributes:
    site: the reading equation's `Op.site` (equation indices through inlined calls).
    slot: which operand.
    spec: the layout it reads.
  """

  site: tuple[Any, ...]
  slot: int
  spec: PartitionSpec


@dataclasses.dataclass(frozen=True)
class Plan:
  """A sharding plan for one program on one mesh.

  Attributes:
    mesh_axes: axis name -> size.
    device: device profile name used for costs.
    in_specs: one pytree of `PartitionSpec` per positional argument.
    class_axes: readable (dimension class example, size, mesh axes) for split classes,
      one line per kind (copies of a layer differ only in their numbers: `Block_*`).
    layers: strategy per unique layer, then glue.
    stats: num_equations, num_layer_instances, num_unique_layers, trace_s, fold_s,
      search_s, predicted_step_s, predicted_comm_bytes, predicted_memory_bytes,
      predicted_state_bytes, cost_tables_built.
    fingerprint: canonical hash of the traced program (checked when applied).
    name: "tapas" for a searched plan, else the baseline's name.
    constraints: layouts `apply` pins inside the program (see `Constraint`).
  """

  mesh_axes: Mapping[str, int]
  device: str
  in_specs: tuple[Any, ...]
  class_axes: tuple[tuple[str, int, tuple[str, ...]], ...]
  layers: tuple[LayerStrategy, ...]
  stats: Mapping[str, Any]
  fingerprint: str
  name: str = "tapas"
  constraints: tuple[Constraint, ...] = ()

  def summary(self) -> str:
    """Readable report: the cost, the split dimension classes, each layer's specs."""
    s = self.stats
    lines = [
        f"Plan {self.name!r} on mesh {dict(self.mesh_axes)} ({self.device}): predicted "
        f"{s['predicted_step_s'] * 1e3:.3f} ms/step, "
        f"{s['predicted_comm_bytes'] / 2**20:.2f} MiB sent/device, "
        f"{s['predicted_memory_bytes'] / 2**30:.3f} GiB/device",
        f"  {s['num_equations']} equations, {s['num_layer_instances']} layer instances of "
        f"{s['num_unique_layers']} unique layer(s); trace {s['trace_s']:.2f}s, fold "
        f"{s['fold_s']:.2f}s, search {s['search_s']:.2f}s"]
    if self.class_axes:
      lines.append("  split dimensions: " + ", ".join(
          f"{ex or '?'} ({size}) -> {'x'.join(axes)}" for ex, size, axes in self.class_axes[:12])
          + (" ..." if len(self.class_axes) > 12 else ""))
    else:
      lines.append("  nothing split: replicated")
    for layer in self.layers:
      used = dict(layer.use_specs)
      # Gathered parameters first: where storage and use differ is the news.
      shown = sorted(layer.param_specs, key=lambda ps: ps[0] not in used)[:8]
      specs = [f"{path}: {_spec_text(spec)}"
               + (f" used as {_spec_text(used[path])}" if path in used else "")
               for path, spec in shown]
      more = f" ... {len(layer.param_specs) - 8} more" if len(layer.param_specs) > 8 else ""
      lines.append(f"  {layer.name} x{layer.instances}: " + "; ".join(specs) + more)
    return "\n".join(lines)


def _spec_text(spec: PartitionSpec) -> str:
  return "P(" + ", ".join(repr(e) for e in spec) + ")"
