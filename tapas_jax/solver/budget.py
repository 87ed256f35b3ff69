"""Fitting a plan into a per-device memory budget.

The budget covers the inputs plus the intermediates live at the activation peak. It
enters the folded search as a Lagrange weight on memory tables, tuned by bisection
(`fit_budget`); the peak's live set depends on the plan, so the constraint is re-posed
at the new peak while the peak moves (`within_budget`); the expert layouts are
incumbents: the fastest of the weight's plan and those that fit is kept (`best_of`,
`experts.incumbents`); greedy single-class moves then close part of the duality gap
(`repair`). The integer program takes the budget as a hard row instead. Results are
`BudgetResult` records; the public error is raised once, with the whole story, by
`solve`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

import numpy as np

from tapas_jax.errors import TapasError
from tapas_jax.options import format_bytes
from tapas_jax.solver.live import Activations
from tapas_jax.solver.memory import activation_tables, largest_live, memory_used
from tapas_jax.solver.problem import Problem
from tapas_jax.solver.result import Status
from tapas_jax.solver.tables import Table, evaluate_tables

__all__ = ["BudgetResult", "InfeasibleBudgetError", "best_of", "budget_error", "fit_budget",
           "repair", "within_budget"]


@dataclasses.dataclass(frozen=True)
class BudgetResult:
  """One attempt at fitting the budget.

  Attributes:
    assignment: class -> domain index: a plan that fits, or else the leanest reached
      (None: the solver found no plan at all).
    fits: whether `assignment` meets the budget.
    weight: the Lagrange weight on memory that produced it (0: none used).
    used_bytes: per-device bytes of `assignment` as the budget counts them.
    largest_live: the biggest intermediates at its peak, as text (set when it does not fit).
    status: the solver's status for `assignment` (`Status`, or HiGHS's message).
  """

  assignment: Mapping[int, int] | None
  fits: bool
  weight: float = 0.0
  used_bytes: float = math.inf
  largest_live: str = ""
  status: Status | str = Status.OPTIMAL


class InfeasibleBudgetError(TapasError, ValueError):
  """No plan fits the memory budget.

  Attributes:
    budget_bytes: the per-device budget asked for.
    leanest_bytes: the least per-device memory any plan the search reached takes
      (inf when none was reached).
  """

  def __init__(self, message: str, budget_bytes: float = math.nan,
               leanest_bytes: float = math.inf):
    super().__init__(message)
    self.budget_bytes = budget_bytes
    self.leanest_bytes = leanest_bytes


# The activation peak moves with the plan: the budget is re-posed at the new peak this
# many times before the search gives up.
BUDGET_ROUNDS = 6


def within_budget(problem: Problem, acts: Activations, initial: BudgetResult,
                  memory: list[Table], budget: float,
                  solve_within: Callable[[tuple[list[Table], ...]], BudgetResult]
                  ) -> BudgetResult:
  """A plan whose inputs plus live intermediates at their peak fit the budget.

  The peak's live set depends on the plan, so the constraint is posed on the values
  live at the current plan's peak, solved, and re-posed at the new plan's peak until
  the plan fits.

  Args:
    initial: the unconstrained plan to start from.
    solve_within: the memory tables of every peak posed so far, newest last -> the
      best plan within the budget on them (on the newest alone, or on all at once).

  Returns:
    The plan that fits (`fits=True`), or else the leanest plan seen.
  """
  current, leanest, posed = initial, None, ()
  for _ in range(BUDGET_ROUNDS):
    used, at, choice = memory_used(problem, acts, memory, current.assignment)
    if leanest is None or used < leanest[0]:
      leanest = (used, current, choice)
    if used <= budget:
      return dataclasses.replace(current, fits=True, used_bytes=used)
    posed += (memory + activation_tables(problem, acts, at),)
    step = solve_within(posed)
    if step.assignment is None:
      break
    if not step.fits:  # the leanest plan the bisection reached
      used, _, choice = memory_used(problem, acts, memory, step.assignment)
      if used < leanest[0]:
        leanest = (used, step, choice)
      break
    current = step
  used, result, choice = leanest
  return dataclasses.replace(result, fits=False, used_bytes=used,
                             largest_live=largest_live(problem, acts, choice))


def best_of(problem: Problem, acts: Activations, result: BudgetResult,
            incumbents: Sequence[Mapping[int, int]], tables: list[Table],
            memory: list[Table], budget: float) -> BudgetResult:
  """The fastest of the search's plan and the incumbents that fit the budget.

  A Lagrange weight on a moving peak can miss plans that fit (or find none at all);
  the expert layouts (`experts.incumbents`) are points of the same space, costed by the
  same tables, so the search never returns slower than one that fits. When nothing
  fits, the leanest of them all, for the error.
  """
  best, best_s = result, (evaluate_tables(tables, result.assignment)[0]
                          if result.fits and result.assignment is not None else math.inf)
  leanest = None
  for assignment in incumbents:
    step_s = evaluate_tables(tables, assignment)[0]
    if best.fits and step_s >= best_s:
      continue  # the peak is the dear part: found only for an incumbent that could win
    used, _, choice = memory_used(problem, acts, memory, assignment)
    if used <= budget:
      best, best_s = BudgetResult(dict(assignment), fits=True, used_bytes=used,
                                  status=result.status), step_s
    elif not best.fits and used < best.used_bytes and (leanest is None or used < leanest[0]):
      leanest = (used, assignment, choice)
  if best.fits or leanest is None:
    return best
  used, assignment, choice = leanest
  return BudgetResult(dict(assignment), fits=False, used_bytes=used,
                      largest_live=largest_live(problem, acts, choice), status=result.status)


def repair(problem: Problem, acts: Activations, assignment, tables, memory, budget,
           sizes, rounds: int = 4) -> dict[int, int]:
  """Greedy single-class moves that make a budgeted plan faster and keep it in budget.

  A Lagrange weight can leave a duality gap (a plan the weight does not reach may be
  faster and still fit); this closes some of it cheaply.
  """
  touching: dict[int, list[Table]] = {}
  for t in tables:
    for c in t.scope:
      touching.setdefault(c, []).append(t)

  def local(c, n):
    """The time of the tables touching c, for each of its n options (others fixed):
    per option, the same sum in the same order as one entry at a time."""
    total = np.zeros(n)
    for t in touching.get(c, ()):
      total = total + t.value[tuple(slice(None) if u == c else assignment.get(u, 0)
                                    for u in t.scope)]
    return total.tolist()

  assignment = dict(assignment)
  for _ in range(rounds):
    moved = False
    for c, n in sizes.items():
      costs = local(c, n)
      now = costs[assignment.get(c, 0)]
      for k in sorted(range(n), key=costs.__getitem__):
        if costs[k] >= now - 1e-12 * max(1.0, abs(now)):
          break
        trial = {**assignment, c: k}
        if memory_used(problem, acts, memory, trial)[0] <= budget:
          assignment, moved = trial, True
          break
    if not moved:
      break
  return assignment


# Tenfold rises of the Lagrange weight from 1e-12 before `fit_budget` gives up.
_ESCALATIONS = 60


def fit_budget(run: Callable[[float], Mapping[int, int]],
               memory: list[Table] | Sequence[list[Table]], budget: float) -> BudgetResult:
  """Bisection on the Lagrange weight of the memory tables until the plan fits them.

  Args:
    run: Lagrange weight -> the plan minimising time + weight * memory.
    memory: the memory tables of one peak, or a sequence of them (one per peak posed):
      a plan fits when it fits at every one.

  Returns:
    The fastest plan found that fits, with its weight; or, when no weight makes a plan
    fit, the leanest one reached (`fits=False`).
  """
  peaks = [memory] if not memory or isinstance(memory[0], Table) else list(memory)

  def used_by(assignment):
    return max(evaluate_tables(m, assignment)[0] for m in peaks)

  lo, hi = 0.0, 1e-12
  if len(peaks) == 1:
    # With one peak the plan's memory falls as the weight rises (each weight's plan is
    # an exact minimiser), so the plan of the escalation's last weight, asked first,
    # settles an infeasible budget in one elimination instead of sixty, with the
    # answer the escalation gives. (Over several peaks the weight is on their sum,
    # which does not order their maximum.)
    last = hi
    for _ in range(_ESCALATIONS - 1):  # the same float the escalation reaches
      last *= 10
    leanest = run(last)
    if (used := used_by(leanest)) > budget:
      return BudgetResult(leanest, fits=False, weight=last * 10, used_bytes=used)
  best = None
  for _ in range(_ESCALATIONS):
    assignment = run(hi)
    used = used_by(assignment)
    if used <= budget:
      best = BudgetResult(assignment, fits=True, weight=hi, used_bytes=used)
      break
    hi *= 10
  if best is None:
    return BudgetResult(assignment, fits=False, weight=hi, used_bytes=used)
  for _ in range(30):
    mid = (lo + hi) / 2
    assignment = run(mid)
    used = used_by(assignment)
    if used <= budget:
      hi, best = mid, BudgetResult(assignment, fits=True, weight=mid, used_bytes=used)
    else:
      lo = mid
  return best


def budget_error(problem: Problem, budget: float, reached: float,
                 live: str = "") -> InfeasibleBudgetError:
  """The smallest per-device memory reached, the floor of the inputs alone, and the
  tensors that dominate it."""
  rows = []
  for i in problem.graph.inputs:
    # The most any layout can split this tensor: per dim the widest option its class
    # allows, each mesh axis once. Ignores op conflicts, so it is a lower bound.
    t, used, shards = problem.graph.types[i.value], set(), 1
    for d in range(len(t.shape)):
      options = [o for o in problem.domains[problem.vclass(i.value, d)]
                 if not used & set(o)]
      best = max(options, key=lambda o: math.prod(problem.mesh.size(a) for a in o))
      used.update(best)
      shards *= math.prod(problem.mesh.size(a) for a in best)
    rows.append((t.nbytes / shards, i.path, t))
  rows.sort(reverse=True)
  floor = sum(r[0] for r in rows)
  top = ", ".join(f"{p} {t} ({b / 2**20:.1f} MiB)" for b, p, t in rows[:5])
  return InfeasibleBudgetError(
      f"search: memory_budget={format_bytes(budget)} per device cannot be met on mesh "
      f"{dict(zip(problem.mesh.axis_names, problem.mesh.axis_sizes))}: "
      + (f"the leanest plan found takes {format_bytes(reached)} (inputs and the "
         "intermediates live at the activation peak); " if math.isfinite(reached) else "")
      + "even splitting "
      f"every dimension as far as the mesh allows leaves {format_bytes(floor)} of "
      f"inputs per device. Largest inputs per device: {top}."
      + (f" Largest intermediates at the peak: {live}." if live else "")
      + " Raise the budget, use a bigger mesh, let the batch split over more mesh axes "
      "(batch_axes=None), rematerialise (jax.checkpoint), or use a smaller batch or "
      "model.", budget_bytes=budget, leanest_bytes=reached)
