"""Where sequence parallelism may cut activations apart from the contractions.

Megatron's sequence parallelism splits the residual stream's positions on the tensor
axis between the dots: a norm's output is gathered into the column-parallel dots and
the row-parallel dots' partial results are reduce-scattered into the residual's
layout. `build_problem` gives the positions on the two sides of such a cut classes of
their own; this module finds the cuts: which values (`sequence_dims`) and which ops
read them from the contractions' side (`dot_side`).

Each function reads the problem's `_Program` (`problem.py`): the view's ops in program
order, their rules, the producer of each value, the state update and the free values.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from tapas_jax import rules as ruleslib
from tapas_jax.trace import Graph, Op

__all__ = ["dot_side", "sequence_dims"]


def dot_side(graph: Graph, top: Sequence[Op], contracts: Mapping[int, bool],
             producer: Mapping[int, int], cv: Callable[[int], int], reassociates: bool
             ) -> dict[int, bool]:
  """Op index -> whether sequence parallelism sees the op on the contractions' side of
  a cut: a contraction, or, where the compiler adds partial sums before reducing them
  (`reassociates`), a sum of values only that side makes (Megatron's backward: the
  partial input gradients of q, k and v added, then reduced once). A cut between the
  dots and such a sum would reduce each operand on its own where the compiler reduces
  their sum once (the cost tables' `_summed_partial`): the cut goes after the sum.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tapas_jax import trace
    >>> w = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    >>> g = trace.trace(lambda a, b, x: jnp.tanh(x @ a + x @ b), w, w, w)
    >>> contracts = {op.index: op.primitive == "dot_general" for op in g.ops}
    >>> producer = {v: op.index for op in g.ops for v in op.outputs}
    >>> side = dot_side(g, g.ops, contracts, producer, lambda v: v, reassociates=True)
    >>> [(op.primitive, side[op.index]) for op in g.ops]
    [('dot_general', True), ('dot_general', True), ('add', True), ('tanh', False)]
  """
  side = dict(contracts)
  if not reassociates:
    return side
  for op in top:  # in program order: a sum's operands are placed before it
    if ruleslib.facts(op.primitive).sums:
      made = [producer.get(cv(v)) for v in op.inputs
              if v not in graph.literals and graph.types[v].shape]
      side[op.index] = len(made) >= 2 and all(m is not None and side[m] for m in made)
  return side


def _past_sums(prog, r: int) -> list[int]:
  """r and the results of the contraction-side sums it flows into (`dot_side`), the
  same shape as r: where a cut out of r's contraction may go."""
  out, todo = [r], [r]
  while todo:
    v = todo.pop()
    for c in prog.graph.consumers.get(v, ()):
      if c in prog.contracts and not prog.contracts[c] and prog.dot_side[c]:
        w = prog.cv(prog.graph.ops[c].outputs[0])
        if w not in out and prog.graph.types[w].shape == prog.graph.types[r].shape:
          out.append(w)
          todo.append(w)
  return out


def sequence_dims(prog, data: frozenset[int], classes) -> dict[int, set[int]]:
  """Value -> the dims sequence parallelism may split apart at a contraction with a
  weight (a dot with a kernel, an embedding lookup and its gradient's scatter-add).

  Those are the dims the flowing operands (activations, the data) bring that no
  weight holds: batch and sequence positions. They are cut where the model's width
  meets a contraction: on an operand a non-contraction makes whose contracted dims
  are the width (a norm's output into the column-parallel dots), and on a result
  non-contractions read whose weight-made dims are the width (the row-parallel dots'
  output into the residual add). The width is the class (`classes`: value dim ->
  class without cuts) the contractions with weights hold most often. Between the
  dots (attention, the MLP's activation) positions stay as the dots hold them:
  Megatron's sequence parallelism, which XLA follows; splitting positions inside
  attention (context parallelism) it does not (measured on GPT-2 small: 2.6x the
  predicted collective bytes and "involuntary full rematerialization").
  """
  sites, count = _contraction_sites(prog, data, classes)
  if not count:
    return {}
  width = max(count, key=lambda c: (count[c], -c))

  def at_width(v, dims, fixed):
    held = [d for d, f in enumerate(dims) if f in fixed]
    return bool(held) and all(classes[(v, d)] == width for d in held)

  out: dict[int, set[int]] = {}
  for op, rule, tensors, held, fixed in sites:
    for k in tensors:
      if k in held:
        continue
      kept = {f for f in rule.inputs[k] if f is not None and f not in fixed}
      a = prog.cv(op.inputs[k])
      if (kept and a in prog.producer and a not in prog.free
          and prog.producer[a] not in prog.update and not prog.dot_side[prog.producer[a]]
          and at_width(a, rule.inputs[k], fixed)):
        out.setdefault(a, set()).update(d for d, f in enumerate(rule.inputs[k]) if f in kept)
    flowing = {f for k in tensors if k not in held for f in rule.inputs[k]
               if f is not None and f not in fixed}
    r = prog.cv(op.outputs[0])
    dims = {d for d, f in enumerate(rule.outputs[0]) if f in flowing}
    if not dims or not at_width(r, rule.outputs[0], fixed):
      continue
    for w in _past_sums(prog, r):
      if any(not prog.dot_side[c] and c not in prog.update
             for c in prog.graph.consumers.get(w, ()) if c in prog.dot_side):
        out.setdefault(w, set()).update(dims)
  return out


def _contraction_sites(prog, data: frozenset[int], classes) -> tuple[list, dict]:
  """The contractions with a weight (op, rule, tensor operands, those weights hold, the
  factors they hold), and per class how often they hold it fixed."""
  graph, cv = prog.graph, prog.cv
  # Program inputs other than the data, and what one-operand ops (casts, transposes,
  # reshapes) make of them: the operands a contraction with a weight holds fixed.
  weights = {cv(i.value) for i in graph.inputs if i.value not in data}
  for op in prog.top:
    ins = [cv(v) for v in op.inputs if v not in graph.literals and cv(v) not in prog.free]
    if op.outputs and len(ins) == 1 and ins[0] in weights and not op.subregions:
      weights.update(cv(v) for v in op.outputs)
  weights |= prog.free
  sites, count = [], {}
  for op in prog.top:
    if op.index in prog.update or not prog.contracts[op.index] or len(op.outputs) != 1:
      continue
    rule = prog.rules[op.index]
    tensors = tuple(k for k, v in enumerate(op.inputs)
                    if v not in graph.literals and graph.types[v].shape)
    held = tuple(k for k in tensors if cv(op.inputs[k]) in weights)
    if not held or len(held) == len(tensors):
      continue
    fixed = frozenset(f for k in held for f in rule.inputs[k] if f is not None)
    sites.append((op, rule, tensors, held, fixed))
    flowing = [(op.inputs[k], rule.inputs[k]) for k in tensors if k not in held]
    for v, fs in flowing + [(op.outputs[0], rule.outputs[0])]:
      for d, f in enumerate(fs):
        if f in fixed:
          count[classes[(cv(v), d)]] = count.get(classes[(cv(v), d)], 0) + 1
  return sites, count
