"""Stage 3, search: `Folded` -> `Plan`, the sharding that minimises predicted step time.

Formulation. Every op's sharding rule (`rules.py`) names its dimensions as factors.
Factors joined through a value (a producer's output dim is a consumer's input dim)
are one *dimension class*, the automatic counterpart of flax's logical axes: the
residual width of every layer, the batch, one layer's heads, another layer's MLP
hidden. A plan gives each class a set of mesh axes (its domain: subsets of axes whose
sizes divide it; the batch class only takes `batch_axes`). Two classes may share an
axis (Megatron puts heads and MLP hidden both on `model`) unless one op or tensor
holds both.

The state update (an optimizer's pointwise ops from parameters, moments and gradients
to the next step's state; `_update_ops`) gets classes of its own: parameters are
*stored* in the update's layout and *used* in the compute's, gradients are *made* in
the compute's and *delivered* in the update's. The two meet at cuts costed like any
edge, once per step, so the search can store state split over `data` while computing
tensor parallel on `model` (ZeRO: gradients reduce-scattered, parameters gathered).

Cost = sum over ops of compute (FLOPs / shards / peak) and the collectives on its input
edges (`cost.reshard` from the producer's layout, partial sums included, to the layout
the op needs), the cuts, plus state carried from outputs back to inputs. Each op's cost
depends only on the few classes it touches, so the objective is a sum of small tables
over class variables, minimised exactly by variable elimination (min-sum). A memory
budget covers the inputs plus the intermediates live at the activation peak; it enters
as a Lagrange weight tuned by bisection (a hard row in the integer program), re-posed at
the new peak while the peak moves.

Folding: ops of instances of one unique layer have identical tables, so with
`fold=True` each table is built once per unique layer and reused for every instance
(and for structurally identical ops elsewhere); `fold=False` builds every op's table
on its own. Both minimise the same objective and reach the same value.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import tapas_jax as tapas
  >>> def loss(w, x):
  ...   return jnp.sum(jnp.tanh(x @ w) ** 2)
  >>> plan = tapas.search(loss, jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
  ...                     jax.ShapeDtypeStruct((65536, 4096), jnp.float32),
  ...                     mesh={"data": 8}, device="h100")
  >>> plan.in_specs[1]
  P('data', None)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
import time
import warnings
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from tapas_jax import cost as costlib
from tapas_jax import rules as ruleslib
from tapas_jax.fold import Folded
from tapas_jax.trace import Graph, Op

__all__ = ["DimClass", "InfeasibleBudgetError", "Problem", "Solution", "View",
           "build_problem", "evaluate", "folded_view", "search", "solve", "unfolded_view"]

DEFAULT_BATCH_AXIS_NAMES = ("data", "batch", "fsdp", "replica")
# Partial sums (a dot_general or reduction whose contracted dim is split) are reduced
# once, where they are made, into the layout their readers get: XLA's SPMD partitioner
# reduces at the producer and does not carry partial sums through the adds, transposes
# and scalings after it (measured: `scripts/bench_compiled.py`, Megatron's backward
# reduces dx of q, k and v one by one), so the model does not either.
# Elimination tables above this many entries mean the class graph is too entangled
# for exact elimination; the search then refuses rather than run for hours.
_MAX_TABLE = 1 << 22


@dataclasses.dataclass(frozen=True)
class DimClass:
  """One dimension class: tensor dims that must be split alike.

  Attributes:
    index: class id.
    size: the largest split any member allows: the gcd of its members' sizes (a
      reshape's merged dim (H*D) joins the class of its major part (H)).
    batch: holds dim 0 of a batch argument.
    splittable: False when one op or tensor holds it twice.
    example: a readable member, e.g. "params/Block_0/MLP/fc1/kernel[1]".
  """

  index: int
  size: int
  batch: bool
  splittable: bool
  example: str


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
  """

  ops: tuple[int, ...]
  canon: Mapping[int, int] = dataclasses.field(default_factory=dict)
  weight: Mapping[int, int] = dataclasses.field(default_factory=dict)
  op_canon: Mapping[int, int] = dataclasses.field(default_factory=dict)
  loops: frozenset[int] = frozenset()


def _scan_region(graph: Graph, op: Op):
  """The body region of a counted loop whose operands bind 1:1 to its body, else None."""
  for r in op.subregions:
    region = graph.regions[r]
    if (region.trip_count and len(region.inputs) == len(op.inputs)
        and len(region.outputs) == len(op.outputs)):
      return region
  return None


def _scan_bindings(graph: Graph, op: Op):
  """(outer value, body value, dim shift) pairs tying a scan to its body.

  Told apart by shape, which every jax release keeps (the params naming consts and
  carries changed in jax 0.11): an operand shaped like its body value is a const or
  carry (shift 0); one with the trip count in front is scanned (shift 1). Anything
  else is left unbound. Where the params still say which operands are carries, the
  body's carry out is also tied to its carry in.
  """
  region = _scan_region(graph, op)
  for outers, inners in ((op.inputs, region.inputs), (op.outputs, region.outputs)):
    for outer, inner in zip(outers, inners):
      if outer in graph.literals or inner in graph.literals:
        continue
      shape, body = graph.types[outer].shape, graph.types[inner].shape
      if shape == body:
        yield outer, inner, 0
      elif shape == (region.trip_count,) + body:
        yield outer, inner, 1
  consts, carry = op.raw_params.get("num_consts"), op.raw_params.get("num_carry")
  if consts is not None and carry is not None:
    for inner_in, inner_out in zip(region.inputs[consts:consts + carry],
                                   region.outputs[:carry]):
      if inner_out not in graph.literals:
        yield inner_in, inner_out, 0


def _with_scan_bodies(graph: Graph, view: View) -> View:
  """Adds the bodies of scans to the view, each op standing for trip-count executions."""
  ops, weight, loops = list(view.ops), dict(view.weight), set()
  for i in view.ops:
    region = _scan_region(graph, graph.ops[i])
    if region is None:
      continue
    loops.add(i)
    body = [op.index for op in graph.ops if op.region == region.index]
    ops += body
    for b in body:
      weight[b] = region.trip_count * view.weight.get(i, 1)
  return dataclasses.replace(view, ops=tuple(ops), weight=weight, loops=frozenset(loops))


def unfolded_view(graph: Graph) -> View:
  return View(ops=tuple(op.index for op in graph.region_ops(0)))


