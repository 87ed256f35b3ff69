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
from typing import Mapping, Sequence

from tapas_jax import cost as costlib
from tapas_jax import rules as ruleslib
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
  """One warning when the program has a batch but no allowed mesh axis can split it."""
  batch = [c for c in problem.classes if c.batch and c.size > 1]
  if not batch or any(len(problem.domains[c.index]) > 1 for c in batch):
    return
  widest = max(batch, key=lambda c: c.size)
  axes = [a for a in problem.mesh.axis_names if problem.mesh.size(a) > 1]
  warnings.warn(
      f"search: the batch ({widest.example}, size {widest.size}) cannot be split over any "
      f"mesh axis allowed to carry it (batch_axes={problem.batch_axes!r}, mesh "
      f"{dict(zip(problem.mesh.axis_names, problem.mesh.axis_sizes))}); every device will "
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
                cv=lambda v: v) -> frozenset[int]:
  """Values computed from no program input: iotas, constants and what is made of them
  alone (a causal mask: iota, broadcasts, a compare).

  XLA folds them or builds each device's piece where it is read, so they take any
  layout at no cost: each read gets classes of its own. Otherwise the one iota behind
  a causal mask joins the query and key positions into one class, which the scores
  then hold twice (unsplittable).
  """
  free: set[int] = set()
  for op in top:  # producers come before their readers
    if (op.outputs and not op.subregions and op.index not in update
        and all(v in graph.literals or cv(v) in free for v in op.inputs)):
      free.update(cv(v) for v in op.outputs)
  return frozenset(free)


def _contracts(graph: Graph, op: Op, rule: ruleslib.OpRule) -> bool:
  """A contraction of two tensors (a dot_general, an embedding lookup): where
  sequence parallelism gathers its operands and reduce-scatters its result."""
  tensors = [v for v in op.inputs if v not in graph.literals and graph.types[v].shape]
  return bool(rule.reduce) and len(tensors) >= 2


def _weights(graph: Graph, top: Sequence[Op], free: frozenset[int], cv,
             data: frozenset[int]) -> set[int]:
  """Program inputs other than the data, and what one-operand ops (casts, transposes,
  reshapes) make of them: the operands a contraction with a weight holds fixed."""
  out = {cv(i.value) for i in graph.inputs if i.value not in data}
  for op in top:
    ins = [cv(v) for v in op.inputs if v not in graph.literals and cv(v) not in free]
    if op.outputs and len(ins) == 1 and ins[0] in out and not op.subregions:
      out.update(cv(v) for v in op.outputs)
  return out


def _sequence_dims(graph: Graph, top: Sequence[Op], rules, update, free, producer,
                   contracts, cv, data: frozenset[int], classes) -> dict[int, set[int]]:
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
  weights = _weights(graph, top, free, cv, data) | free
  sites = []
  count: dict[int, int] = {}
  for op in top:
    if op.index in update or not contracts[op.index] or len(op.outputs) != 1:
      continue
    rule = rules[op.index]
    tensors = [k for k, v in enumerate(op.inputs)
               if v not in graph.literals and graph.types[v].shape]
    held = [k for k in tensors if cv(op.inputs[k]) in weights]
    if not held or len(held) == len(tensors):
      continue
    fixed = {f for k in held for f in rule.inputs[k] if f is not None}
    sites.append((op, rule, tensors, held, fixed))
    for k in tensors:
      if k not in held:
        for d, f in enumerate(rule.inputs[k]):
          if f in fixed:
            c = classes[(cv(op.inputs[k]), d)]
            count[c] = count.get(c, 0) + 1
    for d, f in enumerate(rule.outputs[0]):
      if f in fixed:
        c = classes[(cv(op.outputs[0]), d)]
        count[c] = count.get(c, 0) + 1
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
      a = cv(op.inputs[k])
      if (kept and a in producer and a not in free and producer[a] not in update
          and not contracts[producer[a]] and at_width(a, rule.inputs[k], fixed)):
        out.setdefault(a, set()).update(
            d for d, f in enumerate(rule.inputs[k]) if f in kept)
    flowing = {f for k in tensors if k not in held for f in rule.inputs[k]
               if f is not None and f not in fixed}
    r = cv(op.outputs[0])
    dims = {d for d, f in enumerate(rule.outputs[0]) if f in flowing}
    if dims and at_width(r, rule.outputs[0], fixed) and any(
        not contracts[c] and c not in update
        for c in graph.consumers.get(r, ()) if c in contracts):
      out.setdefault(r, set()).update(dims)
  return out


