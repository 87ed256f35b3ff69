"""The narrower copy of a stacked program input that loops read converted, as the
compiler hoists the cast out of them.

Where a loop's body converts each slice of a stacked program input to a narrower float
and reads the slice no other way (a scanned layer stack's f32 weights cast to bf16 for
its dots; `DeviceProfile.casts_loop_stacks`: the TPU compiler's), the compiler converts
the whole stack once, before the first loop reading it, and every such loop reads that
copy: it is laid out as the input is stored and held from the first of those loops to
the last (the backward one). `add_loop_casts` adds it to `live.activations`' entries
where the loops read the input itself (a body under `jax.checkpoint`); where the forward
loop writes the cast slices out for the backward one, that stack is the copy, and it
stays written when a remat drops it (`remat`, through `cast_stacks`).
"""

from __future__ import annotations

import numpy as np

from tapas_jax import cost as costlib
from tapas_jax.solver.live_program import Entries, LiveProgram
from tapas_jax.solver.problem import Problem
from tapas_jax.solver.views import scan_bindings, scan_region
from tapas_jax.trace import Graph, Op

__all__ = ["add_cast", "add_loop_casts", "cast_stacks"]


def cast_stacks(g: Graph, loop: Op) -> list[tuple[int, frozenset[int], str]]:
  """(stacked program input, the body's cast slices of it, their dtype) of each
  stacked program input `loop` scans whose slice its body reads only by converting it
  to one narrower float type: the casts the compiler hoists out of the loop.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tapas_jax import trace
    >>> def f(ws, x):
    ...   body = lambda h, w: (jnp.tanh(h.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)), None)
    ...   return jax.lax.scan(body, x.astype(jnp.bfloat16), ws)[0]
    >>> g = trace.trace(f, jax.ShapeDtypeStruct((4, 8, 8), jnp.float32),
    ...                 jax.ShapeDtypeStruct((2, 8), jnp.float32))
    >>> loop = next(op for op in g.region_ops(0) if op.subregions)
    >>> [(g.types[v].shape, dtype) for v, _, dtype in cast_stacks(g, loop)]
    [((4, 8, 8), 'bfloat16')]
  """
  region = scan_region(g, loop)
  if region is None:
    return []
  inputs = {i.value for i in g.inputs}
  found = []
  for outer, inner, shift in scan_bindings(g, loop):
    if shift != 1 or outer not in inputs:
      continue
    readers = [g.ops[c] for c in g.consumers.get(inner, ()) if g.ops[c].region == region.index]
    if not readers or any(r.primitive != "convert_element_type" for r in readers):
      continue
    types = {g.types[r.outputs[0]] for r in readers}
    to, of = next(iter(types)), g.types[inner]
    if (len(types) == 1 and to.itemsize < of.itemsize
        and all(t.dtype.startswith(("float", "bfloat")) for t in (to, of))):
      found.append((outer, frozenset(r.outputs[0] for r in readers), to.dtype))
  return found


def add_loop_casts(entries: Entries, problem: Problem, prog: LiveProgram) -> None:
  """Adds the converted copy of each stacked program input that loops read converted
  (and do not write out cast), its bytes as the compiler stores the narrower type."""
  if not problem.profile.casts_loop_stacks:
    return
  g = prog.graph
  read: dict[int, list[tuple[int, str]]] = {}  # stacked input -> (loop position, cast dtype)
  for j in prog.lineup.where(g, prog.top, lambda op: scan_region(g, op) is not None):
    op = prog.top[j]
    if op.index not in prog.live:
      continue
    written = set(scan_region(g, op).outputs)
    for v, casts, dtype in cast_stacks(g, op):
      if not casts & written:  # else the stack the loop writes out is the copy
        read.setdefault(v, []).append((j, dtype))
  for v, loops in read.items():
    if len({dtype for _, dtype in loops}) != 1:
      continue  # cast to two types: not one copy
    add_cast(entries, problem, v, tuple(problem.vclass(v, d) for d in range(len(g.types[v].shape))),
             loops[0][1], min(j for j, _ in loops), max(j for j, _ in loops))


def add_cast(entries: Entries, problem: Problem, v: int, dims, dtype: str, start: int,
             stop: int) -> None:
  """Adds input v's copy cast to `dtype`, over `dims` as stored, live from `start` to
  `stop`: its bytes as the compiler stores the narrower type, named for what it is."""
  nbytes = costlib.stored_bytes(problem.graph.types[v].shape, np.dtype(dtype).itemsize,
                                problem.profile)
  entries.add(start, stop, nbytes, v, dims, padded=True,
              note=f"cast once to {dtype} for the loops reading it")
