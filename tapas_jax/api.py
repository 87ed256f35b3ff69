"""`tapas.search`: trace, fold and solve a program into a `Plan`.

`prepare` is the part the search shares with the baselines (`baselines.py`): the mesh
and device profile resolved, the program traced and folded, the problem built.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import tapas_jax as tapas
  >>> def loss(w, x):
  ...   return jnp.sum(jnp.tanh(x @ w) ** 2)
  >>> plan = tapas.search(loss, jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
  ...                     jax.ShapeDtypeStruct((65536, 4096), jnp.float32),
  ...                     mesh={"data": 8}, device="h100")
  >>> plan.in_specs[1]
  P('data', None)
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import time
import warnings
from typing import Any, Mapping, Sequence

import jax

from tapas_jax import cost as costlib
from tapas_jax import fold as foldlib
from tapas_jax import options
from tapas_jax import plan as planlib
from tapas_jax import solver as solverlib
from tapas_jax import trace as tracelib

# The module, not the function the package exports under its name: `_verified` calls
# `verifylib.verify` through it, so that a stand-in compiler can take its place in tests.
verifylib = importlib.import_module("tapas_jax.verify")

__all__ = ["HBM_HEADROOM", "VERIFY_ROUNDS", "Prepared", "SearchOptions", "baseline_figures",
           "default_budget", "prepare", "search"]

# Share of a device's memory a plan leaves to the runtime: the CUDA context and
# library workspaces (cuBLAS, cuDNN, NCCL buffers), XLA's own scratch and allocator
# fragmentation, none of which the plan counts; and room for the memory model's error
# (its prediction is within about 20% of what XLA allocates: BENCHMARKS.md).
HBM_HEADROOM = 0.10


@dataclasses.dataclass(frozen=True)
class Prepared:
  """A program traced, folded and posed as a search problem on one mesh."""

  graph: tracelib.Graph
  folded: foldlib.Folded
  problem: solverlib.Problem
  mesh: costlib.MeshSpec
  prepare_s: float  # seconds building the problem (after trace and fold)


def default_device() -> str:
  """The device profile of the local devices' generation (`device_kind`: v4, v5e,
  v5p, v6e, A100, H100, H200), or their platform's nearest one."""
  device = jax.devices()[0]
  return costlib.profile_for_kind(device.device_kind, device.platform)


def prepare(fn, args: Sequence[Any], *, mesh, kwargs: Mapping[str, Any] | None = None,
            where: str = "search", config: options.SearchConfig | None = None,
            **search_options: Any) -> Prepared:
  """Traces and folds `fn(*args, **kwargs)` and builds its problem on `mesh`.

  Every option is checked before anything is traced (`tapas_jax.options`). Of the
  config, `device`, `batch_axes`, `fold`, `links` and `sequence_parallel` shape the
  problem; the rest are the solver's.

  Args:
    kwargs: the step's keyword arguments.
    where: the entry point named in error messages.
    config: the search options as one `options.SearchConfig`; or
    **search_options: the same as keywords, as for `search`.
  """
  config = options.search_config(config, search_options, where)
  if not callable(fn):
    raise options.OptionError(f"{where}: fn must be callable, got {type(fn).__name__} "
                              f"({fn!r:.60}); pass the step first: {where}(fn, *args, ...)")
  axes = options.mesh_axes(mesh, where)
  kwargs = options.kwargs(kwargs, where)
  # The names' form was checked with the config; here they meet the mesh.
  batch_axes = options.batch_axes(config.batch_axes, axes, where)
  profile = costlib.get_profile(config.device or default_device())
  mesh_spec = costlib.mesh_spec(axes, profile, config.links_map)
  graph = tracelib.trace(fn, *args, kwargs=kwargs)
  with tracelib.collector_paused():
    folded = foldlib.fold(graph)
    start = time.perf_counter()
    view = solverlib.folded_view(folded) if config.fold else solverlib.unfolded_view(graph)
    problem = solverlib.build_problem(graph, mesh_spec, profile, batch_axes, view=view,
                                      sequence_cuts=config.sequence_parallel)
  return Prepared(graph=graph, folded=folded, problem=problem, mesh=mesh_spec,
                  prepare_s=time.perf_counter() - start)


def default_budget(profile: costlib.DeviceProfile) -> float:
  """Per-device bytes a plan may take when no budget is given: the device's memory
  less `HBM_HEADROOM`.

  Example:
    >>> round(default_budget(costlib.get_profile("h100")) / 2**30, 1)
    67.1
  """
  return profile.hbm_bytes * (1 - HBM_HEADROOM)


