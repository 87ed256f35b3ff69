"""The unfolded reference: the same objective as one integer program, solved by HiGHS.

Alpa-style: one-hot per class, a one-hot per op table over the joint choice of the
classes it touches, and (under a budget) hard memory rows: one per activation peak the
budget has been posed at, so a plan fixed at one peak cannot move the excess to another.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np

from tapas_jax.solver.eliminate import merge
from tapas_jax.solver.result import Status

__all__ = ["IlpResult", "solve_ilp"]


@dataclasses.dataclass(frozen=True)
class IlpResult:
  """What HiGHS returned.

  Attributes:
    assignment: class -> domain index; None when no plan was found.
    status: `Status.OPTIMAL`, `TIME_LIMIT` (stopped early with a plan), `INFEASIBLE`
      (no plan meets the memory rows), or HiGHS's own message for another stop.
  """

  assignment: Mapping[int, int] | None
  status: Status | str


def solve_ilp(factors, domain_size: Mapping[int, int], memory_rows, budget: float | None,
              time_limit: float | None) -> IlpResult:
  """The same objective as one integer program (local-polytope form), solved by HiGHS.

  Binary x[c, k]: class c takes its k-th domain entry, one per class. A factor over
  several classes gets continuous y[f, idx] >= 0 whose marginals equal the x of each
  class; with x integral, y is the indicator of the joint choice. Forbidden entries
  (an op split twice over one axis) get y = 0.

  Args:
    memory_rows: lists of (scope, table) memory terms; under a budget, each list sums
      to at most `budget`.
  """
  from scipy import optimize, sparse  # noqa: PLC0415 - only the reference needs it

  classes = sorted(domain_size)
  xoff, n = {}, 0
  for c in classes:
    xoff[c], n = n, n + domain_size[c]
  cost = np.zeros(n)
  rows, cols, vals, lo, hi = [], [], [], [], []
  upper = [1.0] * n

  def add_row(entries, lb, ub):
    r = len(lo)
    for col, val in entries:
      rows.append(r)
      cols.append(col)
      vals.append(val)
    lo.append(lb)
    hi.append(ub)

  for c in classes:
    add_row([(xoff[c] + k, 1.0) for k in range(domain_size[c])], 1.0, 1.0)
  yoff = {}
  merged = merge(factors)
  rows_merged = ([merge([(sc, t) for sc, t in memory if sc]) for memory in memory_rows]
                 if budget is not None else [])
  for memory_merged in rows_merged:
    for scope, table in memory_merged.items():
      if len(scope) > 1 and scope not in merged:
        merged[scope] = np.zeros_like(table)  # y variables to express the memory row
  for scope, table in merged.items():
    if len(scope) == 1:
      flat = np.where(np.isfinite(table), table, 0.0)
      cost[xoff[scope[0]]:xoff[scope[0]] + domain_size[scope[0]]] += flat
      for k in np.flatnonzero(~np.isfinite(table)):
        upper[xoff[scope[0]] + k] = 0.0
      continue
    yoff[scope] = n
    flat = table.reshape(-1)
    cost = np.concatenate([cost, np.where(np.isfinite(flat), flat, 0.0)])
    upper += [1.0 if np.isfinite(v) else 0.0 for v in flat]
    idx = np.array(list(np.ndindex(table.shape)))
    for j, c in enumerate(scope):
      for k in range(domain_size[c]):
        hits = np.flatnonzero(idx[:, j] == k)
        add_row([(n + int(h), 1.0) for h in hits] + [(xoff[c] + k, -1.0)], 0.0, 0.0)
    n += flat.size
  for memory, memory_merged in zip(memory_rows if budget is not None else (), rows_merged):
    entries = {}
    for scope, table in memory_merged.items():
      if len(scope) == 1:
        for k in range(domain_size[scope[0]]):
          key = xoff[scope[0]] + k
          entries[key] = entries.get(key, 0.0) + float(table[k])
      else:
        for h, v in enumerate(table.reshape(-1)):
          entries[yoff[scope] + h] = entries.get(yoff[scope] + h, 0.0) + float(v)
    fixed = sum(float(t) for s, t in memory if not s)
    add_row(list(entries.items()), -np.inf, budget - fixed)
  integrality = np.zeros(n)
  integrality[:sum(domain_size.values())] = 1
  matrix = sparse.csr_array((vals, (rows, cols)), shape=(len(lo), n))
  options = {"time_limit": time_limit} if time_limit else {}
  res = optimize.milp(cost, integrality=integrality,
                      bounds=optimize.Bounds(np.zeros(n), np.array(upper)),
                      constraints=optimize.LinearConstraint(matrix, lo, hi), options=options)
  if res.x is None:
    if res.status == 2:
      return IlpResult(None, Status.INFEASIBLE)
    if res.status == 1:
      raise RuntimeError(
          f"search: the integer program (solver='ilp') hit time_limit={time_limit} s "
          "before it found any plan. Give it more time, or use solver='elimination' "
          "(with fold=True, the default): the same objective, found far faster.")
    raise RuntimeError(f"search: the integer program found no solution ({res.message})")
  status = {0: Status.OPTIMAL, 1: Status.TIME_LIMIT}.get(res.status, res.message)
  assignment = {c: int(np.argmax(res.x[xoff[c]:xoff[c] + domain_size[c]])) for c in classes}
  return IlpResult(assignment, status)
