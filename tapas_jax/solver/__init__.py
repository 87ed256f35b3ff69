"""The solver: sharding as a minimisation over dimension classes.

Modules, in the order data flows through them:

- `views`: which ops are searched (folded: one copy per unique layer) and what each
  stands for;
- `problem`: dimension classes (automatically found logical axes), their domains of
  mesh axes, each op's rule, the state update's own classes (ZeRO);
- `tables`: per-op cost tables (compute, collectives on input edges, partial sums);
- `live`: live ranges of every intermediate of the top-level program, as the compiler
  keeps it (`Activations`, built once per search); `template` maps a folded view's
  interior copies' from their representative's, so building it stays flat in depth;
- `memory`: per-device bytes of inputs and of intermediates live at the peak;
- `eliminate`: exact min-sum variable elimination;
- `ilp`: the same objective as one integer program (HiGHS), the reference;
- `experts`: data parallel and FSDP as class choices (the budgeted search's incumbents);
- `layouts`: a layout stated in plan terms (batch axes, FSDP, parameter splits, specs
  per input path) as a class choice: `layout_choice`, what the baselines and
  `@tapas.shard`'s forward plans cost;
- `budget`: fitting a memory budget (Lagrange weight, re-posed peak, incumbents, greedy
  repair);
- `solve`: `solve(problem) -> Solution` and `evaluate(problem, choice)`;
- `result`, `plan_terms`: the `Solution` they return, with its `terms` (`PlanTerms`:
  each input's stored and used specs, the constraints `apply` pins, the decisions);
- `memo` (used by the others): the search's cache, results kept by the identity of
  what they were built from, so a whole-program pass runs once per search.

`tapas_jax.api.search` runs trace, fold and this package, then `plan.make_plan`, which
reads a `Solution` and nothing else of the solver; `apply` does a plan's remat through
`layer_remats`, `ScanRemat` and `scan_region`. The modules above the solver use the
names below only (`tests/imports_test.py` checks it).
"""

from tapas_jax.solver.budget import BudgetResult, InfeasibleBudgetError
from tapas_jax.solver.layouts import LayoutChoice, layout_choice
from tapas_jax.solver.problem import (MODEL_AXIS_NAMES, DimClass, Problem,
                                      build_problem, data_axes, default_batch_axes,
                                      warn_batch_unsplit, with_batch_axes)
from tapas_jax.solver.remat import POLICIES as REMAT_POLICIES
from tapas_jax.solver.remat import ScanRemat, layer_remats
from tapas_jax.solver.result import (Constraint, Decision, InputSpec, PlanTerms, Solution,
                                     Status)
from tapas_jax.solver.solve import SOLVERS, evaluate, solve, warn_unsplittable
from tapas_jax.solver.views import View, folded_view, scan_region, unfolded_view

__all__ = ["MODEL_AXIS_NAMES", "REMAT_POLICIES", "SOLVERS", "BudgetResult", "Constraint",
           "Decision", "DimClass", "InfeasibleBudgetError", "InputSpec", "LayoutChoice",
           "PlanTerms", "Problem", "ScanRemat", "Solution", "Status", "View",
           "build_problem", "data_axes", "default_batch_axes", "evaluate", "folded_view",
           "layer_remats", "layout_choice", "scan_region", "solve", "unfolded_view",
           "warn_batch_unsplit", "warn_unsplittable", "with_batch_axes"]
