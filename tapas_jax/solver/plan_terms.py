"""A class choice in plan terms (`result.PlanTerms`): each input's stored and used
`PartitionSpec`, the layouts `apply` pins (where a value is read in another layout than
it is made or stored in, a contraction's result, a searched scan's operands and
results), and each kind of dimension's decision with its reason.

`solve` and `evaluate` hand `plan_terms` to their `Solution`, which builds it once,
when it is first read.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from tapas_jax import cost, trace
  >>> from tapas_jax.solver import build_problem, evaluate, layout_choice
  >>> graph = trace.trace(lambda w, x: jnp.sum(jnp.tanh(x @ w)),
  ...                     jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
  ...                     jax.ShapeDtypeStruct((65536, 4096), jnp.float32))
  >>> p = build_problem(graph, cost.mesh_spec({"data": 8}, "h100"),
  ...                   cost.get_profile("h100"), None)
  >>> terms = evaluate(p, layout_choice(p, batch_axes=("data",))).terms
  >>> [(d.name, d.axes) for d in terms.decisions][:1], [c.spec for c in terms.constraints]
  ([('batch', ('data',))], [P('data', None)])
"""

from __future__ import annotations

import functools
import math
import operator
import re
from typing import Mapping, Sequence

from jax.sharding import PartitionSpec

from tapas_jax import cost as costlib
from tapas_jax.fold import Folded
from tapas_jax.solver import remat as rematlib
from tapas_jax.solver.explain import Reason
from tapas_jax.solver.problem import Problem
from tapas_jax.solver.result import Constraint, Decision, InputSpec, PlanTerms
from tapas_jax.solver.tables import mesh_dims
from tapas_jax.solver.views import Copies, Standing

__all__ = ["plan_terms"]

Choice = Mapping[int, tuple[str, ...]]


def plan_terms(problem: Problem, choice: Choice, reasons: Mapping[int, Reason],
               remat: Mapping[int, str], input_layouts: Mapping[int, costlib.Layout] | None,
               folded: Folded | None) -> PlanTerms:
  """`choice` (with `reasons`, the `remat` chosen and the inputs stored in a fixed
  layout, `input_layouts`) in plan terms; `folded` names the remat's layers."""
  g, fixed = problem.graph, input_layouts or {}
  # A folded layer's copies of a parameter stand for one value (`View.canon`): their
  # specs are its, asked once per (value standing for it, rank, fixed layout).
  specs: dict[tuple, tuple[PartitionSpec, PartitionSpec | None]] = {}
  names: dict[tuple, str] = {}  # a type's text, once per (dtype, shape)
  inputs = []
  for i in g.inputs:
    t = g.types[i.value]
    key = (problem.cv(i.value), len(t.shape), fixed.get(i.value))
    if key not in specs:
      specs[key] = _input_specs(problem, choice, i.value, key[2])
    stored, used = specs[key]
    if (t.dtype, t.shape) not in names:
      names[(t.dtype, t.shape)] = str(t)
    inputs.append(InputSpec(value=i.value, path=i.path, type=names[(t.dtype, t.shape)],
                            stored=stored, used=used))
  if remat and folded is None:
    raise ValueError("plan_terms: a rematerialised solution needs the program's folded=")
  return PlanTerms(
      mesh_axes=dict(zip(problem.mesh.axis_names, problem.mesh.axis_sizes)),
      device=problem.profile.name, inputs=tuple(inputs),
      constraints=_constraints(problem, choice, fixed),
      decisions=_decisions(problem, choice, reasons), class_axes=_class_axes(problem, choice),
      remat=rematlib.policy_names(folded, remat) if remat else (),
      gradient_fences=math.isfinite(problem.profile.combine_threshold_bytes),
      sums_past_fences=problem.profile.reassociates_all_reduces)


def _input_specs(problem: Problem, choice: Choice, v: int, fixed: costlib.Layout | None
                 ) -> tuple[PartitionSpec, PartitionSpec | None]:
  """(stored, used) specs of input v: `used` where the compute reads it otherwise."""
  stored = PartitionSpec(*(fixed or problem.layout(v, choice)).to_partition_spec())
  classes = problem.reader_dims.get((problem.cv(v), False))
  used = _spec(classes, choice) if classes is not None else None
  return stored, used if used != stored else None


