"""The search's cache: results kept by the identity of the objects they were built from.

Every problem of one search (its own, and the wider-batch ones of the report's
baselines) shares one dict, the table cache. A result derived from the program alone
(its fusion, its activations, a view's cut copies) is built once there and handed on
rather than recomputed per problem or per table builder.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

__all__ = ["memo"]

T = TypeVar("T")


def memo(cache: dict | None, name: Hashable, parts: Sequence[Any],
         build: Callable[[], T]) -> T:
  """`build()`, kept in `cache` under `name` and the identities of `parts`.

  The parts are held beside the result, so while the entry lives no other object can
  take one of their ids. With no cache, builds every time.

  Example:
    >>> cache, graph, calls = {}, object(), []
    >>> [memo(cache, "n", (graph,), lambda: calls.append(1) or len(calls))
    ...  for _ in range(2)]
    [1, 1]
    >>> memo(cache, "n", (object(),), lambda: calls.append(1) or len(calls))
    2
  """
  if cache is None:
    return build()
  key = (name, *(id(p) for p in parts))
  hit = cache.get(key)
  if hit is None or any(a is not b for a, b in zip(hit[0], parts)):
    hit = cache[key] = (tuple(parts), build())
  return hit[1]
