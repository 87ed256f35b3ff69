"""The search problem: dimension classes, their domains, and each op's rule.

Every op's sharding rule (`rules.py`) names its dimensions as factors. Factors joined
through a value (a producer's output dim is a consumer's input dim) are one *dimension
class*, the automatic counterpart of flax's logical axes: the residual width of every
layer, the batch, one layer's heads, another layer's MLP hidden. A plan gives each
class a set of mesh axes (its domain: subsets of axes whose sizes divide it; the batch
class only takes `batch_axes`). Two classes may share an axis (Megatron puts heads and
MLP hidden both on `model`) unless one op or tensor holds both.

The state update (an optimizer's pointwise ops from parameters, moments and gradients
to the next step's state; `update_ops`) gets classes of its own: parameters are
*stored* in the update's layout and *used* in the compute's, gradients are *made* in
the compute's and *delivered* in the update's. The two meet at cuts costed like any
edge, once per step, so the search can store state split over `data` while computing
tensor parallel on `model` (ZeRO: gradients reduce-scattered, parameters gathered).

Activations meet at such cuts too, where they flow between a contraction with a weight
and other ops: the sequence positions a norm or residual add holds are classes apart
from those the dots hold, so the search can split the residual stream's sequence on the
tensor axis, gather it into the column-parallel dots and reduce-scatter out of the
row-parallel ones (Megatron's sequence parallelism). Values made from no input (a
causal mask) join nothing: each read takes them in any layout, at no cost.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tapas_jax import cost, trace
  >>> from tapas_jax.solver import problem
  >>> graph = trace.trace(lambda w, x: jnp.sum(x @ w),
  ...                     jax.ShapeDtypeStruct((64, 32), jnp.float32),
  ...                     jax.ShapeDtypeStruct((128, 64), jnp.float32))
  >>> mesh = cost.mesh_spec({"data": 8}, "h100")
  >>> p = problem.build_problem(graph, mesh, cost.get_profile("h100"), None)
  >>> sorted(c.size for c in p.classes if c.splittable)
  [32, 64, 128]
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from typing import Callable, Iterable, Mapping, Sequence

from tapas_jax import cost as costlib
from tapas_jax import rules as ruleslib
from tapas_jax.solver import sequence
from tapas_jax.solver.views import View, scan_bindings, unfolded_view, with_scan_bodies
from tapas_jax.trace import Graph, Op

__all__ = ["MODEL_AXIS_NAMES", "DimClass", "Problem", "batch_inputs", "build_problem",
           "data_axes", "default_batch_axes", "free_values", "update_ops", "warn_batch_unsplit",
           "with_batch_axes"]

# Mesh axis names that say an axis is meant for the model, not the batch: tensor,
# expert, sequence and pipeline parallelism (MaxText, Megatron, praxis and t5x
# spellings). Expert layouts (the Megatron baseline) read roles from these names; the
# search does not: it may put the batch on any axis unless told otherwise.
MODEL_AXIS_NAMES = frozenset({
    "model", "mp", "tp", "tensor", "tensor_parallel", "expert", "experts", "ep",
    "seq", "sequence", "sp", "context", "cp", "pipe", "pipeline", "pp", "stage"})


@dataclasses.dataclass(frozen=True)
class DimClass:
  """One dimension class: tensor dims that must be split alike.

  Attributes:
    index: class id.
    size: the largest split any member allows: the gcd of its members' sizes (a
      reshape's merged dim (H*D) joins the class of its major part (H)).
    batch: holds dim 0 of a data input (see `batch_inputs`).
    splittable: False when one op or tensor holds it twice, or only values made from
      no input hold it (`free_values`: nothing to gain by splitting them).
    example: a readable member, e.g. "params/Block_0/MLP/fc1/kernel[1]".
  """

  index: int
  size: int
  batch: bool
  splittable: bool
  example: str


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
    batch_inputs: input values whose dim 0 is a batch class.
    batch_axes: the mesh axes batch classes may take.
    view: the ops searched and what they stand for.
    factor_class: op index -> class of each factor of its rule (-1: on no value dim).
    reader_dims: (value, side) -> class per dim, for values some readers see apart
      from their maker: side True: the state update reads it (gradients); False: the
      compute reads a stored input (parameters); "dot" / "elem": a contraction reads
      an activation other ops make, or other ops read a contraction's result
      (sequence parallelism). Absent: `vclass`.
    update_ops: the ops of the state update (see `update_ops`).
    free_values: values made from no program input (see `free_values`): each read
      takes classes of its own and costs nothing.
    read_sides: (op index, value) -> "dot" / "elem", the reads through an activation
      cut (see `read_side`).
    scan_cuts: (loop op, outer value, body value, read) of the stacked state a scan
      reads (read True: a stacked parameter or optimizer state, each iteration's slice
      gathered into the body's layout) or writes (False: the stacked gradient, each
      iteration's slice delivered into the stack's layout), seen apart: the stack's
      dims behind the layer dim take classes of their own (see `_scan_cuts`).
  """

  graph: Graph
  mesh: costlib.MeshSpec
  profile: costlib.DeviceProfile
  classes: tuple[DimClass, ...]
  domains: tuple[tuple[tuple[str, ...], ...], ...]
  value_class: Mapping[tuple[int, int], int]
  rules: Mapping[int, ruleslib.OpRule]
  state_pairs: tuple[tuple[int, int, int], ...]
  batch_inputs: frozenset[int]
  batch_axes: tuple[str, ...]
  view: View
  factor_class: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
  reader_dims: Mapping[tuple[int, bool], tuple[int, ...]] = dataclasses.field(
      default_factory=dict)
  update_ops: frozenset[int] = frozenset()
  free_values: frozenset[int] = frozenset()
  read_sides: Mapping[tuple[int, int], str] = dataclasses.field(default_factory=dict)
  scan_cuts: tuple[tuple[int, int, int, bool], ...] = ()

  def cv(self, v: int) -> int:
    """The value standing for v in the view."""
    return self.view.canon.get(v, v)

  def vclass(self, v: int, d: int) -> int:
    return self.value_class[(self.cv(v), d)]

  def read_class(self, v: int, d: int, in_update: bool = False) -> int:
    """Class of dim d of value v as the compute (or the update) reads it."""
    dims = self.reader_dims.get((self.cv(v), in_update))
    return dims[d] if dims is not None else self.vclass(v, d)

  def read_side(self, op_index: int, v: int):
    """The side op `op_index` (an op of the view) reads value v from (a `reader_dims`
    key's second part; present there only where the read goes through a cut)."""
    v = self.cv(v)
    return self.read_sides.get((op_index, v), op_index in self.update_ops)

  def read_dims(self, op_index: int, v: int) -> tuple[int, ...] | None:
    """Per dim, the class op `op_index` reads value v in; None: read as it is made."""
    return self.reader_dims.get((self.cv(v), self.read_side(op_index, v)))

  def stored_apart(self, v: int) -> bool:
    """Whether input v's storage classes are its own, not its compute's: the update
    reads it and the compute, if it reads it at all, reads it through a cut."""
    v = self.cv(v)
    if (v, False) in self.reader_dims or any(read and outer == v
                                             for _, outer, _, read in self.scan_cuts):
      return True
    users = self.graph.consumers.get(v, ())
    return bool(users) and all(u in self.update_ops for u in users)

  def layout(self, value: int, choice: Mapping[int, tuple[str, ...]]) -> costlib.Layout:
    """Layout of a graph input under a class choice."""
    rank = len(self.graph.types[value].shape)
    return costlib.Layout(tuple(choice.get(self.vclass(value, d), ()) for d in range(rank)))


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