def _class_axes(problem: Problem, choice: Choice) -> tuple:
  """One line per kind of split: copies of a layer differ only in their numbers."""
  out, seen = [], set()
  for c, axes in sorted(choice.items(), key=lambda kv: -problem.classes[kv[0]].size):
    example = _generic(problem.classes[c].example)
    if (example, axes) not in seen:
      seen.add((example, axes))
      out.append((example, problem.classes[c].size, axes))
  return tuple(out)


def _decisions(problem: Problem, choice: Choice, reasons: Mapping[int, Reason]
               ) -> tuple[Decision, ...]:
  """One `Decision` per kind of dimension with a choice (copies of a layer alike):
  split ones first, then the batch, widest first."""
  names = _class_names(problem)
  rows, seen = [], set()
  order = sorted((c for c, dom in enumerate(problem.domains) if len(dom) > 1),
                 key=lambda c: (not choice.get(c), not problem.classes[c].batch,
                                -problem.classes[c].size, c))
  for c in order:
    axes = tuple(choice.get(c, ()))
    name = names.get(c) or _generic(problem.classes[c].example) or f"class {c}"
    if (name, axes) in seen:
      continue
    seen.add((name, axes))
    rows.append(Decision(name=name, size=problem.classes[c].size, axes=axes,
                         why=_why(axes, reasons.get(c))))
  return tuple(rows)


def _class_names(problem: Problem) -> dict[int, str]:
  """Names the program gives classes: logical axis names of parameter dims, "batch"."""
  g, out = problem.graph, {}
  # A folded layer's copies of a parameter have the classes of the value standing for
  # them: each (standing for, names) asked once, in the inputs' order.
  asked = set()
  for i in g.inputs:
    if not any(i.logical_axes) or (key := (problem.cv(i.value), i.logical_axes)) in asked:
      continue
    asked.add(key)
    for d, name in enumerate(i.logical_axes):
      if name:
        for c in {problem.vclass(i.value, d), problem.read_class(i.value, d)}:
          out.setdefault(c, name)
  for c in problem.classes:
    if c.batch:
      out.setdefault(c.index, "batch")
  # Sequence parallelism: positions (a sequence, an image's pixels) held apart by the
  # contractions with weights and the norms and residual adds between them.
  for (v, side), dims in problem.reader_dims.items():
    if side not in ("dot", "elem"):
      continue
    for d, c in enumerate(dims):
      made = problem.value_class[(v, d)]
      if c != made:
        inside, outside = (c, made) if side == "dot" else (made, c)
        out.setdefault(outside, "positions between contractions")
        out.setdefault(inside, "positions in contractions")
  return out


def _why(axes: tuple[str, ...], reason: Reason | None) -> str:
  """The best other choice, everything else kept, and what it would add."""
  if reason is None:
    return ""
  other = f"over {'x'.join(reason.alternative)}" if reason.alternative else "unsplit"
  if not math.isfinite(reason.delta_s):
    return "any other axes clash with dims it meets (an op split twice on one axis)"
  if reason.delta_s <= 0:
    return f"tie with {other}"
  return (f"{other}: {_duration(reason.delta_s)}/step, "
          f"{reason.delta_comm_bytes / 2**20:+.2f} MiB")


def _duration(seconds: float) -> str:
  if abs(seconds) >= 1e-3:
    return f"+{seconds * 1e3:.3f} ms"
  return f"+{seconds * 1e6:.1f} µs"


def _spec(classes: Sequence[int | None], choice: Choice) -> PartitionSpec:
  """The PartitionSpec of a value whose dims are in these classes, as the cost tables
  read it (an axis splits only the first dim that asks for it)."""
  axes = [choice.get(c, ()) if c is not None else () for c in classes]
  layout = costlib.Layout(mesh_dims(range(len(axes)), axes))
  return PartitionSpec(*layout.to_partition_spec())


def _generic(example: str) -> str:
  """'params/Block_3/MLP/fc1/kernel[1]' -> 'params/Block_*/MLP/fc1/kernel[1]'."""
  head, sep, dim = example.rpartition("[")
  return re.sub(r"\d+", "*", head) + sep + dim if sep else re.sub(r"\d+", "*", example)


