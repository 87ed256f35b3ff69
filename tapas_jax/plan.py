"""Stage 4, plan: what the search decided, in terms a JAX user applies.

A `Plan` holds one pytree of `PartitionSpec` per positional argument (`in_specs`), the
class-to-axes choice behind it, the strategy of each unique layer (the specs of its
parameters), the predicted cost and the timings of each stage. Its parts (`PlanStats`,
`LayerStrategy`, ...) are defined in `tapas_jax.plan_records` and importable from here;
`plan.save` and `Plan.load` go through `tapas_jax.plan_file`.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import tapas_jax as tapas
  >>> plan = tapas.search(lambda w, x: jnp.sum(x @ w),
  ...                     jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
  ...                     jax.ShapeDtypeStruct((65536, 4096), jnp.float32),
  ...                     mesh={"data": 8}, device="h100")
  >>> plan.in_specs[1], plan.stats.num_equations
  (P('data', None), 2)
"""

from __future__ import annotations

import dataclasses
import functools
import html
import math
import re
import time
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import PartitionSpec

from tapas_jax import cost as costlib
from tapas_jax import plan_file
from tapas_jax.options import format_bytes
from tapas_jax.fold import Folded
from tapas_jax.plan_records import (BaselineFigures, CompiledFigures, Constraint, Decision,
                                    LayerStrategy, PlanStats)
from tapas_jax.solver import Problem, Solution
from tapas_jax.solver import remat, tables

__all__ = ["BaselineFigures", "CompiledFigures", "Constraint", "Decision", "LayerStrategy",
           "Plan", "PlanStats", "make_plan"]


