"""Per-device memory: the program's inputs and the intermediates live at the peak.

Input bytes are tables over the classes of each input's dims (inputs over the same
classes share one table). Intermediates are tracked with live ranges over the
top-level program; the peak and the values live at it depend on the plan, so the
memory budget is posed at one plan's peak and re-posed as it moves (`budget.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Iterable, Mapping

import numpy as np

from tapas_jax import _jax_internals as jx
from tapas_jax import cost as costlib
from tapas_jax import rules as ruleslib
from tapas_jax.solver.fusion import fused_values, live_ops, top_level
from tapas_jax.solver.problem import Problem
from tapas_jax.solver.views import scan_region
from tapas_jax.solver.tables import Table, evaluate_tables

__all__ = ["Activations", "activation_peak", "activation_tables", "activations",
           "largest_live", "loop_body_values", "memory_tables", "memory_used"]


def memory_tables(problem: Problem,
                   fixed: Mapping[int, costlib.Layout] | None = None) -> list[Table]:
  """Per-device bytes of every program input, as tables over its dims' classes.

  Inputs over the same classes share one table (bytes add up), so a folded program's
  many copies of one parameter cost one table.
  """
  fixed = fixed or {}
  total: dict[tuple[int, ...], float] = {}
  tiled: dict[tuple[int, ...], np.ndarray] = {}
  fixed_bytes = 0.0
  for i in problem.graph.inputs:
    t = problem.graph.types[i.value]
    if i.value in fixed:
      fixed_bytes += (costlib.stored_bytes(costlib.local_shape(t.shape, fixed[i.value],
                                                               problem.mesh),
                                           t.itemsize, problem.profile)
                      if problem.profile.memory_tile
                      else t.nbytes / costlib.num_shards(fixed[i.value], problem.mesh))
      continue
    dims = tuple(problem.vclass(i.value, d) for d in range(len(t.shape)))
    key = _scope(problem, dims)
    if problem.profile.memory_tile:  # each shard's tiles: per input, per choice
      table = _stored_table(problem, t, dims, key)
      tiled[key] = tiled[key] + table if key in tiled else table
      continue
    total[key] = total.get(key, 0.0) + t.nbytes
  out = [Table((), np.array(fixed_bytes), np.array(0.0))] if fixed_bytes else []
  out += [Table(key, table, np.zeros_like(table)) for key, table in tiled.items()]
  return out + _bytes_tables(problem, total)


def _stored_table(problem: Problem, t, dims, scope) -> np.ndarray:
  """An input's per-device bytes as the compiler stores its shard (`cost.stored_bytes`),
  for every choice of its scope's domains."""
  domains = tuple(problem.domains[c] for c in scope)
  table = np.empty(tuple(len(d) for d in domains), float)
  for idx in itertools.product(*(range(len(d)) for d in domains)):
    axes = _axes(dims, {c: domains[k][j] for k, (c, j) in enumerate(zip(scope, idx))})
    shape = [-(-n // math.prod(problem.mesh.size(a) for a in d))
             for n, d in zip(t.shape, axes)]
    table[idx] = costlib.stored_bytes(shape, t.itemsize, problem.profile)
  return table


def _scope(problem: Problem, dims: Iterable[int | None]) -> tuple[int, ...]:
  scope: list[int] = []
  for c in dims:
    if c is not None and problem.classes[c].splittable and c not in scope:
      scope.append(c)
  return tuple(scope)


def _bytes_tables(problem: Problem, total: Mapping[tuple[int, ...], float]) -> list[Table]:
  """Per-device bytes as tables: for each scope, its bytes over the mesh axes chosen."""
  out = []
  for scope, nbytes in total.items():
    table = _divide(nbytes, _union_shards(problem.mesh,
                                          tuple(problem.domains[c] for c in scope)))
    out.append(Table(scope, table, np.zeros_like(table)))
  return out


@functools.lru_cache(maxsize=1 << 12)
def _union_shards(mesh: costlib.MeshSpec, domains) -> np.ndarray:
  """Devices a value is split over, per choice of these domains: the product of the
  sizes of every mesh axis chosen (each once). Read-only: shared between calls."""
  table = np.empty(tuple(len(d) for d in domains), int)
  for idx in itertools.product(*(range(len(d)) for d in domains)):
    axes = {a for k, j in enumerate(idx) for a in domains[k][j]}
    table[idx] = math.prod(mesh.size(a) for a in axes)
  table.setflags(write=False)
  return table


@dataclasses.dataclass(frozen=True)
class Activations:
  """Every top-level intermediate value: live range and the class of each dim.

  Attributes:
    start: program position of the op writing it (of its first reader, for a
      parameter's gathered copy).
    stop: position of its last reader (the program's end for an output).
    nbytes: bytes of the whole value.
    dims: class of each dim as it is made (None: made whole).
    length: number of top-level ops.
    values: the value id of each entry.
    stored: for a parameter's gathered copy, or an activation's copy read through a
      cut, the classes it is stored (made) over (the copy takes no memory where the
      two layouts agree); None for other entries.
    unless: per entry, classes any of which split makes the entry vanish (a donated
      input's copy, gone once gradients are all-reduced); entries past its end (added
      by a later stage) have none.
    only: per entry, classes one of which must be split for the entry to take memory
      (a gradient's partial sums beside their reduced copy as the reduction runs:
      no reduction where none is split); () for none, as for entries past its end.
  """

  start: np.ndarray
  stop: np.ndarray
  nbytes: np.ndarray
  dims: tuple[tuple[int | None, ...], ...]
  length: int
  values: tuple[int, ...] = ()
  stored: tuple[tuple[int, ...] | None, ...] = ()
  unless: tuple[tuple[int, ...], ...] = ()
  only: tuple[tuple[int, ...], ...] = ()

  def unless_of(self, k: int) -> tuple[int, ...]:
    return self.unless[k] if k < len(self.unless) else ()

  def only_of(self, k: int) -> tuple[int, ...]:
    return self.only[k] if k < len(self.only) else ()

  @functools.cached_property
  def kinds(self) -> tuple[tuple[tuple, ...], np.ndarray]:
    """(distinct (dims, stored, unless, only) among the entries, each entry's index
    in them): entries alike take the same share of their bytes under any plan."""
    stored = self.stored or (None,) * len(self.dims)
    seen: dict[tuple, int] = {}
    index = [seen.setdefault((d, s, self.unless_of(k), self.only_of(k)), len(seen))
             for k, (d, s) in enumerate(zip(self.dims, stored))]
    return tuple(seen), np.array(index, int)


def activations(problem: Problem, cache: dict | None = None) -> Activations:
  """The intermediates of the top-level program, as XLA keeps them.

  `cache` (a search's table cache) shares the program's fusion with the cost tables
  (`fusion.top_level`).

  * Values no output depends on are dropped (dead code).
  * A program output lives to the end, except the next value of carried state: the
    step runs with the state donated, so it is written into its input's buffer (the
    input is counted among the inputs), whatever reads it (a new moment read by the
    parameter's update is read from there).
  * A gradient (what the update reads, traced back through the elementwise ops XLA
    fuses into the update: one per dot or scatter making it, however many moments read
    it) that a split leaves partial sums is reduced in one reduction combined with
    the others made next to it, up to `DeviceProfile.combine_threshold_bytes` (XLA's
    all-reduce combiner), once the last of them is made: it is
    kept as made until then, both it and its reduced copy (in the layout the update
    reads: a reduce-scatter's slice under ZeRO) are live as the reduction runs, and the
    reduced copy lives to the update. A gradient nothing reduces is used where it is
    made (XLA runs its update then, in place).
  * A parameter stored apart from its use (ZeRO) is gathered once into its compute
    layout (`apply` pins one copy per value) and that copy lives from its first
    compute reader to its last.
  * A donated input read by an op its next value does not depend on (the backward
    pass's `dy @ W.T` does not feed W's own update) is copied whole by XLA's copy
    insertion before anything is written in place, and the copy lives until the update
    (`_donated_copies`).
  * Each dim is split as its producer makes it: over its class's axes, or whole where
    the producer's rule keeps it whole.
  * While a counted loop (scan) runs, what its body writes out in one iteration is
    live at the loop's position too (`loop_body_values`).
  * The compiler's own layout choices, per `DeviceProfile`: without a reduce-scatter
    pass the reduced copy is the whole all-reduced value (`reduce_scatter`); a
    convolution run only in canonical order reads other operands through transposed
    copies made as the operand is made (`canonical_convolutions`); a value read by
    several ops, one leading into a reduction, is written out where reductions do
    not recompute their operands (`reductions_duplicate`); the TPU compiler reads
    elementwise chains inside its dots and recomputes exp in each reader, so a
    norm's output and the logits' cotangent are never written, and their inputs live
    on to the last dot reading them (`dot_operand_fusion`).
  """
  g = problem.graph
  top = g.region_ops(0)
  pos = {op.index: j for j, op in enumerate(top)}
  live, fused = top_level(g, cache, reductions_duplicate=problem.profile.reductions_duplicate,
                          dot_operands=problem.profile.dot_operand_fusion)
  end = len(top) - 1
  outputs = set(g.outputs)
  carried = {g.outputs[k] for k, _ in g.carried}
  start, stop, nbytes, dims, values, stored = [], [], [], [], [], []

  canon, vcanon = problem.view.op_canon, problem.view.canon
  update = {i for i in pos if canon.get(i, i) in problem.update_ops}

  def in_update(c):  # of a top-level op
    return c in update

  # What the update reads of the rest of the program, in the layout it reads it in:
  # value -> (delivered classes, last update reader).
  delivered = {}
  by_update = {v for v, side in problem.reader_dims if side is True}
  for op in top:
    for w in op.outputs if op.index in live else ():
      if vcanon.get(w, w) not in by_update or w in outputs:
        continue
      updates = [pos[c] for c in g.consumers.get(w, ()) if c in live and c in update]
      if updates:
        delivered[w] = (tuple(problem.reader_dims[(vcanon.get(w, w), True)]), max(updates))
  # Ops that only lead to delivered values through fused values (the moments' `g ** 2`,
  # `(1 - b) * g`) fuse into the update, after the gradient's reduction, whatever the
  # program order: they write nothing out of their own.
  feeding: set[int] = set()
  consumers = g.consumers
  for op in reversed(top):
    if op.index in live and op.outputs and op.index not in update and all(
        w in delivered or (w in fused and all(c in feeding or c not in live
                                              for c in consumers.get(w, ())))
        for w in op.outputs):
      feeding.add(op.index)

  # The gradients as XLA reduces them: the values a delivered value is computed from
  # through feeding ops (a tied weight's two gradients, each reduced on its own; one
  # gradient however many moments read it) -> (delivered classes, last update reader).
  gradients: dict[int, tuple[tuple[int, ...], int]] = {}
  for w, (read, last) in delivered.items():
    todo, seen = [w], set()
    while todo:
      x = todo.pop()
      p = g.producer.get(x)
      if x in seen or p not in pos or not g.types[x].shape or in_update(p):
        continue  # an input (a moment scaled in the update), a literal, a scalar, or
        # made by the update itself
      seen.add(x)
      if p in feeding:
        todo.extend(g.ops[p].inputs)
      else:
        dims0, last0 = gradients.get(x, (read, last))
        gradients[x] = (dims0, max(last0, last))

  # Convolutions XLA runs only in canonical order read their other operands through
  # transposed copies: conv op -> {operand: classes}, result -> classes.
  conv_copies: dict[int, dict[int, tuple]] = {}
  if problem.profile.canonical_convolutions:
    for op in top:
      if op.index in live and op.primitive == "conv_general_dilated":
        conv_copies[op.index] = _transposed_for_conv(problem, op)

  # A fused value is recomputed where it is read: what it is made of stays live until
  # then. Readers come after producers, so walk backwards.
  reach: dict[int, int] = {}
  for j in range(end, -1, -1):
    op = top[j]
    if op.index not in live or op.index in feeding:
      continue
    transposed = conv_copies.get(op.index, {})
    here = j
    for w in op.outputs:
      if w in fused:
        here = max(here, reach.get(w, j))
    updating = op.index in update
    for v in op.inputs:
      if updating and v in delivered:
        continue  # the update reads the delivered copy
      if v in transposed:
        continue  # the conv reads its transposed copy
      if reach.get(v, -1) < here:
        reach[v] = here

  def last_reader(v, default):
    return reach.get(v, default)

  own: dict[int, int] = {}  # value -> its entry as made
  sided = {r for r, _ in problem.read_sides}  # ops reading through an activation cut
  # Copies of a layer make their values in their representative's classes: one
  # `_made` per (representative op, output slot, value in the view, rank).
  made_of: dict[tuple, tuple[int | None, ...] | None] = {}
  free = problem.free_values
  for j, op in enumerate(top):
    if op.index not in live:
      continue
    rep_op = canon.get(op.index, op.index)
    for slot, v in enumerate(op.outputs):
      t = g.types[v]
      if not t.shape:
        continue
      cv = vcanon.get(v, v)
      key = (rep_op, slot, cv, len(t.shape), bool(op.subregions))
      made = made_of[key] if key in made_of else made_of.setdefault(
          key, _made(problem, op, v))
      if made is None:
        continue
      whole = not (v in fused or v in carried)
      if cv in free and v not in outputs:
        whole = False  # a constant (a causal mask): XLA builds it inside its readers
      if whole:  # else never written out, or written in place into the donated input
        own[v] = len(start)
        start.append(j)
        stop.append(end if v in outputs and v not in carried else last_reader(v, j))
        nbytes.append(t.nbytes)
        values.append(v)
        dims.append(made)
        stored.append(None)
        # Read through a cut (sequence parallelism): each reader on the other side gets
        # a transient copy in its layout (a norm's output gathered into a dot, a dot's
        # result reduce-scattered for the residual add). XLA gathers again rather than
        # keep a gathered copy from the forward pass to the backward (measured on the
        # tiny zoo under sequence-parallel plans: a copy held from its first reader to
        # its last over-counted XLA's peak by ~10%).
        for c in consumers.get(v, ()) if sided else ():
          rep = canon.get(c, c)
          if rep not in sided or c not in live:
            continue
          for k, x in enumerate(g.ops[c].inputs):
            if x != v:
              continue
            # Read as the op standing for this one reads its operand (an interior copy
            # reading the last layer's output reads it as the representative does).
            y = problem.cv(g.ops[rep].inputs[k])
            side = problem.read_sides.get((rep, y))
            if side is None:
              continue
            start.append(pos[c])
            stop.append(pos[c])
            nbytes.append(t.nbytes)
            values.append(v)
            stored.append(made)
            dims.append(problem.reader_dims[(y, side)])
    # XLA:CPU transposes a conv's operand as soon as it is made (the copy, not the
    # value, is what the backward pass's weight-gradient conv keeps), and makes a
    # non-canonical result canonical first, then transposes it.
    for v, classes in conv_copies.get(op.index, {}).items():
      made_at = pos.get(g.producer.get(v), None)
      if made_at is None:  # a program input: copied where it is first read
        made_at = min(pos[c] for c in g.consumers[v] if c in live)
      start.append(made_at if v in op.inputs else j)
      stop.append(j)
      nbytes.append(g.types[v].nbytes)
      values.append(v)
      dims.append(classes)
      stored.append(None)
  _hand_over_in_place(g, top, pos, live, values, stop, start)
  only = [()] * len(values)
  if gradients:
    # Where a split leaves them partial sums, their reductions are combined, in program
    # order, up to the compiler's combine threshold, each combined reduction run once
    # the last of its gradients is made: each is kept as made until then, its reduced
    # copy from then to the update, and the two live together while the reduction runs.
    # Where none is reduced, XLA updates each parameter as soon as its gradient is made
    # (in place): the gradient lives where it is made only.
    at_of = _combined(g, gradients, pos, problem.profile.combine_threshold_bytes, end)
    for x, (read, last) in gradients.items():
      p, at = g.producer[x], at_of[x]
      made, partial = _made(problem, g.ops[p], x), _partial_classes(problem, p)
      if made is None or not partial:
        continue
      first = stop[own[x]] + 1 if x in own else pos[p]
      # Without a reduce-scatter pass (XLA:CPU) the sums are all-reduced whole, as
      # made, and sliced where the update reads them.
      reduced = read if problem.profile.reduce_scatter else made
      for a, b, classes in ((first, at, made), (at, max(last, at), reduced)):
        if a <= b:
          start.append(a)
          stop.append(b)
          nbytes.append(g.types[x].nbytes)
          values.append(x)
          dims.append(tuple(classes))
          stored.append(None)
          only.append(partial)
  for j, op in enumerate(top):
    # Only a loop (its representative has a body) writes out values of its body.
    if op.index in live and g.ops[canon.get(op.index, op.index)].subregions:
      for v, made in loop_body_values(problem, op):
        start.append(j)
        stop.append(j)
        nbytes.append(g.types[v].nbytes)
        values.append(v)
        dims.append(made)
        stored.append(None)
  for i in g.inputs:
    use = problem.reader_dims.get((problem.cv(i.value), False))
    readers = sorted(pos[c] for c in g.consumers.get(i.value, ()) if c in live and
                     problem.view.op_canon.get(c, c) not in problem.update_ops)
    if use is None or not readers:
      continue
    start.append(readers[0])
    stop.append(readers[-1])
    nbytes.append(g.types[i.value].nbytes)
    values.append(i.value)
    dims.append(tuple(use))
    stored.append(tuple(problem.vclass(i.value, d) for d in range(len(use))))
  only += [()] * (len(values) - len(only))
  unless = [()] * len(values)
  for v, first, last in _donated_copies(problem, top, pos, live):
    start.append(first)
    stop.append(last)
    nbytes.append(g.types[v].nbytes)
    values.append(v)
    dims.append(tuple(problem.vclass(v, d) for d in range(len(g.types[v].shape))))
    stored.append(None)
    unless.append(tuple(c.index for c in problem.classes if c.batch))
  return Activations(np.array(start, int), np.array(stop, int),
                     _as_stored(problem, nbytes, values), tuple(dims), len(top),
                     tuple(values), tuple(stored), tuple(unless), tuple(only))


def _as_stored(problem: Problem, nbytes, values) -> np.ndarray:
  """Each entry's bytes padded as the compiler stores the whole value (`cost.stored_bytes`;
  the padding of the unsplit value stands for its shards')."""
  nbytes = np.array(nbytes, float)
  if not problem.profile.memory_tile:
    return nbytes
  types = problem.graph.types
  return np.array([b * costlib.stored_bytes(types[v].shape, types[v].itemsize, problem.profile)
                   / types[v].nbytes if types[v].nbytes else b
                   for b, v in zip(nbytes, values)], float)


def _combined(g, gradients, pos, threshold: float, end: int) -> dict[int, int]:
  """gradient -> program position of the combined reduction that reduces it: in the
  order they are made, gradients join one reduction until their bytes would pass
  `threshold` (XLA's all-reduce / reduce-scatter combiners; the whole bytes stand
  for each device's share), which runs after the last of them is made."""
  buckets: list[list[int]] = [[]]
  total = 0.0
  for x in sorted(gradients, key=lambda x: pos[g.producer[x]]):
    if buckets[-1] and total + g.types[x].nbytes > threshold:
      buckets.append([])
      total = 0.0
    buckets[-1].append(x)
    total += g.types[x].nbytes
  return {x: min(pos[g.producer[bucket[-1]]] + 1, end)
          for bucket in buckets for x in bucket}


def _transposed_for_conv(problem: Problem, op) -> dict[int, tuple]:
  """value -> classes of the transposed copies a compiler running only canonical
  convolutions makes for this one: each operand not laid out (batch, spatial...,
  feature) / (spatial..., in, out), and the result when it is not (batch,
  spatial..., feature), which is made canonical and then transposed. The
  weight-gradient convs of the backward pass read the activations and their
  gradients in the kernel's and the batch's slots."""
  g = problem.graph
  rule = problem.rules.get(problem.view.op_canon.get(op.index, op.index))
  if rule is None:
    return {}
  rank = len(g.types[op.inputs[0]].shape)
  dn = jx.conv_dims(op.raw_params, rank)
  space = tuple(range(1, rank - 1))
  canonical = ((0, rank - 1) + space, (rank - 1, rank - 2) + tuple(range(rank - 2)),
               (0, rank - 1) + space)
  out = {}
  for spec, want, v, dims in ((dn.lhs_spec, canonical[0], op.inputs[0], rule.inputs[0]),
                              (dn.rhs_spec, canonical[1], op.inputs[1], rule.inputs[1]),
                              (dn.out_spec, canonical[2], op.outputs[0], rule.outputs[0])):
    if tuple(spec) != want and (problem.cv(v), 0) in problem.value_class:
      out[v] = tuple(None if f is None else problem.vclass(v, d)
                     for d, f in enumerate(dims))
  return out


def _made(problem: Problem, op, v) -> tuple[int | None, ...] | None:
  """Classes of v's dims as its producer makes it (None in a dim: made whole); None
  where v has no classes.

  A loop or branch (an op with sub-regions, no rule of its own) makes each output in
  its own classes, which the view ties to its body's: a scan's stacked outputs (the
  residuals its backward pass reads, one slice per iteration) are top-level values
  like any other."""
  if (problem.cv(v), 0) not in problem.value_class:
    return None
  rule = problem.rules.get(problem.view.op_canon.get(op.index, op.index))
  if rule is None:
    if not op.subregions:
      return None
    return tuple(problem.vclass(v, d) for d in range(len(problem.graph.types[v].shape)))
  return tuple(None if f is None else problem.vclass(v, d)
               for d, f in enumerate(rule.outputs[op.outputs.index(v)]))


def _partial_classes(problem: Problem, op_index: int) -> tuple[int, ...]:
  """Classes an op reduces over (splittable): splitting one leaves its result partial."""
  canon = problem.view.op_canon.get(op_index, op_index)
  rule = problem.rules.get(canon)
  if rule is None:
    return ()
  fclass = problem.factor_class.get(canon, ())
  return tuple(sorted({fclass[f] for f in rule.reduce
                       if f < len(fclass) and fclass[f] >= 0
                       and problem.classes[fclass[f]].splittable}))


def _donated_copies(problem: Problem, top, pos, live) -> list[tuple[int, int, int]]:
  """(input, first reader, update) of each donated input XLA copies before its update.

  The next state is written into its input's buffer, so XLA's copy insertion keeps the
  old value in a copy unless every reader of it is ordered before the update, that is,
  is an ancestor of the next value in the dataflow. The backward pass's read of a
  weight (`dy @ W.T`, for the layers below) is not, so without anything joining the
  two the whole input is copied. Where the batch is split, the gradients' all-reduces
  are combined into one, which every update waits on and every backward read comes
  before: no copy (measured on XLA:CPU; `unless` in the entries).
  """
  g = problem.graph
  targets = {}  # producer op of a carried next value -> its bit
  for k, _ in g.carried:
    p = g.producer.get(g.outputs[k])
    if p in pos:
      targets.setdefault(p, len(targets))
  # Per op, a bitmask of the next values it feeds (itself included): walk backwards.
  feeds: dict[int, int] = {}
  consumers = g.consumers
  for op in reversed(top):
    if op.index not in live:
      continue
    mask = 1 << targets[op.index] if op.index in targets else 0
    for v in op.outputs:
      for c in consumers.get(v, ()):
        fed = feeds.get(c)
        if fed:  # most readers feed no next value: skip the wide or
          mask |= fed
    feeds[op.index] = mask
  out = []
  for k, j in g.carried:
    v, p = g.inputs[j].value, g.producer.get(g.outputs[k])
    if p not in pos or not g.types[v].shape:
      continue
    bit = 1 << targets[p]
    readers = [c for c in g.consumers.get(v, ()) if c in live and c in pos]
    if any(not feeds.get(c, 0) & bit for c in readers):
      out.append((v, min(pos[c] for c in readers), max(pos[c] for c in readers + [p])))
  return out


def loop_body_values(problem: Problem, op, dropped: Iterable[int] = ()
                      ) -> list[tuple[int, tuple]]:
  """(value, classes as made) of what one iteration of a counted loop writes out and
  holds at the body's own peak (whole bytes, in body order: each value from the op
  making it to its last reader in the body, the body's outputs to its end), counted
  live together while the loop runs (the blocks of a chunked attention's scores; a
  scanned layer's activations). A copy of a layer the view folds away is costed as
  its representative's loop. `dropped`: output slots the loop no longer writes (a
  scan remat's residuals, recomputed in the backward loop instead)."""
  g = problem.graph
  rep = g.ops[problem.view.op_canon.get(op.index, op.index)]
  region = scan_region(g, rep)
  if region is None:
    return []
  body = list(g.region_ops(region.index))
  gone = set(dropped)
  kept = [v for s, v in enumerate(region.outputs) if s not in gone]
  live = live_ops(g, body, kept)
  fused = fused_values(g, body, live, kept,
                      reductions_duplicate=problem.profile.reductions_duplicate,
                      dot_operands=problem.profile.dot_operand_fusion)
  out, span = [], []
  pos = {o.index: j for j, o in enumerate(body)}
  outputs = set(kept)
  for j, o in enumerate(body):
    rule = problem.rules.get(o.index)
    if rule is None or o.index not in live:
      continue
    for slot, v in enumerate(o.outputs):
      if (v in fused or not g.types[v].shape
          or (problem.cv(v), 0) not in problem.value_class):
        continue
      out.append((v, tuple(None if f is None else problem.vclass(v, d)
                           for d, f in enumerate(rule.outputs[slot]))))
      last = len(body) if v in outputs else max(
          [pos[c] for c in g.consumers.get(v, ()) if c in pos], default=j)
      span.append((j, last))
  # A stacked parameter read through a scan cut is gathered into the body's layout
  # once per iteration: that copy (one layer's, not the stack's) lives from the body's
  # start to its last reader. Counted in the body's layout whether or not the plan
  # gathers: ungathered, it is the slice XLA cuts out of the stack.
  for loop, _, inner, read in problem.scan_cuts:
    if read and loop == rep.index and g.types[inner].shape:
      out.append((inner, tuple(problem.value_class[(inner, d)]
                               for d in range(len(g.types[inner].shape)))))
      span.append((0, max([pos[c] for c in g.consumers.get(inner, ()) if c in pos],
                          default=0)))
  if not out:
    return out
  live_bytes = np.zeros(len(body) + 2)
  for (v, _), (a, b) in zip(out, span):
    live_bytes[a:b + 1] += g.types[v].nbytes
  at = int(np.argmax(live_bytes))
  return [entry for entry, (a, b) in zip(out, span) if a <= at <= b]


def _hand_over_in_place(g, top, pos, live, values, stop, start) -> None:
  """Ends an in-place op's operand one position early where the op is its last reader,
  so that its buffer and the op's result (the same memory) are not counted twice.

  XLA runs these ops (`Facts.in_place`) in place: the result takes over the buffer of
  operand 0 when that is its last use (a scatter into zeros, the embedding gradient's
  scatter-add, say)."""
  at: dict[int, int] = {}
  for k, v in enumerate(values):
    at.setdefault(v, k)  # the value as written, not a later copy of it
  in_place = {p for p in {op.primitive for op in top} if ruleslib.facts(p).in_place}
  for op in top:
    if op.primitive not in in_place or op.index not in live or not op.inputs:
      continue
    k = at.get(op.inputs[0])
    j = pos[op.index]
    if k is not None and stop[k] == j and start[k] < j:
      stop[k] = j - 1


def _axes(dims: Iterable[int | None], choice: Mapping[int, tuple[str, ...]]):
  """Per dim, the mesh axes splitting it (an axis splits the first dim asking for it)."""
  out, seen = [], set()
  for c in dims:
    entry = tuple(a for a in choice.get(c, ()) if a not in seen) if c is not None else ()
    seen.update(entry)
    out.append(entry)
  return tuple(out)


def _shards(mesh: costlib.MeshSpec, dims, stored, choice: Mapping[int, tuple[str, ...]],
            unless=(), only=()) -> int:
  """Devices one entry is split over under a choice; 0 where it takes no memory (a
  gathered copy laid out as its stored input is the input itself, nothing gathered;
  an `unless` class split; no `only` class split)."""
  if any(choice.get(c) for c in unless) or (only and not any(choice.get(c) for c in only)):
    return 0
  axes = _axes(dims, choice)
  if stored is not None and axes == _axes(stored, choice):
    return 0
  return math.prod(mesh.size(a) for d in axes for a in d)


def _per_device(problem: Problem, acts: Activations,
                choice: Mapping[int, tuple[str, ...]]) -> np.ndarray:
  kinds, index = acts.kinds
  shards = np.array([_shards(problem.mesh, d, s, choice, u, o) for d, s, u, o in kinds],
                    int)[index]
  return _divide(acts.nbytes, shards)


def _divide(nbytes, shards: np.ndarray) -> np.ndarray:
  """Per-device bytes: nbytes / shards, each entry divided on its own as a Python float
  would be; 0 where shards is 0 (the entry takes no memory)."""
  return np.where(shards > 0, nbytes / np.maximum(shards, 1), 0.0)


def activation_peak(problem: Problem, acts: Activations,
                     choice: Mapping[int, tuple[str, ...]]) -> tuple[float, int]:
  """(peak per-device bytes of live intermediates, program position of the peak)."""
  if not len(acts.nbytes):
    return 0.0, 0
  per_device = _per_device(problem, acts, choice)
  delta = np.zeros(acts.length + 1)
  np.add.at(delta, acts.start, per_device)
  np.add.at(delta, np.minimum(acts.stop + 1, acts.length), -per_device)
  live = np.cumsum(delta)
  k = int(np.argmax(live))
  return float(live[k]), k


def activation_tables(problem: Problem, acts: Activations, at: int) -> list[Table]:
  """Per-device bytes of the values live at program position `at`, as tables."""
  total: dict[tuple[int, ...], float] = {}
  copies = []
  for k in np.flatnonzero((acts.start <= at) & (acts.stop >= at)):
    stored = acts.stored[k] if acts.stored else None
    if stored is not None or acts.unless_of(k) or acts.only_of(k):
      copies.append(_copy_table(problem, float(acts.nbytes[k]), acts.dims[k], stored,
                                acts.unless_of(k), acts.only_of(k)))
      continue
    key = _scope(problem, acts.dims[k])
    total[key] = total.get(key, 0.0) + float(acts.nbytes[k])
  return _bytes_tables(problem, total) + copies


def _copy_table(problem: Problem, nbytes: float, dims, stored, unless=(), only=()
                ) -> Table:
  """A copy's bytes over its read, stored, `unless` and `only` classes (zero where the
  layouts agree, an `unless` class is split or no `only` class is)."""
  scope = _scope(problem, tuple(dims) + tuple(stored or ()) + tuple(unless) + tuple(only))
  domains = tuple(problem.domains[c] for c in scope)
  table = _divide(nbytes, _copy_shards(problem.mesh, scope, domains, tuple(dims), stored,
                                       tuple(unless), tuple(only)))
  return Table(scope, table, np.zeros_like(table))


@functools.lru_cache(maxsize=1 << 14)
def _copy_shards(mesh: costlib.MeshSpec, scope, domains, dims, stored, unless, only
                 ) -> np.ndarray:
  """`_shards` of a copy entry for every choice of its scope's domains. Read-only:
  shared between calls."""
  table = np.empty(tuple(len(d) for d in domains), int)
  for idx in itertools.product(*(range(len(d)) for d in domains)):
    choice = {c: domains[k][j] for k, (c, j) in enumerate(zip(scope, idx))}
    table[idx] = _shards(mesh, dims, stored, choice, unless, only)
  table.setflags(write=False)
  return table


def memory_used(problem: Problem, acts: Activations, memory, assignment):
  """(inputs + live intermediates at the peak, peak position, class -> axes) of a plan."""
  choice = {c: problem.domains[c][i] for c, i in assignment.items()}
  peak, at = activation_peak(problem, acts, choice)
  return evaluate_tables(memory, assignment)[0] + peak, at, choice


def largest_live(problem: Problem, acts: Activations, choice, top: int = 3) -> str:
  """The biggest intermediates live at the activation peak under a choice, as text."""
  if not len(acts.nbytes):
    return ""
  _, at = activation_peak(problem, acts, choice)
  per_device = _per_device(problem, acts, choice)
  live = np.flatnonzero((acts.start <= at) & (acts.stop >= at))
  g = problem.graph
  rows = []
  for k in live[np.argsort(-per_device[live])][:top]:
    v = acts.values[k]
    if v in g.producer:
      op = g.ops[g.producer[v]]
      what = f"{op.name_stack or '(top)'}/{op.primitive}"
    elif v not in g.input_path:  # a loop body's input, written out per iteration
      what = "a scanned stack's carry, stacked for its recomputation"
    elif acts.unless_of(k):
      what = f"{g.input_path[v]} copied before its in-place update"
    else:
      what = f"{g.input_path[v]} gathered for use"
    rows.append(f"{what} {g.types[v]} "
                f"({per_device[k] / 2**20:.1f} MiB)")
  return ", ".join(rows)