def _constraints(problem: Problem, choice: Choice,
                 fixed: Mapping[int, costlib.Layout]) -> tuple[Constraint, ...]:
  """Where a cut value is read in another layout than it was made or stored in, the
  reading equations of every copy get that layout pinned (see `Constraint`)."""
  g, view = problem.graph, problem.view
  specs: dict[tuple, PartitionSpec] = {}  # copies of a layer read alike: one spec each

  def spec(classes):
    key = tuple(classes)
    if key not in specs:
      specs[key] = _spec(key, choice)
    return specs[key]

  read_dims = functools.lru_cache(maxsize=None)(problem.read_dims)  # per (rep, value)
  top = Standing(g, view)
  out = (_made_constraints(problem, spec, top)
         + _loop_constraints(problem, spec, fixed) + _fixed_made_constraints(problem, spec, top))
  # Copies of a layer read alike: (rep, slot, value in the view, rank) -> (want, have,
  # whether they are one layout).
  pair: dict[tuple, tuple[PartitionSpec, PartitionSpec, bool]] = {}

  def read_as(rep, k, y, x):
    key = (rep, k, problem.cv(x), len(g.types[x].shape))
    if key not in pair:
      want = spec(read_dims(rep, y))
      have = spec([problem.value_class.get((key[2], d)) for d in range(key[3])])
      pair[key] = (want, have, want == have)
    return pair[key]

  # Per op standing for others, its slots read through a cut: asked once, not per copy
  # (a copy reads in the slots its representative does; most ops read none).
  cut_slots: dict[int, list[tuple[int, int]]] = {}

  def slots_of(rep):
    if rep not in cut_slots:
      cut_slots[rep] = [(k, y) for k, y in enumerate(g.ops[rep].inputs)
                        if read_dims(rep, y) is not None]
    return cut_slots[rep]

  def read_through(op, rep, slots) -> list[Constraint]:
    """The constraints of op's reads in `slots` (its representative's slots read through
    a cut, with the values the representative reads there)."""
    found = []
    inputs = op.inputs
    for k, y in slots:
      if k >= len(inputs):  # as zip: a copy has its representative's inputs
        break
      x = inputs[k]
      if x in g.literals:
        continue
      if x in fixed:
        want, have = spec(read_dims(rep, y)), _held(problem, spec, fixed, x)
        same = want == have
      else:
        want, have, same = read_as(rep, k, y, x)
      if same:  # read as it is: nothing for XLA to be told
        continue
      if x not in fixed and not _from_partial_sums(problem, choice, x):
        # Made whole from whole values, read split through a cut (a statistic into
        # state stored apart): pinned as made first, so that XLA slices it here rather
        # than carrying the split back into the compute that makes it. (Made from
        # partial sums, a gradient, XLA may reduce-scatter straight into the read
        # layout: pinning it whole first would force an all-reduce.)
        found.append(Constraint(site=op.site, slot=k, spec=have))
      found.append(Constraint(site=op.site, slot=k, spec=want))
    return found

  # (op, its constraints), in no order: the ops outside the copies, then the copies.
  reads = [(i, read_through(g.ops[i], rep, slots_of(rep))) for i in top.outside
           if slots_of(rep := view.op_canon.get(i, i))]
  for c in view.copies:
    reads += _copies_reads(g, c, slots_of, read_as, read_through)
  reads.sort(key=operator.itemgetter(0))  # in program order, as one walk adds them
  out += [con for _, found in reads for con in found]
  return tuple(out) + _scan_cut_constraints(problem, spec, fixed)


def _loop_constraints(problem: Problem, spec, fixed: Mapping[int, costlib.Layout]
                      ) -> list[Constraint]:
  """Each array a searched scan reads pinned at the scan in the plan's layout, and each
  of its results where it is read. A scan's body is searched in place, but the loop is
  no op XLA is told about: left free, the TPU compiler carried a reader's split back
  into the carry (positions split for the loss head) and gathered the body's weights
  instead, every iteration."""
  g, view, out = problem.graph, problem.view, []
  if not view.loops:
    return out

  planned = functools.partial(_held, problem, spec, fixed)
  for op in Standing(g, view, region=None).where(view.loops.__contains__):
    out += [Constraint(site=op.site, slot=k, spec=planned(x)) for k, x in enumerate(op.inputs)
            if x not in g.literals and g.types[x].shape]
    for v in op.outputs:
      if not g.types[v].shape:
        continue
      made = planned(v)
      for r in g.consumers.get(v, ()):
        if view.op_canon.get(r, r) in view.loops:
          continue  # another loop: pinned where it reads, above
        reader = g.ops[r]
        out += [Constraint(site=reader.site, slot=k, spec=made)
                for k, y in enumerate(reader.inputs) if y == v]
  return out