def folded_view(folded: Folded) -> View:
  """Glue, each unique layer's first and last instance, and its middle instance
  standing for all the interior copies.

  The first and last copies are kept as themselves because their neighbours differ
  (glue on one side): their edges cost differently. The interior copies all look the
  same, so one of them is searched for all, and the search's size stays flat in depth.
  """
  g = folded.graph
  canon, weight, op_canon = {}, {}, {}
  ops = {i for seg in folded.glue for i in seg.ops}
  for u in folded.unique_layers:
    members = [folded.instances[k] for k in u.instances]
    ops.update(i for inst in (members if len(members) <= 3 else (members[0], members[-1]))
               for i in inst.ops)
    if len(members) <= 3:
      continue
    interior = members[1:-1]
    rep = interior[len(interior) // 2]
    ops.update(rep.ops)
    for i in rep.ops:
      weight[i] = len(interior)
    for inst in interior:
      if inst.index == rep.index:
        continue
      for a, b in zip(inst.ops, rep.ops):
        op_a, op_b = g.ops[a], g.ops[b]
        op_canon[a] = b
        canon.update(zip(op_a.outputs, op_b.outputs))
        for va, vb in zip(op_a.inputs, op_b.inputs):
          if va in g.input_path and vb in g.input_path:
            canon[va] = vb  # this copy's parameter is laid out like the representative's
  return View(ops=tuple(sorted(ops)), canon=canon, weight=weight, op_canon=op_canon)


@dataclasses.dataclass(frozen=True)
class Problem:
  """The search problem over dimension classes.

  Attributes:
    graph: the traced program.
    mesh: mesh axes, sizes and links.
    profile: device profile.
    classes: every dimension class.
    domains: per class, the allowed tuples of mesh axes (major to minor).
    value_class: (value id, dim) -> class id, for every top-level value dim.
    rules: op index -> its sharding rule (top-level ops).
    state_pairs: (output value, input value, count) of state carried to the next step.
    batch_args: positional arguments whose leaves' dim 0 is the batch.
    view: the ops searched and what they stand for.
    factor_class: op index -> class of each factor of its rule (-1: on no value dim).
    reader_dims: (value, read by the update?) -> class per dim, for values the state
      update and the compute see apart (parameters, gradients); absent: `vclass`.
    update_ops: the ops of the state update (see `_update_ops`).
  """

  graph: Graph
  mesh: costlib.MeshSpec
  profile: costlib.DeviceProfile
  classes: tuple[DimClass, ...]
  domains: tuple[tuple[tuple[str, ...], ...], ...]
  value_class: Mapping[tuple[int, int], int]
  rules: Mapping[int, ruleslib.OpRule]
  state_pairs: tuple[tuple[int, int, int], ...]
  batch_args: tuple[int, ...]
  view: View
  factor_class: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
  reader_dims: Mapping[tuple[int, bool], tuple[int, ...]] = dataclasses.field(
      default_factory=dict)
  update_ops: frozenset[int] = frozenset()

  def cv(self, v: int) -> int:
    """The value standing for v in the view."""
    return self.view.canon.get(v, v)

  def vclass(self, v: int, d: int) -> int:
    return self.value_class[(self.cv(v), d)]

  def read_class(self, v: int, d: int, in_update: bool = False) -> int:
    """Class of dim d of value v as the compute (or the update) reads it."""
    dims = self.reader_dims.get((self.cv(v), in_update))
    return dims[d] if dims is not None else self.vclass(v, d)

  def stored_apart(self, v: int) -> bool:
    """Whether input v's storage classes are its own, not its compute's: the update
    reads it and the compute, if it reads it at all, reads it through a cut."""
    v = self.cv(v)
    if (v, False) in self.reader_dims:
      return True
    users = self.graph.consumers.get(v, ())
    return bool(users) and all(u in self.update_ops for u in users)

  def layout(self, value: int, choice: Mapping[int, tuple[str, ...]]) -> costlib.Layout:
    """Layout of a graph input under a class choice."""
    rank = len(self.graph.types[value].shape)
    return costlib.Layout(tuple(choice.get(self.vclass(value, d), ()) for d in range(rank)))


@dataclasses.dataclass(frozen=True)
class Solution:
  """A solved problem.

  Attributes:
    choice: class id -> mesh axes.
    step_s: predicted compute + communication seconds per step.
    comm_bytes: bytes sent per device per step, summed over collectives.
    state_bytes: per-device bytes of the program's inputs under the plan.
    tables_built: op cost tables computed (not reused).
    solve_s: seconds spent.
    memory_weight: final Lagrange weight on state bytes (0 without a budget).
    status: "optimal", or "time_limit" when the integer program stopped early.
  """

  choice: Mapping[int, tuple[str, ...]]
  step_s: float
  comm_bytes: float
  state_bytes: float
  tables_built: int
  solve_s: float
  memory_weight: float
  status: str = "optimal"


class InfeasibleBudgetError(ValueError):
  """No plan fits the memory budget."""


class _TooEntangled(RuntimeError):
  """Variable elimination would build too large a table; use the integer program."""


# -- building the problem ----------------------------------------------------------


class _UnionFind:
  def __init__(self):
    self.parent: list[int] = []

  def add(self) -> int:
    self.parent.append(len(self.parent))
    return len(self.parent) - 1

  def find(self, x: int) -> int:
    root = x
    while self.parent[root] != root:
      root = self.parent[root]
    while self.parent[x] != root:
      self.parent[x], x = root, self.parent[x]
    return root

  def union(self, a: int, b: int) -> None:
    ra, rb = self.find(a), self.find(b)
    if ra != rb:
      self.parent[max(ra, rb)] = min(ra, rb)


def _default_batch_axes(mesh: costlib.MeshSpec) -> tuple[str, ...]:
  return tuple(a for a in mesh.axis_names if a in DEFAULT_BATCH_AXIS_NAMES)


def _state_pairs(graph: Graph, canon: Mapping[int, int]) -> tuple[tuple[int, int, int], ...]:
  """(output, input, count) of state carried to the next step, in the view's values."""
  counts: dict[tuple[int, int], int] = {}
  for k, j in graph.carried:
    v, src = graph.outputs[k], graph.inputs[j].value
    key = (canon.get(v, v), canon.get(src, src))
    counts[key] = counts.get(key, 0) + 1
  return tuple((o, i, n) for (o, i), n in counts.items())


def _pointwise(graph: Graph, op: Op, rule: ruleslib.OpRule) -> bool:
  """Every tensor operand and result has one shape and the same factor on each dim."""
  if rule.reduce or not op.outputs or op.subregions:
    return False
  shape = graph.types[op.outputs[0]].shape
  if not shape or any(graph.types[v].shape != shape for v in op.outputs):
    return False
  dims = rule.outputs[0]
  if None in dims or any(d != dims for d in rule.outputs):
    return False
  for v, d in zip(op.inputs, rule.inputs):
    if v in graph.literals or not graph.types[v].shape:
      continue
    if graph.types[v].shape != shape or d != dims:
      return False
  return True


def _update_ops(graph: Graph, top: Sequence[Op], rules: Mapping[int, ruleslib.OpRule]
                ) -> frozenset[int]:
  """The state update: pointwise ops whose results feed only each other and state outputs.

  An optimizer's update (Adam's moments, weight decay, `params - lr * u`) is such a
  region in any train step, found without names. The search gives it dimension classes
  of its own, so parameters and optimizer state can be stored split over an axis their
  compute does not use (ZeRO): gradients arrive by reduce-scatter, parameters are
  gathered for use.
  """
  outputs = set(graph.outputs)
  state = {graph.outputs[k] for k, _ in graph.carried}
  region: set[int] = set()
  for op in reversed(top):  # consumers come after producers: decided first
    if not _pointwise(graph, op, rules[op.index]):
      continue
    if all((v in state or (v not in outputs and graph.consumers.get(v)))
           and all(c in region for c in graph.consumers.get(v, ())) for v in op.outputs):
      region.add(op.index)
  # The update starts at the state: an op reading neither an input nor the update (the
  # sum of a tied weight's two gradients) stays with the compute, where partial sums
  # add up before one reduction.
  inputs, kept = set(graph.input_path), set()
  for op in top:
    if op.index in region and any(v in inputs or graph.producer.get(v) in kept
                                  for v in op.inputs):
      kept.add(op.index)
  return frozenset(kept)


def build_problem(graph: Graph, mesh: costlib.MeshSpec, profile: costlib.DeviceProfile,
                  batch_axes: Sequence[str] | None,
                  batch_args: Sequence[int] | None = None, view: View | None = None) -> Problem:
  """Dimension classes, their domains and the op rules of a traced program.

  Args:
    view: the ops to search (`folded_view` or `unfolded_view`); default unfolded.
  """
  view = _with_scan_bodies(graph, view or unfolded_view(graph))
  canon = view.canon
  cv = lambda v: canon.get(v, v)  # noqa: E731
  top = [graph.ops[i] for i in view.ops if i not in view.loops]
  by_signature: dict[str, ruleslib.OpRule] = {}  # a rule depends on the signature alone
  rules = {}
  for op in top:
    if op.signature not in by_signature:
      by_signature[op.signature] = ruleslib.rule_for(graph, op)
    rules[op.index] = by_signature[op.signature]
  update = _update_ops(graph, top, rules)
  readers: dict[int, set[bool]] = {}  # value -> read by update ops (True), others (False)
  for op in top:
    for v in op.inputs:
      if v not in graph.literals:
        readers.setdefault(cv(v), set()).add(op.index in update)
  # Values the update region and the compute see in layouts of their own: parameters
  # (stored as the update has them, used as the compute wants) and gradients (made as
  # the compute has them, delivered as the update wants).
  producer = {cv(v): op.index for op in top for v in op.outputs}
  cut_use = {v for v, r in readers.items() if r == {True, False} and v not in producer}
  cut_update = {v for v, r in readers.items() if True in r and v in producer
                and producer[v] not in update}
  uf = _UnionFind()
  node: dict[tuple[int, int], int] = {}
  side: dict[tuple[int, int, bool], int] = {}

  def vnode(v: int, d: int) -> int:
    key = (v, d)
    if key not in node:
      node[key] = uf.add()
    return node[key]

  def read_node(v: int, d: int, in_update: bool) -> int:
    if (v in cut_use and not in_update) or (v in cut_update and in_update):
      key = (v, d, in_update)
      if key not in side:
        side[key] = uf.add()
      return side[key]
    return vnode(v, d)

  pinned = set()  # value dims that must stay unsplit: a scan's stacked dim
  for loop in view.loops:
    for outer, inner, shift in _scan_bindings(graph, graph.ops[loop]):
      for d in range(len(graph.types[inner].shape)):
        uf.union(vnode(cv(outer), d + shift), vnode(inner, d))
      if shift:
        pinned.add(vnode(cv(outer), 0))

  op_factor_nodes = {}
  for op in top:
    rule = rules[op.index]
    fnodes = [uf.add() for _ in rule.factor_sizes]
    op_factor_nodes[op.index] = fnodes
    for k, (v, fs) in enumerate(zip(op.inputs, rule.inputs)):
      if v in graph.literals:
        continue
      for d, f in enumerate(fs):
        n = read_node(cv(v), d, op.index in update)
        if f is not None:
          uf.union(fnodes[f], n)
    for v, fs in zip(op.outputs, rule.outputs):
      for d, f in enumerate(fs):
        n = vnode(cv(v), d)
        if f is not None:
          uf.union(fnodes[f], n)
  for i in graph.inputs:
    for d in range(len(graph.types[i.value].shape)):
      vnode(cv(i.value), d)

  all_nodes = list(node.items()) + [((v, d), n) for (v, d, _), n in side.items()]
  roots = sorted({uf.find(n) for _, n in all_nodes})
  index = {r: k for k, r in enumerate(roots)}
  value_class = {key: index[uf.find(n)] for key, n in node.items()}
  side_class = {key: index[uf.find(n)] for key, n in side.items()}
  factor_class = {i: tuple(index.get(uf.find(n), -1) for n in fnodes)
                  for i, fnodes in op_factor_nodes.items()}
  sizes: dict[int, set[int]] = {}
  example: dict[int, str] = {}
  for (v, d), n in all_nodes:
    sizes.setdefault(index[uf.find(n)], set()).add(graph.types[v].shape[d])
  for (v, d, _), c in side_class.items():  # where a parameter is used
    if v in graph.input_path and c not in example:
      example[c] = f"{graph.input_path[v]}[{d}]"
  for i in graph.inputs:  # where it is stored
    for d in range(len(graph.types[i.value].shape)):
      c = value_class[(cv(i.value), d)]
      if c not in example:
        example[c] = f"{i.path}[{d}]" + (" stored" if cv(i.value) in cut_use else "")
  for op in top:  # classes no input holds: named by an op that makes them
    for v in op.outputs:
      for d in range(len(graph.types[v].shape)):
        c = value_class.get((cv(v), d))
        if c is not None and c not in example:
          example[c] = f"{op.name_stack or '(top)'}/{op.primitive}[{d}]"
  conflicted = {index[uf.find(n)] for n in pinned}
  for i, cs in factor_class.items():
    conflicted.update(c for c in cs if c >= 0 and cs.count(c) > 1)
  for dims in _value_dims(graph, value_class, side_class):
    conflicted.update(c for c in dims if dims.count(c) > 1)

  if batch_args is None:
    batch_args = (graph.num_args - 1,) if graph.num_args > 1 else ()
  batch_classes = {value_class[(cv(i.value), 0)] for i in graph.inputs
                   if i.arg in batch_args and graph.types[i.value].shape}
  allowed_batch = tuple(mesh.axis_names) if batch_axes is None else tuple(batch_axes)
  for a in allowed_batch:
    if a not in mesh.axis_names:
      raise ValueError(f"batch_axes names {a!r}, which is not a mesh axis "
                       f"{mesh.axis_names}; pass axes of the mesh or None")

  classes, domains = [], []
  for c in range(len(roots)):
    # Members may differ in size where a reshape splits a merged dim by its major
    # part ((B, S, H*D) -> (B, S, H, D)): a split must divide every member.
    size = math.gcd(*sizes[c])
    splittable = size > 1 and c not in conflicted
    batch = c in batch_classes
    classes.append(DimClass(index=c, size=size, batch=batch, splittable=splittable,
                            example=example.get(c, "")))
    domains.append(_domain(size if splittable else 1, mesh,
                           allowed_batch if batch else None, batch))
  reads = {}
  for (v, d, in_update), c in side_class.items():
    reads.setdefault((v, in_update), {})[d] = c
  reader_dims = {key: tuple(dims[d] for d in range(len(dims))) for key, dims in reads.items()}
  return Problem(graph=graph, mesh=mesh, profile=profile, classes=tuple(classes),
                 domains=tuple(domains), value_class=value_class, rules=rules,
                 state_pairs=_state_pairs(graph, canon), batch_args=tuple(batch_args),
                 view=view, factor_class=factor_class, reader_dims=reader_dims,
                 update_ops=update)


def _value_dims(graph: Graph, value_class, side_class):
  """Per value (and per cut side), the class of each dim."""
  by_value: dict[tuple, dict[int, int]] = {}
  for (v, d), c in value_class.items():
    by_value.setdefault((v,), {})[d] = c
  for (v, d, s), c in side_class.items():
    by_value.setdefault((v, s), {})[d] = c
  return [list(dims.values()) for dims in by_value.values()]


def _domain(size: int, mesh: costlib.MeshSpec, allowed: Sequence[str] | None,
            batch: bool) -> tuple[tuple[str, ...], ...]:
  axes = [a for a in mesh.axis_names if mesh.size(a) > 1]
  out = [()]
  if size <= 1:
    return tuple(out)
  for r in range(1, len(axes) + 1):
    for subset in itertools.combinations(axes, r):
      if batch and allowed is not None and not set(subset) <= set(allowed):
        continue
      if size % math.prod(mesh.size(a) for a in subset) == 0:
        out.append(subset)
  return tuple(out)


# -- op cost tables ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Table:
  scope: tuple[int, ...]       # class ids
  time: np.ndarray             # seconds, indexed by the scope classes' domain indices
  comm: np.ndarray             # bytes


class _TableBuilder:
  """Builds per-op cost tables; with `reuse`, structurally equal ops share one build."""

  def __init__(self, problem: Problem, reuse: bool,
               input_layouts: Mapping[int, costlib.Layout] | None = None):
    self.p = problem
    self.reuse = reuse
    self.fixed = dict(input_layouts or {})
    self.cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    self._partial: dict[int, tuple[int, ...]] = {}
    self.built = 0
    g = problem.graph
    self.ops = [g.ops[i] for i in problem.view.ops if i not in problem.view.loops]
    self.producer = {v: op.index for op in self.ops for v in op.outputs}
    self.users: dict[int, list[int]] = {}
    for op in self.ops:
      for v in op.inputs:
        self.users.setdefault(problem.cv(v), []).append(op.index)

  def _src(self, v: int):
    """(per-dim class or None, partial classes) of a value as it arrives."""
    p, g = self.p, self.p.graph
    v = p.cv(v)
    if v in self.producer:
      op = g.ops[self.producer[v]]
      rule = p.rules[op.index]
      slot = op.outputs.index(v)
      dims = tuple(None if f is None else p.value_class[(v, d)]
                   for d, f in enumerate(rule.outputs[slot]))
      return dims, self.partial_expr(v)
    rank = len(g.types[v].shape)
    return tuple(p.value_class.get((v, d)) for d in range(rank)), None

  def partial_expr(self, v: int):
    """("r", classes): value v holds partial sums over those classes' mesh axes (its
    producer reduced over them); None: never partial."""
    v = self.p.cv(v)
    if v in self._partial:
      return self._partial[v]
    expr = None
    if v in self.producer:
      op = self.p.graph.ops[self.producer[v]]
      rule = self.p.rules[op.index]
      classes = tuple(sorted({c for f in rule.reduce if (c := self._factor_class(op, f)) >= 0
                              and self.p.classes[c].splittable}))
      expr = ("r", classes) if classes else None
    self._partial[v] = expr
    return expr

  def _factor_class(self, op: Op, f: int) -> int:
    return self.p.factor_class[op.index][f]

  def factor_classes(self, op: Op) -> list[int]:
    """Class of each factor of op (-1: no value dim carries it; never split)."""
    return list(self.p.factor_class[op.index])

  def op_tables(self, op: Op) -> list[_Table | None]:
    """The op's cost as tables. An op with no factors (replicated: an unknown
    primitive, a loop kept whole) couples nothing, so each input edge gets a table of
    its own: one joint table over every operand's classes would grow without bound.
    """
    if self.p.rules[op.index].factor_sizes:
      return [self.op_table(op)]
    return [self.op_table(op, only=k) for k in range(len(op.inputs))]

  def op_table(self, op: Op, only: int | None = None) -> _Table | None:
    p, g = self.p, self.p.graph
    rule = p.rules[op.index]
    fclass = self.factor_classes(op)
    edges = []
    for k, v in enumerate(op.inputs):
      if v in g.literals or not g.types[v].shape or only not in (None, k):
        continue
      # Partial sums arrive reduced: by `resolve_table`, or by `cut_table` in the
      # reader's layout.
      src_dims = p.reader_dims.get((p.cv(v), op.index in p.update_ops))
      if src_dims is None:
        src_dims = self.fixed.get(v, self._src(v)[0])
      dst_dims = tuple(None if f is None else fclass[f] for f in rule.inputs[k])
      edges.append((g.types[v], src_dims, None, dst_dims))
    flops = rule.flops if only in (None, 0) else 0.0
    return self._table(("op", op.signature, only), fclass, flops, g.types[op.outputs[0]]
                       if op.outputs else None, edges)

  def resolve_table(self, v: int) -> _Table | None:
    """The one reduction of a partial value, in its producer's layout.

    Charged once per value, however many users read it, as XLA reduces it once. A
    value only the state update reads is reduced by its `cut_table` instead.
    """
    g = self.p.graph
    expr = self.partial_expr(v)
    if expr is None:
      return None
    users = [c for c in self.users.get(v, ()) if c not in self.p.update_ops]
    if not users and v not in set(g.outputs):
      return None
    dims, _ = self._src(v)
    return self._table(("resolve",), [], 0.0, None, [(g.types[v], dims, expr, dims)])

  def carry_table(self, out: int, inp: int) -> _Table | None:
    src_dims, _ = self._src(out)
    partial = None  # outputs are reduced by `resolve_table`
    rank = len(self.p.graph.types[inp].shape)
    dst = self.fixed.get(inp) or tuple(self.p.vclass(inp, d) for d in range(rank))
    return self._table(("carry",), [], 0.0, None,
                       [(self.p.graph.types[inp], src_dims, partial, dst)])

  def cut_table(self, v: int, in_update: bool) -> _Table | None:
    """Bringing a value seen apart by the update and the compute into the reader's
    layout, once per step: a parameter gathered for use (ZeRO-3's all-gather), a
    gradient reduced into the update's layout (an all-reduce, or a reduce-scatter
    when the update is split further)."""
    src_dims, _ = self._src(v)
    src_dims = self.fixed.get(v, src_dims)
    partial = self.partial_expr(v) if in_update else None
    dst = self.p.reader_dims[(v, in_update)]
    return self._table(("cut",), [], 0.0, None,
                       [(self.p.graph.types[v], src_dims, partial, dst)])

  def _table(self, kind, fclass, flops, out_type, edges) -> _Table | None:
    scope: list[int] = []

    def pos(c):
      if c is None or c < 0 or not self.p.classes[c].splittable:
        return None
      if c not in scope:
        scope.append(c)
      return scope.index(c)

    def place(dims):  # class ids -> scope positions; a fixed Layout stays as it is
      return dims if isinstance(dims, costlib.Layout) else tuple(pos(c) for c in dims)

    fpos = [pos(c) for c in fclass]
    def expr_pos(e):
      return None if e is None else ("r", tuple(pos(c) for c in e[1]))

    epos = [(t, place(src), expr_pos(partial), place(dst)) for t, src, partial, dst in edges]
    if not scope and not flops:
      return None
    domains = tuple(self.p.domains[c] for c in scope)
    key = (kind, tuple(fpos), tuple(epos), domains, flops, out_type)
    cached = self.cache.get(key) if self.reuse else None
    if cached is None:
      cached = self._compute(fpos, flops, out_type, epos, domains)
      self.built += 1
      if self.reuse:
        self.cache[key] = cached
    return _Table(tuple(scope), *cached)

  def _compute(self, fpos, flops, out_type, epos, domains):
    p = self.p
    shape = tuple(len(d) for d in domains)
    t = np.zeros(shape)
    b = np.zeros(shape)
    dtype = out_type.dtype if out_type is not None else "float32"
    split = sorted({q for q in fpos if q is not None})
    for idx in itertools.product(*(range(n) for n in shape)):
      axes = tuple(domains[k][i] for k, i in enumerate(idx))
      used = [a for k in split for a in axes[k]]
      if len(used) != len(set(used)):
        t[idx] = np.inf  # one op split twice over one mesh axis
        continue
      shards = math.prod(p.mesh.size(a) for a in used)
      total = costlib.compute_time(flops / shards, p.profile, dtype) if flops else 0.0
      sent = 0.0
      for ttype, src, partial, dst in epos:
        src_d = src.dims if isinstance(src, costlib.Layout) else _dims(src, axes)
        dst_d = dst.dims if isinstance(dst, costlib.Layout) else _dims(dst, axes)
        edge = _edge_cost(ttype.shape, ttype.itemsize, src_d, _eval_partial(partial, axes),
                          dst_d, p.mesh, p.profile)
        if edge is None:
          total = np.inf
          break
        total += edge[0]
        sent += edge[1]
      t[idx], b[idx] = total, sent
    return t, b


@functools.lru_cache(maxsize=1 << 18)
def _edge_cost(shape, itemsize, src_dims, part, dst_dims, mesh, profile):
  """(seconds, bytes sent) to bring a value from src to dst; None if impossible.

  `part`: axes the value is partial over as it arrives; they are reduced on the way.
  """
  src_axes = {a for d in src_dims for a in d}
  part = tuple(a for a in part if a not in src_axes)
  try:
    src_l = costlib.Layout(src_dims, partial=part)
    dst_l = costlib.Layout(dst_dims)
    steps = costlib.reshard(shape, itemsize, src_l, dst_l, mesh, profile)
  except ValueError:
    return None
  return sum(c.time_s for c in steps), sum(c.bytes_sent_per_device for c in steps)


def _eval_partial(expr, axes: Sequence[tuple[str, ...]]) -> tuple[str, ...]:
  """The mesh axes a partial expression (scope positions) holds under a choice."""
  if expr is None:
    return ()
  return tuple(sorted({a for q in expr[1] if q is not None for a in axes[q]}))


def _dims(positions: Sequence[int | None],
          axes: Sequence[tuple[str, ...]]) -> tuple[tuple[str, ...], ...]:
  """Per-dim mesh axes of a value whose dims sit at these scope positions; an axis
  splits only the first dim that asks for it."""
  dims, seen = [], set()
  for q in positions:
    entry = tuple(a for a in axes[q] if a not in seen) if q is not None else ()
    seen.update(entry)
    dims.append(entry)
  return tuple(dims)


# -- solving -----------------------------------------------------------------------


def _memory_tables(problem: Problem,
                   fixed: Mapping[int, costlib.Layout] | None = None) -> list[_Table]:
  """Per-device bytes of every program input, as tables over its dims' classes.

  Inputs over the same classes share one table (bytes add up), so a folded program's
  many copies of one parameter cost one table.
  """
  fixed = fixed or {}
  total: dict[tuple[int, ...], float] = {}
  fixed_bytes = 0.0
  for i in problem.graph.inputs:
    t = problem.graph.types[i.value]
    if i.value in fixed:
      fixed_bytes += t.nbytes / costlib.num_shards(fixed[i.value], problem.mesh)
      continue
    dims = tuple(problem.vclass(i.value, d) for d in range(len(t.shape)))
    key = _scope(problem, dims)
    total[key] = total.get(key, 0.0) + t.nbytes
  out = [_Table((), np.array(fixed_bytes), np.array(0.0))] if fixed_bytes else []
  return out + _bytes_tables(problem, total)


def _scope(problem: Problem, dims: Iterable[int | None]) -> tuple[int, ...]:
  scope: list[int] = []
  for c in dims:
    if c is not None and problem.classes[c].splittable and c not in scope:
      scope.append(c)
  return tuple(scope)


def _bytes_tables(problem: Problem, total: Mapping[tuple[int, ...], float]) -> list[_Table]:
  """Per-device bytes as tables: for each scope, its bytes over the mesh axes chosen."""
  out = []
  for scope, nbytes in total.items():
    domains = [problem.domains[c] for c in scope]
    table = np.empty(tuple(len(d) for d in domains))
    for idx in itertools.product(*(range(len(d)) for d in domains)):
      axes = {a for k, j in enumerate(idx) for a in domains[k][j]}
      table[idx] = nbytes / math.prod(problem.mesh.size(a) for a in axes)
    out.append(_Table(scope, table, np.zeros_like(table)))
  return out


@dataclasses.dataclass(frozen=True)
class _Activations:
  """Every top-level intermediate value: live range and the class of each dim."""

  start: np.ndarray      # program position of the op writing it
  stop: np.ndarray       # position of its last reader
  nbytes: np.ndarray
  dims: tuple[tuple[int | None, ...], ...]
  length: int            # number of top-level ops
  values: tuple[int, ...] = ()


def _activations(problem: Problem) -> _Activations:
  g = problem.graph
  top = g.region_ops(0)
  pos = {op.index: j for j, op in enumerate(top)}
  start, stop, nbytes, dims, values = [], [], [], [], []
  for j, op in enumerate(top):
    rule = problem.rules.get(problem.view.op_canon.get(op.index, op.index))
    if rule is None:
      continue
    for slot, v in enumerate(op.outputs):
      t = g.types[v]
      if not t.shape or (problem.cv(v), 0) not in problem.value_class:
        continue
      start.append(j)
      stop.append(max((pos[c] for c in g.consumers.get(v, ()) if c in pos), default=j))
      nbytes.append(t.nbytes)
      values.append(v)
      dims.append(tuple(None if f is None else problem.vclass(v, d)
                        for d, f in enumerate(rule.outputs[slot])))
  return _Activations(np.array(start, int), np.array(stop, int), np.array(nbytes, float),
                      tuple(dims), len(top), tuple(values))


def _shards(problem: Problem, acts: _Activations,
            choice: Mapping[int, tuple[str, ...]]) -> np.ndarray:
  return np.array([math.prod(problem.mesh.size(a) for a in
                             {a for c in dims if c is not None for a in choice.get(c, ())})
                   for dims in acts.dims], float)


def _activation_peak(problem: Problem, acts: _Activations,
                     choice: Mapping[int, tuple[str, ...]]) -> tuple[float, int]:
  """(peak per-device bytes of live intermediates, program position of the peak)."""
  if not len(acts.nbytes):
    return 0.0, 0
  shards = _shards(problem, acts, choice)
  delta = np.zeros(acts.length + 1)
  np.add.at(delta, acts.start, acts.nbytes / shards)
  np.add.at(delta, np.minimum(acts.stop + 1, acts.length), -acts.nbytes / shards)
  live = np.cumsum(delta)
  k = int(np.argmax(live))
  return float(live[k]), k


def _activation_tables(problem: Problem, acts: _Activations, at: int) -> list[_Table]:
  """Per-device bytes of the values live at program position `at`, as tables."""
  total: dict[tuple[int, ...], float] = {}
  for k in np.flatnonzero((acts.start <= at) & (acts.stop >= at)):
    key = _scope(problem, acts.dims[k])
    total[key] = total.get(key, 0.0) + float(acts.nbytes[k])
  return _bytes_tables(problem, total)


def _eliminate(factors: list[tuple[tuple[int, ...], np.ndarray]],
               domain_size: Mapping[int, int]) -> dict[int, int]:
  """Exact min-sum variable elimination; returns class -> domain index."""
  factors = list(_merge(factors).items())
  variables = set(domain_size)
  for scope, _ in factors:
    variables.update(scope)
  trail = []
  while variables:
    neighbours: dict[int, set[int]] = {v: set() for v in variables}
    for scope, _ in factors:
      for v in scope:
        neighbours[v].update(scope)
    var = min(variables, key=lambda v: (math.prod(domain_size[u] for u in neighbours[v]), v))
    mine = [f for f in factors if var in f[0]]
    factors = [f for f in factors if var not in f[0]]
    scope = tuple(sorted(set().union(*[set(s) for s, _ in mine]) | {var}))
    if math.prod(domain_size[c] for c in scope) > _MAX_TABLE:
      raise _TooEntangled(f"elimination table over {len(scope)} classes")
    total = np.zeros(tuple(domain_size[c] for c in scope))
    for s, table in mine:
      shape = [domain_size[c] if c in s else 1 for c in scope]
      total = total + table.reshape(shape)
    axis = scope.index(var)
    rest = tuple(c for c in scope if c != var)
    trail.append((var, rest, np.argmin(total, axis=axis)))
    factors.append((rest, np.min(total, axis=axis)))
    variables.discard(var)
  assignment: dict[int, int] = {}
  for var, rest, arg in reversed(trail):
    assignment[var] = int(arg[tuple(assignment[c] for c in rest)]) if rest else int(arg)
  return assignment


def _all_tables(problem: Problem, builder: _TableBuilder) -> list[_Table]:
  """Cost tables of every op, every partial value's reduction and every state carry."""
  weighted = []
  for op in builder.ops:
    w = problem.view.weight.get(op.index, 1)
    weighted += [(t, w) for t in builder.op_tables(op)]
    weighted += [(builder.resolve_table(v), w) for v in op.outputs]
  weighted += [(builder.carry_table(out, inp), n) for out, inp, n in problem.state_pairs]
  for v, in_update in problem.reader_dims:
    readers = [i for i in builder.users.get(v, ()) if (i in problem.update_ops) == in_update]
    w = max((problem.view.weight.get(i, 1) for i in readers), default=1)
    weighted.append((builder.cut_table(v, in_update), w))
  return [t if w == 1 else _Table(t.scope, t.time * w, t.comm * w)
          for t, w in weighted if t is not None]


def _evaluate(tables: Iterable[_Table], choice_idx: Mapping[int, int]) -> tuple[float, float]:
  t = b = 0.0
  for table in tables:
    idx = tuple(choice_idx.get(c, 0) for c in table.scope)
    t += float(table.time[idx])
    b += float(table.comm[idx])
  return t, b


def solve(problem: Problem, fold: bool = True, memory_budget: float | None = None,
          time_limit: float | None = None) -> Solution:
  """Minimises predicted step time over class-to-axes choices, exactly.

  Args:
    problem: from `build_problem`.
    fold: True: build each cost table once per unique layer (reused for every
      structurally identical op) and minimise by variable elimination. False: the
      unfolded reference: every op's table built on its own, and the whole program
      solved as one integer program (HiGHS via scipy), Alpa-style.
    memory_budget: per-device bytes for the program's inputs (params, optimizer
      state, batch) plus the intermediates live at the activation peak; None means
      unconstrained.
    time_limit: seconds for the integer program (fold=False); `Solution.status`
      says "time_limit" when it stopped early.

  Raises:
    InfeasibleBudgetError: no choice meets the budget.
  """
  start = time.perf_counter()
  builder = _TableBuilder(problem, reuse=fold)
  tables = _all_tables(problem, builder)
  memory = _memory_tables(problem)
  acts = _activations(problem) if memory_budget is not None else None
  domain_size = {c: len(problem.domains[c]) for c in range(len(problem.classes))
                 if len(problem.domains[c]) > 1}

  def factors_of(mem, weight: float):
    out = [(t.scope, t.time) for t in tables if t.scope]
    out += [(t.scope, weight * t.time) for t in mem if t.scope and weight]
    out = [(tuple(c for c in s if c in domain_size), _restrict(s, tab, domain_size))
           for s, tab in out]
    return [f for f in out if f[0]]

  weight, status = 0.0, "optimal"
  if fold:
    for level in ("full", "single-axis", "batch-only"):
      keep = _reduced_domains(problem, level)
      sizes = {c: len(k) for c, k in keep.items() if len(k) > 1}

      def run(mem, w, keep=keep, sizes=sizes):
        picked = _eliminate(_take(factors_of(mem, w), keep, sizes), sizes)
        return {c: keep[c][i] for c, i in picked.items()}

      def solve_within(mem, run=run):
        return _fit_budget(lambda w: run(mem, w), mem, memory_budget)

      try:
        assignment, weight = run([], 0.0), 0.0
        if acts is not None:
          assignment, weight = _within_budget(problem, acts, assignment, memory,
                                              memory_budget, solve_within)
          assignment = _repair(problem, acts, assignment, tables, memory, memory_budget,
                               domain_size)
        break
      except _TooEntangled:
        # Too entangled for exact elimination over every axis subset (e.g. ResNet's
        # many channel classes on a 3-D mesh): stay exact over a smaller space and
        # say so in the status.
        continue
    else:
      raise RuntimeError("search: the dimension classes are too entangled to solve")
    if level != "full":
      status = f"exact over reduced domains ({level})"
  else:
    def ilp(mem, budget):
      rows = [(tuple(c for c in t.scope if c in domain_size),
               _restrict(t.scope, t.time, domain_size)) for t in mem]
      return _solve_ilp(factors_of([], 0.0), domain_size, rows, budget, time_limit)

    first, status = ilp(memory, None)
    statuses = [status]

    def solve_within(mem):
      assignment, st = ilp(mem, memory_budget)
      statuses.append(st)
      return assignment, 0.0

    assignment = first
    if acts is not None:
      assignment, _ = _within_budget(problem, acts, first, memory, memory_budget,
                                     solve_within)
    status = statuses[-1]
  state = _evaluate(memory, assignment)[0]
  step_s, comm = _evaluate(tables, assignment)
  if not np.isfinite(step_s):
    raise RuntimeError("search: no finite-cost plan (every choice splits an op twice)")
  choice = {c: problem.domains[c][i] for c, i in assignment.items() if problem.domains[c][i]}
  return Solution(choice=choice, step_s=step_s, comm_bytes=comm, state_bytes=state,
                  tables_built=builder.built, solve_s=time.perf_counter() - start,
                  memory_weight=weight, status=status)


# The activation peak moves with the plan: the budget is re-posed at the new peak this
# many times before the search gives up.
_BUDGET_ROUNDS = 6


def _within_budget(problem: Problem, acts: _Activations, assignment, memory, budget,
                   solve_within):
  """A plan whose inputs plus live intermediates at their peak fit the budget.

  The peak's live set depends on the plan, so the constraint is posed on the values
  live at the current plan's peak, solved (`solve_within(tables)`), and re-posed at
  the new plan's peak until the plan fits.

  Returns:
    (assignment, Lagrange weight).
  """
  best, leanest = math.inf, {}
  weight = 0.0
  for _ in range(_BUDGET_ROUNDS):
    used, at, choice = _memory_used(problem, acts, memory, assignment)
    if used < best:
      best, leanest = used, choice
    if used <= budget:
      return assignment, weight
    try:
      assignment, weight = solve_within(memory + _activation_tables(problem, acts, at))
    except InfeasibleBudgetError as e:
      if len(e.args) > 1:  # the leanest plan the bisection reached
        used, _, choice = _memory_used(problem, acts, memory, e.args[1])
        if used < best:
          best, leanest = used, choice
      break
  raise InfeasibleBudgetError(best, _largest_live(problem, acts, leanest))


def _memory_used(problem: Problem, acts: _Activations, memory, assignment):
  """(inputs + live intermediates at the peak, peak position, class -> axes) of a plan."""
  choice = {c: problem.domains[c][i] for c, i in assignment.items()}
  peak, at = _activation_peak(problem, acts, choice)
  return _evaluate(memory, assignment)[0] + peak, at, choice


def _repair(problem: Problem, acts: _Activations, assignment, tables, memory, budget,
            sizes, rounds: int = 4) -> dict[int, int]:
  """Greedy single-class moves that make a budgeted plan faster and keep it in budget.

  A Lagrange weight can leave a duality gap (a plan the weight does not reach may be
  faster and still fit); this closes some of it cheaply.
  """
  touching: dict[int, list[_Table]] = {}
  for t in tables:
    for c in t.scope:
      touching.setdefault(c, []).append(t)

  def local(c, k):
    total = 0.0
    for t in touching.get(c, ()):
      idx = tuple(k if u == c else assignment.get(u, 0) for u in t.scope)
      total += float(t.time[idx])
    return total

  assignment = dict(assignment)
  for _ in range(rounds):
    moved = False
    for c, n in sizes.items():
      costs = [local(c, k) for k in range(n)]
      now = costs[assignment.get(c, 0)]
      for k in sorted(range(n), key=costs.__getitem__):
        if costs[k] >= now - 1e-12 * max(1.0, abs(now)):
          break
        trial = {**assignment, c: k}
        if _memory_used(problem, acts, memory, trial)[0] <= budget:
          assignment, moved = trial, True
          break
    if not moved:
      break
  return assignment


def _largest_live(problem: Problem, acts: _Activations, choice, top: int = 3) -> str:
  """The biggest intermediates live at the activation peak under a choice, as text."""
  if not len(acts.nbytes):
    return ""
  _, at = _activation_peak(problem, acts, choice)
  per_device = acts.nbytes / _shards(problem, acts, choice)
  live = np.flatnonzero((acts.start <= at) & (acts.stop >= at))
  g = problem.graph
  rows = []
  for k in live[np.argsort(-per_device[live])][:top]:
    op = g.ops[g.producer[acts.values[k]]]
    rows.append(f"{op.name_stack or '(top)'}/{op.primitive} {g.types[acts.values[k]]} "
                f"({per_device[k] / 2**20:.1f} MiB)")
  return ", ".join(rows)


def _reduced_domains(problem: Problem, level: str) -> dict[int, list[int]]:
  """Domain indices kept per class: all, single axes only, or nothing but the batch."""
  keep = {}
  for c, dom in enumerate(problem.domains):
    if len(dom) <= 1:
      continue
    if level == "full" or (level == "batch-only" and problem.classes[c].batch):
      keep[c] = list(range(len(dom)))
    elif level == "single-axis" or problem.classes[c].batch:
      keep[c] = [k for k, axes in enumerate(dom) if len(axes) <= 1 or problem.classes[c].batch]
    else:
      keep[c] = [0]
  return keep


def _take(factors, keep, sizes):
  """Factors restricted to the kept domain indices; classes left with one option drop."""
  out = []
  for scope, table in factors:
    for axis, c in enumerate(scope):
      table = np.take(table, keep[c], axis=axis)
    index = tuple(slice(None) if c in sizes else 0 for c in scope)
    reduced = tuple(c for c in scope if c in sizes)
    if reduced:
      out.append((reduced, table[index]))
  return out


def _merge(factors):
  merged: dict[tuple[int, ...], np.ndarray] = {}
  for scope, table in factors:
    order = tuple(sorted(scope))
    if order != scope:
      table = np.transpose(table, [scope.index(c) for c in order])
    merged[order] = merged[order] + table if order in merged else np.array(table, float)
  return merged


def _solve_ilp(factors, domain_size, memory, budget, time_limit):
  """The same objective as one integer program (local-polytope form), solved by HiGHS.

  Binary x[c, k]: class c takes its k-th domain entry, one per class. A factor over
  several classes gets continuous y[f, idx] >= 0 whose marginals equal the x of each
  class; with x integral, y is the indicator of the joint choice. Forbidden entries
  (an op split twice over one axis) get y = 0.
  """
  from scipy import optimize, sparse  # noqa: PLC0415 - only the reference needs it

  classes = sorted(domain_size)
  xoff, n = {}, 0
  for c in classes:
    xoff[c], n = n, n + domain_size[c]
  cost = np.zeros(n)
  rows, cols, vals, lo, hi = [], [], [], [], []
  upper = [1.0] * n

  def add_row(entries, lb, ub):
    r = len(lo)
    for col, val in entries:
      rows.append(r)
      cols.append(col)
      vals.append(val)
    lo.append(lb)
    hi.append(ub)

  for c in classes:
    add_row([(xoff[c] + k, 1.0) for k in range(domain_size[c])], 1.0, 1.0)
  yoff = {}
  merged = _merge(factors)
  memory_merged = _merge([(sc, t) for sc, t in memory if sc]) if budget is not None else {}
  for scope, table in memory_merged.items():
    if len(scope) > 1 and scope not in merged:
      merged[scope] = np.zeros_like(table)  # y variables to express the memory row
  for scope, table in merged.items():
    if len(scope) == 1:
      flat = np.where(np.isfinite(table), table, 0.0)
      cost[xoff[scope[0]]:xoff[scope[0]] + domain_size[scope[0]]] += flat
      for k in np.flatnonzero(~np.isfinite(table)):
        upper[xoff[scope[0]] + k] = 0.0
      continue
    yoff[scope] = n
    flat = table.reshape(-1)
    cost = np.concatenate([cost, np.where(np.isfinite(flat), flat, 0.0)])
    upper += [1.0 if np.isfinite(v) else 0.0 for v in flat]
    idx = np.array(list(np.ndindex(table.shape)))
    for j, c in enumerate(scope):
      for k in range(domain_size[c]):
        hits = np.flatnonzero(idx[:, j] == k)
        add_row([(n + int(h), 1.0) for h in hits] + [(xoff[c] + k, -1.0)], 0.0, 0.0)
    n += flat.size
  if budget is not None:
    entries = {}
    for scope, table in memory_merged.items():
      if len(scope) == 1:
        for k in range(domain_size[scope[0]]):
          key = xoff[scope[0]] + k
          entries[key] = entries.get(key, 0.0) + float(table[k])
      else:
        for h, v in enumerate(table.reshape(-1)):
          entries[yoff[scope] + h] = entries.get(yoff[scope] + h, 0.0) + float(v)
    fixed = sum(float(t) for s, t in memory if not s)
    add_row(list(entries.items()), -np.inf, budget - fixed)
  integrality = np.zeros(n)
  integrality[:sum(domain_size.values())] = 1
  matrix = sparse.csr_array((vals, (rows, cols)), shape=(len(lo), n))
  options = {"time_limit": time_limit} if time_limit else {}
  res = optimize.milp(cost, integrality=integrality,
                      bounds=optimize.Bounds(np.zeros(n), np.array(upper)),
                      constraints=optimize.LinearConstraint(matrix, lo, hi), options=options)
  if res.x is None:
    if res.status == 2:
      raise InfeasibleBudgetError(math.inf)
    if res.status == 1:
      raise RuntimeError(
          f"search: the unfolded integer program (fold=False) hit time_limit={time_limit} s "
          "before it found any plan. Give it more time, or use fold=True: the same "
          "objective, found by the folded search far faster.")
    raise RuntimeError(f"search: the integer program found no solution ({res.message})")
  status = "optimal" if res.status == 0 else "time_limit" if res.status == 1 else res.message
  assignment = {c: int(np.argmax(res.x[xoff[c]:xoff[c] + domain_size[c]])) for c in classes}
  return assignment, status


def evaluate(problem: Problem, choice: Mapping[int, tuple[str, ...]],
             input_layouts: Mapping[int, costlib.Layout] | None = None) -> Solution:
  """Predicted cost of a given class choice (and optional fixed input layouts).

  Baselines (data parallel, FSDP, Megatron) are choices costed here by the same model.
  """
  start = time.perf_counter()
  builder = _TableBuilder(problem, reuse=True, input_layouts=input_layouts)
  tables = _all_tables(problem, builder)
  index = {}
  for c, axes in choice.items():
    if axes not in problem.domains[c]:
      raise ValueError(f"class {problem.classes[c].example or c} (size "
                       f"{problem.classes[c].size}) cannot take mesh axes {axes}; allowed: "
                       f"{problem.domains[c]}")
    index[c] = problem.domains[c].index(axes)
  step_s, comm = _evaluate(tables, index)
  state = _evaluate(_memory_tables(problem, input_layouts), index)[0]
  return Solution(choice=dict(choice), step_s=step_s, comm_bytes=comm, state_bytes=state,
                  tables_built=builder.built, solve_s=time.perf_counter() - start,
                  memory_weight=0.0)


def _restrict(scope, table, domain_size):
  """Drops scope classes with a one-element domain (index 0)."""
  idx = tuple(slice(None) if c in domain_size else 0 for c in scope)
  return table[idx]


def _fit_budget(run, memory, budget):
  """Bisection on the Lagrange weight of the memory tables until the plan fits them.

  Returns:
    (assignment, weight).
  """
  lo, hi = 0.0, 1e-12
  best = None
  for _ in range(60):
    assignment = run(hi)
    used = _evaluate(memory, assignment)[0]
    if used <= budget:
      best = (assignment, hi)
      break
    hi *= 10
  if best is None:
    raise InfeasibleBudgetError(used, assignment)  # the leanest it found
  for _ in range(30):
    mid = (lo + hi) / 2
    assignment = run(mid)
    if _evaluate(memory, assignment)[0] <= budget:
      hi, best = mid, (assignment, mid)
    else:
      lo = mid
  return best


def warn_unsplittable(problem: Problem) -> None:
  """One warning when nothing in the program can be split."""
  if not any(len(d) > 1 for d in problem.domains):
    warnings.warn("search: no dimension can be split on this mesh; the plan is replicated",
                  stacklevel=2)


# -- public entry point ----------------------------------------------------------------


def _mesh_axes(mesh: Any) -> dict[str, int]:
  """Axis sizes of a jax Mesh, an AbstractMesh or a dict; rejects Explicit axes."""
  if isinstance(mesh, Mapping):
    return {str(k): int(v) for k, v in mesh.items()}
  from tapas_jax.mesh import check_auto  # noqa: PLC0415 - jax import kept lazy
  if hasattr(mesh, "axis_types"):
    check_auto(mesh)
  return {str(k): int(v) for k, v in dict(mesh.shape).items()}


def _default_device() -> str:
  import jax  # noqa: PLC0415
  platform = jax.devices()[0].platform
  return {"gpu": "h100", "tpu": "tpu-v5e"}.get(platform, "cpu")


def search(fn, *args, mesh, device: str | None = None, memory_budget: float | None = None,
           batch_axes: Sequence[str] | None | str = "default", fold: bool = True,
           links: Mapping[str, str] | None = None, time_limit: float | None = None):
  """Traces, folds and searches a sharding plan for `fn(*args)`.

  Args:
    fn: the step to shard, e.g. `train_step(state, batch)`.
    *args: its arguments: arrays or `jax.ShapeDtypeStruct` pytrees (nothing allocated).
    mesh: a `jax.sharding.Mesh` (Auto axes), an abstract mesh, or a dict of axis sizes.
    device: device profile name (tpu-v4, tpu-v5e, tpu-v5p, a100, h100, h200, cpu);
      default from the local platform.
    memory_budget: per-device bytes the plan may take: the program's inputs
      (parameters, optimizer state, batch) plus the intermediates live at the
      activation peak, as `plan.stats["predicted_memory_bytes"]` reports; None:
      unlimited. Tight budgets store parameters and optimizer state split over axes
      their compute does not use (ZeRO) before they split the compute itself.
    batch_axes: mesh axes that may split the batch (dim 0 of the last argument);
      default: the axes named data, batch, fsdp or replica; None: any axis.
    fold: search each unique layer once (True) or every op on its own (False); both
      reach the same plan, folding is faster.
    links: mesh axis -> "intra" or "inter" link; default from the device profile.
    time_limit: seconds for the unfolded integer program (fold=False);
      `plan.stats["solver_status"]` is "time_limit" when it was hit.

  Returns:
    A `tapas_jax.plan.Plan`.

  Raises:
    InfeasibleBudgetError: no plan fits `memory_budget`; the message gives the smallest
      per-device memory reachable and the tensors that dominate it.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> plan = search(lambda w, x: jnp.sum(jnp.tanh(x @ w)),
    ...               jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
    ...               jax.ShapeDtypeStruct((65536, 4096), jnp.float32),
    ...               mesh={"data": 8}, device="h100")
    >>> plan.in_specs
    (P(None, None), P('data', None))
  """
  from tapas_jax import fold as foldlib  # noqa: PLC0415
  from tapas_jax import trace as tracelib  # noqa: PLC0415

  axes = _mesh_axes(mesh)
  profile = costlib.get_profile(device or _default_device())
  mesh_spec = costlib.mesh_spec(axes, profile, links)
  if isinstance(batch_axes, str) and batch_axes == "default":
    batch_axes = _default_batch_axes(mesh_spec)
  graph = tracelib.trace(fn, *args)
  folded = foldlib.fold(graph)
  start = time.perf_counter()
  view = folded_view(folded) if fold else unfolded_view(graph)
  problem = build_problem(graph, mesh_spec, profile, batch_axes, view=view)
  warn_unsplittable(problem)
  try:
    solution = solve(problem, fold=fold, memory_budget=memory_budget, time_limit=time_limit)
  except InfeasibleBudgetError as e:
    reached = e.args[0] if e.args else math.inf
    live = e.args[1] if len(e.args) > 1 else ""
    raise _budget_error(problem, memory_budget, reached, live) from None
  search_s = time.perf_counter() - start
  return make_plan(problem, folded, solution, args, search_s=search_s)


def _budget_error(problem: Problem, budget: float, reached: float,
                  live: str = "") -> InfeasibleBudgetError:
  """The smallest per-device memory reached, the floor of the inputs alone, and the
  tensors that dominate it."""
  rows = []
  for i in problem.graph.inputs:
    # The most any layout can split this tensor: per dim the widest option its class
    # allows, each mesh axis once. Ignores op conflicts, so it is a lower bound.
    t, used, shards = problem.graph.types[i.value], set(), 1
    for d in range(len(t.shape)):
      options = [o for o in problem.domains[problem.vclass(i.value, d)]
                 if not used & set(o)]
      best = max(options, key=lambda o: math.prod(problem.mesh.size(a) for a in o))
      used.update(best)
      shards *= math.prod(problem.mesh.size(a) for a in best)
    rows.append((t.nbytes / shards, i.path, t))
  rows.sort(reverse=True)
  floor = sum(r[0] for r in rows)
  top = ", ".join(f"{p} {t} ({b / 2**20:.1f} MiB)" for b, p, t in rows[:5])
  return InfeasibleBudgetError(
      f"search: memory_budget={budget / 2**30:.3f} GiB per device cannot be met on mesh "
      f"{dict(zip(problem.mesh.axis_names, problem.mesh.axis_sizes))}: "
      + (f"the leanest plan found takes {reached / 2**30:.3f} GiB (inputs and the "
         "intermediates live at the activation peak); " if math.isfinite(reached) else "")
      + "even splitting "
      f"every dimension as far as the mesh allows leaves {floor / 2**30:.3f} GiB of "
      f"inputs per device. Largest inputs per device: {top}."
      + (f" Largest intermediates at the peak: {live}." if live else "")
      + " Raise the budget, use a bigger mesh, let the batch split over more mesh axes "
      "(batch_axes=None), rematerialise (jax.checkpoint), or use a smaller batch or "
      "model.")


def make_plan(problem: Problem, folded: Folded, solution: Solution, args: Sequence[Any],
              search_s: float, name: str = "tapas",
              input_layouts: Mapping[int, costlib.Layout] | None = None):
  """Turns a solution into a `Plan` (PartitionSpecs per argument, report, stats).

  Args:
    input_layouts: inputs stored in a fixed layout rather than their classes' (the
      FSDP baseline); their specs come from here.
  """
  import jax  # noqa: PLC0415
  from jax.sharding import PartitionSpec  # noqa: PLC0415

  from tapas_jax import plan as planlib  # noqa: PLC0415

  g = problem.graph
  fixed = input_layouts or {}
  specs = [PartitionSpec(*(fixed.get(i.value) or problem.layout(i.value, solution.choice))
                         .to_partition_spec()) for i in g.inputs]
  in_specs, k = [], 0
  for arg in args:
    leaves, treedef = jax.tree_util.tree_flatten(arg)
    in_specs.append(jax.tree_util.tree_unflatten(treedef, specs[k:k + len(leaves)]))
    k += len(leaves)
  spec_of = {i.value: s for i, s in zip(g.inputs, specs)}
  use_of = {}
  for i in g.inputs:
    classes = problem.reader_dims.get((problem.cv(i.value), False))
    if classes is not None and _spec(classes, solution.choice) != spec_of[i.value]:
      use_of[i.value] = _spec(classes, solution.choice)
  layers = []
  groups = [(u.name, len(u.instances), folded.instances[u.instances[0]].ops)
            for u in folded.unique_layers]
  groups.append(("glue", 1, [i for seg in folded.glue for i in seg.ops]))
  for layer_name, count, ops in groups:
    read: dict[str, int] = {}
    for i in ops:
      for v in g.ops[i].inputs:
        if v in spec_of:
          read.setdefault(g.input_path[v], v)
    if not read:
      continue
    layers.append(planlib.LayerStrategy(
        name=layer_name, instances=count,
        param_specs=tuple((path, spec_of[v]) for path, v in read.items()),
        use_specs=tuple((path, use_of[v]) for path, v in read.items() if v in use_of)))
  # One line per kind of split: copies of a layer differ only in their numbers.
  class_axes, seen = [], set()
  for c, axes in sorted(solution.choice.items(), key=lambda kv: -problem.classes[kv[0]].size):
    example = _generic(problem.classes[c].example)
    if (example, axes) not in seen:
      seen.add((example, axes))
      class_axes.append((example, problem.classes[c].size, axes))
  class_axes = tuple(class_axes)
  stats = {
      "num_equations": len(g.ops),
      "num_layer_instances": len(folded.instances),
      "num_unique_layers": len(folded.unique_layers),
      "trace_s": g.trace_s + g.walk_s,
      "fold_s": folded.fold_s,
      "search_s": search_s,
      "predicted_step_s": solution.step_s,
      "predicted_comm_bytes": solution.comm_bytes,
      "predicted_state_bytes": solution.state_bytes,
      "predicted_memory_bytes": solution.state_bytes + activation_peak(problem, solution),
      "cost_tables_built": solution.tables_built,
      "solver_status": solution.status,
  }
  return planlib.Plan(mesh_axes=dict(zip(problem.mesh.axis_names, problem.mesh.axis_sizes)),
                      device=problem.profile.name, in_specs=tuple(in_specs),
                      class_axes=class_axes, layers=tuple(layers), stats=stats,
                      fingerprint=g.regions[0].fingerprint, name=name,
                      constraints=_constraints(problem, solution, fixed))


def _spec(classes: Sequence[int | None], choice: Mapping[int, tuple[str, ...]]):
  """The PartitionSpec of a value whose dims are in these classes, as the cost tables
  read it (an axis splits only the first dim that asks for it)."""
  from jax.sharding import PartitionSpec  # noqa: PLC0415

  axes = [choice.get(c, ()) if c is not None else () for c in classes]
  return PartitionSpec(*costlib.Layout(_dims(range(len(axes)), axes)).to_partition_spec())


def _generic(example: str) -> str:
  """'params/Block_3/MLP/fc1/kernel[1]' -> 'params/Block_*/MLP/fc1/kernel[1]'."""
  head, sep, dim = example.rpartition("[")
  return re.sub(r"\d+", "*", head) + sep + dim if sep else re.sub(r"\d+", "*", example)


def _constraints(problem: Problem, solution: Solution,
                 fixed: Mapping[int, costlib.Layout]) -> tuple:
  """Where a cut value is read in another layout than it was made or stored in, the
  reading equations of every copy get that layout pinned (see `plan.Constraint`)."""
  from jax.sharding import PartitionSpec  # noqa: PLC0415

  from tapas_jax import plan as planlib  # noqa: PLC0415

  g, view = problem.graph, problem.view
  copies: dict[int, list[int]] = {}
  for u, c in view.canon.items():
    copies.setdefault(c, []).append(u)
  spec = functools.partial(_spec, choice=solution.choice)
  out = []
  for (v, in_update), classes in sorted(problem.reader_dims.items()):
    want = spec(classes)
    rank = len(g.types[v].shape)
    if v in fixed:
      have = PartitionSpec(*fixed[v].to_partition_spec())
    else:
      have = spec([problem.value_class.get((v, d)) for d in range(rank)])
    if want == have:
      continue  # read as it is: nothing for XLA to be told
    for u in [v] + copies.get(v, []):
      for r in g.consumers.get(u, ()):
        op = g.ops[r]
        if op.region != 0 or (view.op_canon.get(r, r) in problem.update_ops) != in_update:
          continue
        out += [planlib.Constraint(site=op.site, slot=k, spec=want)
                for k, x in enumerate(op.inputs) if x == u]
  # Contractions' results as planned, reduced where they are made: XLA propagates the
  # rest from these, and otherwise picks layouts of its own between them.
  for op in g.region_ops(0):
    rep = view.op_canon.get(op.index, op.index)
    rule = problem.rules.get(rep)
    tensors = [x for x in op.inputs if g.types[x].shape and x not in g.literals]
    if rule is None or not rule.reduce or len(tensors) < 2 or not op.outputs:
      continue
    v = op.outputs[0]
    made = spec([None if f is None else problem.vclass(v, d)
                 for d, f in enumerate(rule.outputs[0])])
    for r in g.consumers.get(v, ()):
      reader = g.ops[r]
      if reader.region != 0 or (problem.cv(v), view.op_canon.get(r, r) in problem.update_ops) \
          in problem.reader_dims:
        continue  # read through a cut: pinned above
      out += [planlib.Constraint(site=reader.site, slot=k, spec=made)
              for k, x in enumerate(reader.inputs) if x == v]
  return tuple(out)


def activation_peak(problem: Problem, solution: Solution) -> float:
  """Peak per-device bytes of live intermediate values over the top-level program."""
  return _activation_peak(problem, _activations(problem), solution.choice)[0]