def default_batch_axes(mesh: costlib.MeshSpec) -> tuple[str, ...]:
  """The mesh axes that may split the batch unless the user says otherwise: all of them.

  Names are labels, not orders: FSDP over a whole slice (the batch and the parameters
  over every axis, MaxText's default on TPU) must be in the search's space whatever
  the axes are called, and it wins over tensor parallelism up to ~100B parameters.
  `batch_axes=` restricts it.
  """
  return tuple(mesh.axis_names)


def data_axes(mesh: costlib.MeshSpec) -> tuple[str, ...]:
  """The axes an expert layout gives the batch: every axis whose name does not say it
  is meant for the model (`MODEL_AXIS_NAMES`)."""
  return tuple(a for a in mesh.axis_names if a.lower() not in MODEL_AXIS_NAMES)


def with_batch_axes(problem: Problem, batch_axes: Sequence[str] | None) -> Problem:
  """The same problem with the batch classes allowed on other mesh axes (None: any)."""
  domains = tuple(_domain(c.size if c.splittable else 1, problem.mesh, batch_axes, True)
                  if c.batch else problem.domains[c.index] for c in problem.classes)
  allowed = tuple(problem.mesh.axis_names) if batch_axes is None else tuple(batch_axes)
  return dataclasses.replace(problem, domains=domains, batch_axes=allowed)


