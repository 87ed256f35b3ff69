"""The records a `Plan` is made of: its predicted figures and timings (`PlanStats`),
each unique layer's parameter specs (`LayerStrategy`), the layouts `apply` pins inside
the program (`Constraint`), what was decided and why (`Decision`), the baselines'
figures (`BaselineFigures`) and the compiler's (`CompiledFigures`).

Frozen data only (`Constraint` and `Decision` are the solver's, `solver.PlanTerms`
holds them): `tapas_jax.plan` builds and reports them, `tapas_jax.plan_file`
writes and reads them; both import this module (names importable from `plan` too).

Example:
  >>> from tapas_jax.plan_records import BaselineFigures
  >>> BaselineFigures("fsdp", step_s=0.1, comm_bytes=2e9, memory_bytes=3e9).name
  'fsdp'
"""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec

# The solver's result speaks in these two: defined with it, a plan's records all the same.
from tapas_jax.solver import Constraint, Decision

__all__ = ["BaselineFigures", "CompiledFigures", "Constraint", "Decision", "LayerStrategy",
           "PlanStats"]


@dataclasses.dataclass(frozen=True)
class PlanStats:
  """What planning took and what the plan is predicted to cost, per device.

  Attributes:
    num_equations: equations traced (every level of nesting).
    num_layer_instances: layer instances folding found.
    num_unique_layers: distinct layers among them.
    trace_s: seconds tracing (`make_jaxpr` and the walk).
    fold_s: seconds folding.
    search_s: seconds building the problem and solving it.
    predicted_step_s: predicted compute + communication seconds per step.
    predicted_comm_bytes: bytes sent per device per step.
    predicted_state_bytes: per-device bytes of the program's inputs.
    predicted_memory_bytes: inputs plus the intermediates live at the activation peak.
    cost_tables_built: op cost tables computed (not reused).
    solver_status: "optimal"; "time_limit" when the integer program stopped early;
      "exact over reduced domains (...)" when elimination had to narrow the choices.
    plan_s: seconds turning the solution into this plan (specs, constraints, report
      records), after the search.
    report_s: seconds costing the report's baselines (`baselines`) beside the plan.
      With trace, fold and search, the stages of one call: they add up to its wall
      time, less the options' checks.
  """

  num_equations: int
  num_layer_instances: int
  num_unique_layers: int
  trace_s: float
  fold_s: float
  search_s: float
  predicted_step_s: float
  predicted_comm_bytes: float
  predicted_state_bytes: float
  predicted_memory_bytes: float
  cost_tables_built: int
  solver_status: str = "optimal"
  plan_s: float = 0.0
  report_s: float = 0.0


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
class BaselineFigures:
  """A baseline layout costed by the same model on the same program and mesh.

  Attributes:
    name: "data_parallel" or "fsdp" (see `tapas_jax.baselines`).
    step_s, comm_bytes, memory_bytes: as `PlanStats`' predicted figures.
  """

  name: str
  step_s: float
  comm_bytes: float
  memory_bytes: float


@dataclasses.dataclass(frozen=True)
class CompiledFigures:
  """What the compiler made of a plan (`tapas.verify`), as the plan carries and saves it.

  Attributes:
    target: the TPU topology compiled for ("v5p:2x2x1") or "local <platform>".
    argument_bytes, output_bytes, alias_bytes, temp_bytes: per device, from the
      compiler's `memory_analysis()`.
    hbm_bytes: the memory a device may use, judged against.
    fits: whether it compiled with its peak within `hbm_bytes`.
    flops: the compiler's FLOPs per device.
    comm_bytes: (collective kind, bytes sent per device) of the compiled HLO.
    rounds: (memory budget searched under, predicted bytes, compiled peak bytes) of each
      search `search(..., verify=...)` made; the last is this plan's.
    error: the first line of the compiler's message when it rejected the program.
    live_peak_bytes: the TPU compiler's own peak of live buffers, the figure `fits`
      judged there (`Verified.fit_bytes`); 0 elsewhere, where `peak_bytes` is judged.
  """

  target: str
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  hbm_bytes: float
  fits: bool
  flops: float
  comm_bytes: tuple[tuple[str, float], ...] = ()
  rounds: tuple[tuple[float, float, float], ...] = ()
  error: str = ""
  live_peak_bytes: int = 0

  @property
  def peak_bytes(self) -> int:
    """Arguments + temporaries + outputs - aliased outputs."""
    return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

  @property
  def fit_bytes(self) -> int:
    """The figure `fits` judged: the TPU compiler's live peak, else `peak_bytes`."""
    return self.live_peak_bytes or self.peak_bytes
