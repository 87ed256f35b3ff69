"""Every use of JAX internals in tapas_jax lives here, and nowhere else.

Jaxpr data structures are semi-public (`jax.extend.core`) and move between
releases; the rest of the package talks to them only through these helpers.
Supported: the current jax release line and the one before (0.9 - 0.11).
"""

from __future__ import annotations

from typing import Any, Iterator

import jax
import numpy as np

try:  # public home since jax 0.4.3x
  from jax.extend import core as _core
except ImportError:  # pragma: no cover - very old jax
  from jax import core as _core  # type: ignore

ClosedJaxpr = _core.ClosedJaxpr
Jaxpr = _core.Jaxpr
Literal = _core.Literal
DropVar = _core.DropVar

# Params that carry a loop trip count: an equation with one of these is a loop even
# when its body's types match its operands (a scan over carries only).
_TRIP_COUNT_PARAMS = ("length", "num_iterations", "trip_count")


def is_literal(atom: Any) -> bool:
  return isinstance(atom, Literal)


def literal_value(atom: Any) -> Any:
  return atom.val


def aval_of(atom: Any) -> tuple[tuple[int, ...], str]:
  """(shape, dtype name) of a jaxpr atom; tokens and other non-arrays get ((), kind)."""
  aval = atom.aval
  shape = getattr(aval, "shape", None)
  dtype = getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return (), type(aval).__name__
  return tuple(int(d) for d in shape), np.dtype(dtype).name if _is_numpy_dtype(dtype) else str(dtype)


def _is_numpy_dtype(dtype: Any) -> bool:
  try:
    np.dtype(dtype)
    return True
  except TypeError:
    return False


def name_stack(eqn: Any) -> str:
  return str(eqn.source_info.name_stack)


def open_jaxpr(jaxpr: Any) -> tuple[Any, tuple[Any, ...]]:
  """(open jaxpr, consts) for either a `ClosedJaxpr` or an open `Jaxpr`."""
  if isinstance(jaxpr, ClosedJaxpr):
    return jaxpr.jaxpr, tuple(jaxpr.consts)
  return jaxpr, ()


def sub_jaxprs(eqn: Any) -> Iterator[tuple[str, int, Any]]:
  """Yields (param name, index, jaxpr) for every jaxpr found in an equation's params.

  Found generically, by type, so new higher-order primitives need no code here.
  """
  for key, value in eqn.params.items():
    if isinstance(value, (ClosedJaxpr, Jaxpr)):
      yield key, 0, value
    elif isinstance(value, (tuple, list)):
      for i, item in enumerate(value):
        if isinstance(item, (ClosedJaxpr, Jaxpr)):
          yield key, i, item


def trip_count(eqn: Any) -> int | None:
  for key in _TRIP_COUNT_PARAMS:
    value = eqn.params.get(key)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
      return int(value)
  return None


def is_jaxpr_param(value: Any) -> bool:
  if isinstance(value, (ClosedJaxpr, Jaxpr)):
    return True
  return isinstance(value, (tuple, list)) and any(
      isinstance(v, (ClosedJaxpr, Jaxpr)) for v in value)


def make_jaxpr(fn: Any, *args: Any) -> tuple[Any, Any]:
  """(ClosedJaxpr, output shape pytree) of `fn(*args)`."""
  return jax.make_jaxpr(fn, return_shape=True)(*args)


def bind_eqn(eqn: Any, invals: list[Any]) -> list[Any]:
  """Evaluates one equation on values (tracers or arrays), as `jax.core.eval_jaxpr` does."""
  bound = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(bound, tuple):  # jax < 0.10: (subfuns, params)
    subfuns, params = bound
  else:  # jax >= 0.10: params, sub-functions among them
    subfuns, params = (), bound
  ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
  if ctx is None:
    out = eqn.primitive.bind(*subfuns, *invals, **params)
  else:
    with ctx:
      out = eqn.primitive.bind(*subfuns, *invals, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def is_tracer(x: Any) -> bool:
  """Whether x is a traced value (inside jit, grad, ...) rather than a concrete array."""
  return isinstance(x, jax.core.Tracer)
