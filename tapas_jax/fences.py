"""The order `apply` gives an unrolled layer stack's backward (stage 5, beside `apply`).

A train step's backward has two chains per layer: the cotangent handed down to the
layer below (the critical path) and the layer's own results (its weight gradients, read
only by the state update at the end). Nothing in the program orders the second chain.
At scale the TPU compiler schedules every layer's weight-gradient dots after the whole
backward, so every layer's recomputed activations and cotangents are live at once:
LLaMA-3-70B shaped, FSDP with full remat, 64 chips, its live peak grew 5.2 GiB per
layer where the memory model, which has each layer's gradients made in turn, adds 0.65
(BENCHMARKS.md, "Each layer's gradients before the layer below"). A scanned stack
cannot do that (an iteration ends before the next begins); `Fences` makes an unrolled
one behave alike: the cotangent a layer's backward hands down goes through one
`jax.lax.optimization_barrier` together with the results of the layer above, reduced to
the layout their readers pin, so at most two layers' results are pending. The numbers
are the program's own; only the order changes.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import tapas_jax as tapas
  >>> from tapas_jax import fences, fold, models, trace
  >>> m = models.get_model("gpt", "tiny", num_layers=4)
  >>> g = trace.trace(m.train_step(), m.abstract_state(), m.batch_spec(8))
  >>> len(fences.Fences(g, fold.fold(g), {}).at)  # every layer's backward but the lowest
  3
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
from jax.sharding import NamedSharding

__all__ = ["Fences"]


class Fences:
  """Where each layer's backward ends, what it hands down and what it leaves for the
  update; run by `apply`'s interpreter (`made` after each equation, `read` before).

  Attributes:
    at: site of the last equation of a layer's backward -> (the values it hands down
      to the layer below, the values it leaves for later: its gradients).
    pin: value -> the layout every reader of it pins (reduced there before the
      barrier, where the plan says so).

  `left_out(v)`: a result the barrier need not take. A partial sum through a barrier is
  reduced before it; where the compiler adds partial sums first and reduces once
  (`Plan.sums_past_fences`), the results only sums read that go on, through the glue,
  to a layer below stay out (T5's decoder layers' parts of the encoder output's
  gradient: one all-reduce, not one per layer and projection; BENCHMARKS.md, "Partial
  sums past the fences"). A weight gradient stays in whatever reads it (an
  accumulator's sum too): it goes only to the update.
  """

  def __init__(self, graph, folded, pins: Mapping,
               left_out: Callable[[int], bool] = lambda v: False):
    top = graph.region_ops(0)
    pos = {op.index: k for k, op in enumerate(top)}
    owner = {op: inst.index for inst in folded.instances for op in inst.ops}
    returned = set(graph.outputs)
    self.slots: dict[tuple, list[tuple[int, int]]] = {}  # site -> (out slot, value)
    self.at: dict[tuple, tuple[list[int], list[int]]] = {}
    self.pin: dict[int, NamedSharding] = {}
    for inst in folded.instances:
      if inst.trip_count > 1:
        continue
      run = _backward_run(inst, top, pos, owner, graph)
      if not run:
        continue
      mine = set(run)
      exits = [v for p in run for v in graph.ops[p].outputs
               if v in returned or any(r not in mine for r in graph.consumers.get(v, ()))]
      passed = [v for v in exits if _hands_down(v, inst.index, owner, graph)]
      exits = [v for v in exits if v in passed or not (
          left_out(v) and _reaches_below(v, inst.index, owner, graph))]
      self.at[graph.ops[run[-1]].site] = (passed, [v for v in exits if v not in passed])
      for v in exits:
        op = graph.ops[graph.producer[v]]
        self.slots.setdefault(op.site, []).append((op.outputs.index(v), v))
        spec = _read_as(graph, v, pins)
        if spec is not None:
          self.pin[v] = spec
    self.value: dict[int, Any] = {}
    self.swap: dict[int, Any] = {}  # id of a value as made -> the one behind the barrier
    self.pending: list[int] = []

  def read(self, values: list[Any]) -> list[Any]:
    """`values` as the program reads them after the barriers so far."""
    return [self.swap.get(id(x), x) for x in values]

  def made(self, site: tuple, outs: Sequence[Any]) -> None:
    """Records the equation at `site`'s results; at a layer's last backward equation,
    puts what it hands down through one barrier with the layer above's results."""
    for slot, v in self.slots.get(site, ()):
      self.value[v] = outs[slot]
    if site not in self.at:
      return
    anchors, results = self.at[site]
    if not self.pending:
      self.pending = results
      return
    through = list(dict.fromkeys(self.pending + anchors))
    old = [self.value[v] for v in through]
    new = jax.lax.optimization_barrier(
        [jax.lax.with_sharding_constraint(x, self.pin[v]) if v in self.pin else x
         for v, x in zip(through, old)])
    for v, x, y in zip(through, old, new):
      self.swap[id(x)] = self.value[v] = y
    self.pending = results


def _backward_run(inst, top, pos: Mapping[int, int], owner: Mapping[int, int],
                  graph) -> list[int]:
  """The ops of a layer instance's backward, in program order: the run of its ops
  (runs split by another layer's ops, or by more than a few of the glue's) that hands
  a value on to a layer below, after the forward; empty where there is none (a
  forward-only program, the lowest layer)."""
  ops = sorted(inst.ops, key=pos.__getitem__)
  runs = [[ops[0]]]
  for a, b in zip(ops, ops[1:]):
    between = range(pos[a] + 1, pos[b])
    if len(between) > _GLUE_IN_A_RUN or any(top[k].index in owner for k in between):
      runs.append([])
    runs[-1].append(b)
  for run in runs[1:]:
    if any(_hands_down(v, inst.index, owner, graph) for p in run
           for v in graph.ops[p].outputs):
      return run
  return []


def _hands_down(v: int, instance: int, owner: Mapping[int, int], graph) -> bool:
  """Whether a layer below `instance` (an earlier one in the program) reads `v`."""
  return any(owner.get(r, instance) < instance for r in graph.consumers.get(v, ()))


def _reaches_below(v: int, instance: int, owner: Mapping[int, int], graph,
                   limit: int = 10_000) -> bool:
  """Whether `v` goes on, through ops of no layer, to a layer below `instance` (a
  cotangent summed in the glue first), not only to the update; `limit` ops walked at
  most (then: no)."""
  todo, seen = [v], set()
  while todo and len(seen) < limit:
    for r in graph.consumers.get(todo.pop(), ()):
      if r in owner:
        if owner[r] < instance:
          return True
      elif r not in seen:
        seen.add(r)
        todo.extend(graph.ops[r].outputs)
  return False


# Ops of no layer (a cast, a sum JAX leaves unnamed) inside a layer's backward.
_GLUE_IN_A_RUN = 8


def _read_as(graph, v: int, pins: Mapping) -> NamedSharding | None:
  """The one layout every reader of `v` pins it to, or None."""
  specs = set()
  for r in graph.consumers.get(v, ()):
    op = graph.ops[r]
    mine = [sh for slot, sh in pins.get(op.site, ()) if op.inputs[slot] == v]
    if len(mine) != 1:
      return None
    specs.add(mine[0])
  return specs.pop() if len(specs) == 1 else None
