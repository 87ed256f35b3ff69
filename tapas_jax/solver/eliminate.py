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

import math
from typing import Mapping

import numpy as np

from tapas_jax.solver.problem import Problem

__all__ = ["MAX_TABLE", "TooEntangled", "eliminate", "merge", "reduced_domains", "restrict",
           "take"]

# Elimination tables above this many entries mean the class graph is too entangled
# for exact elimination; the search then refuses rather than run for hours.
MAX_TABLE = 1 << 22


class TooEntangled(RuntimeError):
  """Variable elimination would build too large a table: solve over smaller domains."""


def eliminate(factors: list[tuple[tuple[int, ...], np.ndarray]],
               domain_size: Mapping[int, int]) -> dict[int, int]:
  """Exact min-sum variable elimination; returns class -> domain index."""
  factors = list(merge(factors).items())
  variables = set(domain_size)
  for scope, _ in factors:
    variables.update(scope)
  trail = []
  while variables:
    neighbours: dict[int, set[int]] = {v: set() for v in variables}
    for scope, _ in factors:
      for v in scope:
        neighbours[v].update(scope)
    var = min(variables, key=lambda v: (math.prod(domain_size[u] for u in neighbours[v]), v))
    mine = [f for f in factors if var in f[0]]
    factors = [f for f in factors if var not in f[0]]
    scope = tuple(sorted(set().union(*[set(s) for s, _ in mine]) | {var}))
    if math.prod(domain_size[c] for c in scope) > MAX_TABLE:
      raise TooEntangled(f"elimination table over {len(scope)} classes")
    total = np.zeros(tuple(domain_size[c] for c in scope))
    for s, table in mine:
      shape = [domain_size[c] if c in s else 1 for c in scope]
      total = total + table.reshape(shape)
    axis = scope.index(var)
    rest = tuple(c for c in scope if c != var)
    trail.append((var, rest, np.argmin(total, axis=axis)))
    factors.append((rest, np.min(total, axis=axis)))
    variables.discard(var)
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
  merged: dict[tuple[int, ...], np.ndarray] = {}
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