def _held(problem: Problem, spec, fixed: Mapping[int, costlib.Layout], x: int,
          skip: int = 0) -> PartitionSpec:
  """The layout the plan holds value x in: the fixed one it is stored in, else its
  classes' under the choice (`spec`); without its `skip` leading dims (a stack's
  iteration slice)."""
  if x in fixed:
    return PartitionSpec(*costlib.Layout(fixed[x].dims[skip:]).to_partition_spec())
  return spec([problem.vclass(x, d) for d in range(skip, len(problem.graph.types[x].shape))])


def _fixed_made_constraints(problem: Problem, spec, top: Standing) -> list[Constraint]:
  """The operands and results of an op on shards the program fixed (a
  `jax.shard_map`'s), pinned in the layout the plan holds them in where that is not the
  one it reads or makes (`_fixed_read`; results at each reader): the plan prices their
  reshard there, where XLA would otherwise carry the fixed layout into the next
  contraction and reduce its partial sums instead."""
  g, rules, out = problem.graph, problem.rules, []

  def on_fixed(i):
    return _makes_fixed(problem, i) or _on_fixed_shards(problem, i)

  # Scanned layers' bodies too: `apply` pins inside a loop by running its body itself.
  ops = [g.ops[i] for i in problem.view.ops if on_fixed(i)]
  seen = {op.index for op in ops}
  ops += [op for op in top.where(on_fixed) if op.index not in seen]
  for op in ops:
    rule = rules[problem.view.op_canon.get(op.index, op.index)]
    out += _fixed_read(problem, spec, op, rule)
    for slot, v in enumerate(op.outputs):
      fixed = rule.fixed_output(slot)
      rank = len(g.types[v].shape)
      if fixed is None or (problem.cv(v), 0) not in problem.value_class or not rank:
        continue
      planned = spec([problem.vclass(v, d) for d in range(rank)])
      # Whole, it is held in classes nothing ties to the rest (a baseline leaves them
      # unsplit): pinned, the kernel's result would be gathered. Left to XLA.
      if planned == PartitionSpec(*costlib.Layout(fixed).to_partition_spec()) or all(
          e is None for e in planned):
        continue
      # A reader on fixed shards itself (the backward's shard_map reading a residual)
      # takes it from the layout made into its own, never the plan's: not pinned.
      out += [Constraint(site=g.ops[r].site, slot=k, spec=planned)
              for r in g.consumers.get(v, ()) if g.ops[r].region == op.region
              and not _on_fixed_shards(problem, r)
              for k, x in enumerate(g.ops[r].inputs) if x == v]
  return out


def _fixed_read(problem: Problem, spec, op, rule) -> list[Constraint]:
  """An op on fixed shards' operands, pinned where it reads them in the layout the plan
  holds them in, where that is not the one it reads: the plan prices their reshard
  there. Left to itself, XLA carries the fixed layout back into the ops that make the
  operand (a projection into a kernel's heads computed from the whole residual stream,
  gathered for it in the forward and again in the backward)."""
  g, out = problem.graph, []
  for k, x in enumerate(op.inputs):
    fixed, rank = rule.fixed_input(k), len(g.types[x].shape)
    if (fixed is None or not rank or x in g.literals
        or (problem.cv(x), 0) not in problem.value_class):
      continue
    planned = spec([problem.vclass(x, d) for d in range(rank)])
    # Whole, pinned, it would be gathered first; made on fixed shards (the forward
    # kernel's residual read by the backward's), it goes from one fixed layout to the
    # other as the plan prices it.
    maker = g.producer.get(x)
    if (planned == PartitionSpec(*costlib.Layout(fixed).to_partition_spec())
        or all(e is None for e in planned)
        or (maker is not None and _makes_fixed(problem, maker))):
      continue
    out.append(Constraint(site=op.site, slot=k, spec=planned))
  return out


def _makes_fixed(problem: Problem, op_index: int) -> bool:
  return bool(getattr(_rule(problem, op_index), "fixed_outputs", ()))


def _on_fixed_shards(problem: Problem, op_index: int) -> bool:
  return bool(getattr(_rule(problem, op_index), "fixed_inputs", ()))


def _rule(problem: Problem, op_index: int):
  """The rule of the op standing for `op_index` (None: no rule, a loop)."""
  return problem.rules.get(problem.view.op_canon.get(op_index, op_index))