def warn_batch_unsplit(problem: Problem) -> None:
  """One warning when the program has a batch but no allowed mesh axis can split it,
  saying why: no allowed axis divides it, or the program itself holds it whole."""
  batch = [c for c in problem.classes if c.batch and c.size > 1]
  if not batch or any(len(problem.domains[c.index]) > 1 for c in batch):
    return
  widest = max(batch, key=lambda c: c.size)
  axes = [a for a in problem.mesh.axis_names if problem.mesh.size(a) > 1]
  mesh = dict(zip(problem.mesh.axis_names, problem.mesh.axis_sizes))
  if not widest.splittable:
    # Axes would divide it, but the program pins it (`_unsplittable`).
    warnings.warn(
        f"search: the batch ({widest.example}, size {widest.size}) is a dimension the "
        f"program itself keeps whole: a loop runs over it or one op holds it twice; every "
        f"device will compute the whole batch (mesh {mesh}). Gradient accumulation that "
        f"reshapes the batch (B, ...) to (A, B // A, ...) and scans over A loops over the "
        f"batch's leading part; reshape to (B // A, A, ...) and scan over "
        f"jnp.moveaxis(x, 1, 0) instead: each device keeps its own rows, and every "
        f"microbatch takes some of each device's.", stacklevel=3)
    return
  warnings.warn(
      f"search: the batch ({widest.example}, size {widest.size}) cannot be split over any "
      f"mesh axis allowed to carry it (batch_axes={problem.batch_axes!r}, mesh "
      f"{mesh}); every device will "
      f"compute the whole batch. Pass batch_axes= naming the axes that may split it (e.g. "
      f"batch_axes={tuple(axes)!r}), or use a batch size those axes divide.", stacklevel=3)


def batch_inputs(graph: Graph, input_classes: Mapping[int, Sequence[int]]) -> frozenset[int]:
  """The inputs whose dim 0 is the batch, found by dataflow rather than by position.

  A train step returns its state for the next step (`Graph.carried`): parameters,
  optimizer state, step counters. Every other input with a dim is data (tokens,
  labels, masks, an RNG key's raw bits); its dim 0 is a batch dimension unless a state
  input holds the same class (a positional table indexed by it, say). A program that
  carries no state (a bare loss or forward pass) has no such split: there the last
  positional argument is taken as the data.

  Args:
    input_classes: input value -> the class of each of its dims as stored, then any
      other classes it is read in (a parameter used in another layout than stored).
  """
  state = {graph.inputs[j].value for _, j in graph.carried}
  if not state:
    last = graph.num_args - 1
    return frozenset(i.value for i in graph.inputs if graph.num_args > 1 and i.arg == last
                     and graph.types[i.value].shape)
  held = {c for v in state for c in input_classes[v]}
  return frozenset(i.value for i in graph.inputs if i.value not in state
                   and graph.types[i.value].shape and input_classes[i.value][0] not in held)


def _state_pairs(graph: Graph, canon: Mapping[int, int]) -> tuple[tuple[int, int, int], ...]:
  """(output, input, count) of state carried to the next step, in the view's values."""
  counts: dict[tuple[int, int], int] = {}
  for k, j in graph.carried:
    v, src = graph.outputs[k], graph.inputs[j].value
    key = (canon.get(v, v), canon.get(src, src))
    counts[key] = counts.get(key, 0) + 1
  return tuple((o, i, n) for (o, i), n in counts.items())


def _pointwise(graph: Graph, op: Op, rule: ruleslib.OpRule) -> bool:
  """Every tensor operand and result has one shape and the same factor on each dim (no
  factor only on a dim of size 1: a 1x1 convolution's kernel is updated pointwise too)."""
  if rule.reduce or not op.outputs or op.subregions:
    return False
  shape = graph.types[op.outputs[0]].shape
  if not shape or any(graph.types[v].shape != shape for v in op.outputs):
    return False
  dims = rule.outputs[0]
  if any(f is None and n != 1 for f, n in zip(dims, shape)) or \
      any(d != dims for d in rule.outputs):
    return False
  for v, d in zip(op.inputs, rule.inputs):
    if v in graph.literals or not graph.types[v].shape:
      continue
    if graph.types[v].shape != shape or d != dims:
      return False
  return True


