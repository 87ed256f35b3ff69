"""Live ranges: every intermediate of the top-level program, as the compiler keeps it.

`activations(problem)` lists each value written out (and each copy the compiler makes
of one: gathered parameters, reduced gradients, values read through a cut, donated
inputs copied before their update) with the program positions it is live between and
the classes of its dims, as an `Activations` record that `memory` prices under a plan.
It is built once per search in named steps over one `LiveProgram` record
(`live_program`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Collection, Iterable, Mapping, Sequence

import numpy as np

from tapas_jax import _jax_internals as jx
from tapas_jax import cost as costlib
from tapas_jax import rules as ruleslib
from tapas_jax.solver.conv_inputs import add_conv_input_copies
from tapas_jax.solver.donated import donated_copies
from tapas_jax.solver.fusion import fused_values, live_ops
from tapas_jax.solver.problem import Problem
from tapas_jax.solver.reductions import combined_reductions, last_update_reads
from tapas_jax.solver.reorder import glue_gradients_last
from tapas_jax.solver.live_program import (Entries, LiveProgram, live_program,
                                            readers_through)
from tapas_jax.solver.loop_casts import add_loop_casts
from tapas_jax.solver.template import Reach, mapped_entries, merge
from tapas_jax.solver.update_reads import UpdateReads
from tapas_jax.solver.views import scan_bindings, scan_region
from tapas_jax.trace import Op

__all__ = ["Activations", "activations", "kernel_share", "loop_body_values"]


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
    notes: entry -> what it holds, for the copies of an input its value does not name.
    shard_bytes: entry -> its bytes on one device from its shard's shape, for entries
      the compiler lays out per shard (a convolution's copy pads its batch to a tile).
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
  notes: Mapping[int, str] = dataclasses.field(default_factory=dict)
  shard_bytes: Mapping[int, Callable[[tuple[int, ...]], float]] = dataclasses.field(
      default_factory=dict)

  def with_entries(self, extra: Entries, *, start: np.ndarray | None = None,
                   stop: np.ndarray | None = None, nbytes: np.ndarray | None = None
                   ) -> Activations:
    """These entries (their `start`, `stop` or `nbytes` replaced where given, entry
    for entry) followed by `extra`'s, whose bytes are taken as given (per entry, as
    `Activations.nbytes` holds them)."""
    n = len(self.dims)
    pad = lambda xs: tuple(xs) + ((),) * (n - len(xs))  # noqa: E731
    return Activations(
        np.concatenate([self.start if start is None else start,
                        np.array(extra.start, int)]),
        np.concatenate([self.stop if stop is None else stop, np.array(extra.stop, int)]),
        np.concatenate([self.nbytes if nbytes is None else nbytes,
                        np.array(extra.nbytes, float)]),
        self.dims + tuple(extra.dims), self.length, self.values + tuple(extra.values),
        tuple(self.stored or (None,) * n) + tuple(extra.stored),
        pad(self.unless) + tuple(extra.unless), pad(self.only) + tuple(extra.only),
        {**self.notes, **{n + k: note for k, note in extra.notes.items()}},
        {**self.shard_bytes, **{n + k: f for k, f in extra.shard_bytes.items()}})

  def unless_of(self, k: int) -> tuple[int, ...]:
    return self.unless[k] if k < len(self.unless) else ()

  def only_of(self, k: int) -> tuple[int, ...]:
    return self.only[k] if k < len(self.only) else ()

  @functools.cached_property
  def kinds(self) -> tuple[tuple[tuple, ...], np.ndarray]:
    """(distinct (dims, stored, unless, only) among the entries, each entry's index
    in them): entries alike take the same share of their bytes under any plan."""
    n = len(self.dims)
    stored = self.stored or (None,) * n
    unless = self.unless + ((),) * (n - len(self.unless))  # as `unless_of` reads them
    only = self.only + ((),) * (n - len(self.only))
    seen: dict[tuple, int] = {}
    index = [seen.setdefault(key, len(seen)) for key in zip(self.dims, stored, unless, only)]
    return tuple(seen), np.array(index, int)


def activations(problem: Problem, cache: dict | None = None, *, per_op: bool = False
                ) -> Activations:
  """The intermediates of the top-level program, as XLA keeps them.

  `cache` (a search's table cache) shares the program's fusion with the cost tables
  (`fusion.top_level`). `per_op`: walk every op of every copy of a layer (the
  reference the tests hold the folded path to); by default the values a folded view's
  interior copies make and read inside themselves are mapped from their
  representative's (`template`), and what the walks ask of other ops is found from
  the values asked about, not by walking the program.

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
  * Where the compiler makes the glue's weight gradients last
    (`DeviceProfile.glue_gradients_last`: an lm_head's, a head's; no fence
    orders them), each is made just before its first reader past the backward, and
    what it reads is held until then (`reorder.glue_gradients_last`).
  * A parameter stored apart from its use (ZeRO) is gathered once into its compute
    layout (`apply` pins one copy per value) and that copy lives from its first
    compute reader to its last.
  * A donated input read by an op its next value does not depend on (the backward
    pass's `dy @ W.T` does not feed W's own update) is copied whole by XLA's copy
    insertion before anything is written in place, and the copy lives until the update
    (`donated`; the TPU compiler orders the readers first instead:
    `copies_donated_inputs`).
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
    on to the last dot reading them (`dot_operand_fusion`), and holds an f32 value read
    only by dots and convolutions at DEFAULT precision in bf16
    (`stores_dot_operands_in_bf16`); it reads a program input convolutions read
    through a copy in their own layout (`copies_conv_inputs`, `conv_inputs`).

  Built in named steps over one `LiveProgram` record, each adding its kind of entry in
  program order (the order is part of the result: ties in `largest_live`, and which
  entry stands for a value as written).
  """
  prog = live_program(problem, cache, per_op)
  update = UpdateReads.of(problem, prog)
  conv = _conv_copies(problem, prog)
  entries = Entries()
  if per_op:
    own = _add_made(entries, problem, prog, conv, _last_readers(prog, update, conv),
                    range(len(prog.top)))
  else:
    own = _add_mapped(entries, problem, prog, update, conv)
  _hand_over_in_place(prog, entries)
  moved = glue_gradients_last(entries, problem, prog, update, own)
  _add_reductions(entries, problem, prog, update, own, moved)
  _add_loop_bodies(entries, problem, prog)
  _add_gathered_inputs(entries, problem, prog)
  _add_donated_copies(entries, problem, prog)
  add_conv_input_copies(entries, problem, prog)
  add_loop_casts(entries, problem, prog)
  return _record(entries, problem, len(prog.top), _narrowed(problem, prog, entries))


def _conv_copies(problem: Problem, prog: LiveProgram) -> dict[int, dict[int, tuple]]:
  """Convolutions XLA runs only in canonical order read their other operands through
  transposed copies: conv op -> {operand or result: classes}."""
  if not problem.profile.canonical_convolutions:
    return {}
  convs = prog.lineup.where(prog.graph, prog.top,
                            lambda op: op.primitive == "conv_general_dilated")
  return {op.index: _transposed_for_conv(problem, op) for op in map(prog.top.__getitem__, convs)
          if op.index in prog.live}


def _last_readers(prog: LiveProgram, update: UpdateReads, conv) -> dict[int, int]:
  """value -> position of its last reader. A fused value is recomputed where it is
  read: what it is made of stays live until then. Readers come after producers, so
  walk backwards."""
  reach: dict[int, int] = {}
  for j in range(prog.end, -1, -1):
    op = prog.top[j]
    if op.index not in prog.live or op.index in update.feeding:
      continue
    transposed = conv.get(op.index, {})
    here = j
    for w in op.outputs:
      if w in prog.fused:
        here = max(here, reach.get(w, j))
    updating = op.index in prog.update
    for v in op.inputs:
      if updating and v in update.delivered:
        continue  # the update reads the delivered copy
      if v in transposed:
        continue  # the conv reads its transposed copy
      if reach.get(v, -1) < here:
        reach[v] = here
  return reach


def _add_mapped(entries: Entries, problem: Problem, prog: LiveProgram, update: UpdateReads,
                conv) -> dict[int, int]:
  """`_add_made` over the whole program, the interior copies' values that `template`
  maps from their representative's added without walking their ops."""
  reach = Reach(prog, update, conv, problem.view.canon)
  sided = {r for r, _ in problem.read_sides}
  mapped = mapped_entries(prog, problem.view.copies, reach.readers, reach.position,
                          _Made(problem, prog), update.feeding, update.delivered, conv,
                          sided and (lambda v: _cut_copies(problem, prog, v, sided)),
                          reach.known)
  walk = np.ones(len(prog.top), bool)
  walk[mapped.skip] = False
  at: list[int] = []
  own = _add_made(entries, problem, prog, conv, reach, np.flatnonzero(walk).tolist(), at)
  return merge(entries, at, own, mapped)


def _record(entries: Entries, problem: Problem, length: int,
            narrowed: frozenset[int] | set[int] = frozenset()) -> Activations:
  """The record of `entries`; `narrowed`: the entries the compiler stores in bf16."""
  return Activations(np.array(entries.start, int), np.array(entries.stop, int),
                     _as_stored(problem, entries.nbytes, entries.values, narrowed,
                                entries.padded),
                     tuple(entries.dims), length, tuple(entries.values),
                     tuple(entries.stored), tuple(entries.unless), tuple(entries.only),
                     dict(entries.notes), dict(entries.shard_bytes))


def _add_made(entries: Entries, problem: Problem, prog: LiveProgram, conv,
              reach: Mapping[int, int], positions: Iterable[int],
              at: list[int] | None = None) -> dict[int, int]:
  """Adds every value the ops at `positions` (ascending) make, as they make it (and the
  copies read through a cut or transposed for a convolution, next to it); returns value
  -> its entry as made. `at`, where given, gets each entry's op position."""
  g = prog.graph
  own: dict[int, int] = {}
  sided = {r for r, _ in problem.read_sides}  # ops reading through an activation cut
  made = _Made(problem, prog)
  fixed = any(r.fixed_outputs for r in problem.rules.values())  # a shard_map's results
  for j in positions:
    op = prog.top[j]
    if op.index not in prog.live:
      continue
    before = len(entries.start)
    for slot, v in enumerate(op.outputs):
      classes = made(op, slot, v)
      if classes is None:
        continue
      stop = (prog.end if v in prog.outputs and v not in prog.carried
              else reach.get(v, j))
      nbytes = g.types[v].nbytes
      if fixed:
        nbytes = _made_bytes(problem, op, slot, nbytes)
      own[v] = entries.add(j, stop, nbytes, v, classes)
      for c, dims in _cut_copies(problem, prog, v, sided) if sided else ():
        entries.add(prog.pos[c], prog.pos[c], g.types[v].nbytes, v, dims, stored=classes)
    for v, classes in conv.get(op.index, {}).items():
      _add_conv_copy(entries, prog, op, j, v, classes)
    if at is not None:
      at.extend([j] * (len(entries.start) - before))
  return own


class _Made:
  """`made(op, slot, v)`: the classes v is written over where `_add_made` adds it
  whole, else None (no shape, no classes, fused, written in place into the donated
  input, or a constant XLA builds inside its readers (a causal mask)). Copies of a
  layer make their values in their representative's classes: one `_made` per
  (representative op, output slot, value in the view, rank)."""

  def __init__(self, problem: Problem, prog: LiveProgram):
    self.problem, self.prog, self.of, self.partial = problem, prog, {}, {}

  def classes(self, op, slot: int, v: int) -> tuple[int | None, ...] | None:
    """`_made(problem, op, v)` (v is op's output `slot`)."""
    problem = self.problem
    key = (problem.view.op_canon.get(op.index, op.index), slot, problem.cv(v),
           len(self.prog.graph.types[v].shape), bool(op.subregions))
    return self.of[key] if key in self.of else self.of.setdefault(key, _made(problem, op, v))

  def nbytes(self, op, slot: int, v: int) -> float:
    """v's bytes as made (`_made_bytes`: a device's share of a kernel's result)."""
    return _made_bytes(self.problem, op, slot, self.prog.graph.types[v].nbytes)

  def partial_classes(self, op_index: int) -> tuple[int, ...]:
    """`_partial_classes(problem, op_index)`, one per op standing for others."""
    canon = self.problem.view.op_canon.get(op_index, op_index)
    if canon not in self.partial:
      self.partial[canon] = _partial_classes(self.problem, op_index)
    return self.partial[canon]

  def __call__(self, op, slot: int, v: int) -> tuple | None:
    problem, prog = self.problem, self.prog
    if not prog.graph.types[v].shape:
      return None
    made = self.classes(op, slot, v)
    cv = problem.view.canon.get(v, v)
    if made is None or v in prog.fused or v in prog.carried:
      return None
    if cv in problem.free_values and v not in prog.outputs:
      return None
    return made


def _cut_copies(problem: Problem, prog: LiveProgram, v: int, sided) -> list[tuple[int, tuple]]:
  """(reader, classes) of v's copies read through a cut (sequence parallelism): each
  reader on the other side gets a transient copy in its layout (a norm's output
  gathered into a dot, a dot's result reduce-scattered for the residual add), live at
  the reader only, made over the classes v is made over. XLA gathers again rather than
  keep a gathered copy from the forward pass to the backward (measured on the tiny zoo
  under sequence-parallel plans: a copy held from its first reader to its last
  over-counted XLA's peak by ~10%)."""
  g, canon = prog.graph, problem.view.op_canon
  out = []
  for c in g.consumers.get(v, ()):
    rep = canon.get(c, c)
    if rep not in sided or c not in prog.live:
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
      out.append((c, problem.reader_dims[(y, side)]))
  return out


def _add_conv_copy(entries: Entries, prog: LiveProgram, op, j: int, v: int, classes) -> None:
  """XLA:CPU transposes a conv's operand as soon as it is made (the copy, not the
  value, is what the backward pass's weight-gradient conv keeps), and makes a
  non-canonical result canonical first, then transposes it."""
  g, pos = prog.graph, prog.pos
  made_at = pos.get(g.producer.get(v), None)
  if made_at is None:  # a program input: copied where it is first read
    made_at = min(pos[c] for c in g.consumers[v] if c in prog.live)
  entries.add(made_at if v in op.inputs else j, j, g.types[v].nbytes, v, classes)


def _add_reductions(entries: Entries, problem: Problem, prog: LiveProgram,
                    update: UpdateReads, own: Mapping[int, int],
                    moved: Mapping[int, int] | None = None) -> None:
  """Where a split leaves them partial sums, the gradients' reductions are combined, in
  program order, up to the compiler's combine threshold, each combined reduction run
  once the last of its gradients is made: each is kept as made until then, its reduced
  copy from then to the update (as soon as the update can run, where the compiler runs
  it so: `reductions.last_update_reads`), and the two live together while the reduction
  runs.
  Where none is reduced, XLA updates each parameter as soon as its gradient is made
  (in place): the gradient lives where it is made only."""
  gradients = update.gradients
  if not gradients:
    return
  g, pos, made_of, moved = prog.graph, prog.pos, _Made(problem, prog), moved or {}
  at_of = combined_reductions(g, gradients, pos, problem.profile.combine_threshold_bytes,
                              prog.end, moved)
  early = (last_update_reads(prog, update.feeding, at_of)
           if problem.profile.updates_when_ready else {})
  for x, (read, last) in gradients.items():
    p, at = g.producer[x], at_of[x]
    made = made_of.classes(g.ops[p], g.ops[p].outputs.index(x), x)
    partial = made_of.partial_classes(p)
    if made is None or not partial:
      continue
    first = entries.stop[own[x]] + 1 if x in own else moved.get(p, pos[p])
    # Without a reduce-scatter pass (XLA:CPU) the sums are all-reduced whole, as
    # made, and sliced where the update reads them.
    reduced = read if problem.profile.reduce_scatter else made
    last = min(last, early.get(x, last))
    for a, b, classes in ((first, at, made), (at, max(last, at), reduced)):
      if a <= b:
        entries.add(a, b, g.types[x].nbytes, x, classes, only=partial)


def _add_loop_bodies(entries: Entries, problem: Problem, prog: LiveProgram) -> None:
  """What a loop's body writes out in one iteration, live at the loop's position (only
  a loop, whose representative has a body, writes out values of its body)."""
  g, canon = prog.graph, problem.view.op_canon
  body: dict[int, list] = {}  # a copy's loop writes out what its representative's does
  for j in prog.lineup.where(g, prog.top, lambda op: bool(op.subregions)):
    op = prog.top[j]
    if op.index in prog.live:
      rep = canon.get(op.index, op.index)
      for v, made, nbytes in body[rep] if rep in body else body.setdefault(
          rep, loop_body_values(problem, op)):
        entries.add(j, j, nbytes, v, made)


def _add_gathered_inputs(entries: Entries, problem: Problem, prog: LiveProgram) -> None:
  """A parameter used in another layout than it is stored in (ZeRO): its gathered
  copy, from its first compute reader to its last. Its layouts are asked once per value
  standing for it (a folded layer's copies of a parameter are laid out alike), its
  readers of the wiring's arrays (every copy's parameters are asked)."""
  g = prog.graph
  used: dict[int, tuple | None] = {}  # value standing for the input -> (use, stored)
  asked = []
  for i in g.inputs:
    cv = problem.cv(i.value)
    if cv not in used:
      use = problem.reader_dims.get((cv, False))
      used[cv] = None if use is None else (use, tuple(problem.value_class[(cv, d)]
                                                      for d in range(len(use))))
    if used[cv] is not None:
      asked.append((i.value, used[cv]))
  if not asked:
    return
  w = g.top_wiring
  read, read_at = w.values[w.read], w.positions[w.read]
  ask = np.zeros(len(g.types), bool)
  ask[[v for v, _ in asked]] = True
  keep = ask[read] & prog.alive[w.index[read_at]] & ~prog.updating[w.index[read_at]]
  first = np.full(len(g.types), len(prog.top))
  last = np.full(len(g.types), -1)
  np.minimum.at(first, read[keep], read_at[keep])
  np.maximum.at(last, read[keep], read_at[keep])
  for (v, (use, stored)), a, b in zip(asked, first[[v for v, _ in asked]].tolist(),
                                      last[[v for v, _ in asked]].tolist()):
    if b >= 0:
      entries.add(a, b, g.types[v].nbytes, v, use, stored=stored)


def _add_donated_copies(entries: Entries, problem: Problem, prog: LiveProgram) -> None:
  """A donated input's copy before its update (`donated.donated_copies`); gone where the
  batch is split (`unless`), and on a compiler that orders the readers first instead
  (`DeviceProfile.copies_donated_inputs`)."""
  if not problem.profile.copies_donated_inputs:
    return
  g = prog.graph
  batch = tuple(c.index for c in problem.classes if c.batch)
  for v, first, last in donated_copies(prog):
    entries.add(first, last, g.types[v].nbytes, v,
                tuple(problem.vclass(v, d) for d in range(len(g.types[v].shape))),
                unless=batch)


def _as_stored(problem: Problem, nbytes, values, narrowed: frozenset[int] | set[int],
               padded: Sequence[bool]) -> np.ndarray:
  """Each entry's bytes as the compiler stores the whole value: padded
  (`cost.stored_bytes`; the padding of the unsplit value stands for its shards'), in
  bf16 for the entries `narrowed` holds; those `padded` marks as they are."""
  nbytes = np.array(nbytes, float)
  if not problem.profile.memory_tile and not narrowed:
    return nbytes
  types = problem.graph.types
  return np.array([b * costlib.stored_bytes(types[v].shape,
                                            2 if k in narrowed else types[v].itemsize,
                                            problem.profile)
                   / types[v].nbytes if types[v].nbytes and not ready else b
                   for k, (b, v, ready) in enumerate(zip(nbytes, values, padded, strict=True))],
                  float)


def _narrowed(problem: Problem, prog: LiveProgram, entries: Entries) -> set[int]:
  """The entries of f32 values the compiler writes out in bf16: where it runs a dot or
  a convolution at DEFAULT precision as one bf16 pass
  (`DeviceProfile.stores_dot_operands_in_bf16`), a value read only by such
  contractions (directly, or through values fused into them, as a
  projection's bias add) is converted as it is made and only the bf16 copy is kept
  (the tiny zoo's queries, keys and values on the TPU compiler: bf16 buffers); so is a
  stack a loop scans into such contractions (a scanned layer stack's residuals), and,
  inside a loop's body, a value its body reads so (a stacked kernel's slice gathered
  for one layer). Of a program input, only its gathered copy, which the compute reads
  and the update does not."""
  if not problem.profile.stores_dot_operands_in_bf16:
    return set()
  g, inputs = problem.graph, {i.value for i in problem.graph.inputs}
  bodies: dict = {}  # loop body -> its live ops and fused values, made once
  body_of = {v: r.index for r in g.regions[1:] for v in r.inputs}

  @functools.lru_cache(maxsize=None)
  def by_contractions(v):
    region = g.ops[g.producer[v]].region if v in g.producer else body_of.get(v, 0)
    if region:
      return (v not in g.regions[region].outputs
              and _body_reads_by_contractions(problem, region, [v], bodies))
    return _read_by_contractions(problem, prog, v, bodies)
  return {k for k, v in enumerate(entries.values)
          if g.types[v].dtype == "float32"
          and (v not in inputs or entries.stored[k] is not None) and by_contractions(v)}


def _read_by_contractions(problem: Problem, prog: LiveProgram, v: int, bodies: dict
                          ) -> bool:
  """Whether every live reader of v outside the state update is a DEFAULT-precision
  contraction, looking through the values its readers make that are fused into
  theirs (never written out), or a loop scanning v into a body that reads it so. A
  value made inside the program and read by the update is not."""
  g = prog.graph
  return _only_contractions(
      readers_through(
          g, prog.live, [v],
          # The update of an input reads the stored input, not a copy; a reduction inside
          # the fusion making x reads it there, before it is written.
          skip=lambda c, x: ((c in prog.update and x in g.input_path)
                             or c in prog.side_reductions),
          through=_fused_into(prog.fused)),
      also=lambda op, x: _scanned_into_contractions(problem, op, x, bodies))


def _scanned_into_contractions(problem: Problem, loop, x: int, bodies: dict) -> bool:
  """Whether a counted loop scans x (a stack: one slice per iteration) into a body that
  reads each slice only with DEFAULT-precision contractions. The compiler then stacks x
  in bf16, converting each slice as the loop making x writes it: a scanned layer
  stack's residuals the backward loop's dots read (TPU compiler, an equinox LM scanned
  over 4 layers on v5p:2x2x1: the queries, keys, values, attention probabilities and
  norm outputs stacked as bf16)."""
  g = problem.graph
  region = scan_region(g, loop)
  inner = [] if region is None else [
      i for o, i, shift in scan_bindings(g, loop) if o == x and shift == 1]
  return bool(inner) and not any(i in region.outputs for i in inner) and \
      _body_reads_by_contractions(problem, region.index, inner, bodies)


def _body_reads_by_contractions(problem: Problem, region: int, values: Sequence[int],
                                bodies: dict) -> bool:
  """Whether a loop body reads `values` only with DEFAULT-precision contractions,
  looking through what the body fuses into them (`bodies`: region -> its live ops and
  fused values, filled as asked)."""
  g = problem.graph
  if region not in bodies:
    bodies[region] = _body_fusion(problem, region, g.regions[region].outputs)[1:]
  live, fused = bodies[region]
  return _only_contractions(readers_through(
      g, live, values, skip=lambda c, x: g.ops[c].region != region,
      through=_fused_into(fused)))


def _fused_into(fused: Collection[int]) -> Callable[[Op], bool]:
  """Whether a reader is looked through on the way to the contractions: not one
  itself, and each value it makes is fused into its readers (never written)."""
  return lambda op: (not ruleslib.default_precision_contraction(op) and bool(op.outputs)
                     and all(w in fused for w in op.outputs))


def _only_contractions(readers: Iterable[tuple[int, Op]],
                       also: Callable[[Op, int], bool] = lambda op, x: False) -> bool:
  """Whether there is a reader, and each is a DEFAULT-precision contraction (or one
  `also` takes)."""
  dots = 0
  for x, op in readers:
    if not (ruleslib.default_precision_contraction(op) or also(op, x)):
      return False
    dots += 1
  return dots > 0


def _body_fusion(problem: Problem, region: int, kept: tuple[int, ...],
                 stack_writes: Collection[int] = ()) -> tuple[list, set[int], set[int]]:
  """(ops, live op indices, fused values) of a loop body whose iteration writes out
  `kept` of its outputs (`stack_writes` of them into its scan's stacks, as made), fused
  as `problem.profile`'s compiler fuses it."""
  g = problem.graph
  body = list(g.region_ops(region))
  live = live_ops(g, body, kept)
  return body, live, fused_values(g, body, live, kept,
                                  reductions_duplicate=problem.profile.reductions_duplicate,
                                  dot_operands=problem.profile.dot_operand_fusion,
                                  stack_writes=stack_writes)


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
    rank = len(problem.graph.types[v].shape)
    if _fixed_made(problem, op, op.outputs.index(v)) is not None:
      return (None,) * rank  # a stack of a kernel's result: its share, `_made_bytes`
    return tuple(problem.vclass(v, d) for d in range(rank))
  return tuple(None if f is None else problem.vclass(v, d)
               for d, f in enumerate(rule.outputs[op.outputs.index(v)]))


def _made_bytes(problem: Problem, op, slot: int, nbytes: int) -> float:
  """Bytes of an op's result `slot` as made: a device's share where the program fixed
  the shards it is made on (a `jax.shard_map`'s result, or a scan's stack of one: its
  classes are whole), else the whole value's, which the entry's classes divide."""
  fixed = _fixed_made(problem, op, slot)
  if fixed is None:
    return nbytes
  return nbytes / costlib.num_shards(costlib.Layout(fixed), problem.mesh)


def kernel_share(problem: Problem, v: int) -> float | None:
  """A device's bytes of v where a kernel fixed the shards it is made on (`_fixed_made`),
  else None (its classes divide it)."""
  g = problem.graph
  if v not in g.producer:
    return None
  op = g.ops[g.producer[v]]
  slot = op.outputs.index(v)
  if _fixed_made(problem, op, slot) is None:
    return None
  return _made_bytes(problem, op, slot, g.types[v].nbytes)


def _fixed_made(problem: Problem, op, slot: int) -> tuple | None:
  """The fixed layout an op's result `slot` is made in: a `jax.shard_map`'s per its
  `out_specs`; a scan's stack of a body value a shard_map makes, that layout under the
  stacked dim (the compiler stacks the kernel's residuals as the kernel made them, one
  device's share each: a scanned LLaMA under FSDP with its attention in a shard_map,
  TPU compiler). None where nothing fixes it."""
  g = problem.graph
  rep = g.ops[problem.view.op_canon.get(op.index, op.index)]
  rule = problem.rules.get(rep.index)
  if rule is not None:
    return rule.fixed_output(slot)
  if not rep.subregions or scan_region(g, rep) is None:
    return None
  v = rep.outputs[slot]
  for outer, inner, shift in scan_bindings(g, rep):
    if outer == v and shift == 1 and inner in g.producer:
      maker = g.ops[g.producer[inner]]
      inner_rule = problem.rules.get(maker.index)
      fixed = (inner_rule.fixed_output(maker.outputs.index(inner))
               if inner_rule is not None else None)
      return None if fixed is None else ((),) + tuple(fixed)
  return None


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


def loop_body_values(problem: Problem, op, dropped: Iterable[int] = ()
                      ) -> list[tuple[int, tuple, float]]:
  """(value, classes as made, bytes as made: `_made_bytes`) of what one iteration of a
  counted loop writes out and holds at the body's own peak (in body order: each value
  from the op making it to its last reader in the body, the body's outputs to its end,
  or, where the compiler writes a stacked slice into its stack as it is made
  (`DeviceProfile.stacks_in_place`), only the carries), counted live together while
  the loop runs (the blocks of a chunked attention's scores; a
  scanned layer's activations). A copy of a layer the view folds away is costed as
  its representative's loop. `dropped`: output slots the loop no longer writes (a
  scan remat's residuals, recomputed in the backward loop instead)."""
  g = problem.graph
  rep = g.ops[problem.view.op_canon.get(op.index, op.index)]
  region = scan_region(g, rep)
  if region is None:
    return []
  gone = set(dropped)
  kept = [v for s, v in enumerate(region.outputs) if s not in gone]
  # Where the compiler writes a slice the loop stacks into a result into its stack as
  # it is made (`stacks_in_place`), only a carry, or an output bound to nothing known,
  # is held to the body's end.
  stacked = ({inner for outer, inner, shift in scan_bindings(g, rep)
              if shift == 1 and outer in rep.outputs}
             if problem.profile.stacks_in_place else set())
  body, live, fused = _body_fusion(problem, region.index, tuple(kept), stacked)
  out, span = [], []
  pos = {o.index: j for j, o in enumerate(body)}
  outputs = set(kept) - stacked
  for j, o in enumerate(body):
    rule = problem.rules.get(o.index)
    if rule is None or o.index not in live:
      continue
    for slot, v in enumerate(o.outputs):
      if (v in fused or not g.types[v].shape
          or (problem.cv(v), 0) not in problem.value_class):
        continue
      out.append((v, tuple(None if f is None else problem.vclass(v, d)
                           for d, f in enumerate(rule.outputs[slot])),
                  _made_bytes(problem, o, slot, g.types[v].nbytes)))
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
                               for d in range(len(g.types[inner].shape))),
                  g.types[inner].nbytes))
      span.append((0, max([pos[c] for c in g.consumers.get(inner, ()) if c in pos],
                          default=0)))
  if not out:
    return out
  live_bytes = np.zeros(len(body) + 2)
  for (_, _, nbytes), (a, b) in zip(out, span):
    live_bytes[a:b + 1] += nbytes
  at = int(np.argmax(live_bytes))
  return [entry for entry, (a, b) in zip(out, span) if a <= at <= b]


def _hand_over_in_place(prog: LiveProgram, entries: Entries) -> None:
  """Ends an in-place op's operand one position early where the op is its last reader,
  so that its buffer and the op's result (the same memory) are not counted twice.

  XLA runs these ops (`Facts.in_place`) in place: the result takes over the buffer of
  operand 0 when that is its last use (a scatter into zeros, the embedding gradient's
  scatter-add, say)."""
  ops = prog.lineup.where(prog.graph, prog.top,
                         lambda op: ruleslib.facts(op.primitive).in_place)
  if not ops:
    return
  n = len(entries.values)  # the value as written, not a later copy of it: its first entry
  at = dict(zip(reversed(entries.values), range(n - 1, -1, -1)))
  start, stop = entries.start, entries.stop
  for op in map(prog.top.__getitem__, ops):
    if op.index not in prog.live or not op.inputs:
      continue
    k = at.get(op.inputs[0])
    j = prog.pos[op.index]
    if k is not None and stop[k] == j and start[k] < j:
      stop[k] = j - 1