def _made_constraints(problem: Problem, spec, top: Standing) -> list[Constraint]:
  """Contractions' results as planned, reduced where they are made: XLA propagates the
  rest from these, and otherwise picks layouts of its own between them. A reader
  through a cut gets the made layout first, then its own (`_constraints`): XLA
  reduces the result where it is made and reshards it, as the cut is priced. One
  spec per (op standing for the maker, value standing for its result): copies of a
  layer make alike. Every copy's reducing op is asked (thousands in a deep model):
  what it asks is looked up once."""
  g, rules = problem.graph, problem.rules
  op_canon, canon = problem.view.op_canon, problem.view.canon
  ops, types, literals, consumers = g.ops, g.types, g.literals, g.consumers
  made_as: dict[tuple[int, int], PartitionSpec] = {}
  out = []

  def reduces(rep):
    """A contraction of two tensors or more (asked of the op standing for others: a
    copy has its representative's types)."""
    rule, op = rules.get(rep), ops[rep]
    return (rule is not None and bool(rule.reduce) and bool(op.outputs)
            and sum(1 for x in op.inputs if types[x].shape and x not in literals) >= 2)

  for op in top.where(reduces):
    rep = op_canon.get(op.index, op.index)
    v = op.outputs[0]
    key = (rep, canon.get(v, v))
    made = made_as.get(key)
    if made is None:
      made = made_as[key] = spec([None if f is None else problem.vclass(v, d)
                                  for d, f in enumerate(rules[rep].outputs[0])])
    for r in consumers.get(v, ()):
      reader = ops[r]
      if reader.region != 0:
        continue
      inputs = reader.inputs
      # Read in the slots the op standing for the reader has (as zip pairs them).
      n = min(len(inputs), len(ops[op_canon.get(r, r)].inputs))
      if inputs.count(v) == 1:  # most readers read it once
        k = inputs.index(v)
        if k < n:
          out.append(Constraint(site=reader.site, slot=k, spec=made))
      else:
        out += [Constraint(site=reader.site, slot=k, spec=made)
                for k in range(n) if inputs[k] == v]
  return out


def _copies_reads(g, c: Copies, slots_of, read_as, read_through) -> list[tuple[int, list]]:
  """(op, constraints) of one layer's interior copies' reads through a cut. Each copy
  reads as the op standing for it does (an interior copy reading the last layer's
  output reads it through the representative's cut); a slot reading a value the layer
  makes reads, in every copy, the copy's value standing for the representative's:
  where the representative reads it in the layout it is made in, no copy is asked."""
  made = set(c.rep_values)
  out = []
  for s, rep in enumerate(c.rep):
    slots = [(k, y) for k, y in slots_of(rep)
             if y not in made or not read_as(rep, k, y, y)[2]]
    if slots:
      out += [(row[s], read_through(g.ops[row[s]], rep, slots)) for row in c.ops]
  return out


def _scan_cut_constraints(problem: Problem, spec, fixed: Mapping[int, costlib.Layout]
                          ) -> tuple[Constraint, ...]:
  """A stacked parameter stored in another layout than the scan's body reads it in
  (`Problem.scan_cuts`): every body equation reading the iteration's slice reads it
  pinned in the body's layout, so XLA gathers one layer per iteration inside the loop
  (as priced) rather than the whole stack before it."""
  g, out = problem.graph, []
  for _, outer, inner, read in problem.scan_cuts:
    rank = len(g.types[inner].shape)
    if not read or not rank:
      continue
    stored = _held(problem, spec, fixed, outer, skip=1)
    want = spec([problem.value_class[(inner, d)] for d in range(rank)])
    if want == stored:
      continue
    for c in g.consumers.get(inner, ()):
      out += [Constraint(site=g.ops[c].site, slot=k, spec=want)
              for k, x in enumerate(g.ops[c].inputs) if x == inner]
  return tuple(out)


def _from_partial_sums(problem: Problem, choice: Choice, v: int) -> bool:
  """Whether v is an input, or made from partial sums under the choice: a reduction
  with a split reduced dim, reached back through ops that reduce nothing."""
  g, canon = problem.graph, problem.view.op_canon
  todo, seen = [v], set()
  while todo:
    x = todo.pop()
    made = g.producer.get(x)
    if made is None:
      if x == v:
        return True  # an input: stored, not made
      continue
    if made in seen:
      continue
    seen.add(made)
    rule, classes = problem.rules.get(canon.get(made, made)), problem.factor_class.get(
        canon.get(made, made), ())
    if rule is None:
      return True  # not searched (in a loop body): leave it to XLA
    if any(choice.get(classes[f]) for f in rule.reduce if f < len(classes)
           and classes[f] >= 0):
      return True
    if not rule.reduce:
      todo.extend(y for y in g.ops[made].inputs if y not in g.literals)
  return False
