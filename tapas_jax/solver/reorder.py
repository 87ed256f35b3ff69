"""Where the compiler runs ops away from program order, as the memory model reads it
(`live.activations`' entries moved after they are added).
"""

from __future__ import annotations

from typing import Mapping

from tapas_jax import rules as ruleslib
from tapas_jax.solver.live_program import Entries, LiveProgram
from tapas_jax.solver.problem import Problem
from tapas_jax.solver.update_reads import UpdateReads

__all__ = ["glue_gradients_last"]


def glue_gradients_last(entries: Entries, problem: Problem, prog: LiveProgram,
                         update: UpdateReads, own: Mapping[int, int]) -> dict[int, int]:
  """Moves the weight gradients no layer holds to just before their first reader past
  the backward, or before the first loop after them (`DeviceProfile.
  glue_gradients_last`): a contraction of the glue making a gradient, with the ops
  after it that only move its elements, is made there, and what it reads (through the
  values fused into it) is held until then. Returns op -> its position now."""
  if not problem.profile.glue_gradients_last or not problem.view.glue:
    return {}
  g, pos, live = prog.graph, prog.pos, prog.live
  # Not past a loop: a scanned stack's backward runs after it (the compiler made the
  # scanned LLaMA's lm_head gradient before the loop, freeing the logits).
  loops = [j for j in prog.lineup.where(g, prog.top, lambda op: any(
      g.regions[r].trip_count or g.regions[r].kind.startswith("while.")
      for r in op.subregions)) if prog.top[j].index in live]
  moved: dict[int, int] = {}
  for x in update.gradients:
    p = g.producer.get(x)
    if p not in problem.view.glue or not ruleslib.facts(g.ops[p].primitive).contracts:
      continue
    chain, v = [p], x
    while len(readers := [r for r in g.consumers.get(v, ()) if r in live]) == 1 and (
        ruleslib.facts(g.ops[readers[0]].primitive).moves
        and len(g.ops[readers[0]].outputs) == 1):
      chain.append(readers[0])
      v = g.ops[readers[0]].outputs[0]
    later = [pos[r] for r in g.consumers.get(v, ()) if r in live and r in pos]
    at = min([*later, *(k for k in loops if k > pos[chain[-1]])], default=pos[chain[-1]]) - 1
    if at <= pos[chain[-1]]:
      continue
    for q in chain:
      moved[q] = at
      for w in g.ops[q].outputs:
        if w in own:
          entries.start[own[w]] = at
          entries.stop[own[w]] = max(entries.stop[own[w]], at)
    _hold_until(entries, prog, own, list(g.ops[p].inputs), at)
  return moved


def _hold_until(entries: Entries, prog: LiveProgram, own: Mapping[int, int], values,
                at: int) -> None:
  """What `values` are made of as written (through the fused values among them) lives
  until position `at` at least."""
  g, seen = prog.graph, set()
  while values:
    v = values.pop()
    if v in seen:
      continue
    seen.add(v)
    if v in own:
      entries.stop[own[v]] = max(entries.stop[own[v]], at)
    elif v in prog.fused and v in g.producer:
      values.extend(g.ops[g.producer[v]].inputs)