@dataclasses.dataclass(frozen=True)
class Plan:
  """A sharding plan for one program on one mesh.

  Attributes:
    mesh_axes: axis name -> size.
    device: device profile name used for costs.
    in_specs: one pytree of `PartitionSpec` per positional argument.
    class_axes: readable (dimension class example, size, mesh axes) for split classes,
      one line per kind (copies of a layer differ only in their numbers: `Block_*`).
    layers: strategy per unique layer, then glue.
    stats: timings of each stage and the predicted cost (`PlanStats`).
    fingerprint: canonical hash of the traced program (checked when applied).
    name: "tapas" for a searched plan, else the baseline's name.
    constraints: layouts `apply` pins inside the program (see `Constraint`).
    kwargs_specs: keyword argument name -> its pytree of `PartitionSpec`, for a step
      searched with keyword arguments (`search(..., kwargs={...})`); else empty.
    input_types: (path, "float32[8,64]") of every argument leaf searched, so that a
      plan applied to another program says which input differs.
    decisions: every kind of dimension with a choice: what was chosen and why.
    baselines: expert layouts costed side by side (searched plans carry data
      parallel and FSDP).
    remat: (unique layer name, `jax.checkpoint_policies` name) of the layers whose
      backward recomputes their forward ("dots_saveable": all but dot outputs,
      "nothing_saveable": all of it); `apply` does it, `remat_policy` gives the policy.
    compiled: the compiler's figures (`search(..., verify=...)`), or None.
  """

  mesh_axes: Mapping[str, int]
  device: str
  in_specs: tuple[Any, ...]
  class_axes: tuple[tuple[str, int, tuple[str, ...]], ...]
  layers: tuple[LayerStrategy, ...]
  stats: PlanStats
  fingerprint: str
  name: str = "tapas"
  constraints: tuple[Constraint, ...] = ()
  kwargs_specs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  input_types: tuple[tuple[str, str], ...] = ()
  decisions: tuple[Decision, ...] = ()
  baselines: tuple[BaselineFigures, ...] = ()
  remat: tuple[tuple[str, str], ...] = ()
  compiled: CompiledFigures | None = None

  def save(self, path) -> None:
    """Writes the plan to `path` as JSON (see `tapas_jax.plan_file`), atomically."""
    plan_file.save(self, path)

  def bind(self, *args: Any, kwargs: Mapping[str, Any] | None = None) -> "Plan":
    """This plan with `in_specs` (and `kwargs_specs`) in the arguments' own pytree
    structure, e.g. to build `jax.jit(..., in_shardings=...)` yourself from a loaded
    plan, whose flax/optax/nnx nodes are stand-ins (`plan_file.StoredNode`).

    Raises:
      ValueError: the arguments' leaves have other key paths than the plan's.
    """
    kwargs = dict(kwargs or {})
    if len(args) != len(self.in_specs) or sorted(kwargs) != sorted(self.kwargs_specs):
      raise ValueError(f"bind: plan {self.name!r} has specs for {len(self.in_specs)} "
                       f"positional argument(s) and keywords {sorted(self.kwargs_specs)}; "
                       f"got {len(args)} and {sorted(kwargs)}.")
    return dataclasses.replace(
        self,
        in_specs=tuple(plan_file.bind_specs(s, a, f"argument {i}", self.name)
                       for i, (s, a) in enumerate(zip(self.in_specs, args))),
        kwargs_specs={k: plan_file.bind_specs(self.kwargs_specs[k], v,
                                              f"keyword argument {k!r}", self.name)
                      for k, v in kwargs.items()})

  @classmethod
  def load(cls, path) -> "Plan":
    """Reads a plan `save` wrote. Raises `plan_file.PlanFileError` (a ValueError)
    naming the field that is wrong in a truncated or edited file."""
    return plan_file.load(path, cls)

  def summary(self, width: int = 100) -> str:
    """Readable report, lines at most `width` characters: the cost next to the
    baselines, every kind of dimension with its axes and why, each layer's specs.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import tapas_jax as tapas
      >>> plan = tapas.search(lambda w, x: jnp.sum(jnp.tanh(x @ w)),
      ...                     jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
      ...                     jax.ShapeDtypeStruct((65536, 4096), jnp.float32),
      ...                     mesh={"data": 8}, device="h100")
      >>> print(plan.summary())  # doctest: +ELLIPSIS
      Plan 'tapas' on mesh data=8, profile h100
      ...
        layout               step ms    sent MiB/device    memory GiB/device
        tapas                ...
        data_parallel        ...
        fsdp                 ...
        dimension                                 size  axes       why: best other choice, its cost
        batch                                    65536  data       unsplit: +...
    """
    return "\n".join(_fit(line, width) for line in self._report_lines())

  def _report_lines(self) -> list[str]:
    s = self.stats
    mesh = " x ".join(f"{a}={n}" for a, n in self.mesh_axes.items())
    lines = [f"Plan {self.name!r} on mesh {mesh}, profile {self.device}",
             f"  {s.num_equations} equations; {s.num_layer_instances} layer instances of "
             f"{s.num_unique_layers} unique; {_timings(s)}; solver {s.solver_status}", ""]
    lines.append(f"  {'layout':<16} {'step ms':>11} {'sent MiB/device':>18} "
                 f"{'memory GiB/device':>20}")
    for name, step, comm, mem in self._figures():
      lines.append(f"  {name:<16} {step * 1e3:>11.3f} {comm / 2**20:>18.2f} "
                   f"{mem / 2**30:>20.3f}")
    lines += self._compiled_lines()
    lines += ["", f"  {'dimension':<38} {'size':>7}  {'axes':<10} why: best other choice, "
              "its cost"]
    split = [d for d in self.decisions if d.axes]
    kept = [d for d in self.decisions if not d.axes]
    for layer, policy in self.remat:
      lines.append(f"  rematerialise {layer}: jax.checkpoint policy {policy}")
    if self.remat:
      lines.append("")
    for d in split + kept[:_REPLICATED_ROWS]:
      lines.append(f"  {_fit(d.name, 38):<38} {d.size:>7}  {'x'.join(d.axes) or '-':<10} "
                   f"{d.why}")
    if len(kept) > _REPLICATED_ROWS:
      lines.append(f"  ... {len(kept) - _REPLICATED_ROWS} more kinds of dimension left "
                   "unsplit (plan.decisions has them all)")
    if not self.decisions:
      lines.append("  (no dimension can be split on this mesh)")
    for layer in self.layers:
      used = dict(layer.use_specs)
      lines += ["", f"  layer {layer.name} x{layer.instances}: parameter, stored as"
                + (" (used as)" if used else "")]
      # Gathered parameters first: where storage and use differ is the news.
      shown = sorted(layer.param_specs, key=lambda ps: ps[0] not in used)[:8]
      for path, spec in shown:
        use = f" ({_spec_text(used[path])})" if path in used else ""
        lines.append(f"    {_fit(path, 56):<56} {_spec_text(spec)}{use}")
      if len(layer.param_specs) > 8:
        lines.append(f"    ... {len(layer.param_specs) - 8} more")
    return lines

  def _compiled_lines(self) -> list[str]:
    c = self.compiled
    if c is None:
      return []
    size = format_bytes
    verdict = "fits" if c.fits else "DOES NOT FIT"
    lines = ["", f"  compiled for {c.target}: {verdict}, peak {size(c.peak_bytes)} of "
             f"{size(c.hbm_bytes)} (predicted {size(self.stats.predicted_memory_bytes)}), "
             f"sends {size(dict(c.comm_bytes).get('total', 0.0))}"]
    if len(c.rounds) > 1:
      lines += [f"    search {k + 1} under {size(b)}: predicted {size(p)}, compiled "
                f"{size(m)}" for k, (b, p, m) in enumerate(c.rounds)]
    if c.error:
      lines.append(f"    compiler: {c.error}")
    return lines

  def _figures(self) -> list[tuple[str, float, float, float]]:
    s = self.stats
    rows = [(self.name, s.predicted_step_s, s.predicted_comm_bytes, s.predicted_memory_bytes)]
    return rows + [(b.name, b.step_s, b.comm_bytes, b.memory_bytes) for b in self.baselines]

  def _repr_html_(self) -> str:
    """The summary as HTML tables, for notebooks."""
    esc = html.escape
    s = self.stats
    mesh = " &times; ".join(f"{esc(a)}={n}" for a, n in self.mesh_axes.items())
    out = [f"<div><b>Plan {esc(self.name)}</b> on mesh {mesh}, profile {esc(self.device)}"
           f"<br><small>{s.num_equations} equations; {s.num_layer_instances} layer "
           f"instances of {s.num_unique_layers} unique; {esc(_timings(s))}</small>"]
    out.append(_html_table(["layout", "step ms", "sent MiB/device", "memory GiB/device"],
                           [(n, f"{t * 1e3:.3f}", f"{b / 2**20:.2f}", f"{m / 2**30:.3f}")
                            for n, t, b, m in self._figures()]))
    out += [f"<small>{esc(line.strip())}</small><br>" for line in self._compiled_lines()]
    if self.remat:
      out.append(_html_table(["rematerialised layer", "jax.checkpoint policy"],
                             list(self.remat)))
    out.append(_html_table(["dimension", "size", "axes", "why"],
                           [(d.name, d.size, "×".join(d.axes) or "-", d.why)
                            for d in self.decisions]))
    for layer in self.layers:
      used = dict(layer.use_specs)
      out.append(f"<b>{esc(layer.name)}</b> &times;{layer.instances}")
      out.append(_html_table(["parameter", "stored as", "used as"],
                             [(p, _spec_text(spec), _spec_text(used[p]) if p in used else "")
                              for p, spec in layer.param_specs]))
    return "".join(out) + "</div>"


