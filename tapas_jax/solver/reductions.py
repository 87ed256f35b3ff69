"""When the gradients are reduced, and when the state update reads their reduced copies.

`combined_reductions`: in the order they are made, gradients join one reduction up to
the compiler's combine threshold (XLA's all-reduce / reduce-scatter combiners).
`last_update_reads`: the program writes the optimizer's update after the whole
backward pass; a compiler that schedules each parameter's update as soon as its inputs
are ready (`DeviceProfile.updates_when_ready`: the TPU compiler's) runs it soon after
its gradient's reduction and frees the reduced copy there, where the program order
would hold every reduced gradient until the update at its end (libtpu 0.0.50.1, the
small T5 under FSDP: 34 layer gradients reduced in one all-reduce at point 1357 and
applied one by one by point 2073, as the backward goes on, before the embedding's
gradient is made at 2110-2156). An update that reads what other gradients make (a
global-norm clip) waits for them: each op of the update runs where the last of its
inputs is ready.
"""

from __future__ import annotations

from typing import Collection, Mapping

from tapas_jax.solver.live_program import LiveProgram

__all__ = ["combined_reductions", "last_update_reads"]


def combined_reductions(g, gradients, pos, threshold: float, end: int,
                        moved: Mapping[int, int] | None = None) -> dict[int, int]:
  """gradient -> program position of the combined reduction that reduces it: in the
  order they are made, gradients join one reduction until their bytes would pass
  `threshold` (XLA's all-reduce / reduce-scatter combiners; the whole bytes stand
  for each device's share), which runs after the last of them is made. An op in
  `moved` is made at the position it maps to, not at `pos`'s."""
  def made_at(x):
    p = g.producer[x]
    return moved.get(p, pos[p]) if moved else pos[p]

  buckets: list[list[int]] = [[]]
  total = 0.0
  for x in sorted(gradients, key=made_at):
    if buckets[-1] and total + g.types[x].nbytes > threshold:
      buckets.append([])
      total = 0.0
    buckets[-1].append(x)
    total += g.types[x].nbytes
  return {x: min(made_at(bucket[-1]) + 1, end) for bucket in buckets for x in bucket}


def last_update_reads(prog: LiveProgram, feeding: Collection[int],
                      reduced_at: Mapping[int, int]) -> dict[int, int]:
  """gradient -> the earliest position by which the update has read its reduced copy.

  Each op of the update (and each feeding op, fused into the update: it reads where
  its readers run) can run once its inputs are ready: a gradient at its reduction
  (`reduced_at`), a value of the update where its op can run, any other where the
  program makes it, a program input at once.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from tapas_jax import api
    >>> from tapas_jax.solver import live_program, update_reads
    >>> def step(w, x):  # two layers, SGD: each update needs only its own gradient
    ...   loss = lambda w: jnp.sum(jnp.tanh(jnp.tanh(x @ w[0]) @ w[1]))
    ...   value, g = jax.value_and_grad(loss)(w)
    ...   return jax.tree.map(lambda p, d: p - 0.1 * d, w, g), value
    >>> w = [jax.ShapeDtypeStruct((8, 8), jnp.float32)] * 2
    >>> x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    >>> problem = api.prepare(step, (w, x), mesh={"data": 2}, device="tpu-v5p").problem
    >>> prog = live_program.live_program(problem, None)
    >>> reads = update_reads.UpdateReads.of(problem, prog)
    >>> at = {x: prog.pos[problem.graph.producer[x]] + 1 for x in reads.gradients}
    >>> len(at), last_update_reads(prog, reads.feeding, at) == at  # read as reduced
    (2, True)
  """
  g, pos, live = prog.graph, prog.pos, prog.live
  region = sorted((i for i in prog.update | set(feeding) if i in pos and i in live),
                  key=pos.__getitem__)
  runs: dict[int, int] = {}

  def ready(v: int) -> int:
    if v in reduced_at:
      return reduced_at[v]
    p = g.producer.get(v)
    if p is None or p not in pos:
      return 0
    return runs.get(p, pos[p])

  for i in region:
    runs[i] = max((ready(v) for v in g.ops[i].inputs), default=0)
  reads: dict[int, int] = {}  # op -> where what it makes is read (a feeding op's readers)
  for i in reversed(region):
    if i not in feeding:
      reads[i] = runs[i]
      continue
    readers = [reads[c] for w in g.ops[i].outputs for c in g.consumers.get(w, ())
               if c in reads]
    reads[i] = max(readers, default=runs[i])
  out = {}
  for x in reduced_at:
    readers = [reads[c] for c in g.consumers.get(x, ()) if c in reads]
    if readers:
      out[x] = max(readers)
  return out
