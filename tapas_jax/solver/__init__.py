"""The solver: sharding as a minimisation over dimension classes.

Modules, in the order data flows through them:

- `views`: which ops are searched (folded: one copy per unique layer) and what each
  stands for;
- `problem`: dimension classes (automatically found logical axes), their domains of
  mesh axes, each op's rule, the state update's own classes (ZeRO);
- `tables`: per-op cost tables (compute, collectives on input edges, partial sums);
- `memory`: per-device bytes of inputs and of intermediates live at the peak;
- `eliminate`: exact min-sum variable elimination;
- `ilp`: the same objective as one integer program (HiGHS), the reference;
- `experts`: data parallel and FSDP as class choices (the budgeted search's incumbents);
- `budget`: fitting a memory budget (Lagrange weight, re-posed peak, incumbents, greedy
  repair);
- `solve`: `solve(problem) -> Solution` and `evaluate(problem, choice)`;
- `memo` (used by the others): the search's cache, results kept by the identity of
  what they were built from, so a whole-program pass runs once per search.

`tapas_jax.api.search` runs trace, fold and this package, then `plan.make_plan`.
"""

from tapas_jax.solver.budget import BudgetResult, InfeasibleBudgetError
from tapas_jax.solver.problem import (MODEL_AXIS_NAMES, DimClass, Problem,
                                      build_problem, default_batch_axes,
                                      warn_batch_unsplit)
from tapas_jax.solver.solve import SOLVERS, Solution, evaluate, solve, warn_unsplittable
from tapas_jax.solver.views import View, folded_view, unfolded_view

__all__ = ["MODEL_AXIS_NAMES", "SOLVERS", "BudgetResult", "DimClass",
           "InfeasibleBudgetError", "Problem", "Solution", "View", "build_problem",
           "default_batch_axes", "evaluate", "folded_view", "solve", "unfolded_view",
           "warn_batch_unsplit", "warn_unsplittable"]