# The summary lists every split dimension, and this many of the widest unsplit ones.
_REPLICATED_ROWS = 8


def _fit(text: str, width: int) -> str:
  return text if len(text) <= width else text[:width - 3] + "..."


def _html_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
  body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                 for row in rows)
  return f"<table><tr>{head}</tr>{body}</table>"


def _spec_text(spec: PartitionSpec) -> str:
  return "P(" + ", ".join(repr(e) for e in spec) + ")"


def _timings(s: PlanStats) -> str:
  """The stage timings, each stage that took time (the plan and the report's baselines
  are stages too: together they add up to the call)."""
  stages = [("trace", s.trace_s), ("fold", s.fold_s), ("search", s.search_s),
            ("plan", s.plan_s), ("report", s.report_s)]
  return ", ".join(f"{name} {t:.2f} s" for name, t in stages
                   if t or name in ("trace", "fold", "search"))


def make_plan(problem: Problem, folded: Folded, solution: Solution, args: Sequence[Any],
              search_s: float, name: str = "tapas",
              input_layouts: Mapping[int, costlib.Layout] | None = None,
              kwargs: Mapping[str, Any] | None = None,
              baselines: Sequence[BaselineFigures] = (), report_s: float = 0.0):
  """Turns a solution into a `Plan` (PartitionSpecs per argument, report, stats).

  Args:
    input_layouts: inputs stored in a fixed layout rather than their classes' (the
      FSDP baseline); their specs come from here.
    kwargs: the keyword arguments traced (after `args`, in sorted name order).
    baselines: expert layouts' figures to report next to this plan's.
    report_s: seconds costing them (`PlanStats.report_s`).
  """
  start = time.perf_counter()
  g = problem.graph
  fixed = input_layouts or {}
  specs = [PartitionSpec(*(fixed.get(i.value) or problem.layout(i.value, solution.choice))
                         .to_partition_spec()) for i in g.inputs]
  names = sorted(kwargs or {})
  all_specs, k = [], 0
  for arg in tuple(args) + tuple(kwargs[n] for n in names):
    leaves, treedef = jax.tree_util.tree_flatten(arg)
    all_specs.append(jax.tree_util.tree_unflatten(treedef, specs[k:k + len(leaves)]))
    k += len(leaves)
  in_specs, kwargs_specs = all_specs[:len(args)], dict(zip(names, all_specs[len(args):]))
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
    layers.append(LayerStrategy(
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
  constraints = _constraints(problem, solution, fixed)
  rows = decisions(problem, solution)
  stats = PlanStats(
      num_equations=len(g.ops),
      num_layer_instances=len(folded.instances),
      num_unique_layers=len(folded.unique_layers),
      trace_s=g.trace_s + g.walk_s,
      fold_s=folded.fold_s,
      search_s=search_s,
      predicted_step_s=solution.step_s,
      predicted_comm_bytes=solution.comm_bytes,
      predicted_state_bytes=solution.state_bytes,
      predicted_memory_bytes=solution.memory_bytes,
      cost_tables_built=solution.tables_built,
      solver_status=solution.status,
      plan_s=time.perf_counter() - start,
      report_s=report_s,
  )
  return Plan(mesh_axes=dict(zip(problem.mesh.axis_names, problem.mesh.axis_sizes)),
              device=problem.profile.name, in_specs=tuple(in_specs),
              class_axes=class_axes, layers=tuple(layers), stats=stats,
              fingerprint=g.regions[0].fingerprint, name=name, constraints=constraints,
              kwargs_specs=kwargs_specs,
              input_types=tuple((i.path, str(g.types[i.value])) for i in g.inputs),
              decisions=rows, baselines=tuple(baselines),
              remat=remat.policy_names(folded, solution.remat))


def decisions(problem: Problem, solution: Solution) -> tuple[Decision, ...]:
  """One `Decision` per kind of dimension with a choice (copies of a layer alike):
  split ones first, then the batch, widest first."""
  names = _class_names(problem)
  rows, seen = [], set()
  order = sorted((c for c, dom in enumerate(problem.domains) if len(dom) > 1),
                 key=lambda c: (not solution.choice.get(c), not problem.classes[c].batch,
                                -problem.classes[c].size, c))
  for c in order:
    axes = tuple(solution.choice.get(c, ()))
    name = names.get(c) or _generic(problem.classes[c].example) or f"class {c}"
    if (name, axes) in seen:
      continue
    seen.add((name, axes))
    rows.append(Decision(name=name, size=problem.classes[c].size, axes=axes,
                         why=_why(axes, solution.reasons.get(c))))
  return tuple(rows)


def _class_names(problem: Problem) -> dict[int, str]:
  """Names the program gives classes: logical axis names of parameter dims, "batch"."""
  g, out = problem.graph, {}
  for i in g.inputs:
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


def _why(axes: tuple[str, ...], reason) -> str:
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


def _spec(classes: Sequence[int | None], choice: Mapping[int, tuple[str, ...]]):
  """The PartitionSpec of a value whose dims are in these classes, as the cost tables
  read it (an axis splits only the first dim that asks for it)."""
  axes = [choice.get(c, ()) if c is not None else () for c in classes]
  layout = costlib.Layout(tables.mesh_dims(range(len(axes)), axes))
  return PartitionSpec(*layout.to_partition_spec())


def _generic(example: str) -> str:
  """'params/Block_3/MLP/fc1/kernel[1]' -> 'params/Block_*/MLP/fc1/kernel[1]'."""
  head, sep, dim = example.rpartition("[")
  return re.sub(r"\d+", "*", head) + sep + dim if sep else re.sub(r"\d+", "*", example)


def _constraints(problem: Problem, solution: Solution,
                 fixed: Mapping[int, costlib.Layout]) -> tuple:
  """Where a cut value is read in another layout than it was made or stored in, the
  reading equations of every copy get that layout pinned (see `plan.Constraint`)."""
  g, view = problem.graph, problem.view
  specs: dict[tuple, PartitionSpec] = {}  # copies of a layer read alike: one spec each

  def spec(classes):
    key = tuple(classes)
    if key not in specs:
      specs[key] = _spec(key, solution.choice)
    return specs[key]

  read_dims = functools.lru_cache(maxsize=None)(problem.read_dims)  # per (rep, value)
  top = g.region_ops(0)
  out = []
  # Contractions' results as planned, reduced where they are made: XLA propagates the
  # rest from these, and otherwise picks layouts of its own between them. A reader
  # through a cut gets the made layout first, then its own (below): XLA reduces the
  # result where it is made and reshards it, as the cut is priced.
  for op in top:
    rep = view.op_canon.get(op.index, op.index)
    rule = problem.rules.get(rep)
    tensors = [x for x in op.inputs if g.types[x].shape and x not in g.literals]
    if rule is None or not rule.reduce or len(tensors) < 2 or not op.outputs:
      continue
    v = op.outputs[0]
    made = spec([None if f is None else problem.vclass(v, d)
                 for d, f in enumerate(rule.outputs[0])])
    for r in g.consumers.get(v, ()):
      reader, rep_r = g.ops[r], view.op_canon.get(r, r)
      if reader.region != 0:
        continue
      out += [Constraint(site=reader.site, slot=k, spec=made)
              for k, (x, y) in enumerate(zip(reader.inputs, g.ops[rep_r].inputs))
              if x == v]
  for op in top:
    # Each copy reads as the op standing for it does: an interior copy reading the
    # last layer's output reads it through the representative's cut.
    rep = view.op_canon.get(op.index, op.index)
    for k, (x, y) in enumerate(zip(op.inputs, g.ops[rep].inputs)):
      classes = read_dims(rep, y)
      if classes is None or x in g.literals:
        continue
      want = spec(classes)
      if x in fixed:
        have = PartitionSpec(*fixed[x].to_partition_spec())
      else:
        have = spec([problem.value_class.get((problem.cv(x), d))
                     for d in range(len(g.types[x].shape))])
      if want == have:  # read as it is: nothing for XLA to be told
        continue
      if x not in fixed and not _from_partial_sums(problem, solution.choice, x):
        # Made whole from whole values, read split through a cut (a statistic into
        # state stored apart): pinned as made first, so that XLA slices it here rather
        # than carrying the split back into the compute that makes it. (Made from
        # partial sums, a gradient, XLA may reduce-scatter straight into the read
        # layout: pinning it whole first would force an all-reduce.)
        out.append(Constraint(site=op.site, slot=k, spec=have))
      out.append(Constraint(site=op.site, slot=k, spec=want))
  return tuple(out) + _scan_cut_constraints(problem, spec, fixed)


def _scan_cut_constraints(problem: Problem, spec, fixed: Mapping[int, costlib.Layout]
                          ) -> tuple:
  """A stacked parameter stored in another layout than the scan's body reads it in
  (`Problem.scan_cuts`): every body equation reading the iteration's slice reads it
  pinned in the body's layout, so XLA gathers one layer per iteration inside the loop
  (as priced) rather than the whole stack before it."""
  g, out = problem.graph, []
  for _, outer, inner, read in problem.scan_cuts:
    rank = len(g.types[inner].shape)
    if not read or not rank:
      continue
    stored = (PartitionSpec(*costlib.Layout(fixed[outer].dims[1:]).to_partition_spec())
              if outer in fixed else spec([problem.vclass(outer, d + 1) for d in range(rank)]))
    want = spec([problem.value_class[(inner, d)] for d in range(rank)])
    if want == stored:
      continue
    for c in g.consumers.get(inner, ()):
      out += [Constraint(site=g.ops[c].site, slot=k, spec=want)
              for k, x in enumerate(g.ops[c].inputs) if x == inner]
  return tuple(out)


def _from_partial_sums(problem: Problem, choice, v: int) -> bool:
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

