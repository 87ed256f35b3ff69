"""The part of a program the solver looks at: folded (one copy per unique layer) or not.

A `View` lists the top-level ops searched and what each stands for. Folded, the
interior copies of a unique layer map onto one representative copy, so the search's
size stays flat in depth; the bodies of counted loops (scans) are searched in place,
each op standing for trip-count executions.

Example:
  >>> from tapas_jax import models, fold, trace
  >>> from tapas_jax.solver import views
  >>> m = models.get_model("gpt", "tiny", num_layers=6)
  >>> graph = trace.trace(m.train_step(), m.abstract_state(), m.batch_spec(2))
  >>> view = views.folded_view(fold.fold(graph))
  >>> len(view.ops) < len(views.unfolded_view(graph).ops)
  True
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from typing import Mapping

import numpy as np

from tapas_jax import _jax_internals as jx
from tapas_jax.fold import Folded
from tapas_jax.trace import Graph, Op

__all__ = ["Copies", "Standing", "View", "folded_view", "scan_bindings", "scan_region",
           "searched_instances", "unfolded_view", "with_scan_bodies"]


@dataclasses.dataclass(frozen=True)
class Copies:
  """The interior copies of one unique layer that a folded view maps onto its
  representative, as their op and value ids line up (what `live` maps per copy
  rather than walking each).

  Attributes:
    rep: the representative's ops, in program order.
    ops: per other interior copy, its ops, position for position with `rep`.
    rep_values: the values `rep`'s ops make, op by op, output by output.
    values: per other interior copy, the values its ops make, in the same order.
    read_outside: the values of the representative or a copy read outside their own
      instance, or returned by the program (`LayerInstance.outputs`).
  """

  rep: tuple[int, ...]
  ops: tuple[tuple[int, ...], ...]
  rep_values: tuple[int, ...]
  values: tuple[tuple[int, ...], ...]
  read_outside: frozenset[int]

  # `ops` and `values` as arrays (one row per copy), built once: each pass that maps
  # the copies reads them (a 96-layer GPT's copies made them anew ~1 ms a pass). Read
  # only.
  @functools.cached_property
  def op_rows(self) -> np.ndarray:
    return np.array(self.ops, np.int64)

  @functools.cached_property
  def value_rows(self) -> np.ndarray:
    return np.array(self.values, np.int64)


@dataclasses.dataclass(frozen=True)
class View:
  """The part of the program the search looks at, and what each part stands for.

  Folded: the glue plus one representative instance per unique layer; every other
  instance's values and ops map onto the representative's (same position in the
  instance, which fingerprints guarantee is the same computation). Unfolded: all ops.

  Attributes:
    ops: top-level op indices searched.
    canon: value -> the value standing for it (absent: itself).
    weight: op index -> how many ops it stands for (absent: 1).
    op_canon: op index -> the op standing for it (absent: itself).
    loops: scan ops whose bodies are searched in their place (the body's ops are in
      `ops`, each standing for trip-count executions).
    copies: folded, per unique layer with interior copies, how they line up with
      their representative.
    glue: folded, the top-level ops of no layer instance (empty unfolded).
  """

  ops: tuple[int, ...]
  canon: Mapping[int, int] = dataclasses.field(default_factory=dict)
  weight: Mapping[int, int] = dataclasses.field(default_factory=dict)
  op_canon: Mapping[int, int] = dataclasses.field(default_factory=dict)
  loops: frozenset[int] = frozenset()
  copies: tuple[Copies, ...] = ()
  glue: frozenset[int] = frozenset()


class Standing:
  """A graph's ops found by what is asked of the op standing for each
  (`View.op_canon`): a folded layer's interior copies (`View.copies`) are asked once,
  as their representative, not one op at a time (what reads them stays flat in depth).

  Example:
    >>> from tapas_jax import models, fold, trace
    >>> m = models.get_model("gpt", "tiny", num_layers=6)
    >>> graph = trace.trace(m.train_step(), m.abstract_state(), m.batch_spec(2))
    >>> view = folded_view(fold.fold(graph))
    >>> dots = lambda i: graph.ops[i].primitive == "dot_general"
    >>> Standing(graph, view).where(dots) == [op for op in graph.region_ops(0)
    ...                                       if dots(view.op_canon.get(op.index, op.index))]
    True
  """

  def __init__(self, graph: Graph, view: View, region: int | None = 0):
    """`region`: the ops of that region (the top level), or None: every op."""
    self.graph, self.view = graph, view
    copied = np.zeros(len(graph.ops), bool)
    for c in view.copies:
      copied[c.op_rows.ravel()] = True
    # The ops in no copy (few: the glue, the first and last instances, the
    # representatives), in a region's program order (op order).
    self.outside = [i for i in np.flatnonzero(~copied).tolist()
                    if region is None or graph.ops[i].region == region]

  def where(self, keep) -> list[Op]:
    """The ops, in program order, whose standing-for op `keep` holds for (asked with
    its index)."""
    canon = self.view.op_canon
    found = [i for i in self.outside if keep(canon.get(i, i))]
    for c in self.view.copies:
      slots = [k for k, i in enumerate(c.rep) if keep(i)]
      if slots:
        found += c.op_rows[:, slots].ravel().tolist()
    ops = self.graph.ops
    return [ops[i] for i in sorted(found)]  # ops are numbered in program order


def scan_region(graph: Graph, op: Op):
  """The body region of a counted loop whose operands bind 1:1 to its body, else None."""
  for r in op.subregions:
    region = graph.regions[r]
    if (region.trip_count and len(region.inputs) == len(op.inputs)
        and len(region.outputs) == len(op.outputs)):
      return region
  return None


def scan_bindings(graph: Graph, op: Op):
  """(outer value, body value, dim shift) pairs tying a scan to its body.

  Told apart by shape, which every jax release keeps (the params naming consts and
  carries changed in jax 0.11): an operand shaped like its body value is a const or
  carry (shift 0); one with the trip count in front is scanned (shift 1). Anything
  else is left unbound. Where the params still say which operands are carries, the
  body's carry out is also tied to its carry in.
  """
  region = scan_region(graph, op)
  for outers, inners in ((op.inputs, region.inputs), (op.outputs, region.outputs)):
    for outer, inner in zip(outers, inners):
      if outer in graph.literals or inner in graph.literals:
        continue
      shape, body = graph.types[outer].shape, graph.types[inner].shape
      if shape == body:
        yield outer, inner, 0
      elif shape == (region.trip_count,) + body:
        yield outer, inner, 1
  counts = jx.scan_counts(op.raw_params)
  if counts is not None:
    consts, carry = counts.num_consts, counts.num_carry
    for inner_in, inner_out in zip(region.inputs[consts:consts + carry],
                                   region.outputs[:carry]):
      if inner_out not in graph.literals:
        yield inner_in, inner_out, 0


def with_scan_bodies(graph: Graph, view: View) -> View:
  """Adds the bodies of scans to the view, each op standing for trip-count executions;
  a scan inside a scan's body (a chunked attention's `lax.map` in a scanned layer)
  too, standing for both trip counts: kept whole, it would be priced replicated."""
  ops, weight, loops = list(view.ops), dict(view.weight), set()
  pending = list(view.ops)
  while pending:
    i = pending.pop()
    region = scan_region(graph, graph.ops[i])
    if region is None:
      continue
    loops.add(i)
    body = [op.index for op in graph.region_ops(region.index)]
    ops += body
    pending += body
    for b in body:
      weight[b] = region.trip_count * weight.get(i, 1)
  return dataclasses.replace(view, ops=tuple(ops), weight=weight, loops=frozenset(loops))


def unfolded_view(graph: Graph) -> View:
  return View(ops=tuple(op.index for op in graph.region_ops(0)))


def searched_instances(instances: tuple[int, ...]) -> tuple[int, ...]:
  """The instances of a unique layer a folded view searches as themselves: all of up
  to three; else the first, the interior copies' representative (the middle one) and
  the last. Every other interior copy is its representative's computation.

  Example:
    >>> searched_instances((3, 4, 5, 6, 7, 8))
    (3, 6, 8)
  """
  if len(instances) <= 3:
    return tuple(instances)
  interior = instances[1:-1]
  return instances[0], interior[len(interior) // 2], instances[-1]


class _MadeBy:
  """`made_by(op_rows)`: the values each row of top-level ops makes, op by op, output by
  output, as one array (rows alike: copies of one layer), gathered from the graph's
  wiring arrays (`Graph.top_wiring`) rather than op by op."""

  def __init__(self, graph: Graph):
    w = graph.top_wiring
    self.row, self.num_outputs = w.row, w.num_outputs
    self.made = w.values[~w.read]
    self.start = np.concatenate([[0], np.cumsum(w.num_outputs)[:-1]])

  def __call__(self, op_rows: np.ndarray) -> np.ndarray | None:
    """None where the rows' ops make different counts of values."""
    rows = self.row[op_rows]
    if not rows.size:
      return np.zeros((len(op_rows), 0), np.int64)
    counts = self.num_outputs[rows[0]]  # one layer's ops: the same outputs in each row
    if (self.num_outputs[rows] != counts).any():
      return None
    first = np.cumsum(counts) - counts
    offset = np.arange(int(counts.sum())) - np.repeat(first, counts)
    return self.made[np.repeat(self.start[rows], counts, axis=1) + offset]