def update_ops(graph: Graph, top: Sequence[Op], rules: Mapping[int, ruleslib.OpRule]
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


def free_values(graph: Graph, top: Sequence[Op], update: frozenset[int],
                cv=lambda v: v, seed: Iterable[int] = ()) -> frozenset[int]:
  """Values computed from no program input: iotas, constants and what is made of them
  alone (a causal mask: iota, broadcasts, a compare), and the results a shard_map's
  body makes of them alone (`Facts.maps_operands`: the mask and the fill a softmax's
  `where` reads, handed to the backward as residuals, or hoisted out of a scanned
  layer by JAX into a shard_map that reads nothing). `seed`: values known free (a
  body's inputs whose operands are).

  XLA folds them or builds each device's piece where it is read, so they take any
  layout at no cost and are held nowhere: each read gets classes of its own. Otherwise
  the one iota behind a causal mask joins the query and key positions into one class,
  which the scores then hold twice (unsplittable).
  """
  free: set[int] = set(seed)
  for op in top:  # producers come before their readers
    if not op.outputs or op.index in update:
      continue
    if not op.subregions:
      if all(v in graph.literals or cv(v) in free for v in op.inputs):
        free.update(cv(v) for v in op.outputs)
    elif ruleslib.facts(op.primitive).maps_operands:
      body = graph.regions[op.subregions[0]]
      inner = free_values(graph, graph.region_ops(body.index), frozenset(), seed=(
          w for x, w in zip(op.inputs, body.inputs) if x in graph.literals or cv(x) in free))
      free.update(cv(v) for v, w in zip(op.outputs, body.outputs)
                  if w in inner or w in graph.literals)
  return frozenset(free)


@dataclasses.dataclass(frozen=True)
class _Program:
  """What every step of `build_problem` reads, found once from the view."""

  graph: Graph
  view: View  # scan bodies included
  top: tuple[Op, ...]  # the view's ops but its loops, in program order
  rules: Mapping[int, ruleslib.OpRule]
  cv: Callable[[int], int]  # value -> the value standing for it in the view
  update: frozenset[int]  # `update_ops`
  free: frozenset[int]  # `free_values`
  producer: Mapping[int, int]  # value -> the op making it
  contracts: Mapping[int, bool]  # op index -> `_contracts`
  dot_side: Mapping[int, bool]  # op index -> `sequence.dot_side`
  cut_use: frozenset[int]  # inputs the update and the compute both read (parameters)
  cut_update: frozenset[int]  # values the compute makes, the update reads (gradients)
  apart: tuple[tuple[int, int, int, bool], ...]  # `_scan_cuts`


def _on_the_mesh(rules: dict[int, ruleslib.OpRule], top: Sequence[Op],
                 mesh: costlib.MeshSpec) -> None:
  """Drops the fixed layouts of ops whose mesh is not the search's (a `jax.shard_map` on
  a mesh of its own over the same devices, say `{'d': 8}` under a `data x model`
  plan: JAX runs it so, but its shards name axes the plan has not), with one warning:
  they are then priced as read and made whole, as an op without a rule is."""
  want = {a: n for a, n in zip(mesh.axis_names, mesh.axis_sizes)}
  other = {}
  for op in top:
    rule = rules[op.index]
    if rule.fixed_mesh and dict(rule.fixed_mesh) != want:
      rules[op.index] = dataclasses.replace(rule, fixed_inputs=(), fixed_outputs=(),
                                            fixed_mesh=())
      other.setdefault(rule.fixed_mesh, op)
  for fixed, op in other.items():
    warnings.warn(
        f"search: '{op.primitive}' at {op.name_stack or 'the top level'} runs on mesh "
        f"{dict(fixed)}, the search's is {want}: its operands and results are priced "
        "whole (gathered into it, made replicated). Search on the shard_map's mesh axes "
        "to have them priced on its shards.", stacklevel=4)


def _program(graph: Graph, view: View, reassociates: bool = False,
             mesh: costlib.MeshSpec | None = None) -> _Program:
  """The ops of the view, their rules (on `mesh`: `_on_the_mesh`), the update, the free
  values and the cuts. `reassociates`: the profile's `reassociates_all_reduces`
  (`sequence.dot_side`)."""
  canon = view.canon
  cv = lambda v: canon.get(v, v)  # noqa: E731
  top = tuple(graph.ops[i] for i in view.ops if i not in view.loops)
  by_signature: dict[str, ruleslib.OpRule] = {}  # a rule depends on the signature alone
  rules = {}
  for op in top:
    if op.signature not in by_signature:
      by_signature[op.signature] = ruleslib.rule_for(graph, op)
    rules[op.index] = by_signature[op.signature]
  if mesh is not None:
    _on_the_mesh(rules, top, mesh)
  update = update_ops(graph, top, rules)
  free = free_values(graph, top, update, cv)
  readers: dict[int, set[bool]] = {}  # value -> read by update ops (True), others (False)
  for op in top:
    for v in op.inputs:
      if v not in graph.literals:
        readers.setdefault(cv(v), set()).add(op.index in update)
  # Values the update region and the compute see in layouts of their own: parameters
  # (stored as the update has them, used as the compute wants) and gradients (made as
  # the compute has them, delivered as the update wants).
  producer = {cv(v): op.index for op in top for v in op.outputs}
  cut_use = frozenset(v for v, r in readers.items() if r == {True, False} and v not in producer)
  cut_update = frozenset(v for v, r in readers.items() if True in r and v in producer
                         and producer[v] not in update)
  contracts = {op.index: _contracts(graph, op, rules[op.index]) for op in top}
  return _Program(graph=graph, view=view, top=top, rules=rules, cv=cv, update=update,
                  free=free, producer=producer, cut_use=cut_use, cut_update=cut_update,
                  contracts=contracts,
                  dot_side=sequence.dot_side(graph, top, contracts, producer, cv, reassociates),
                  apart=_scan_cuts(graph, view, rules, update, cv))


def build_problem(graph: Graph, mesh: costlib.MeshSpec, profile: costlib.DeviceProfile,
                  batch_axes: Sequence[str] | None, view: View | None = None,
                  sequence_cuts: bool = False) -> Problem:
  """Dimension classes, their domains and the op rules of a traced program.

  Args:
    view: the ops to search (`folded_view` or `unfolded_view`); default unfolded.
    sequence_cuts: let activations where the model's width meets a contraction hold
      their positions apart on the two sides (Megatron's sequence parallelism: the
      residual stream split on the tensor axis, gathered into the dots and
      reduce-scattered out of them; see `sequence.sequence_dims`); False: one layout per
      value dim.
  """
  prog = _program(graph, with_scan_bodies(graph, view or unfolded_view(graph)),
                  profile.reassociates_all_reduces, mesh)
  first = _unite(prog, {}, lambda v, d: True)
  data, batch = _batch(prog, mesh, first, batch_axes)
  batch_dims = {key for key, c in first.value_class.items() if c in batch}
  # Activations between a contraction with a weight and other ops: read by the other
  # kind through a cut ("dot": gathered into contractions; "elem": a contraction's
  # result as norms and residual adds hold it), over the dims the activation brings
  # to the contraction and keeps (the sequence; the batch stays one class, below).
  cut_dims = (sequence.sequence_dims(prog, data, first.value_class) if sequence_cuts
              else {})
  u, read_sides = _unite_cut(prog, first, cut_dims, batch_dims)
  classes = _dim_classes(prog, u, {u.value_class[key] for key in batch_dims})
  allowed_batch = tuple(mesh.axis_names) if batch_axes is None else tuple(batch_axes)
  domains = tuple(_domain(c.size if c.splittable else 1, mesh,
                          allowed_batch if c.batch else None, c.batch) for c in classes)
  reader_dims = _reader_dims(prog, u)
  return Problem(graph=graph, mesh=mesh, profile=profile, classes=classes, domains=domains,
                 value_class=u.value_class, rules=prog.rules, batch_inputs=data,
                 state_pairs=_state_pairs(graph, prog.view.canon), batch_axes=allowed_batch,
                 view=prog.view, factor_class=u.factor_class, reader_dims=reader_dims,
                 update_ops=prog.update, free_values=prog.free, scan_cuts=prog.apart,
                 read_sides={k: s for k, s in read_sides.items() if (k[1], s) in reader_dims})


def _scan_cuts(graph: Graph, view: View, rules, update: frozenset[int], cv
               ) -> tuple[tuple[int, int, int, bool], ...]:
  """The scanned stacks' state, seen apart from the body (`Problem.scan_cuts`).

  A scanned layer stack (`nn.scan`, `scan_layers=True`) reads its parameters as the
  scan's stacked operands, layer dim in front. Joined with the body's dims, a stored
  layout would be the compute's: FSDP's (the stack split behind the layer dim over the
  batch axes, each layer gathered where the body reads it, as MaxText and levanter
  store a scanned stack) would be outside the space. So the stacked operands that are
  carried state inputs, and the stacked results that only lead into the state update
  through pointwise ops (the stack's gradient, into Adam's moments), keep the body's
  dims apart from their own: the body reads (or makes) its iteration's slice through a
  cut, priced once per iteration (`TableBuilder.scan_cut_table`).
  """
  state = {cv(graph.inputs[j].value) for _, j in graph.carried}
  feeds: dict[int, bool] = {}
  out = []
  for loop in sorted(view.loops):
    op = graph.ops[loop]
    for outer, inner, shift in scan_bindings(graph, op):
      if not shift:
        continue
      if outer in op.inputs and cv(outer) in state:
        out.append((loop, cv(outer), inner, True))
      elif outer in op.outputs and _into_update(graph, rules, update, feeds, outer):
        out.append((loop, cv(outer), inner, False))
  return tuple(out)


def _into_update(graph: Graph, rules, update: frozenset[int], feeds: dict[int, bool],
                 v: int, depth: int = 0) -> bool:
  """Whether every reader of v is the update, or a pointwise op leading only there
  (a few deep: Adam's `(1 - b2) * g ** 2` is two before the update's add); `feeds`
  keeps the answers. Not a closure: a recursive one is a cycle holding the graph."""
  if v not in feeds:
    users = graph.consumers.get(v, ())
    feeds[v] = bool(users) and depth < 4 and all(
        c in update or (c in rules and _pointwise(graph, graph.ops[c], rules[c]) and all(
            _into_update(graph, rules, update, feeds, w, depth + 1)
            for w in graph.ops[c].outputs))
        for c in users)
  return feeds[v]


@dataclasses.dataclass(frozen=True)
class _United:
  """One union-find pass over the view: classes of value dims, cut sides and factors."""

  value_class: dict  # (value, dim) -> class
  side_class: dict  # (value, dim, cut side) -> class
  factor_class: dict  # op index -> class per factor of its rule, -1: on no value dim
  pinned: set  # classes that must stay unsplit: a scan's stacked dim
  count: int  # classes are 0..count-1


def _unite(prog: _Program, read_sides: Mapping[tuple[int, int], str], joined,
           contraction_sides: Mapping[tuple[int, int], int] | None = None) -> _United:
  """Joins factors through values. A read through a cut (`_Nodes.read`) takes dims of its
  own (except dims `joined(v, d)` keeps one); a read of a free value gets dims of its own
  per read. `contraction_sides`: cut value dim -> a key; the contraction sides of cut
  dims with one key are joined. Scan bindings in `prog.apart` keep their stacked dims
  apart from the body's."""
  nodes = _Nodes(prog, read_sides, joined)
  pinned = nodes.join_scans()
  factor_nodes = nodes.join_ops()
  for i in prog.graph.inputs:
    for d in range(len(prog.graph.types[i.value].shape)):
      nodes.value(prog.cv(i.value), d)
  first: dict[int, int] = {}
  for (v, d), key in (contraction_sides or {}).items():
    # A value contractions read through a cut: their side is the cut's read; a
    # contraction's result read by others through one: their side is the value.
    n = nodes.side.get((v, d, "dot"),
                       nodes.node.get((v, d)) if (v, d, "elem") in nodes.side else None)
    if n is not None:
      nodes.uf.union(first.setdefault(key, n), n)
  uf = nodes.uf
  roots = sorted({uf.find(n) for n in list(nodes.node.values()) + list(nodes.side.values())})
  index = {r: k for k, r in enumerate(roots)}
  return _United(
      value_class={key: index[uf.find(n)] for key, n in nodes.node.items()},
      side_class={key: index[uf.find(n)] for key, n in nodes.side.items()},
      factor_class={i: tuple(index.get(uf.find(n), -1) for n in fnodes)
                    for i, fnodes in factor_nodes.items()},
      pinned={index[uf.find(n)] for n in pinned}, count=len(index))


class _Nodes:
  """The union-find nodes of one pass: value dims, and dims read through a cut."""

  def __init__(self, prog: _Program, read_sides: Mapping[tuple[int, int], str], joined):
    self.prog, self.read_sides, self.joined = prog, read_sides, joined
    self.uf = _UnionFind()
    self.node: dict[tuple[int, int], int] = {}  # value dim -> node
    self.side: dict[tuple[int, int, object], int] = {}  # (value, dim, cut side) -> node

  def value(self, v: int, d: int) -> int:
    if (v, d) not in self.node:
      self.node[(v, d)] = self.uf.add()
    return self.node[(v, d)]

  def read(self, op_index: int, v: int, d: int) -> int:
    """Dim d of v as op `op_index` reads it: a node of its own through a cut."""
    p = self.prog
    if v in p.free:
      return self.uf.add()
    if op_index in p.update:
      s = True if v in p.cut_update else None
    else:
      s = False if v in p.cut_use else self.read_sides.get((op_index, v))
    if s is None or (isinstance(s, str) and self.joined(v, d)):
      return self.value(v, d)
    if (v, d, s) not in self.side:
      self.side[(v, d, s)] = self.uf.add()
    return self.side[(v, d, s)]

  def join_scans(self) -> set[int]:
    """Joins each scan's outer values with the body's; returns the stacked dims."""
    graph, cv = self.prog.graph, self.prog.cv
    cut = {(loop, outer, inner) for loop, outer, inner, _ in self.prog.apart}
    pinned = set()  # value dims that must stay unsplit: a scan's stacked dim
    for loop in self.prog.view.loops:
      for outer, inner, shift in scan_bindings(graph, graph.ops[loop]):
        if (loop, cv(outer), inner) not in cut:
          for d in range(len(graph.types[inner].shape)):
            self.uf.union(self.value(cv(outer), d + shift), self.value(inner, d))
        else:  # the body's own classes; `inner` is made or read in them
          for d in range(len(graph.types[inner].shape)):
            self.value(inner, d)
        if shift:
          pinned.add(self.value(cv(outer), 0))
    return pinned

  def join_ops(self) -> dict[int, list[int]]:
    """Joins each op's factors with the dims it reads and makes; op -> factor nodes."""
    p, uf = self.prog, self.uf
    factor_nodes = {}
    for op in p.top:
      rule = p.rules[op.index]
      fnodes = [uf.add() for _ in rule.factor_sizes]
      factor_nodes[op.index] = fnodes
      for v, fs in zip(op.inputs, rule.inputs):
        if v in p.graph.literals:
          continue
        for d, f in enumerate(fs):
          n = self.read(op.index, p.cv(v), d)
          if f is not None:
            uf.union(fnodes[f], n)
      for v, fs in zip(op.outputs, rule.outputs):
        for d, f in enumerate(fs):
          n = self.value(p.cv(v), d)
          if f is not None:
            uf.union(fnodes[f], n)
    return factor_nodes


def _batch(prog: _Program, mesh: costlib.MeshSpec, u: _United,
           batch_axes: Sequence[str] | None) -> tuple[frozenset[int], set[int]]:
  """The batch inputs (`batch_inputs`) and the classes of their dim 0."""
  graph, cv = prog.graph, prog.cv
  read_as: dict[int, list[int]] = {}  # classes a value is read in, besides its own
  for (v, _, _), c in u.side_class.items():
    read_as.setdefault(v, []).append(c)
  # Copies of a layer's parameter stand for one value: its classes, found once (read
  # only: the inputs share the list).
  classes: dict[tuple[int, int], list[int]] = {}
  input_classes = {}
  for i in graph.inputs:
    key = (cv(i.value), len(graph.types[i.value].shape))
    if key not in classes:
      classes[key] = ([u.value_class[(key[0], d)] for d in range(key[1])]
                      + read_as.get(key[0], []))
    input_classes[i.value] = classes[key]
  data = batch_inputs(graph, input_classes)
  for a in (() if batch_axes is None else batch_axes):
    if a not in mesh.axis_names:
      raise ValueError(f"batch_axes names {a!r}, which is not a mesh axis "
                       f"{mesh.axis_names}; pass axes of the mesh or None")
  return data, {u.value_class[(cv(v), 0)] for v in data}


def _contracts(graph: Graph, op: Op, rule: ruleslib.OpRule) -> bool:
  """A contraction of two tensors (a dot_general, an embedding lookup): where
  sequence parallelism gathers its operands and reduce-scatters its result."""
  tensors = [v for v in op.inputs if v not in graph.literals and graph.types[v].shape]
  return bool(rule.reduce) and len(tensors) >= 2


def _unite_cut(prog: _Program, first: _United, cut_dims: Mapping[int, set[int]],
               batch_dims: set[tuple[int, int]]) -> tuple[_United, dict]:
  """The union again with the cut dims apart on the two sides, and (op index, value)
  -> the side of a cut the op reads the value from."""
  read_sides: dict[tuple[int, int], str] = {}
  for op in prog.top:
    if op.index in prog.update:
      continue
    for v in op.inputs:
      v = prog.cv(v)
      if v in cut_dims and prog.dot_side[op.index] != prog.dot_side[prog.producer[v]]:
        read_sides[(op.index, v)] = "dot" if prog.dot_side[op.index] else "elem"
  if not read_sides:
    return first, read_sides
  # The batch stays one class (the sides of a cut share it): `batch_axes` then holds
  # everywhere, and the search does not grow by a copy of it per cut.
  # The contractions keep one layout per dim as without cuts (Megatron-SP: only the
  # positions between them split apart): a dim every contraction of the model reads
  # alike stays one class there, so the dots around attention and the loss's head
  # cannot split positions each their own way (XLA lowers those gradients' partial
  # sums over two axes as two all-reduces: measured 1.47x the predicted bytes on
  # GPT-2 small).
  return _unite(prog, read_sides, lambda v, d: d not in cut_dims[v] or (v, d) in batch_dims,
                {(v, d): first.value_class[(v, d)] for v, dims in cut_dims.items()
                 for d in dims}), read_sides


def _dim_classes(prog: _Program, u: _United, batch_classes: set[int]) -> tuple[DimClass, ...]:
  """Every class of the final union, with its size, batch role and example."""
  sizes: dict[int, set[int]] = {}
  for (v, d), c in list(u.value_class.items()) + [((v, d), c) for (v, d, _), c
                                                   in u.side_class.items()]:
    sizes.setdefault(c, set()).add(prog.graph.types[v].shape[d])
  example, unsplittable = _examples(prog, u), _unsplittable(prog, u)
  classes = []
  for c in range(u.count):
    # Members may differ in size where a reshape splits a merged dim by its major
    # part ((B, S, H*D) -> (B, S, H, D)): a split must divide every member.
    size = math.gcd(*sizes[c])
    classes.append(DimClass(index=c, size=size, batch=c in batch_classes,
                            splittable=size > 1 and c not in unsplittable,
                            example=example.get(c, "")))
  return tuple(classes)


def _examples(prog: _Program, u: _United) -> dict[int, str]:
  """Class -> a readable member: a parameter, an input, an op's result, a cut read."""
  graph, cv = prog.graph, prog.cv
  example: dict[int, str] = {}
  for (v, d, _), c in u.side_class.items():  # where a parameter is used
    if v in graph.input_path and c not in example:
      example[c] = f"{graph.input_path[v]}[{d}]"
  seen = set()  # the values standing for inputs already named (copies: the first)
  for i in graph.inputs:  # where it is stored (named once: copies share their classes)
    v = cv(i.value)
    if (v, len(graph.types[i.value].shape)) in seen:
      continue
    seen.add((v, len(graph.types[i.value].shape)))
    for d in range(len(graph.types[i.value].shape)):
      if (c := u.value_class[(v, d)]) not in example:
        example[c] = f"{i.path}[{d}]{' stored' if v in prog.cut_use else ''}"
  for op in prog.top:  # classes no input holds: named by an op that makes them
    for v in op.outputs:
      for d in range(len(graph.types[v].shape)):
        c = u.value_class.get((cv(v), d))
        if c is not None and c not in example:
          example[c] = f"{op.name_stack or '(top)'}/{op.primitive}[{d}]"
  for (v, d, s), c in u.side_class.items():  # an activation as the other side reads it
    if c not in example and v in prog.producer:
      op = graph.ops[prog.producer[v]]
      example[c] = f"{op.name_stack or '(top)'}/{op.primitive}[{d}] read by {s}"
  return example


def _unsplittable(prog: _Program, u: _United) -> set[int]:
  """Classes one op or tensor holds twice, a scan's stacked dims, and unused ones."""
  conflicted = set(u.pinned)
  for cs in u.factor_class.values():
    conflicted.update(c for c in cs if c >= 0 and cs.count(c) > 1)
  by_value: dict[tuple, dict[int, int]] = {}  # per value (and per cut side), its dims
  for (v, d), c in u.value_class.items():
    by_value.setdefault((v,), {})[d] = c
  for (v, d, s), c in u.side_class.items():
    by_value.setdefault((v, s), {})[d] = c
  for cs in (list(dims.values()) for dims in by_value.values()):
    conflicted.update(c for c in cs if cs.count(c) > 1)
  # Classes only free values hold cost nothing either way: left whole, out of the search.
  used = {c for (v, _), c in u.value_class.items() if v not in prog.free}
  used.update(u.side_class.values())
  for op in prog.top:
    if not all(prog.cv(v) in prog.free for v in op.outputs):
      used.update(c for c in u.factor_class[op.index] if c >= 0)
  conflicted.update(set(range(u.count)) - used)
  return conflicted


def _reader_dims(prog: _Program, u: _United) -> dict[tuple[int, object], tuple[int, ...]]:
  """(value, side) -> the class of each dim as that side reads it (`Problem.reader_dims`)."""
  reads: dict[tuple[int, object], dict[int, int]] = {}
  for (v, d, s), c in u.side_class.items():
    reads.setdefault((v, s), {})[d] = c
  # dims a cut leaves joined read the value's own
  return {(v, s): tuple(dims.get(d, u.value_class[(v, d)])
                        for d in range(len(prog.graph.types[v].shape)))
          for (v, s), dims in reads.items()}


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