def search(fn, *args, mesh, kwargs: Mapping[str, Any] | None = None,
           config: options.SearchConfig | None = None, **search_options: Any
           ) -> planlib.Plan:
  """Traces, folds and searches a sharding plan for `fn(*args, **kwargs)`.

  Every option is checked before anything is traced; a bad one raises `ValueError`
  (`tapas_jax.options.OptionError`, or `MeshError` for the mesh) naming the fix.

  Args:
    fn: the step to shard, e.g. `train_step(state, batch)`.
    *args: its arguments: arrays or `jax.ShapeDtypeStruct` pytrees (nothing allocated).
    mesh: a `jax.sharding.Mesh` (Auto axes), an abstract mesh, or a dict of axis sizes
      (positive ints, e.g. `{"data": 2, "model": 4}`).
    kwargs: the step's keyword arguments, as a dict (`search`'s own keywords such as
      `mesh` would clash with the step's): `search(step, state, kwargs={"batch": b},
      mesh=...)` plans `step(state, batch=b)`. The plan's `kwargs_specs` holds their
      specs; keyword arguments count after the positional ones, in sorted name order,
      so with `step(state, batch=b)` the batch is the last argument.
    config: every option below at once, as an `options.SearchConfig` (the same checks,
      made when it is built); with `config=`, no option may also be given as a
      keyword (a `TypeError`: change a config with `dataclasses.replace`).
    **search_options: the search options, each a field of `options.SearchConfig`:
    device: device profile name (tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e, a100, h100, h200,
      cpu); default: the `verify` topology's generation, else the local devices'
      (`device_kind`).
    memory_budget: per-device bytes the plan may take: the program's inputs
      (parameters, optimizer state, batch) plus the intermediates live at the
      activation peak, as `plan.stats.predicted_memory_bytes` reports. None: the
      device profile's memory (`hbm_bytes`) less 10% headroom (`default_budget`);
      `float("inf")`: unlimited. A number of bytes or a string: "16GiB" (GiB, MiB,
      ...: powers of 1024), "16GB" (GB, MB, ...: powers of 1000), "1.5 TiB". Tight
      budgets store parameters and optimizer state split over axes their compute does
      not use (ZeRO) before they split the compute itself. The prediction assumes the
      state argument is donated (`tapas.apply(..., donate_argnums=0)`): otherwise it
      is held twice.
    batch_axes: mesh axes that may split the batch: one axis name ("data") or a
      sequence of them; default (and None): every axis, so data parallelism and FSDP
      over the whole mesh are in the search's space whatever the axes are called. The
      batch is found by dataflow: dim 0 of every input that is not state carried to
      the next step.
    fold: search each unique layer once (True: the folded view, and each cost table
      built once per unique layer) or every op on its own (False).
    solver: "elimination" (exact variable elimination) or "ilp" (one integer program
      solved by HiGHS, the Alpa-style reference); default: elimination when folded,
      the integer program when not. Unbudgeted, both reach the optimum of the view
      they are given; the folded view's objective is an estimate of the whole program
      (T5: 1.4% off), and under a budget elimination is near, not exactly, optimal.
    links: mesh axis -> "intra" or "inter" link; default from the device profile.
    time_limit: seconds (positive) for the integer program; `plan.stats.solver_status`
      is "time_limit" when it was hit.
    sequence_parallel: also search Megatron's sequence parallelism (on by default): the
      residual stream (norms, residual adds) may split its sequence positions apart
      from the dots around it, gathered into them and reduce-scattered out of them,
      where that is cheaper. False searches without it (fewer choices).
    verify: a TPU topology ("v5p:4x4x4", "v5e:2x2"; its chip count the mesh's) to
      compile the plan found for, through libtpu on this machine (`tapas.verify`,
      `pip install 'tapas_jax[tpu]'`), with the state (argument 0) donated. Where the
      compiler's peak exceeds the chip's usable HBM (or `memory_budget`, if smaller),
      the search runs again under a budget lowered by what was missing, at most
      `VERIFY_ROUNDS` times; the plan returned has compiled within it, and carries the
      compiler's figures and every round in `plan.compiled`. None: no compile.
    layouts: the state's in-memory layouts the step will run in, as
      `tapas.apply(..., layouts=)`: "default" (JAX's) or "auto" (the compiler's);
      `verify` compiles those.

  Returns:
    A `tapas_jax.plan.Plan`.

  Raises:
    InfeasibleBudgetError: no plan fits `memory_budget` (by default, the device's
      memory); the message gives the budget, the smallest per-device memory
      reachable and the tensors that dominate it. Raised before anything runs. With
      `verify`: no plan found compiled within the chip's memory (with no
      `memory_budget` given, the leanest plan is compiled even where it is predicted
      over the default budget: the compiler judges); the message gives each round
      and by how much the leanest one failed.
    TypeError: an unknown option, or `config=` with options as keywords.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> plan = search(lambda w, x: jnp.sum(jnp.tanh(x @ w)),
    ...               jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
    ...               jax.ShapeDtypeStruct((65536, 4096), jnp.float32),
    ...               mesh={"data": 8}, device="h100", memory_budget="1GiB")
    >>> plan.in_specs
    (P(None, None), P('data', None))
  """
  config = options.search_config(config, search_options)
  if config.verify is not None and config.device is None:
    # The chip compiled for.
    config = dataclasses.replace(config, device=costlib.profile_for_topology(config.verify))
  prepared = prepare(fn, args, mesh=mesh, kwargs=kwargs, config=config)
  solverlib.warn_unsplittable(prepared.problem)
  solverlib.warn_batch_unsplit(prepared.problem)
  budget = resolve_budget(config.memory_budget, prepared.problem.profile)
  cache: dict = {}

  @tracelib.collector_paused()
  def solve(budget: float | None) -> planlib.Plan:
    start = time.perf_counter()
    solution = _solve(prepared, budget, config, cache=cache)
    search_s = prepared.prepare_s + time.perf_counter() - start
    start = time.perf_counter()
    figures = baseline_figures(prepared.problem, cache)
    return planlib.make_plan(prepared.folded, solution, args, search_s=search_s,
                             kwargs=kwargs, baselines=figures,
                             report_s=time.perf_counter() - start)

  try:
    plan = solve(budget)
  except solverlib.InfeasibleBudgetError as e:
    if config.verify is None or config.memory_budget is not None:
      raise
    # The default budget leaves headroom for the model's error; with the compiler as
    # the judge, the leanest plan the model knows is compiled instead of refused.
    budget = e.leanest_bytes * (1 + 1e-9)
    plan = solve(budget)
  if config.verify is None:
    return plan
  return _verified(plan, solve, fn, args, kwargs, config, budget)