def folded_view(folded: Folded) -> View:
  """Glue, each unique layer's first and last instance, and its middle instance
  standing for all the interior copies.

  The first and last copies are kept as themselves because their neighbours differ
  (glue on one side): their edges cost differently. The interior copies all look the
  same, so one of them is searched for all, and the search's size stays flat in depth.
  """
  g = folded.graph
  canon, weight, op_canon, copies = {}, {}, {}, []
  ops = {i for seg in folded.glue for i in seg.ops}
  outputs = operator.attrgetter("outputs")
  # The values an instance's ops make, op by op, output by output (without a Python
  # frame per op: every interior copy is listed).
  made = lambda inst: tuple(itertools.chain.from_iterable(  # noqa: E731
      map(outputs, map(g.ops.__getitem__, inst.ops))))
  made_by = _MadeBy(g)
  for u in folded.unique_layers:
    searched = searched_instances(u.instances)
    for k in searched:
      ops.update(folded.instances[k].ops)
    if len(u.instances) <= 3:
      continue
    interior = [folded.instances[k] for k in u.instances[1:-1]]
    rep = folded.instances[searched[1]]
    for i in rep.ops:
      weight[i] = len(interior)
    params = g.input_path
    others = [inst for inst in interior if inst.index != rep.index]
    rep_values = made(rep)
    # The representative's reads of parameters, (op's place, slot, parameter): only
    # there can a copy read a parameter that maps onto it.
    reads = [(k, j, vb) for k, b in enumerate(rep.ops)
             for j, vb in enumerate(g.ops[b].inputs) if vb in params]
    op_rows = np.array([inst.ops for inst in others], np.int64).reshape(len(others), -1)
    value_rows = made_by(op_rows)
    if value_rows is None:  # rows making different counts of values: no array
      values = [made(inst) for inst in others]
    else:
      values = list(map(tuple, value_rows.tolist()))
    for inst, made_here in zip(others, values):
      op_canon.update(zip(inst.ops, rep.ops))
      canon.update(zip(made_here, rep_values))
      for k, j, vb in reads:  # copies of one layer: the same ops, the same slots
        inputs = g.ops[inst.ops[k]].inputs
        if inputs[j] in params:
          canon[inputs[j]] = vb  # this copy's parameter is laid out like the representative's
    if others:
      c = Copies(rep.ops, tuple(inst.ops for inst in others), rep_values, tuple(values),
                 frozenset(v for inst in interior for v in inst.outputs))
      if value_rows is not None:  # its arrays (`Copies.op_rows`, `value_rows`), made here
        c.__dict__.update(op_rows=op_rows, value_rows=value_rows)
      copies.append(c)
  return View(ops=tuple(sorted(ops)), canon=canon, weight=weight, op_canon=op_canon,
              copies=tuple(copies), glue=frozenset(i for seg in folded.glue for i in seg.ops))