def build_problem(graph: Graph, mesh: costlib.MeshSpec, profile: costlib.DeviceProfile,
                  batch_axes: Sequence[str] | None, view: View | None = None,
                  sequence_cuts: bool = False) -> Problem:
  """Dimension classes, their domains and the op rules of a traced program.

  Args:
    view: the ops to search (`folded_view` or `unfolded_view`); default unfolded.
    sequence_cuts: let activations where the model's width meets a contraction hold
      their positions apart on the two sides (Megatron's sequence parallelism: the
      residual stream split on the tensor axis, gathered into the dots and
      reduce-scattered out of them; see `_sequence_dims`); False: one layout per
      value dim.
  """
  view = with_scan_bodies(graph, view or unfolded_view(graph))
  canon = view.canon
  cv = lambda v: canon.get(v, v)  # noqa: E731
  top = [graph.ops[i] for i in view.ops if i not in view.loops]
  by_signature: dict[str, ruleslib.OpRule] = {}  # a rule depends on the signature alone
  rules = {}
  for op in top:
    if op.signature not in by_signature:
      by_signature[op.signature] = ruleslib.rule_for(graph, op)
    rules[op.index] = by_signature[op.signature]
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
  cut_use = {v for v, r in readers.items() if r == {True, False} and v not in producer}
  cut_update = {v for v, r in readers.items() if True in r and v in producer
                and producer[v] not in update}
  read_sides: dict[tuple[int, int], str] = {}  # filled once the batch is known

  def side_of(op_index: int, v: int):
    if op_index in update:
      return True if v in cut_update else None
    if v in cut_use:
      return False
    return read_sides.get((op_index, v))

  apart = _scan_cuts(graph, view, rules, update, cv)
  first = _unite(graph, view, top, rules, cv, side_of, free, lambda v, d: True, apart=apart)
  batch = _batch_classes(graph, mesh, first, cv, batch_axes)
  batch_dims = {key for key, c in first.value_class.items() if c in batch}
  # Activations between a contraction with a weight and other ops: read by the other
  # kind through a cut ("dot": gathered into contractions; "elem": a contraction's
  # result as norms and residual adds hold it), over the dims the activation brings
  # to the contraction and keeps (the sequence; the batch stays one class, below).
  contracts = {op.index: _contracts(graph, op, rules[op.index]) for op in top}
  cut_dims = (_sequence_dims(graph, top, rules, update, free, producer, contracts, cv,
                             first.data, first.value_class)
              if sequence_cuts else {})
  for op in top:
    if op.index in update:
      continue
    for v in op.inputs:
      v = cv(v)
      if v in cut_dims and contracts[op.index] != contracts[producer[v]]:
        read_sides[(op.index, v)] = "dot" if contracts[op.index] else "elem"

  # The batch stays one class (the sides of a cut share it): `batch_axes` then holds
  # everywhere, and the search does not grow by a copy of it per cut.
  # The contractions keep one layout per dim as without cuts (Megatron-SP: only the
  # positions between them split apart): a dim every contraction of the model reads
  # alike stays one class there, so the dots around attention and the loss's head
  # cannot split positions each their own way (XLA lowers those gradients' partial
  # sums over two axes as two all-reduces: measured 1.47x the predicted bytes on
  # GPT-2 small).
  u = (_unite(graph, view, top, rules, cv, side_of, free,
              lambda v, d: d not in cut_dims[v] or (v, d) in batch_dims,
              {(v, d): first.value_class[(v, d)] for v, dims in cut_dims.items()
               for d in dims}, apart=apart)
       if read_sides else first)
  value_class, side_class, index = u.value_class, u.side_class, u.index
  sizes: dict[int, set[int]] = {}
  example: dict[int, str] = {}
  for (v, d), c in list(value_class.items()) + [((v, d), c) for (v, d, _), c
                                                 in side_class.items()]:
    sizes.setdefault(c, set()).add(graph.types[v].shape[d])
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
  for (v, d, s), c in side_class.items():  # an activation as the other side reads it
    if c not in example and v in producer:
      op = graph.ops[producer[v]]
      example[c] = f"{op.name_stack or '(top)'}/{op.primitive}[{d}] read by {s}"
  conflicted = {index[u.uf.find(n)] for n in u.pinned}
  for cs in u.factor_class.values():
    conflicted.update(c for c in cs if c >= 0 and cs.count(c) > 1)
  for dims in _value_dims(graph, value_class, side_class):
    conflicted.update(c for c in dims if dims.count(c) > 1)

  # Classes only free values hold cost nothing either way: left whole, out of the search.
  used = {c for (v, _), c in value_class.items() if v not in free}
  used.update(side_class.values())
  for op in top:
    if not all(cv(v) in free for v in op.outputs):
      used.update(c for c in u.factor_class[op.index] if c >= 0)
  conflicted.update(set(range(len(index))) - used)
  batch_classes = {value_class[key] for key in batch_dims}
  allowed_batch = tuple(mesh.axis_names) if batch_axes is None else tuple(batch_axes)
  classes, domains = [], []
  for c in range(len(index)):
    # Members may differ in size where a reshape splits a merged dim by its major
    # part ((B, S, H*D) -> (B, S, H, D)): a split must divide every member.
    size = math.gcd(*sizes[c])
    splittable = size > 1 and c not in conflicted
    is_batch = c in batch_classes
    classes.append(DimClass(index=c, size=size, batch=is_batch, splittable=splittable,
                            example=example.get(c, "")))
    domains.append(_domain(size if splittable else 1, mesh,
                           allowed_batch if is_batch else None, is_batch))
  reads = {}
  for (v, d, s), c in side_class.items():
    reads.setdefault((v, s), {})[d] = c
  reader_dims = {}
  for (v, s), dims in reads.items():  # dims a cut leaves joined read the value's own
    reader_dims[(v, s)] = tuple(dims.get(d, value_class[(v, d)])
                                for d in range(len(graph.types[v].shape)))
  return Problem(graph=graph, mesh=mesh, profile=profile, classes=tuple(classes),
                 domains=tuple(domains), value_class=value_class, rules=rules,
                 state_pairs=_state_pairs(graph, canon), batch_inputs=first.data,
                 batch_axes=allowed_batch,
                 view=view, factor_class=u.factor_class, reader_dims=reader_dims,
                 update_ops=update, free_values=free,
                 read_sides={k: s for k, s in read_sides.items()
                             if (k[1], s) in reader_dims},
                 scan_cuts=apart)


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

  def into_update(v: int, depth: int = 0) -> bool:
    """Whether every reader of v is the update, or a pointwise op leading only there
    (a few deep: Adam's `(1 - b2) * g ** 2` is two before the update's add)."""
    if v not in feeds:
      users = graph.consumers.get(v, ())
      feeds[v] = bool(users) and depth < 4 and all(
          c in update or (c in rules and _pointwise(graph, graph.ops[c], rules[c])
                          and all(into_update(w, depth + 1) for w in graph.ops[c].outputs))
          for c in users)
    return feeds[v]

  out = []
  for loop in sorted(view.loops):
    op = graph.ops[loop]
    for outer, inner, shift in scan_bindings(graph, op):
      if not shift:
        continue
      if outer in op.inputs and cv(outer) in state:
        out.append((loop, cv(outer), inner, True))
      elif outer in op.outputs and into_update(outer):
        out.append((loop, cv(outer), inner, False))
  return tuple(out)


