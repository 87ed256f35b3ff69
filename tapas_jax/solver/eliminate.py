"""Exact min-sum variable elimination over class tables, and the domain reductions
used when the class graph is too entangled for it.

The objective is a sum of small tables, each over a few classes; eliminating one class
at a time (smallest resulting table first) minimises it exactly. On a folded view this
eliminates a unique layer's interior classes into a table over its boundary classes,
then the chain of layers: TAPAS's per-layer search and chain DP in one algorithm.

Example:
  >>> import numpy as np
  >>> from tapas_jax.solver.eliminate import eliminate
  >>> eliminate([((0,), np.array([3.0, 1.0])), ((0, 1), np.array([[0.0, 5.0], [4.0, 0.0]]))],
  ...           {0: 2, 1: 2})
  {1: 1, 0: 1}
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Mapping, Sequence

import numpy as np

from tapas_jax.errors import TapasError
from tapas_jax.solver.problem import Problem

__all__ = ["MAX_TABLE", "Schedule", "TooEntangled", "eliminate", "eliminate_merged", "merge",
           "merge_into", "reduced_domains", "restrict", "take"]

# Elimination tables above this many entries mean the class graph is too entangled
# for exact elimination; the search then refuses rather than run for hours.
MAX_TABLE = 1 << 22


class TooEntangled(TapasError, RuntimeError):
  """Variable elimination would build too large a table: solve over smaller domains."""


def eliminate(factors: list[tuple[tuple[int, ...], np.ndarray]],
              domain_size: Mapping[int, int]) -> dict[int, int]:
  """Exact min-sum variable elimination; returns class -> domain index."""
  return eliminate_merged(merge(factors), domain_size)


def eliminate_merged(merged: Mapping[tuple[int, ...], np.ndarray],
                     domain_size: Mapping[int, int]) -> dict[int, int]:
  """`eliminate` on factors already merged (one table per sorted scope, as `merge`
  returns them)."""
  return Schedule(tuple(merged), domain_size).run(tuple(merged.values()))


@dataclasses.dataclass(frozen=True)
class _Step:
  """Eliminating one class: sum `parts` (factor id, shape to broadcast it in) into a
  table of `shape` over `scope`, minimise over `axis`; the result is a new factor."""

  var: int
  rest: tuple[int, ...]
  shape: tuple[int, ...]
  parts: tuple[tuple[int, tuple[int, ...]], ...]
  axis: int


class Schedule:
  """The order of variable elimination over factors of given scopes, and the sums it
  makes; `run` replays it on tables of those scopes.

  The order depends on the scopes and domain sizes alone, never on table values, so
  a problem solved at many Lagrange weights (`budget.fit_budget`) is scheduled once.
  The class eliminated next is the one whose elimination table is smallest (ties: the
  lowest class id). Each class's factors are summed in creation order (the given
  factors first, in order, then those elimination makes), so the same tables give the
  same sums, bit for bit, however the schedule was reached.

  Raises:
    TooEntangled: a step's table would exceed `MAX_TABLE` entries.

  Example:
    >>> import numpy as np
    >>> schedule = Schedule(((0,), (0, 1)), {0: 2, 1: 2})
    >>> schedule.run((np.array([3.0, 1.0]), np.array([[0.0, 5.0], [4.0, 0.0]])))
    {1: 1, 0: 1}
    >>> schedule.run((np.array([0.0, 9.0]), np.array([[0.0, 5.0], [4.0, 0.0]])))
    {1: 0, 0: 0}
  """

  def __init__(self, scopes: Sequence[tuple[int, ...]], domain_size: Mapping[int, int]):
    self.num_factors = len(scopes)
    live: dict[int, tuple[int, ...]] = dict(enumerate(scopes))  # factor id -> scope
    variables = set(domain_size)
    for scope in scopes:
      variables.update(scope)
    holding: dict[int, list[int]] = {v: [] for v in variables}  # class -> factor ids
    neighbours: dict[int, set[int]] = {v: set() for v in variables}
    for f, scope in live.items():
      for v in scope:
        holding[v].append(f)
        neighbours[v].update(scope)
    # Kept up to date as factors are replaced, not recomputed from every factor.
    cost = {v: math.prod(domain_size[u] for u in neighbours[v]) for v in variables}
    heap = [(n, v) for v, n in cost.items()]
    heapq.heapify(heap)
    steps = []
    next_id = len(scopes)
    while variables:
      n, var = heapq.heappop(heap)
      if var not in variables or cost[var] != n:
        continue  # a stale entry: the class was eliminated or its table changed
      mine = holding.pop(var)
      scope = tuple(sorted(neighbours.pop(var) | {var}))
      if math.prod(domain_size[c] for c in scope) > MAX_TABLE:
        raise TooEntangled(f"elimination table over {len(scope)} classes")
      parts = tuple((f, tuple(domain_size[c] if c in live[f] else 1 for c in scope))
                    for f in mine)
      for f in mine:
        del live[f]
      rest = tuple(c for c in scope if c != var)
      steps.append(_Step(var, rest, tuple(domain_size[c] for c in scope), parts,
                         scope.index(var)))
      live[next_id] = rest
      variables.discard(var)
      for u in rest:
        # u's factors among `mine` give way to the new one, whose scope holds all of
        # theirs but `var`.
        holding[u] = [f for f in holding[u] if f in live] + [next_id]
        added = set(rest) - neighbours[u]
        neighbours[u] = (neighbours[u] | added) - {var}
        cost[u] = cost[u] // domain_size[var] * math.prod(domain_size[a] for a in added)
        heapq.heappush(heap, (cost[u], u))
      next_id += 1
    self.steps = tuple(steps)

  def run(self, tables: Sequence[np.ndarray]) -> dict[int, int]:
    """Class -> domain index minimising the sum of `tables` (one per scope, in order)."""
    if len(tables) != self.num_factors:
      raise ValueError(f"Schedule.run: {len(tables)} tables for {self.num_factors} scopes")
    factors = list(tables)
    trail = []
    for step in self.steps:
      total = np.zeros(step.shape)
      for f, shape in step.parts:
        total = total + factors[f].reshape(shape)
      trail.append(np.argmin(total, axis=step.axis))
      factors.append(np.min(total, axis=step.axis))
    assignment: dict[int, int] = {}
    for step, arg in zip(reversed(self.steps), reversed(trail)):
      rest = step.rest
      assignment[step.var] = int(arg[tuple(assignment[c] for c in rest)]) if rest else int(arg)
    return assignment


def reduced_domains(problem: Problem, level: str) -> dict[int, list[int]]:
  """Domain indices kept per class: all, single axes only, or nothing but the batch."""
  keep = {}
  for c, dom in enumerate(problem.domains):
    if len(dom) <= 1:
      continue
    if level == "full" or (level == "batch-only" and problem.classes[c].batch):
      keep[c] = list(range(len(dom)))
    elif level == "single-axis" or problem.classes[c].batch:
      keep[c] = [k for k, axes in enumerate(dom) if len(axes) <= 1 or problem.classes[c].batch]
    else:
      keep[c] = [0]
  return keep


def take(factors, keep, sizes):
  """Factors restricted to the kept domain indices; classes left with one option drop."""
  out = []
  for scope, table in factors:
    for axis, c in enumerate(scope):
      table = np.take(table, keep[c], axis=axis)
    index = tuple(slice(None) if c in sizes else 0 for c in scope)
    reduced = tuple(c for c in scope if c in sizes)
    if reduced:
      out.append((reduced, table[index]))
  return out


def merge(factors):
  """One table per sorted scope: the factors over it summed, in order."""
  return merge_into({}, factors)


def merge_into(merged: dict, factors) -> dict:
  """Adds factors into `merged` (new arrays: the tables it holds are not written to)."""
  for scope, table in factors:
    order = tuple(sorted(scope))
    if order != scope:
      table = np.transpose(table, [scope.index(c) for c in order])
    merged[order] = merged[order] + table if order in merged else np.array(table, float)
  return merged


def restrict(scope, table, domain_size):
  """Drops scope classes with a one-element domain (index 0)."""
  idx = tuple(slice(None) if c in domain_size else 0 for c in scope)
  return table[idx]