@dataclasses.dataclass(frozen=True)
class SearchOptions:
  """How `tapas.shard` searches: the mesh and the config it passes on to `tapas.search`.

  Attributes:
    mesh: a `jax.sharding.Mesh` (Auto axes) or a dict of axis sizes; None: the
      `jax.set_mesh` context, else `tapas_jax.mesh.default_mesh()`.
    config: every other search option (`options.SearchConfig`; the batch may take any
      axis by default).
  """

  mesh: Any = None
  config: options.SearchConfig = options.SearchConfig(where="shard")

  def search(self, fn, args: Sequence[Any], mesh: jax.sharding.Mesh) -> planlib.Plan:
    """`tapas.search` on `mesh` (whose axis names are labels: the batch may take any
    axis by default)."""
    return search(fn, *args, mesh=mesh, config=self.config)


# How many times `search(..., verify=...)` searches again under a lower budget.
VERIFY_ROUNDS = 4


def _solve(prepared: Prepared, budget: float | None, config: options.SearchConfig, *,
           cache: dict):
  """The solver's solution under `budget`; the default budget's error says it is one."""
  profile = prepared.problem.profile
  try:
    return solverlib.solve(prepared.problem, reuse=config.fold,
                           solver=solver_name(config.solver, config.fold),
                           memory_budget=budget, time_limit=config.time_limit,
                           table_cache=cache, folded=prepared.folded)
  except solverlib.InfeasibleBudgetError as e:
    if config.memory_budget is not None:
      raise
    raise solverlib.InfeasibleBudgetError(
        f"{e} The budget is the default: {profile.name}'s "
        f"{options.format_bytes(profile.hbm_bytes)} of device memory less "
        f"{HBM_HEADROOM:.0%} headroom; pass memory_budget= to change it (float('inf'): "
        "no limit).", budget_bytes=e.budget_bytes, leanest_bytes=e.leanest_bytes) from None


