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
import html
import time
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from tapas_jax import plan_file
from tapas_jax.options import format_bytes
from tapas_jax.fold import Folded
from tapas_jax.plan_records import (BaselineFigures, CompiledFigures, Constraint, Decision,
                                    LayerStrategy, PlanStats)
from tapas_jax.solver import InputSpec, Solution

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
    use_specs: (path, PartitionSpec) of every argument leaf the compute reads in
      another layout than it is stored in, every layer instance's (`layers` lists only
      each unique layer's first instance, for the report).
    gradient_fences: `apply` has each unrolled layer's backward make its weight
      gradients before the layer below's backward starts, as the memory model assumes
      (set for profiles whose compiler reduces gradients as they are made; XLA:CPU's
      holds them all to the end).
    sums_past_fences: the fences leave out a layer's results that only sums read (a
      decoder layer's part of the encoder output's gradient), so that their partial
      sums are added up before one reduction (set where the compiler reassociates
      all-reduces, `DeviceProfile.reassociates_all_reduces`, as the model costs it).
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
  use_specs: tuple[tuple[str, PartitionSpec], ...] = ()
  gradient_fences: bool = False
  sums_past_fences: bool = False

  def save(self, path) -> None:
    """Writes the plan to `path` as JSON (see `tapas_jax.plan_file`), atomically."""
    plan_file.save(self, path)

  def shardings(self, mesh: jax.sharding.Mesh) -> tuple[Any, ...]:
    """`in_specs` as `NamedSharding`s on `mesh`: one pytree per positional argument,
    e.g. for `jax.jit(step, in_shardings=plan.shardings(mesh))` or `jax.device_put`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import tapas_jax as tapas
      >>> mesh = tapas.make_mesh({"data": 8})
      >>> plan = tapas.search(lambda x: x * 2, jnp.ones((8, 4)), mesh=mesh)
      >>> plan.shardings(mesh)[0].spec == jax.sharding.PartitionSpec("data", None)
      True
    """
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    return tuple(jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=is_spec)
                 for specs in self.in_specs)

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
    live = f" (live {size(c.live_peak_bytes)}, judged)" if c.live_peak_bytes else ""
    lines = ["", f"  compiled for {c.target}: {verdict}, peak {size(c.peak_bytes)}{live} of "
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


def make_plan(folded: Folded, solution: Solution, args: Sequence[Any], search_s: float,
              name: str = "tapas", kwargs: Mapping[str, Any] | None = None,
              baselines: Sequence[BaselineFigures] = (), report_s: float = 0.0) -> Plan:
  """Turns a solution into a `Plan` (PartitionSpecs per argument, report, stats).

  Everything the plan says of the layout comes from `solution.terms` (the solver's
  result in plan terms); the program's structure (its layers, its arguments' pytrees,
  the timings) from `folded` and `args`.

  Args:
    folded: the program traced and folded (`fold.fold`), the one solved.
    solution: from `solver.solve` or `solver.evaluate` on it.
    args: the positional arguments traced, for their pytree structure.
    search_s: seconds building the problem and solving it.
    name: "tapas", or the baseline's name.
    kwargs: the keyword arguments traced (after `args`, in sorted name order).
    baselines: expert layouts' figures to report next to this plan's.
    report_s: seconds costing them (`PlanStats.report_s`).
  """
  start = time.perf_counter()
  g, terms = folded.graph, solution.terms
  specs = [i.stored for i in terms.inputs]
  names = sorted(kwargs or {})
  all_specs, k = [], 0
  for arg in tuple(args) + tuple(kwargs[n] for n in names):
    leaves, treedef = jax.tree_util.tree_flatten(arg)
    all_specs.append(jax.tree_util.tree_unflatten(treedef, specs[k:k + len(leaves)]))
    k += len(leaves)
  in_specs, kwargs_specs = all_specs[:len(args)], dict(zip(names, all_specs[len(args):]))
  layers = _layers(folded, terms.inputs)
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
      solver_status=str(solution.status),
      plan_s=time.perf_counter() - start,
      report_s=report_s,
  )
  return Plan(mesh_axes=dict(terms.mesh_axes), device=terms.device, in_specs=tuple(in_specs),
              class_axes=terms.class_axes, layers=layers, stats=stats,
              fingerprint=g.regions[0].fingerprint, name=name, constraints=terms.constraints,
              kwargs_specs=kwargs_specs, input_types=tuple((i.path, i.type) for i in terms.inputs),
              decisions=terms.decisions, baselines=tuple(baselines), remat=terms.remat,
              gradient_fences=terms.gradient_fences, sums_past_fences=terms.sums_past_fences,
              use_specs=tuple((i.path, i.used) for i in terms.inputs if i.used is not None))


def _layers(folded: Folded, inputs: Sequence[InputSpec]) -> tuple[LayerStrategy, ...]:
  """Each unique layer's (then the glue's) parameters, as its first instance reads them."""
  g = folded.graph
  by_value = {i.value: i for i in inputs}
  groups = [(u.name, len(u.instances), folded.instances[u.instances[0]].ops)
            for u in folded.unique_layers]
  groups.append(("glue", 1, [i for seg in folded.glue for i in seg.ops]))
  out = []
  for layer_name, count, ops in groups:
    read: dict[str, int] = {}
    for i in ops:
      for v in g.ops[i].inputs:
        if v in by_value:
          read.setdefault(g.input_path[v], v)
    if not read:
      continue
    out.append(LayerStrategy(
        name=layer_name, instances=count,
        param_specs=tuple((path, by_value[v].stored) for path, v in read.items()),
        use_specs=tuple((path, by_value[v].used) for path, v in read.items()
                        if by_value[v].used is not None)))
  return tuple(out)
