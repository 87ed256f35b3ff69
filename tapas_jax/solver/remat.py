"""Rematerialisation per unique layer, chosen with the sharding under a memory budget.

A train step traced through `jax.grad` already holds its backward pass: the forward
values the backward reads (residuals) are simply values made by a layer's forward ops
and read by the same layer's backward ops (`transpose(jvp(...))` in JAX's name stack).
Rematerialising a layer means: its backward reads recomputed copies instead, made from
a smaller saved set after the layer's cotangent arrives, so the originals die at the
end of the forward. Which forward values stay saved is a `jax.checkpoint` policy:

- "everything_saveable": no remat (the plain program);
- "dots_saveable": dot/conv outputs stay saved, elementwise work is recomputed;
- "nothing_saveable": the whole forward of the layer is recomputed from its inputs.

The price, under a plan's sharding: the recomputed ops' cost tables (compute /
shards plus their collectives) once more per step, against the residual bytes / shards
removed from the activation peak. `choose` tries policies per unique layer, each with
its own sharding solved under the budget, and keeps the fastest plan that fits.
`tapas.apply` performs the same recomputation on the program (`apply.py`).

Approximations (stated, not hidden):
- each recomputed op runs as late as its readers allow (just before the first backward
  op, or recomputed op, reading it: the compilers schedule a recomputation next to its
  use), its copy live from there to its last reader; an intermediate read only inside
  the recomputation and fused into its readers there takes no buffer. A parameter
  gathered again only for its casts to a narrower float is gathered as those casts
  where the compiler converts before gathering (the TPU's), each cast where read;
- ops holding branches or uncounted loops are never recomputed whole: they stay saved. A
  counted loop inside a layer (a chunked attention's `lax.map`) is recomputed whole
  under nothing_saveable (its body priced per iteration, its body's values live again
  where it reruns), and saved under dots_saveable. A scanned layer stack (`nn.scan`,
  `lax.scan`) is rematerialised inside its body instead (`ScanRemat`): its forward loop
  stops writing out the stacked residuals the policy does not save, and its backward
  loop recomputes them per iteration from what stays (the layer's input, the parameters'
  slices). Under `dots_saveable` a dot output the forward loop does not already write
  out is recomputed too (nothing new is written out but a carry's per-iteration value).
  Needs the scan's operand counts, which jax 0.11+ records only in its flat trees
  (`_jax_internals.scan_counts`); the forward loop's operands the backward loop does not
  read are not kept longer in the model, though the recomputation reads them;
- without a budget remat only costs time, so it is chosen only under a budget;
- the originals' new last reader is the last reader left, without the reach a value
  gets from fused readers (`live.activations`); a recomputed value the activation
  model treats as fused (never written out) gains nothing and costs no copy. A saved
  dot the forward computes inside its reader's fusion (a residual add's) is written
  out where a recomputed op reads it, and kept from the forward to there, as the TPU
  compiler does (a second output of the dot's fusion).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tapas_jax import fold, trace
  >>> from tapas_jax.solver import remat
  >>> def net(ws, x):
  ...   for w in ws:
  ...     x = jnp.sin(x @ w) + x
  ...   return jnp.sum(x)
  >>> g = trace.trace(jax.grad(net), [jax.ShapeDtypeStruct((8, 8), jnp.float32)] * 3,
  ...                 jax.ShapeDtypeStruct((2, 8), jnp.float32))
  >>> f = fold.fold(g)
  >>> r = remat.instance_remat(g, f.instances[1].ops, "nothing_saveable")
  >>> [g.ops[i].primitive for i in r.recompute]
  ['dot_general', 'cos']
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, Collection, Mapping, Sequence

import numpy as np

from tapas_jax import _jax_internals as jx
from tapas_jax import rules as ruleslib
from tapas_jax.fold import Folded
from tapas_jax.solver.fusion import fused_values, fuses_into, live_ops, narrowing_cast
from tapas_jax.solver.live import Activations, kernel_share, loop_body_values
from tapas_jax.solver.live_program import Entries
from tapas_jax.solver.loop_casts import add_cast, cast_stacks
from tapas_jax.solver.problem import Problem
from tapas_jax.solver.tables import Table, TableBuilder, evaluate_tables
from tapas_jax.solver.views import scan_region, searched_instances
from tapas_jax.trace import Graph, Op

__all__ = ["POLICIES", "InstanceRemat", "ScanRemat", "choose", "instance_remat",
           "layer_remats", "recompute_tables", "scan_remat", "with_remat"]

# Policies in order of memory saved; names are `jax.checkpoint_policies` attributes.
POLICIES = ("everything_saveable", "dots_saveable", "nothing_saveable")
NO_REMAT = POLICIES[0]
# Up to this many policy combinations are tried exhaustively (each is a budgeted
# solve); beyond, one policy for
# every remat-able layer at a time.
MAX_COMBINATIONS = 9


def is_forward(op: Op) -> bool:
  """A primal op of a differentiated program (JAX names it `jvp(...)`): what a remat
  recomputes. Not fold's test (`not jx.is_transposed`), which also takes the ops
  outside differentiation (the optimizer update), never recomputed."""
  return jx.is_primal(op.name_stack)


def is_backward(op: Op) -> bool:
  """A transposed (backward) op of a differentiated program."""
  return jx.is_transposed(op.name_stack)


@dataclasses.dataclass(frozen=True)
class InstanceRemat:
  """What rematerialising one layer instance recomputes.

  Attributes:
    recompute: forward op indices recomputed in the backward, in program order.
    reads: (backward op index, operand slot) reads switched to recomputed copies.
    first: the first backward op in program order reading a recomputed copy or a
      re-gathered parameter (no recomputation runs before it).
    params: program inputs the layer's forward reads and its backward (or the
      recomputation) reads again. Where the plan stores one apart from its use (ZeRO),
      the backward gathers it again rather than keeping the forward's gathered copy
      through the step: what `jax.checkpoint` around an FSDP layer does (the gather
      is part of the recomputed forward).
    param_reads: (backward op index, operand slot) reads of `params`.
  """

  recompute: tuple[int, ...]
  reads: tuple[tuple[int, int], ...]
  first: int
  params: tuple[int, ...] = ()
  param_reads: tuple[tuple[int, int], ...] = ()


def _saved(op: Op, policy: str, graph: Graph | None = None) -> bool:
  if policy == "nothing_saveable" and ruleslib.facts(op.primitive).called:
    return False  # a call (a shard_map's kernel) is recomputed whole
  if op.subregions:  # loops and branches are never recomputed (see module doc)
    return True
  if policy == "nothing_saveable":
    return False
  if policy == "dots_saveable":
    if ruleslib.facts(op.primitive).copies and graph is not None:
      # The user's own remat marks each residual it saves with an identity
      # `reduce_precision` (so XLA cannot merge the recomputation into the forward):
      # a copy of a saved dot is saved with it, not recomputed from it.
      src = graph.producer.get(op.inputs[0]) if op.inputs else None
      return src is not None and _saved(graph.ops[src], policy, graph)
    # What `jax.checkpoint_policies.dots_saveable` keeps: dots and convolutions.
    return ruleslib.facts(op.primitive).contracts
  return True


def _loop_recomputed(graph: Graph, op: Op, policy: str, stacks) -> bool:
  """Whether a counted loop inside a layer (a chunked attention's `lax.map`) is recomputed
  whole: under nothing_saveable, as `jax.checkpoint` around the layer recomputes it, so
  its outputs (the attention's, 192 MiB a layer at LLaMA-3-8B's recipe shape) are not
  kept from the forward to the backward. A scanned layer stack (`stacks`: a forward scan
  whose backward scan reads it) is rematerialised inside its body instead (`ScanRemat`)."""
  return (policy == "nothing_saveable" and op.index not in stacks
          and scan_region(graph, op) is not None)


def instance_remat(graph: Graph, ops: Sequence[int], policy: str) -> InstanceRemat | None:
  """The recomputation of one instance (its top-level ops) under a policy; None when
  nothing would be recomputed (no backward, or everything saved)."""
  if policy not in POLICIES:
    raise ValueError(f"remat policy {policy!r} is not one of {POLICIES}")
  mine = set(ops)
  # Each op's side read once (a name-stack scan per op; the passes below reuse them):
  # a transposed op is backward, never primal.
  primal, backward = [], []
  for i in ops:
    op = graph.ops[i]
    if is_backward(op):
      backward.append(i)
    elif op.region == 0 and is_forward(op):
      primal.append(i)
  # Scanned stacks are rematerialised in their bodies; only a loop can be one.
  stacks = ({f for f, _ in _scan_loops(graph, ops)}
            if any(graph.ops[i].subregions for i in primal) else set())
  forward = {i for i in primal if not _saved(graph.ops[i], policy, graph)
             or _loop_recomputed(graph, graph.ops[i], policy, stacks)}
  producer = graph.producer
  reads, recompute, stack = [], set(), []
  for b in backward:
    op = graph.ops[b]
    for k, v in enumerate(op.inputs):
      p = producer.get(v)
      if p in forward and v not in graph.literals:
        reads.append((b, k))
        stack.append(p)
  while stack:
    p = stack.pop()
    if p in recompute:
      continue
    recompute.add(p)
    for v in graph.ops[p].inputs:
      q = producer.get(v)
      if q in forward and q in mine and v not in graph.literals:
        stack.append(q)
  if not reads:
    return None
  inputs = graph.input_path
  read_forward = {v for i in primal for v in graph.ops[i].inputs if v in inputs}
  read_again = {v for p in recompute for v in graph.ops[p].inputs if v in inputs}
  param_reads = [(b, k) for b in backward
                 for k, v in enumerate(graph.ops[b].inputs) if v in read_forward]
  read_again.update(graph.ops[b].inputs[k] for b, k in param_reads)
  params = tuple(sorted(read_forward & read_again))
  return InstanceRemat(recompute=tuple(sorted(recompute)), reads=tuple(reads),
                       first=min(b for b, _ in reads + param_reads), params=params,
                       param_reads=tuple(param_reads))


@dataclasses.dataclass(frozen=True)
class ScanRemat:
  """What rematerialising a scanned layer stack recomputes, inside its backward loop.

  Attributes:
    forward: top-level index of the forward scan (it writes out the stacked residuals).
    backward: top-level index of the backward scan reading them.
    dropped: (backward operand slot, forward output slot) of each stacked residual the
      forward no longer writes out: the backward's body recomputes its slice.
    kept: (backward operand slot, forward output slot) of the stacked residuals the
      backward still reads (the recomputation reads their slices).
    carries: forward carry positions (0-based among the carries) whose per-iteration
      value the recomputation reads and no kept residual holds: the forward writes
      them out, stacked.
    recompute: forward body op indices recomputed in each backward iteration.
    trip_count: iterations of the loops.
  """

  forward: int
  backward: int
  dropped: tuple[tuple[int, int], ...]
  kept: tuple[tuple[int, int], ...]
  carries: tuple[int, ...]
  recompute: tuple[int, ...]
  trip_count: int
  params: tuple[int, ...] = ()  # none gathered again beyond what the backward reads


def _scan_loops(graph: Graph, ops: Sequence[int]):
  """(forward scan, backward scan) pairs among these ops: a backward (transposed) scan
  reading a forward one's outputs, both with known operand counts."""
  loops = [i for i in ops if graph.ops[i].subregions and graph.ops[i].region == 0
           and scan_region(graph, graph.ops[i])
           and jx.scan_counts(graph.ops[i].raw_params) is not None]
  for f in loops:
    if not is_forward(graph.ops[f]):
      continue
    outs = set(graph.ops[f].outputs)
    for b in loops:
      if is_backward(graph.ops[b]) and outs & set(graph.ops[b].inputs):
        yield f, b
        break


def scan_remat(graph: Graph, forward: int, backward: int, policy: str) -> ScanRemat | None:
  """The recomputation of a scanned stack's body under a policy; None when nothing would
  be recomputed (everything saved, or no residual only the backward loop reads)."""
  fop, bop = graph.ops[forward], graph.ops[backward]
  fr = scan_region(graph, fop)
  fc, bc = jx.scan_counts(fop.raw_params), jx.scan_counts(bop.raw_params)
  b_xs = bc.num_consts + bc.num_carry
  body = {op.index for op in graph.ops if op.region == fr.index}
  readers = graph.consumers
  dropped, kept = [], []
  for s in range(fc.num_carry, len(fop.outputs)):
    v = fop.outputs[s]
    slots = [j for j, x in enumerate(bop.inputs) if x == v]
    if not slots or v in graph.literals or fr.outputs[s] in graph.literals:
      continue
    p = graph.producer.get(fr.outputs[s])
    only_backward = set(readers.get(v, ())) == {backward} and min(slots) >= b_xs
    if p in body and only_backward and not _saved(graph.ops[p], policy, graph):
      dropped += [(j, s) for j in slots]
    else:
      kept.append((slots[0], s))
  if not dropped:
    return None
  available = {fr.outputs[s] for _, s in kept}
  recompute, stack, needed = set(), [graph.producer[fr.outputs[s]] for _, s in dropped], set()
  while stack:
    p = stack.pop()
    if p in recompute:
      continue
    recompute.add(p)
    for v in graph.ops[p].inputs:
      if v in graph.literals or v in available:
        continue
      q = graph.producer.get(v)
      if q in body:
        stack.append(q)  # saved by the policy, but not written out: recomputed too
      else:
        needed.add(v)
  carry_in = fr.inputs[fc.num_consts:fc.num_consts + fc.num_carry]
  carries = tuple(c for c, v in enumerate(carry_in) if v in needed)
  return ScanRemat(forward=forward, backward=backward, dropped=tuple(dropped),
                   kept=tuple(kept), carries=carries, recompute=tuple(sorted(recompute)),
                   trip_count=fr.trip_count)


def layer_remats(folded: Folded, layer: int, policy: str
                 ) -> list[InstanceRemat | ScanRemat]:
  """`instance_remat` of every instance of a unique layer (those with something to do),
  and `scan_remat` of each scanned stack in it."""
  return [r for k in folded.unique_layers[layer].instances
          for r in _instance_remats(folded, k, policy)]


def _instance_remats(folded: Folded, instance: int, policy: str):
  """`layer_remats`' part for one instance, one remat at a time."""
  ops = folded.instances[instance].ops
  r = instance_remat(folded.graph, ops, policy)
  if r is not None:
    yield r
  if policy in POLICIES[1:]:
    for f, b in _scan_loops(folded.graph, ops):
      s = scan_remat(folded.graph, f, b, policy)
      if s is not None:
        yield s


def remat_able(folded: Folded, layer: int, policy: str = "nothing_saveable") -> bool:
  """Whether `layer_remats` has anything for the layer, asked instance by instance
  until one has: the first usually answers for all (copies are alike), where listing
  them all walks every instance. Only the instances a folded view searches are asked
  (`searched_instances`): an interior copy is its representative's computation, so a
  layer with nothing to recompute is not walked once per copy (flat in depth)."""
  return any(next(_instance_remats(folded, k, policy), None) is not None
             for k in searched_instances(folded.unique_layers[layer].instances))


def with_remat(problem: Problem, acts: Activations, remats: Sequence[InstanceRemat]
               ) -> Activations:
  """The live ranges once these instances are rematerialised: a recomputed value's
  original dies at its last reader outside the switched reads, and its copy lives
  from where it is recomputed (`_recompute_times`) to its last reader; a value the
  recomputation reads stays live until then. A parameter's gathered copy (`Activations.stored`)
  dies after the forward and is gathered again for the backward."""
  scans = [r for r in remats if isinstance(r, ScanRemat)]
  remats = [r for r in remats if not isinstance(r, ScanRemat)]
  if scans:
    acts = _with_scan_remat(problem, acts, scans)
  if not remats:
    return acts
  g = problem.graph
  pos = {op.index: j for j, op in enumerate(g.region_ops(0))}
  at: dict[int, int] = {}
  for k, v in enumerate(acts.values):
    # The value as made (or a parameter's gathered copy), not a later entry for it:
    # a copy read through a cut, a donated input's copy.
    at.setdefault(v, k)
  start, stop = acts.start.copy(), acts.stop.copy()
  stored = acts.stored or (None,) * len(acts.dims)
  extra = Entries()
  extend: dict[int, int] = {}  # applied last: a new reader outlives any cut above
  for r in remats:
    switched: dict[int, set[int]] = {}
    for b, k in r.reads:
      switched.setdefault(g.ops[b].inputs[k], set()).add(b)
    recomputed = set(r.recompute)
    when = _recompute_times(g, r, switched, pos)
    regathered = set()
    for v in r.params:
      k = at.get(v)
      if k is None or stored[k] is None:
        continue  # read as stored: nothing gathered
      readers = [(pos[c], is_backward(g.ops[c])) for c in g.consumers.get(v, ())
                 if c in pos and start[k] <= pos[c] <= stop[k]]
      early = [j for j, late in readers if not late and j < pos[r.first]]
      if not early:
        continue
      late = [j for j, late in readers if late]
      again = [when[c] for c in g.consumers.get(v, ()) if c in recomputed]
      regathered.add(v)
      stop[k] = max(early)
      if not late and _gathered_narrow(problem, v, recomputed, at):
        continue  # gathered as its recomputed casts' copies (below), each where read
      late += again or [pos[r.first]]
      extra.add(min(late), max(late), acts.nbytes[k], v, acts.dims[k], stored=stored[k])
    written: dict[int, int] = {}
    for p in r.recompute:
      for v in g.ops[p].inputs:  # what the recomputation reads must still be there
        if g.producer.get(v) in recomputed or v in regathered:
          continue
        if v in at:
          extend[at[v]] = max(extend.get(at[v], when[p]), when[p])
        elif _fused_dot(problem, v, pos):
          # A saved dot the forward computed inside its reader's fusion (a residual
          # add's): the recomputed reader reads it again, so the forward writes it out
          # and keeps it to the backward (a second output of the dot's fusion).
          written[v] = max(written.get(v, when[p]), when[p])
      for v in g.ops[p].outputs:
        if v not in at:
          continue
        k = at[v]
        readers = switched.get(v, set())
        others = [pos[c] for c in g.consumers.get(v, ()) if c in pos and c not in readers]
        stop[k] = max(others, default=start[k])
        inner = [c for c in g.consumers.get(v, ()) if c in recomputed]
        if not readers and fuses_into(g.ops[p], [g.ops[c] for c in inner],
                                      problem.profile.dot_operand_fusion,
                                      narrow=g.types[v].itemsize < 4):
          continue  # an intermediate of the recomputation, made inside its readers
        # An op's output, never a gathered parameter: nothing stored apart.
        until = [pos[b] for b in readers] + [when[c] for c in inner]
        extra.add(when[p], max(until, default=when[p]), acts.nbytes[k], v, acts.dims[k])
      # A recomputed loop holds its body's values again while it runs, there.
      for v, made, size in (loop_body_values(problem, g.ops[p]) if g.ops[p].subregions
                            else ()):
        extra.add(when[p], when[p], size, v, made)
    for v, until in written.items():
      extra.add(pos[g.producer[v]], until, g.types[v].nbytes, v,
                tuple(problem.vclass(v, d) for d in range(len(g.types[v].shape))))
  for k, p in extend.items():
    stop[k] = max(stop[k], p)
  return acts.with_entries(extra, start=start, stop=stop)


def _recompute_times(g: Graph, r: InstanceRemat, switched: Mapping[int, set[int]],
                     pos: Mapping[int, int]) -> dict[int, int]:
  """Where each recomputed op runs: as late as its readers allow (just before the
  first backward op reading its copy, or the first recomputed op needing it), as the
  compilers' schedulers place a recomputation next to its use rather than all of a
  layer's at the start of its backward."""
  recomputed = set(r.recompute)
  when: dict[int, int] = {}
  for p in reversed(r.recompute):  # program order: readers after their producers
    needs = [pos[b] for v in g.ops[p].outputs for b in switched.get(v, ())]
    needs += [when[c] for v in g.ops[p].outputs for c in g.consumers.get(v, ())
              if c in recomputed and c in when]
    when[p] = min(needs, default=pos[r.first])
  return when


def _gathered_narrow(problem: Problem, v: int, recomputed: Collection[int],
                     written: Collection[int]) -> bool:
  """Whether a parameter gathered again for a recomputation is gathered as its casts:
  every recomputed reader converts it to one narrower float and the compiler converts
  the shard before gathering it (`DeviceProfile.gathers_dot_operands_in_bf16`), so no
  copy of it is made whole in its own type. Only where each cast is `written` out (has
  an entry of its own to stand for the gathered copy)."""
  if not problem.profile.gathers_dot_operands_in_bf16:
    return False
  g = problem.graph
  readers = [g.ops[c] for c in g.consumers.get(v, ()) if c in recomputed]
  return (narrowing_cast(g, readers, g.types[v]) is not None
          and all(op.outputs[0] in written for op in readers))


def _fused_dot(problem: Problem, v: int, pos: Mapping[int, int]) -> bool:
  """Whether v is a top-level dot's (or convolution's) result the activation model
  holds no entry for: computed inside its reader's fusion, never written out."""
  g = problem.graph
  p = g.producer.get(v)
  return (p in pos and bool(g.types[v].shape)
          and ruleslib.facts(g.ops[p].primitive).contracts
          and (problem.cv(v), 0) in problem.value_class)


def _with_scan_remat(problem: Problem, acts: Activations, scans: Sequence[ScanRemat]
                     ) -> Activations:
  """The live ranges once scanned stacks are rematerialised: the dropped stacked
  residuals are never written (their entries take no bytes), but a stacked input's cast
  slices among them are its whole stack cast once (`_cast_once`), a carry the
  recomputation reads is written out stacked from the forward loop to the backward one
  (both held from the one loop to the other), and one iteration's recomputed values are
  live with the backward's body (counted as `live.loop_body_values` counts a body:
  together, at the loop's position)."""
  g = problem.graph
  pos = {op.index: j for j, op in enumerate(g.region_ops(0))}
  nbytes = acts.nbytes.copy()
  gone = {g.ops[r.forward].outputs[s] for r in scans for _, s in r.dropped}
  for k, v in enumerate(acts.values):
    if v in gone and v in g.producer and g.producer[v] in {r.forward for r in scans}:
      nbytes[k] = 0.0
  extra = Entries()
  for r in scans:  # the forward body's own peak, without the residuals it drops
    at, drop = pos[r.forward], {s for _, s in r.dropped}
    mine = {v for v, _, _ in loop_body_values(problem, g.ops[r.forward])}
    for k, v in enumerate(acts.values):
      if acts.start[k] == at == acts.stop[k] and v in mine:
        nbytes[k] = 0.0
    for v, made, size in loop_body_values(problem, g.ops[r.forward], drop):
      extra.add(at, at, size, v, made)

  def classes(v):
    if (problem.cv(v), 0) not in problem.value_class:
      return tuple(None for _ in g.types[v].shape)
    return tuple(problem.vclass(v, d) for d in range(len(g.types[v].shape)))

  for r in scans:
    fop = g.ops[r.forward]
    fr = scan_region(g, fop)
    consts = jx.scan_counts(fop.raw_params).num_consts
    for v, dtype in _cast_once(problem, r):
      add_cast(extra, problem, v, classes(v), dtype, pos[r.forward], pos[r.backward])
    for c in r.carries:
      v = fr.inputs[consts + c]
      extra.add(pos[r.forward], pos[r.backward], r.trip_count * g.types[v].nbytes, v,
                (None,) + classes(v))
    for v in _recomputed_live(problem, r):
      share = kernel_share(problem, v)  # a kernel's result: its fixed share, whole classes
      extra.add(pos[r.backward], pos[r.backward], g.types[v].nbytes if share is None
                else share, v, classes(v) if share is None else (None,) * len(classes(v)))
  return acts.with_entries(extra, nbytes=nbytes)


def _cast_once(problem: Problem, r: ScanRemat) -> list[tuple[int, str]]:
  """(stacked program input, dtype cast to) of the dropped residuals that are its cast
  slices: the compiler still casts the whole stack, once, before the loops, and holds
  the copy (as the input is stored) until the backward one has read it
  (`DeviceProfile.casts_loop_stacks`)."""
  if not problem.profile.casts_loop_stacks:
    return []
  g = problem.graph
  fop = g.ops[r.forward]
  dropped = {scan_region(g, fop).outputs[s] for _, s in r.dropped}
  return [(v, dtype) for v, casts, dtype in cast_stacks(g, fop) if casts & dropped]


def _recomputed_live(problem: Problem, r: ScanRemat) -> list[int]:
  """The values of one iteration's recomputation held together in the backward loop's
  body: those the backward body reads (the dropped residuals' slices, live until it
  has read them), and the recomputation's own intermediates live at its peak (in
  forward body order, each from the op making it to its last recomputed reader). An
  intermediate only other recomputed ops read is dead before the backward ops run, so
  the compiler reuses its buffer (the TPU compiler's heap at a tiny scanned LLaMA under
  nothing_saveable held one iteration's values, not every recomputed value at once)."""
  g = problem.graph
  fr = scan_region(g, g.ops[r.forward])
  body = [op for op in g.ops if op.region == fr.index]
  fused = fused_values(g, body, live_ops(g, body, fr.outputs), fr.outputs,
                       reductions_duplicate=problem.profile.reductions_duplicate,
                       dot_operands=problem.profile.dot_operand_fusion)
  order = [op.index for op in body if op.index in set(r.recompute)]
  at = {p: j for j, p in enumerate(order)}
  read_back = _read_back(problem, r, fr)
  fused |= {fr.outputs[s] for _, s in r.dropped} - read_back
  made, span = [], []
  for j, p in enumerate(order):
    for v in g.ops[p].outputs:
      if v in fused or not g.types[v].shape:
        continue
      last = len(order) if v in read_back else max(
          [at[c] for c in g.consumers.get(v, ()) if c in at], default=j)
      made.append(v)
      span.append((j, last))
  if not made:
    return []
  live = np.zeros(len(order) + 1)
  for v, (a, b) in zip(made, span):
    live[a:b + 1] += g.types[v].nbytes
  peak = int(np.argmax(live[:-1])) if len(order) else 0
  return [v for v, (a, b) in zip(made, span) if b == len(order) or a <= peak <= b]


def _read_back(problem: Problem, r: ScanRemat, fr) -> set[int]:
  """The recomputed values the backward body reads as written values: a dropped
  residual made by an elementwise op whose backward readers all take it into their
  fusions is computed there, from its own operands (read back in its place), as XLA
  fuses any such value within one body (`fusion.fused_values`)."""
  g = problem.graph
  br = scan_region(g, g.ops[r.backward])
  recomputed = set(r.recompute)
  out: set[int] = set()
  for j, s in r.dropped:
    v, p = fr.outputs[s], g.producer.get(fr.outputs[s])
    readers = [g.ops[c] for c in g.consumers.get(br.inputs[j], ())
               if g.ops[c].region == br.index]
    if p in recomputed and fuses_into(g.ops[p], readers, problem.profile.dot_operand_fusion,
                                      narrow=g.types[v].itemsize < 4):
      out.update(x for x in g.ops[p].inputs if g.producer.get(x) in recomputed)
    else:
      out.add(v)
  return out


def _priced_ops(problem: Problem, ops: Sequence[int]) -> list[int]:
  """The ops whose tables price `ops`: a loop searched in place (a chunked attention's
  `lax.map` that a scan body recomputes) by its body's ops, each weighted by the view."""
  g, out = problem.graph, []
  for i in ops:
    region = scan_region(g, g.ops[i]) if i in problem.view.loops else None
    if region is None:
      out.append(i)
    else:
      out += _priced_ops(problem, [o.index for o in g.ops if o.region == region.index])
  return out


def recompute_tables(problem: Problem, builder: TableBuilder,
                     remats: Sequence[InstanceRemat]) -> list[Table]:
  """Cost tables of the recomputed ops the search looks at (the folded view's copies,
  each weighted by the instances it stands for): their compute and collectives again."""
  in_view = set(problem.view.ops)
  kernel_reads = _backward_fixed_reads(problem, builder)
  out = []
  for r in remats:
    if isinstance(r, ScanRemat):
      out += _regathered_slices(problem, builder, r)
    for i in _priced_ops(problem, r.recompute):
      if i not in in_view:
        continue
      w = problem.view.weight.get(i, 1)
      op = problem.graph.ops[i]
      shared = _shared_fixed_reads(problem, op, kernel_reads)
      tabs = (builder.op_tables(op, shared=shared)
              + [builder.resolve_table(v) for v in op.outputs])
      out += [t if w == 1 else Table(t.scope, t.value * w, t.comm * w)
              for t in tabs if t is not None]
    for v in r.params:  # gathered again for the backward (zero where used as stored)
      if problem.cv(v) != v or (v, False) not in problem.reader_dims:
        continue  # a folded copy (its representative counts for it) or never gathered
      w = max((problem.view.weight.get(i, 1) for i in builder.users.get(v, ())
               if i not in problem.update_ops), default=1)
      t = builder.cut_table(v, False)
      if t is not None:
        out.append(t if w == 1 else Table(t.scope, t.value * w, t.comm * w))
  return out


def _backward_fixed_reads(problem: Problem, builder: TableBuilder) -> frozenset[tuple]:
  """(classes per dim, fixed layout) of each operand a backward op on shards the
  program fixed reads (a `jax.shard_map`'s backward kernel reading q, k and v)."""
  out = set()
  for op in builder.ops:
    rule = problem.rules[op.index]
    if rule.fixed_inputs and is_backward(op):
      out.update(_kernel_read(problem, op, k) for k in range(len(op.inputs)))
  return frozenset(out) - {None}


def _shared_fixed_reads(problem: Problem, op: Op, kernel_reads: frozenset[tuple]
                        ) -> frozenset[int]:
  """Slots of a recomputed op on fixed shards whose reshard the backward kernel's read
  of the same value pays for: both run in the backward, from one layout into one
  fixed layout, and the compiler reshards once for both (TPU compiler, a scanned
  LLaMA under FSDP with full remat and its attention in a shard_map: three all-to-alls
  per layer in the backward for q, k and v, not six)."""
  if not problem.rules[op.index].fixed_inputs:
    return frozenset()
  return frozenset(k for k in range(len(op.inputs))
                   if _kernel_read(problem, op, k) in kernel_reads)


def _kernel_read(problem: Problem, op: Op, k: int) -> tuple | None:
  """(classes per dim of the operand, the fixed layout it is read in), or None."""
  fixed, v = problem.rules[op.index].fixed_input(k), op.inputs[k]
  if fixed is None or v in problem.graph.literals:
    return None
  rank = len(problem.graph.types[v].shape)
  return tuple(problem.vclass(v, d) for d in range(rank)), fixed


def _regathered_slices(problem: Problem, builder: TableBuilder, r: ScanRemat
                       ) -> list[Table]:
  """A rematerialised scan's backward loop gathers each iteration's slice of a stacked
  parameter again for its recomputation, once per iteration: the scan cuts the forward
  loop reads through, priced again. Without remat the compiler keeps the forward's
  gathered slices for the backward (TPU compiler, FSDP over a scanned tiny LLaMA on
  v5p:2x2x1: one all-gather per layer without remat, two with it)."""
  out = []
  w = r.trip_count * problem.view.weight.get(r.forward, 1)
  for loop, outer, inner, read in problem.scan_cuts:
    if read and loop == r.forward:
      t = builder.scan_cut_table(outer, inner, True)
      if t is not None:
        out.append(Table(t.scope, t.value * w, t.comm * w))
  return out


def choose(problem: Problem, folded: Folded, builder: TableBuilder, tables: list[Table],
           acts: Activations, attempt: Callable[[list[Table], Activations], object],
           may_fit: Callable[[Activations], bool] = lambda acts: True):
  """The fastest budgeted plan over remat policies per unique layer.

  Args:
    tables: the program's cost tables without remat.
    acts: its activations without remat.
    attempt: (cost tables, activations) -> a `BudgetResult` under the budget.
    may_fit: activations -> False where no plan can fit the budget with them (a lower
      bound, `memory.memory_floor`, over it). Such policies are attempted only if no
      other fits: a plan that fits beats every one that does not, so the answer is the
      same, and a deep stack that only fits rematerialised is not searched three times.

  Returns:
    (result, {unique layer index: policy} of the layers rematerialised, cost tables
    of the chosen plan, activations of the chosen plan).
  """
  layers = [u.index for u in folded.unique_layers if remat_able(folded, u.index)]
  if not layers:
    return attempt(tables, acts), {}, tables, acts
  combos: list[tuple[str, ...]]
  if len(POLICIES) ** len(layers) <= MAX_COMBINATIONS:
    combos = list(itertools.product(POLICIES, repeat=len(layers)))
  else:
    combos = [(p,) * len(layers) for p in POLICIES]
  tried: list[tuple[tuple, int, object, dict, list[Table], Activations]] = []
  put_off = []
  for order, (modes, remats, here) in enumerate(_candidates(folded, layers, combos, acts)):
    here = here if here is not None else with_remat(problem, acts, remats)
    if not may_fit(here):
      put_off.append((order, modes, remats, here))
      continue
    tabs = tables + recompute_tables(problem, builder, remats) if remats else tables
    result = attempt(tabs, here)
    if order == 0 and result.assignment is not None and result.fits:
      step = evaluate_tables(tables, result.assignment)[0]
      # Remat only adds cost tables: when the budget does not bind (the unconstrained
      # optimum fits), no policy can beat the plain plan.
      if step <= evaluate_tables(tables, attempt(tables, None).assignment)[0] * (1 + 1e-12):
        return result, {}, tables, acts
    tried.append(_ranked(order, result, modes, tabs, here))
  if not any(t[0][0] is False for t in tried):  # none fits: the leanest of them all
    for order, modes, remats, here in put_off:
      tabs = tables + recompute_tables(problem, builder, remats) if remats else tables
      tried.append(_ranked(order, attempt(tabs, here), modes, tabs, here))
  found = [t for t in tried if t[2].assignment is not None]
  if not found:
    plain = next(t for t in tried if t[1] == 0)
    return plain[2:]
  return min(found, key=lambda t: (t[0], t[1]))[2:]


def _candidates(folded: Folded, layers: Sequence[int], combos, acts: Activations):
  """(modes, recomputations, activations or None) per distinct recomputation, the plain
  plan first, each listed only when asked for (the plain plan usually settles it).
  Policies that recompute the same ops as an earlier combination (a layer without
  dots, say) give the same plan, and the earlier one already wins any tie."""
  yield {}, [], acts
  seen = {()}
  for combo in combos[1:]:
    modes = {u: p for u, p in zip(layers, combo) if p != NO_REMAT}
    remats = [r for u, p in modes.items() for r in layer_remats(folded, u, p)]
    if tuple(remats) not in seen:
      seen.add(tuple(remats))
      yield modes, remats, None


def _ranked(order: int, result, modes, tabs, here) -> tuple:
  """(rank, order, result, modes, tables, activations): plans that fit first, the
  fastest of them; else the leanest."""
  if result.assignment is None:
    return (True, np.inf), order, result, modes, tabs, here
  key = ((False, evaluate_tables(tabs, result.assignment)[0]) if result.fits
         else (True, result.used_bytes))
  return key, order, result, modes, tabs, here


def policy_names(folded: Folded, modes: Mapping[int, str]) -> tuple[tuple[str, str], ...]:
  """(unique layer name, policy) of the layers rematerialised."""
  return tuple((folded.unique_layers[u].name, p) for u, p in sorted(modes.items()))