@dataclasses.dataclass
class _United:
  """One union-find pass over the view: classes of value dims, cut sides and factors."""

  uf: _UnionFind
  value_class: dict
  side_class: dict
  factor_class: dict
  index: dict
  pinned: set
  data: frozenset = frozenset()


def _unite(graph: Graph, view: View, top: Sequence[Op], rules, cv, side_of, free,
           joined, contraction_sides: Mapping[tuple[int, int], int] | None = None,
           apart: Sequence[tuple[int, int, int, bool]] = ()) -> _United:
  """Joins factors through values. A read whose `side_of` is not None reads the value
  through a cut: dims of its own (except dims `joined(v, d)` keeps one); a read of a
  free value gets dims of its own per read. `contraction_sides`: cut value dim -> a
  key; the contraction sides of cut dims with one key are joined. `apart`: scan
  bindings (`_scan_cuts`) whose stacked dims stay apart from the body's."""
  cut = {(loop, outer, inner) for loop, outer, inner, _ in apart}
  uf = _UnionFind()
  node: dict[tuple[int, int], int] = {}
  side: dict[tuple[int, int, object], int] = {}

  def vnode(v: int, d: int) -> int:
    key = (v, d)
    if key not in node:
      node[key] = uf.add()
    return node[key]

  def read_node(op_index: int, v: int, d: int) -> int:
    if v in free:
      return uf.add()
    s = side_of(op_index, v)
    if s is None or (isinstance(s, str) and joined(v, d)):
      return vnode(v, d)
    key = (v, d, s)
    if key not in side:
      side[key] = uf.add()
    return side[key]

  pinned = set()  # value dims that must stay unsplit: a scan's stacked dim
  for loop in view.loops:
    for outer, inner, shift in scan_bindings(graph, graph.ops[loop]):
      if (loop, cv(outer), inner) not in cut:
        for d in range(len(graph.types[inner].shape)):
          uf.union(vnode(cv(outer), d + shift), vnode(inner, d))
      else:  # the body's own classes; `inner` is made or read in them
        for d in range(len(graph.types[inner].shape)):
          vnode(inner, d)
      if shift:
        pinned.add(vnode(cv(outer), 0))

  op_factor_nodes = {}
  for op in top:
    rule = rules[op.index]
    fnodes = [uf.add() for _ in rule.factor_sizes]
    op_factor_nodes[op.index] = fnodes
    for v, fs in zip(op.inputs, rule.inputs):
      if v in graph.literals:
        continue
      for d, f in enumerate(fs):
        n = read_node(op.index, cv(v), d)
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
  first: dict[int, int] = {}
  for (v, d), key in (contraction_sides or {}).items():
    # A value contractions read through a cut: their side is the cut's read; a
    # contraction's result read by others through one: their side is the value.
    n = side.get((v, d, "dot"), node.get((v, d)) if (v, d, "elem") in side else None)
    if n is not None:
      uf.union(first.setdefault(key, n), n)

  all_nodes = list(node.values()) + list(side.values())
  roots = sorted({uf.find(n) for n in all_nodes})
  index = {r: k for k, r in enumerate(roots)}
  return _United(
      uf=uf, value_class={key: index[uf.find(n)] for key, n in node.items()},
      side_class={key: index[uf.find(n)] for key, n in side.items()},
      factor_class={i: tuple(index.get(uf.find(n), -1) for n in fnodes)
                    for i, fnodes in op_factor_nodes.items()},
      index=index, pinned=pinned)


def _batch_classes(graph: Graph, mesh: costlib.MeshSpec, u: _United, cv,
                   batch_axes: Sequence[str] | None) -> set[int]:
  """The classes of the batch inputs' dim 0 (and records the batch inputs in `u`)."""
  read_as: dict[int, list[int]] = {}  # classes a value is read in, besides its own
  for (v, _, _), c in u.side_class.items():
    read_as.setdefault(v, []).append(c)
  input_classes = {i.value: [u.value_class[(cv(i.value), d)]
                             for d in range(len(graph.types[i.value].shape))]
                   + read_as.get(cv(i.value), []) for i in graph.inputs}
  u.data = batch_inputs(graph, input_classes)
  for a in (() if batch_axes is None else batch_axes):
    if a not in mesh.axis_names:
      raise ValueError(f"batch_axes names {a!r}, which is not a mesh axis "
                       f"{mesh.axis_names}; pass axes of the mesh or None")
  return {u.value_class[(cv(v), 0)] for v in u.data}


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
