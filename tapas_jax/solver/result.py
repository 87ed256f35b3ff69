"""The solver's result: what `solve` and `evaluate` return, in the solver's terms (a
class choice, its predicted figures) and in the plan's (`PlanTerms`: every input's
stored and used `PartitionSpec`, the layouts `apply` pins, the decisions and why).

The rest of the package sees the solver through these records only: `tapas_jax.plan`
builds a `Plan` from a `Solution`'s figures and its `terms`, never from the `Problem`.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tapas_jax import cost, trace
  >>> from tapas_jax.solver import build_problem, solve
  >>> graph = trace.trace(lambda w, x: jnp.sum(jnp.tanh(x @ w)),
  ...                     jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
  ...                     jax.ShapeDtypeStruct((65536, 4096), jnp.float32))
  >>> s = solve(build_problem(graph, cost.mesh_spec({"data": 8}, "h100"),
  ...                         cost.get_profile("h100"), None))
  >>> [i.stored for i in s.terms.inputs], s.status == "optimal"
  ([P(None, None), P('data', None)], True)
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Callable, Mapping

from jax.sharding import PartitionSpec

from tapas_jax.solver.explain import Reason

__all__ = ["Constraint", "Decision", "InputSpec", "PlanTerms", "Solution", "Status"]


class Status(enum.StrEnum):
  """How the solver ended. Each equals its text (`Status.OPTIMAL == "optimal"`), which
  `PlanStats.solver_status` and plan files hold."""

  OPTIMAL = "optimal"
  TIME_LIMIT = "time_limit"  # the integer program stopped early, with a plan
  REDUCED_SINGLE_AXIS = "exact over reduced domains (single-axis)"  # elimination narrowed
  REDUCED_BATCH_ONLY = "exact over reduced domains (batch-only)"  # the choices to solve
  INFEASIBLE = "infeasible"  # the integer program: no plan meets the budget rows

  @classmethod
  def of(cls, text: str) -> "Status | str":
    """The member named by `text`; else the text (the integer program's own message
    for a stop it gives no code for)."""
    try:
      return cls(text)
    except ValueError:
      return text


@dataclasses.dataclass(frozen=True)
class Constraint:
  """A layout the applied program pins on one operand of one equation.

  Where a value is read in another layout than it is made or stored in (a parameter
  stored split over `data` and used gathered; a gradient made for the compute and
  reduced into the update's layout), where a contraction makes a result, and where a
  searched scan reads an operand or its result is read, `apply` feeds the reading
  equation `with_sharding_constraint(value, spec)`.

  Attributes:
    site: the reading equation's `Op.site` (equation indices through inlined calls).
    slot: which operand.
    spec: the layout it reads.
  """

  site: tuple[Any, ...]
  slot: int
  spec: PartitionSpec


@dataclasses.dataclass(frozen=True)
class Decision:
  """What the search chose for one kind of dimension, and why.

  Attributes:
    name: a name users know: the logical axis name the program gives it (flax
      `with_logical_partitioning` / nnx `with_partitioning`), "batch", or else a
      parameter path and dim ("params/Block_*/MLP/fc1/kernel[1]").
    size: the dimension's size.
    axes: mesh axes it is split over (() = not split).
    why: the best single change and its price, everything else kept: "replicated:
      over model +37.2 us/step (+1.5 MiB sent)".
  """

  name: str
  size: int
  axes: tuple[str, ...]
  why: str


@dataclasses.dataclass(frozen=True)
class InputSpec:
  """One leaf of the program's arguments as the plan places it.

  Attributes:
    value: the traced graph's value of the leaf (`Graph.inputs[k].value`).
    path: its key path ("0/params/Block_0/MLP/fc1/kernel").
    type: its type as text ("float32[64,256]").
    stored: the `PartitionSpec` it is stored in.
    used: the `PartitionSpec` the compute reads it in, where that differs (ZeRO-3:
      stored split, gathered for use); else None.
  """

  value: int
  path: str
  type: str
  stored: PartitionSpec
  used: PartitionSpec | None = None


@dataclasses.dataclass(frozen=True)
class PlanTerms:
  """A solution in the terms a plan is made of.

  Attributes:
    mesh_axes: mesh axis name -> size.
    device: the device profile's name.
    inputs: one `InputSpec` per leaf of the arguments, in the graph's order.
    constraints: the layouts `apply` pins inside the program.
    decisions: every kind of dimension with a choice: split ones first, then the
      batch, widest first.
    class_axes: (dimension class example, size, mesh axes) of every class with axes,
      one per kind (copies of a layer alike), widest first.
    remat: (unique layer name, `jax.checkpoint` policy) of the layers rematerialised.
    gradient_fences: whether the memory model has each layer's weight gradients made and
      reduced before the backward moves on (the profile's combiner stops at a
      threshold), which `apply` then enforces; XLA:CPU holds them all to the end.
    sums_past_fences: whether those fences leave out a layer's results that only sums
      read, their partial sums added before one reduction as the model costs them
      (the profile's `reassociates_all_reduces`).
  """

  mesh_axes: Mapping[str, int]
  device: str
  inputs: tuple[InputSpec, ...]
  constraints: tuple[Constraint, ...]
  decisions: tuple[Decision, ...]
  class_axes: tuple[tuple[str, int, tuple[str, ...]], ...]
  remat: tuple[tuple[str, str], ...] = ()
  gradient_fences: bool = False
  sums_past_fences: bool = False


@dataclasses.dataclass(frozen=True)
class Solution:
  """A solved (or costed) problem.

  Attributes:
    choice: class id -> mesh axes.
    step_s: predicted compute + communication seconds per step.
    comm_bytes: bytes sent per device per step, summed over collectives.
    state_bytes: per-device bytes of the program's inputs under the plan.
    activation_bytes: per-device bytes of the intermediates live at the activation peak
      under the plan (its remat included).
    tables_built: op cost tables computed (not reused).
    solve_s: seconds spent.
    memory_weight: final Lagrange weight on state bytes (0 without a budget).
    status: how the solver ended (`Status`).
    reasons: class id -> its best single alternative, priced (`explain.reasons`).
    remat: unique layer index -> `jax.checkpoint` policy name, for the layers
      rematerialised (`solver.remat`; chosen only under a budget); `step_s` includes
      their recompute.
    make_terms: builds `terms` from what `solve` or `evaluate` solved (it holds their
      problem and choice: a `dataclasses.replace` of `choice` keeps the old terms);
      read `terms`.
  """

  choice: Mapping[int, tuple[str, ...]]
  step_s: float
  comm_bytes: float
  state_bytes: float
  activation_bytes: float
  tables_built: int
  solve_s: float
  memory_weight: float
  status: Status | str = Status.OPTIMAL
  reasons: Mapping[int, Reason] = dataclasses.field(default_factory=dict)
  remat: Mapping[int, str] = dataclasses.field(default_factory=dict)
  make_terms: Callable[[], PlanTerms] | None = dataclasses.field(default=None, repr=False,
                                                                 compare=False)

  @property
  def memory_bytes(self) -> float:
    """Predicted per-device bytes: the inputs plus the live intermediates at the peak."""
    return self.state_bytes + self.activation_bytes

  @functools.cached_property
  def terms(self) -> PlanTerms:
    """The solution in plan terms (`PlanTerms`), built once, when first read: costing
    a layout for its figures alone (the report's baselines) builds none."""
    if self.make_terms is None:
      raise ValueError("Solution.terms: this solution was not made by solve or evaluate")
    return self.make_terms()
