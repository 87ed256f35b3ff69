"""Solving a problem: build the tables, minimise, fit the budget; or cost a given choice.

`solve` minimises predicted step time over class-to-axes choices: by variable
elimination (exact; `solver="elimination"`) or as one integer program (HiGHS;
`solver="ilp"`, the Alpa-style reference). `reuse=True` builds each cost table once per
structurally identical op (folding's saving); it never changes the objective.
`evaluate` costs a given choice by the same model (the baselines use it). Both return a
`result.Solution`: its figures, and its `terms` (the plan's specs, constraints and
decisions), which is all a plan is built from.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tapas_jax import cost, trace
  >>> from tapas_jax.solver import build_problem, solve
  >>> graph = trace.trace(lambda w, x: jnp.sum(jnp.tanh(x @ w)),
  ...                     jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
  ...                     jax.ShapeDtypeStruct((65536, 4096), jnp.float32))
  >>> p = build_problem(graph, cost.mesh_spec({"data": 8}, "h100"),
  ...                   cost.get_profile("h100"), None)
  >>> by_elimination, by_ilp = solve(p), solve(p, solver="ilp")
  >>> by_elimination.step_s == by_ilp.step_s
  True
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from typing import Mapping

import numpy as np

from tapas_jax import cost as costlib
from tapas_jax.options import SOLVERS
from tapas_jax.solver import experts
from tapas_jax.solver.budget import (BudgetResult, best_of, budget_error, fit_budget, repair,
                                     within_budget)
from tapas_jax.solver.explain import reasons
from tapas_jax.solver.eliminate import (Schedule, TooEntangled, merge, merge_into,
                                        reduced_domains, restrict, take)
from tapas_jax.solver.ilp import solve_ilp
from tapas_jax.solver import remat as rematlib
from tapas_jax.solver.memo import memo
from tapas_jax.solver.layouts import LayoutChoice
from tapas_jax.solver.live import Activations, activations
from tapas_jax.solver.memory import activation_peak, memory_floor, memory_tables
from tapas_jax.solver.plan_terms import plan_terms
from tapas_jax.solver.problem import Problem
from tapas_jax.solver.result import Solution, Status
from tapas_jax.solver.tables import Table, TableBuilder, all_tables, evaluate_tables

__all__ = ["SOLVERS", "Solution", "cached_activations", "evaluate", "solve",
           "warn_unsplittable"]


def solve(problem: Problem, reuse: bool = True, solver: str = "elimination",
          memory_budget: float | None = None, time_limit: float | None = None,
          table_cache: dict | None = None, folded=None) -> Solution:
  """Minimises predicted step time over class-to-axes choices, exactly.

  Args:
    problem: from `build_problem`.
    reuse: build each cost table once per structurally identical op (every instance
      of a unique layer shares one build) rather than once per op. Same tables.
    solver: "elimination" (exact min-sum variable elimination; under a budget, a
      Lagrange weight plus greedy repair) or "ilp" (one integer program solved by
      HiGHS, Alpa-style, with the budget as a hard row: the reference).
    memory_budget: per-device bytes for the program's inputs (params, optimizer
      state, batch) plus the intermediates live at the activation peak; None means
      unconstrained.
    time_limit: seconds for the integer program; `Solution.status` says
      "time_limit" when it stopped early.
    table_cache: cost tables already built for this problem (shared with `evaluate`
      so that costing baselines next to the plan rebuilds nothing; with `reuse`), and
      the program's activations (`cached_activations`), built once for every problem
      over the same program.
    folded: the program's `fold.Folded`; given, under a budget, rematerialisation per
      unique layer is chosen with the sharding (`solver.remat.choose`).

  Raises:
    InfeasibleBudgetError: no choice meets the budget.
    ValueError: an unknown solver.
  """
  if solver not in SOLVERS:
    raise ValueError(f"solver={solver!r} is not one of {SOLVERS}")
  start = time.perf_counter()
  builder = TableBuilder(problem, reuse=reuse, cache=table_cache)
  tables = all_tables(problem, builder)
  objective = _Objective(problem, tables, memory_tables(problem))
  plain_acts = cached_activations(problem, table_cache)
  acts = plain_acts if memory_budget is not None else None
  incumbents = experts.incumbents(problem) if acts is not None else ()

  def attempt(tables, acts):
    posed = _Objective(problem, tables, objective.memory)
    if solver == "elimination":
      return _by_elimination(problem, posed, acts, memory_budget, incumbents)
    return _by_ilp(problem, posed, acts, memory_budget, time_limit, incumbents)

  modes = {}
  if acts is not None and folded is not None:
    result, modes, tables, acts = rematlib.choose(
        problem, folded, builder, tables, acts, attempt,
        # Slack for the floor's sums, added in another order than a plan's.
        may_fit=lambda a: memory_floor(problem, a, objective.memory)
        <= memory_budget * (1 + 1e-9))
    objective = _Objective(problem, tables, objective.memory)
  else:
    result = attempt(tables, acts)
  if not result.fits:
    raise budget_error(problem, memory_budget, result.used_bytes, result.largest_live)
  assignment = result.assignment
  state = evaluate_tables(objective.memory, assignment)[0]
  step_s, comm = evaluate_tables(tables, assignment)
  if not np.isfinite(step_s):
    raise RuntimeError("search: no finite-cost plan (every choice splits an op twice)")
  choice = {c: problem.domains[c][i] for c, i in assignment.items() if problem.domains[c][i]}
  # `choose` hands back the chosen plan's activations, its remat applied.
  peak = activation_peak(problem, acts if acts is not None else plain_acts, choice)[0]
  why = reasons(problem, tables, assignment)
  return Solution(choice=choice, step_s=step_s, comm_bytes=comm, state_bytes=state,
                  activation_bytes=peak, tables_built=builder.built,
                  solve_s=time.perf_counter() - start, memory_weight=result.weight,
                  status=Status.of(result.status), reasons=why, remat=modes,
                  make_terms=functools.partial(plan_terms, problem, choice, why, modes, None,
                                               folded))


@dataclasses.dataclass(frozen=True)
class _Objective:
  """Cost tables and memory tables of one problem, over the classes with a choice."""

  problem: Problem
  tables: list[Table]
  memory: list[Table]

  @functools.cached_property
  def domain_size(self) -> dict[int, int]:
    domains = self.problem.domains
    return {c: len(d) for c, d in enumerate(domains) if len(d) > 1}

  def factors(self, memory: list[Table] = (), weight: float = 0.0):
    """(scope, array) terms of time + weight * memory, fixed classes dropped."""
    out = self.terms(self.tables)
    if weight:
      out += [(s, weight * tab) for s, tab in self.terms(memory)]
    return out

  def terms(self, tables: list[Table]):
    """(scope, array) of these tables, fixed classes dropped."""
    sizes = self.domain_size
    out = [(tuple(c for c in t.scope if c in sizes), restrict(t.scope, t.value, sizes))
           for t in tables if t.scope]
    return [f for f in out if f[0]]


class _Weighted:
  """Time + weight * memory over reduced domains, for elimination at many weights.

  The time terms are restricted and merged once; each weight adds the memory terms
  to them in the order `eliminate` would (time first, then memory), so every sum is
  the same floating-point sum as eliminating the whole list from scratch. The
  elimination order depends on the scopes alone: scheduled once per set of scopes.
  """

  def __init__(self, objective: _Objective, keep, sizes):
    self.keep, self.sizes = keep, sizes
    self.objective = objective
    self.time = merge(take(objective.factors(), keep, sizes))
    self._schedules: dict[tuple, Schedule] = {}

  def run(self, memory: list[Table] = (), weight: float = 0.0) -> dict[int, int]:
    return self.at(memory)(weight)

  def at(self, memory: list[Table]):
    """weight -> the assignment minimising time + weight * these memory tables."""
    terms = take(self.objective.terms(memory), self.keep, self.sizes)

    def run(weight: float) -> dict[int, int]:
      merged = dict(self.time)
      if weight:
        merge_into(merged, [(s, weight * tab) for s, tab in terms])
      scopes = tuple(merged)
      if scopes not in self._schedules:
        self._schedules[scopes] = Schedule(scopes, self.sizes)
      picked = self._schedules[scopes].run(tuple(merged.values()))
      return {c: self.keep[c][i] for c, i in picked.items()}
    return run


_LEVEL_STATUS = {"full": Status.OPTIMAL, "single-axis": Status.REDUCED_SINGLE_AXIS,
                 "batch-only": Status.REDUCED_BATCH_ONLY}


def _by_elimination(problem: Problem, objective: _Objective, acts, budget,
                    incumbents=()) -> BudgetResult:
  """Exact elimination over every axis subset, or over fewer when that is too entangled
  (e.g. ResNet's many channel classes on a 3-D mesh), said in the status. Under a
  budget, the fastest of its plan and the `incumbents` that fit is repaired."""
  for level in ("full", "single-axis", "batch-only"):
    keep = reduced_domains(problem, level)
    sizes = {c: len(k) for c, k in keep.items() if len(k) > 1}
    status = _LEVEL_STATUS[level]
    try:
      weighted = _Weighted(objective, keep, sizes)
      result = BudgetResult(weighted.run(), fits=True, status=status)
      if acts is None:
        return result
      # One Lagrange weight on the sum of every peak posed so far, the plan checked at
      # each: posed on the newest peak alone, the plan can swing between two peaks,
      # lean at one and over at the other, round after round.
      result = within_budget(
          problem, acts, result, objective.memory, budget,
          lambda posed, weighted=weighted, status=status: dataclasses.replace(
              fit_budget(weighted.at([t for peak in posed for t in peak]), posed, budget),
              status=status))
      result = best_of(problem, acts, result, incumbents, objective.tables,
                       objective.memory, budget)
      if not result.fits:
        return result
      return dataclasses.replace(result, assignment=repair(
          problem, acts, result.assignment, objective.tables, objective.memory, budget,
          objective.domain_size))
    except TooEntangled:
      continue
  raise RuntimeError("search: the dimension classes are too entangled to solve")


def _by_ilp(problem: Problem, objective: _Objective, acts, budget, time_limit,
            incumbents=()) -> BudgetResult:
  """The integer program, with a budget row at every activation peak it has met; the
  `incumbents` that fit where the peak moves past the rows posed (`best_of`)."""
  sizes = objective.domain_size
  factors = objective.factors()

  def ilp(rows, limit) -> BudgetResult:
    rows = [[(tuple(c for c in t.scope if c in sizes), restrict(t.scope, t.value, sizes))
             for t in memory] for memory in rows]
    out = solve_ilp(factors, sizes, rows, limit, time_limit)
    return BudgetResult(out.assignment, fits=out.assignment is not None, status=out.status)

  first = ilp([objective.memory], None)
  if first.assignment is None:  # no budget row: only "infeasible" can get here
    return dataclasses.replace(first, fits=False)
  if acts is None:
    return first
  # A hard row per peak posed so far: the plan must fit at every one of them.
  result = within_budget(problem, acts, first, objective.memory, budget,
                         lambda posed: ilp(posed, budget))
  return best_of(problem, acts, result, incumbents, objective.tables, objective.memory,
                 budget)


def evaluate(problem: Problem, choice: Mapping[int, tuple[str, ...]] | LayoutChoice,
             input_layouts: Mapping[int, costlib.Layout] | None = None,
             table_cache: dict | None = None, folded=None,
             remat: Mapping[int, str] | None = None, figures_only: bool = False,
             pin_batch: bool = True) -> Solution:
  """Predicted cost of a given class choice (and optional fixed input layouts).

  Baselines (data parallel, FSDP, Megatron) are choices costed here by the same model.

  Args:
    choice: class id -> mesh axes, or a layout stated in plan terms (`layout_choice`),
      which brings its own `input_layouts`.
    input_layouts: input value -> a fixed layout it is stored in.
    folded: the program's `fold.Folded`; needed with `remat`.
    remat: unique layer index -> `jax.checkpoint` policy (`solver.remat.POLICIES`) of
      the layers rematerialised; their recompute is costed as the search costs it.
    table_cache: as for `solve`: the search's tables and activations, shared.
    figures_only: the figures alone (a report's baseline): neither `reasons` nor
      `terms` is made, and with `pin_batch` the batch classes' tables are built over
      the chosen option only (where a baseline widens the batch's domain, those tables
      are built again anyway; the others are the search's, cached). The same figures.
    pin_batch: False where the batch's domain is the one the cached tables were built
      over (the search let the batch take every axis): they are all looked up.
  """
  start = time.perf_counter()
  if isinstance(choice, LayoutChoice):
    if input_layouts is not None:
      raise ValueError("evaluate: a LayoutChoice brings its own input_layouts; pass one")
    choice, input_layouts = choice.choice, choice.input_layouts
  index = {}
  for c, axes in choice.items():
    if axes not in problem.domains[c]:
      raise ValueError(f"class {problem.classes[c].example or c} (size "
                       f"{problem.classes[c].size}) cannot take mesh axes {axes}; allowed: "
                       f"{problem.domains[c]}")
    index[c] = problem.domains[c].index(axes)
  costed = problem
  if figures_only and pin_batch:  # the batch's options: the choice's own alone
    pinned = {c.index: index.get(c.index, 0) for c in problem.classes if c.batch}
    # One problem per pin, so that baselines pinning the batch alike share its tables.
    costed = memo(table_cache, ("pinned", tuple(pinned.items())), (problem,),
                  lambda: dataclasses.replace(problem, domains=tuple(
                      (d[pinned[c]],) if c in pinned else d
                      for c, d in enumerate(problem.domains))))
    index = {c: 0 if c in pinned else k for c, k in index.items()}
  builder = TableBuilder(costed, reuse=True, input_layouts=input_layouts, cache=table_cache)
  tables = all_tables(costed, builder)
  remat = {u: p for u, p in (remat or {}).items() if p != rematlib.NO_REMAT}
  acts = cached_activations(problem, table_cache)
  if remat:
    if folded is None:
      raise ValueError("evaluate: remat= needs the program's folded= (fold.fold(graph))")
    remats = [r for u, p in remat.items() for r in rematlib.layer_remats(folded, u, p)]
    tables = tables + rematlib.recompute_tables(costed, builder, remats)
    acts = rematlib.with_remat(problem, acts, remats)
  step_s, comm = evaluate_tables(tables, index)
  state = evaluate_tables(memory_tables(costed, input_layouts), index)[0]
  peak = activation_peak(problem, acts, choice)[0]
  if figures_only:
    return Solution(choice=dict(choice), step_s=step_s, comm_bytes=comm, state_bytes=state,
                    activation_bytes=peak, tables_built=builder.built,
                    solve_s=time.perf_counter() - start, memory_weight=0.0, remat=remat)
  choice, why = dict(choice), reasons(problem, tables, index)
  return Solution(choice=choice, step_s=step_s, comm_bytes=comm, state_bytes=state,
                  activation_bytes=peak, tables_built=builder.built,
                  solve_s=time.perf_counter() - start, memory_weight=0.0,
                  reasons=why, remat=remat,
                  make_terms=functools.partial(plan_terms, problem, choice, why, remat,
                                               input_layouts, folded))


def cached_activations(problem: Problem, cache: dict | None) -> Activations:
  """`live.activations(problem)`, kept in `cache` (a search's table cache) for every
  problem over the same program, view, classes and profile: they read neither the
  domains (a baseline's wider batch, `problem.with_batch_axes`) nor fixed input
  layouts, so the search and its baselines share one."""
  parts = (problem.graph, problem.view, problem.classes, problem.value_class,
           problem.reader_dims, problem.profile)
  return memo(cache, "activations", parts, lambda: activations(problem, cache))


def warn_unsplittable(problem: Problem) -> None:
  """One warning when nothing in the program can be split."""
  if not any(len(d) > 1 for d in problem.domains):
    warnings.warn("search: no dimension can be split on this mesh; the plan is replicated",
                  stacklevel=2)