def _verified(plan: planlib.Plan, solve, fn, args, kwargs, config: options.SearchConfig,
              budget: float | None) -> planlib.Plan:
  """Compiles `plan` for `config.verify`; while the compiler's peak does not fit, searches
  again under a budget lowered by what was missing (`VERIFY_ROUNDS` at most)."""
  fmt = options.format_bytes
  topology, memory_budget = config.verify, config.memory_budget
  rounds: list[tuple[float, float, float]] = []
  notes: list[str] = []
  for k in range(VERIFY_ROUNDS):
    with warnings.catch_warnings():  # a step that returns no new state donates nothing
      warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
      record = verifylib.verify(plan, fn, *args, topology=topology, donate_argnums=0,
                                kwargs=kwargs, layouts=config.layouts)
    limit = min(record.hbm_bytes, memory_budget or math.inf)
    predicted = plan.stats.predicted_memory_bytes
    rounds.append((math.inf if budget is None else budget, predicted,
                   float(record.fit_bytes)))
    notes.append(f"round {k + 1}: budget {fmt(budget) if budget else 'unlimited'}, "
                 f"predicted {fmt(predicted)}, compiled {fmt(record.fit_bytes)}"
                 + ("" if record.compiled else " (the compiler refused it)"))
    missing = record.fit_bytes - limit
    if not record.compiled and missing <= 0:
      # Refused, with no sizes in the message: a quarter less, for want of a figure.
      missing = predicted / 4
    if record.compiled and missing <= 0:
      # Judged against the budget where it is below the chip's memory.
      figures = dataclasses.replace(record.figures(), rounds=tuple(rounds), hbm_bytes=limit)
      return dataclasses.replace(plan, compiled=figures)
    budget = min(budget or math.inf, predicted) - missing
    if k == VERIFY_ROUNDS - 1:
      break
    if budget <= 0:
      # The compiler needs more than the prediction over again (an unrolled 80-layer
      # stack at 4-5x): no lowered budget is left, so the leanest plan the model knows
      # is the one left to try.
      leanest = _leanest(solve)
      if leanest is None or not leanest < predicted:
        break
      notes.append(f"the compiler needs {record.fit_bytes / predicted:.1f}x the "
                   f"prediction: the leanest plan known ({fmt(leanest)}) next")
      budget = leanest * (1 + 1e-9)
    try:
      plan = solve(budget)
    except solverlib.InfeasibleBudgetError as e:
      notes.append(f"no plan is predicted within {fmt(budget)} (the leanest "
                   f"{fmt(e.leanest_bytes)})")
      if not e.leanest_bytes < predicted:
        break
      # The compiler may still take the leanest plan the model knows: try it.
      budget = e.leanest_bytes * (1 + 1e-9)
      try:
        plan = solve(budget)
      except solverlib.InfeasibleBudgetError:
        break
  leanest = min(rounds, key=lambda r: r[2])
  raise solverlib.InfeasibleBudgetError(
      f"search(verify={topology!r}): no plan compiled within {fmt(limit)} per device "
      f"({'memory_budget' if limit == memory_budget else 'the usable HBM of ' + topology}); "
      f"the leanest needs {fmt(leanest[2])}, {fmt(leanest[2] - limit)} too much. "
      + "; ".join(notes) + ". Use a bigger mesh, rematerialise, or a smaller batch or "
      "model.", budget_bytes=limit, leanest_bytes=leanest[2])


def _leanest(solve) -> float | None:
  """Predicted bytes of the leanest plan the search knows (what a search under a
  budget no plan fits reports), or None."""
  try:
    solve(1.0)
  except solverlib.InfeasibleBudgetError as e:
    return e.leanest_bytes
  return None


def resolve_budget(memory_budget: float | None,
                   profile: costlib.DeviceProfile) -> float | None:
  """The budget the solver gets from a checked one (`options.memory_bytes`): None
  (unlimited) for infinity, the device's by default.

  Example:
    >>> resolve_budget(float("inf"), costlib.get_profile("h100")) is None
    True
  """
  if memory_budget is None:
    return default_budget(profile)
  return None if memory_budget == math.inf else memory_budget


def solver_name(name: options.Solver | None, fold: bool) -> options.Solver:
  """The solver to use: as named, or the default for the view."""
  if name is not None:
    return name
  return options.Solver.ELIMINATION if fold else options.Solver.ILP


def baseline_figures(problem: solverlib.Problem, table_cache: dict | None = None
                     ) -> tuple[planlib.BaselineFigures, ...]:
  """Data parallel and FSDP costed on an already built problem, for a plan's report.

  As `tapas_jax.baselines.baseline` does, the batch may take every mesh axis, whatever
  the search's `batch_axes`.

  Args:
    table_cache: the searched plan's cost tables (`solver.solve(..., table_cache=)`),
      so that only tables the batch's wider domain or the fixed FSDP layouts change
      are built again (a table's key holds its classes' domains).
  """
  wide = solverlib.with_batch_axes(problem, None)
  every = tuple(a for a in wide.mesh.axis_names if wide.mesh.size(a) > 1)
  out = []
  for name in ("data_parallel", "fsdp"):
    layout = solverlib.layout_choice(wide, batch_axes=every, fsdp=name == "fsdp")
    solution = solverlib.evaluate(wide, layout, table_cache=table_cache,
                                  figures_only=True, pin_batch=wide.domains != problem.domains)
    out.append(planlib.BaselineFigures(
        name=name, step_s=solution.step_s, comm_bytes=solution.comm_bytes,
        memory_bytes=solution.memory_bytes))
  return tuple(out)
