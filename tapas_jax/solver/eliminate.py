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

import heapq
import math
from typing import Mapping

import numpy as np

from tapas_jax.solver.problem import Problem

__all__ = ["MAX_TABLE", "TooEntangled", "eliminate", "eliminate_merged", "merge", "merge_into",
           "reduced_domains", "restrict", "take"]

# Elimination tables above this many entries mean the class graph is too entangled
# for exact elimination; the search then refuses rather than run for hours.
MAX_TABLE = 1 << 22


class TooEntangled(RuntimeError):
  """Variable elimination would build too large a table: solve over smaller domains."""


def eliminate(factors: list[tuple[tuple[int, ...], np.ndarray]],
              domain_size: Mapping[int, int]) -> dict[int, int]:
  """Exact min-sum variable elimination; returns class -> domain index."""
  return eliminate_merged(merge(factors), domain_size)


def eliminate_merged(merged: Mapping[tuple[int, ...], np.ndarray],
                     domain_size: Mapping[int, int]) -> dict[int, int]:
  """`eliminate` on factors already merged (one table per sorted scope, as `merge`
  returns them).

  The class eliminated next is the one whose elimination table is smallest (ties: the
  lowest class id). Neighbour sets and table sizes are kept up to date as factors are
  replaced rather than recomputed from every factor at every step: a budgeted search
  eliminates the same problem a hundred times over (`budget.fit_budget`).
  """
  # Factors by creation id: a class's factors are summed in that order (the order of
  # the factor list this replaces), so every sum is the same floating-point sum.
  factors: dict[int, tuple[tuple[int, ...], np.ndarray]] = dict(enumerate(merged.items()))
  variables = set(domain_size)
  for scope, _ in factors.values():
    variables.update(scope)
  holding: dict[int, list[int]] = {v: [] for v in variables}  # class -> factor ids
  neighbours: dict[int, set[int]] = {v: set() for v in variables}
  for f, (scope, _) in factors.items():
    for v in scope:
      holding[v].append(f)
      neighbours[v].update(scope)

  def size(v):
    return math.prod(domain_size[u] for u in neighbours[v])

  cost = {v: size(v) for v in variables}
  heap = [(n, v) for v, n in cost.items()]
  heapq.heapify(heap)
  trail = []
  next_id = len(factors)
  while variables:
    n, var = heapq.heappop(heap)
    if var not in variables or cost[var] != n:
      continue  # a stale entry: the class was eliminated or its table grew
    mine = [factors.pop(f) for f in holding.pop(var)]
    scope = tuple(sorted(neighbours.pop(var) | {var}))
    if math.prod(domain_size[c] for c in scope) > MAX_TABLE:
      raise TooEntangled(f"elimination table over {len(scope)} classes")
    total = np.zeros(tuple(domain_size[c] for c in scope))
    for s, table in mine:
      shape = [domain_size[c] if c in s else 1 for c in scope]
      total = total + table.reshape(shape)
    axis = scope.index(var)
    rest = tuple(c for c in scope if c != var)
    trail.append((var, rest, np.argmin(total, axis=axis)))
    factors[next_id] = (rest, np.min(total, axis=axis))
    variables.discard(var)
    for u in rest:
      # u's factors among `mine` are replaced by the new one, whose scope holds all
      # of theirs but `var`.
      holding[u] = [f for f in holding[u] if f in factors] + [next_id]
      neighbours[u] = (neighbours[u] | set(rest)) - {var}
      cost[u] = size(u)
      heapq.heappush(heap, (cost[u], u))
    next_id += 1
  assignment: dict[int, int] = {}
  for var, rest, arg in reversed(trail):
    assignment[var] = int(arg[tuple(assignment[c] for c in rest)]) if rest else int(arg)
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
