"""Why each dimension class took its mesh axes: the best single change, priced.

For a class, every other choice is costed with all other classes kept as planned (the
same tables the solver minimised, so the figures are the objective's own). At an
optimum no single change is cheaper; the gap to the best one is the reason the plan
gives ("replicated: splitting over model would add 37 µs/step").

Example:
  >>> import jax, jax.numpy as jnp
  >>> import tapas_jax as tapas
  >>> plan = tapas.search(lambda w, x: jnp.sum(jnp.tanh(x @ w)),
  ...                     jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
  ...                     jax.ShapeDtypeStruct((65536, 4096), jnp.float32),
  ...                     mesh={"data": 8}, device="h100")
  >>> [d.name for d in plan.decisions][:1]
  ['batch']
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping

from tapas_jax.solver.problem import Problem
from tapas_jax.solver.tables import Table

__all__ = ["Reason", "reasons"]


@dataclasses.dataclass(frozen=True)
class Reason:
  """The best other choice for one class, everything else kept.

  Attributes:
    alternative: its mesh axes (() = unsplit).
    delta_s: its predicted step time minus the plan's (inf: it splits an op twice
      over one axis).
    delta_comm_bytes: its bytes sent per device minus the plan's.
  """

  alternative: tuple[str, ...]
  delta_s: float
  delta_comm_bytes: float


def reasons(problem: Problem, tables: Iterable[Table],
            assignment: Mapping[int, int]) -> dict[int, Reason]:
  """Per class with a choice, the best single change from `assignment`."""
  touching: dict[int, list[Table]] = {}
  for t in tables:
    for c in t.scope:
      touching.setdefault(c, []).append(t)

  def local(c: int, k: int) -> tuple[float, float]:
    time = comm = 0.0
    for t in touching.get(c, ()):
      idx = tuple(k if u == c else assignment.get(u, 0) for u in t.scope)
      time += float(t.value[idx])
      comm += float(t.comm[idx])
    return time, comm

  out = {}
  for c, domain in enumerate(problem.domains):
    if len(domain) <= 1:
      continue
    now = assignment.get(c, 0)
    base_t, base_b = local(c, now)
    options = [(local(c, k), k) for k in range(len(domain)) if k != now]
    (best_t, best_b), k = min(options, key=lambda o: (o[0][0], o[1]))
    delta = best_t - base_t if math.isfinite(best_t) else math.inf
    out[c] = Reason(domain[k], delta, best_b - base_b if math.isfinite(best_t) else 0.0)
  return out
