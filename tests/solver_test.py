"""solver: elimination and the integer program against brute force, budget fitting,
`solve` end to end, and golden plans of the zoo's tiny models.

Golden plans live in `tests/golden/*.json`: each input's PartitionSpec by pytree path,
the split dimension classes and the predicted step time, communication and memory.
A change to the search that moves a plan fails `test_golden_plan` with a diff. When the
change is intended, regenerate the files and review the diff in git:

  python tests/solver_test.py --update-golden

(the same as `TAPAS_UPDATE_GOLDEN=1 python -m pytest tests/solver_test.py -k golden`).

jax lines differentiate some functions differently (from 0.11, tanh's derivative is one
`one_minus_square` and GPT's train step has 20 ops fewer), so where a line's program
moves a figure the record has a file from that line on, `NAME.jax0.11.json`; a line
reads the newest such file at or below it, else `NAME.json`. Run the regeneration on
each line CI tests: it writes a line's own file only where its record differs from the
one it reads.
"""

import dataclasses
import functools
import itertools
import json
import math
import os
import pathlib
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import tapas_jax as tapas
from tapas_jax import api, baselines, cost, measure, models, solver
from tapas_jax.solver.budget import fit_budget
from tapas_jax.solver.eliminate import Schedule, eliminate, merge
from tapas_jax.solver.ilp import IlpResult, solve_ilp
from tapas_jax.solver import tables
from tapas_jax.solver.tables import Table, TableBuilder, all_tables, evaluate_tables

# HiGHS stops once its incumbent is within this relative gap of its bound (scipy's
# default `mip_rel_gap`), so the integer program is optimal to this tolerance.
MIP_REL_GAP = 1e-4


# -- random objectives ---------------------------------------------------------------


def random_objective(seed, inf_rate=0.1):
  """(factors, domain_size): tables over 1-3 of 3-7 classes with domains of 1-4 entries.

  Scopes come in any order and may repeat (elimination merges them); some entries are
  +inf (an op split twice over one axis); at least one assignment is finite.
  """
  rng = np.random.default_rng(seed)
  while True:
    n = int(rng.integers(3, 8))
    domain_size = {c: int(rng.integers(1, 5)) for c in range(n)}
    factors = []
    for _ in range(int(rng.integers(n, 2 * n + 2))):
      k = int(rng.integers(1, 4))
      scope = tuple(int(c) for c in rng.permutation(n)[:k])
      table = rng.uniform(0.0, 10.0, [domain_size[c] for c in scope])
      table[rng.random(table.shape) < inf_rate] = np.inf
      factors.append((scope, table))
    if np.isfinite(brute_force(factors, domain_size).min()):
      return factors, domain_size


def brute_force(factors, domain_size):
  """The objective of every joint assignment: an array with one axis per class."""
  n = len(domain_size)
  total = np.zeros([domain_size[c] for c in range(n)])
  for scope, table in factors:
    order = np.argsort(scope)
    aligned = np.transpose(table, order)
    shape = [domain_size[c] if c in scope else 1 for c in range(n)]
    total = total + aligned.reshape(shape)
  return total


def value(factors, assignment):
  return sum(float(table[tuple(assignment[c] for c in scope)]) for scope, table in factors)


@pytest.mark.parametrize("seed", range(40))
def test_elimination_reaches_the_brute_force_minimum(seed):
  factors, domain_size = random_objective(seed)
  assignment = eliminate(factors, domain_size)
  assert set(assignment) == set(domain_size)
  assert all(0 <= assignment[c] < n for c, n in domain_size.items())
  # Ties exist: compare objective values, not assignments.
  assert value(factors, assignment) == pytest.approx(
      brute_force(factors, domain_size).min(), rel=1e-12)


def _eliminate_reference(factors, domain_size):
  """Elimination as first written: neighbours recomputed from every factor each step."""
  factors = list(merge(factors).items())
  variables = set(domain_size)
  for scope, _ in factors:
    variables.update(scope)
  trail = []
  while variables:
    neighbours = {v: set() for v in variables}
    for scope, _ in factors:
      for v in scope:
        neighbours[v].update(scope)
    var = min(variables, key=lambda v: (math.prod(domain_size[u] for u in neighbours[v]), v))
    mine = [f for f in factors if var in f[0]]
    factors = [f for f in factors if var not in f[0]]
    scope = tuple(sorted(set().union(*[set(s) for s, _ in mine]) | {var}))
    total = np.zeros(tuple(domain_size[c] for c in scope))
    for s, table in mine:
      total = total + table.reshape([domain_size[c] if c in s else 1 for c in scope])
    axis = scope.index(var)
    rest = tuple(c for c in scope if c != var)
    trail.append((var, rest, np.argmin(total, axis=axis)))
    factors.append((rest, np.min(total, axis=axis)))
    variables.discard(var)
  assignment = {}
  for var, rest, arg in reversed(trail):
    assignment[var] = int(arg[tuple(assignment[c] for c in rest)]) if rest else int(arg)
  return assignment, [var for var, _, _ in trail]


@pytest.mark.parametrize("seed", range(40))
def test_elimination_picks_what_the_plain_algorithm_picks(seed):
  # The incremental bookkeeping must not change the order classes are eliminated in
  # nor any sum: same assignment, ties included (tables rounded to make ties common).
  factors, domain_size = random_objective(seed)
  rounded = [(s, np.round(t)) for s, t in factors]
  schedule = Schedule(tuple(merge(factors)), domain_size)  # one schedule, many tables
  for fs in (factors, rounded):
    expected, order = _eliminate_reference(fs, domain_size)
    assert eliminate(fs, domain_size) == expected
    assert schedule.run(tuple(merge(fs).values())) == expected
    assert [step.var for step in schedule.steps] == order
  with pytest.raises(ValueError, match="tables for"):
    schedule.run(())


def test_elimination_assigns_classes_no_table_mentions():
  factors = [((0,), np.array([2.0, 1.0]))]
  assert eliminate(factors, {0: 2, 1: 3}) == {0: 1, 1: 0}


# -- budget fitting: Lagrange bisection vs the integer program vs brute force --------


def random_budget_instance(seed):
  """(time factors, memory tables, domain_size, budget) shaped like the search's.

  Memory is bytes divided by the shards each class's choice makes (domain entry 0 is
  unsplit), plus a fixed part; the budget sits between the leanest and the fastest
  plan's memory (or a tenth above the leanest where the fastest plan is also the
  leanest), or just under the leanest (infeasible).
  """
  rng = np.random.default_rng(1000 + seed)
  factors, domain_size = random_objective(seed, inf_rate=0.05)
  shards = {c: np.concatenate([[1.0], rng.choice([2.0, 4.0, 8.0], n - 1)])
            for c, n in domain_size.items()}
  memory = [Table((), np.array(float(rng.uniform(0, 5))), np.array(0.0))]
  for _ in range(int(rng.integers(2, 5))):
    scope = tuple(int(c) for c in rng.permutation(len(domain_size))[:int(rng.integers(1, 3))])
    split = np.ones([domain_size[c] for c in scope])
    for axis, c in enumerate(scope):
      split = split * shards[c].reshape([-1 if a == axis else 1 for a in range(len(scope))])
    table = rng.uniform(10, 100) / split
    memory.append(Table(scope, table, np.zeros_like(table)))
  time = brute_force(factors, domain_size)
  mem = brute_force([(t.scope, t.value) for t in memory if t.scope], domain_size) \
      + sum(float(t.value) for t in memory if not t.scope)
  lean = mem[np.isfinite(time)].min()
  fastest = mem[time == time.min()].min()
  # Never exactly the leanest plan's memory: sums in another order round differently.
  spread = max(fastest - lean, 0.1 * lean)
  budget = lean + float(rng.uniform(-0.2, 1.0)) * spread
  return factors, memory, domain_size, budget


def _lagrange_run(factors, memory, domain_size):
  """weight -> the assignment minimising time + weight * memory, as `solve` builds it."""
  def run(weight):
    weighted = [(t.scope, weight * t.value) for t in memory if t.scope and weight]
    return eliminate(factors + weighted, domain_size)
  return run


@dataclasses.dataclass(frozen=True)
class BudgetCase:
  opt: float        # brute-force: least time within the budget (inf: none fits)
  lean: float       # brute-force: least memory of any finite-time plan
  fit: solver.BudgetResult
  fit_time: float
  fit_mem: float    # brute-force memory of the bisection's plan
  ilp: IlpResult
  ilp_time: float
  ilp_mem: float
  budget: float


@functools.lru_cache(maxsize=None)
def budget_case(seed):
  factors, memory, domain_size, budget = random_budget_instance(seed)
  time = brute_force(factors, domain_size)
  mem = brute_force([(t.scope, t.value) for t in memory if t.scope], domain_size) \
      + sum(float(t.value) for t in memory if not t.scope)
  finite = np.isfinite(time)
  fits = finite & (mem <= budget)
  fit = fit_budget(_lagrange_run(factors, memory, domain_size), memory, budget)
  rows = [[(t.scope, t.value) for t in memory]]  # one budget row
  ilp = solve_ilp(factors, domain_size, rows, budget, None)
  ilp_time = value(factors, ilp.assignment) if ilp.assignment is not None else math.inf
  ilp_mem = (evaluate_tables(memory, ilp.assignment)[0] if ilp.assignment is not None
             else math.inf)
  return BudgetCase(opt=float(time[fits].min()) if fits.any() else math.inf,
                    lean=float(mem[finite].min()), fit=fit,
                    fit_time=value(factors, fit.assignment),
                    fit_mem=float(mem[tuple(fit.assignment[c] for c in range(len(mem.shape)))]),
                    ilp=ilp, ilp_time=ilp_time,
                    ilp_mem=ilp_mem, budget=budget)


BUDGET_SEEDS = range(40)


@pytest.mark.parametrize("seed", BUDGET_SEEDS)
def test_integer_program_is_the_constrained_optimum(seed):
  case = budget_case(seed)
  if math.isinf(case.opt):
    assert case.ilp.assignment is None and case.ilp.status == "infeasible"
    return
  assert case.ilp.status == "optimal"
  assert case.ilp_mem <= case.budget * (1 + 1e-9)
  # Two sums of the same terms in different orders: equal up to rounding.
  assert case.opt * (1 - 1e-12) <= case.ilp_time <= case.opt * (1 + MIP_REL_GAP)


@pytest.mark.parametrize("seed", BUDGET_SEEDS)
def test_lagrange_bisection_fits_or_says_why(seed):
  case = budget_case(seed)
  fit = case.fit
  # It fails exactly when even the leanest plan is over the budget, and then returns
  # the leanest plan (the largest weight makes memory dominate).
  assert fit.fits == (case.lean <= case.budget)
  assert fit.used_bytes == pytest.approx(case.fit_mem, rel=1e-12)
  if not fit.fits:
    assert fit.used_bytes == pytest.approx(case.lean, rel=1e-12)
    return
  assert fit.used_bytes <= case.budget
  # Never better than the constrained optimum, and within the Lagrangian certificate:
  # the plan minimises time + w * memory, so for the optimum x*,
  # time(fit) - time(x*) <= w * (memory(x*) - memory(fit)) <= w * (budget - used).
  assert case.fit_time >= case.opt * (1 - 1e-12)
  assert case.ilp_time <= case.fit_time * (1 + MIP_REL_GAP)
  assert case.fit_time - case.opt <= fit.weight * (case.budget - fit.used_bytes) + 1e-9


def _escalation(run, memory, budget):
  """`fit_budget` without its first probe: weights 1e-12, 1e-11, ... until one fits, then
  bisection (the reference the probe must agree with)."""
  used_by = lambda a: evaluate_tables(memory, a)[0]  # noqa: E731
  lo, hi, best = 0.0, 1e-12, None
  for _ in range(60):
    assignment = run(hi)
    if (used := used_by(assignment)) <= budget:
      best = (assignment, True, hi, used)
      break
    hi *= 10
  if best is None:
    return assignment, False, hi, used
  for _ in range(30):
    mid = (lo + hi) / 2
    assignment = run(mid)
    if (used := used_by(assignment)) <= budget:
      hi, best = mid, (assignment, True, mid, used)
    else:
      lo = mid
  return best


@pytest.mark.parametrize("seed", BUDGET_SEEDS)
def test_an_infeasible_budget_is_settled_by_one_elimination_with_the_escalations_answer(
    seed):
  factors, memory, domain_size, budget = random_budget_instance(seed)
  calls = []
  run = _lagrange_run(factors, memory, domain_size)
  fit = fit_budget(lambda w: calls.append(w) or run(w), memory, budget)
  assignment, fits, weight, used = _escalation(run, memory, budget)
  assert (dict(fit.assignment), fit.fits, fit.weight, fit.used_bytes) == (
      dict(assignment), fits, weight, used)
  if not fits:
    assert len(calls) == 1


def test_budget_instances_cover_every_regime():
  """The seeds above hold infeasible budgets, binding ones, and a Lagrange gap (a plan
  within the budget no weight reaches). Measured on seeds 0-999 (before `repair`, which
  needs a traced problem): 61 of 825 feasible instances have a gap; among those the
  median is 3%, the 90th percentile 11%, the largest 29%. Nothing bounds it a priori
  beyond the certificate above, so no bound is asserted."""
  cases = [budget_case(seed) for seed in BUDGET_SEEDS]
  feasible = [c for c in cases if math.isfinite(c.opt)]
  assert len(feasible) < len(cases)
  assert any(c.opt > min_time(seed) * (1 + 1e-9)  # the budget binds
             for seed, c in zip(BUDGET_SEEDS, cases) if math.isfinite(c.opt))
  assert any(c.fit_time > c.opt * (1 + 1e-9) for c in feasible)


def min_time(seed):
  factors, _, domain_size, _ = random_budget_instance(seed)
  return float(brute_force(factors, domain_size).min())


# -- solve() end to end on a traced program -------------------------------------------

MESH = {"data": 2, "model": 4}


@functools.lru_cache(maxsize=None)
def gpt_problem(num_layers, fold):
  """GPT tiny's train step posed on the cpu profile, where tiny models get a plan that
  splits something."""
  m = models.get_model("gpt", "tiny", num_layers=num_layers)
  return api.prepare(m.train_step(), (m.abstract_state(), m.batch_spec(8)), mesh=MESH,
                     device="cpu", fold=fold).problem


def test_elimination_and_integer_program_agree_unbudgeted():
  problem = gpt_problem(2, fold=False)
  by_elimination = solver.solve(problem, solver="elimination")
  by_ilp = solver.solve(problem, solver="ilp", time_limit=60)
  assert by_elimination.status == by_ilp.status == "optimal"
  assert by_elimination.choice, "the plan splits something: a non-trivial comparison"
  # Elimination is exact; HiGHS is optimal to its relative gap. Ties make the choices
  # differ, so compare objectives.
  assert by_elimination.step_s <= by_ilp.step_s * (1 + 1e-12)
  assert by_ilp.step_s <= by_elimination.step_s * (1 + MIP_REL_GAP)
  # `evaluate` costs a choice by the same tables the solver minimised.
  for sol in (by_elimination, by_ilp):
    again = solver.evaluate(problem, sol.choice)
    assert again.step_s == pytest.approx(sol.step_s, rel=1e-12)
    assert again.comm_bytes == pytest.approx(sol.comm_bytes, rel=1e-12)
    assert again.state_bytes == pytest.approx(sol.state_bytes, rel=1e-12)


def test_reuse_builds_fewer_tables_and_the_same_objective():
  problem = gpt_problem(4, fold=True)
  shared, own = TableBuilder(problem, reuse=True), TableBuilder(problem, reuse=False)
  reused, built = all_tables(problem, shared), all_tables(problem, own)
  # Table for table, the same numbers: reuse only skips recomputing them.
  assert [t.scope for t in reused] == [t.scope for t in built]
  for a, b in zip(reused, built):
    np.testing.assert_array_equal(a.value, b.value)
    np.testing.assert_array_equal(a.comm, b.comm)
  with_reuse = solver.solve(problem, reuse=True)
  without = solver.solve(problem, reuse=False)
  assert with_reuse.choice and with_reuse.step_s == without.step_s
  assert with_reuse.comm_bytes == without.comm_bytes
  assert with_reuse.tables_built == shared.built < without.tables_built == own.built
  # Built once per structurally distinct op: as many for 8 layers as for 4.
  deeper = gpt_problem(8, fold=True)
  builder = TableBuilder(deeper, reuse=True)
  all_tables(deeper, builder)
  assert builder.built == shared.built


class _EntrywiseBuilder(TableBuilder):
  """Tables as first written: one entry at a time, in Python."""

  def _compute(self, fpos, flops, out_type, epos, domains, traffic=()):
    p = self.p
    shape = tuple(len(d) for d in domains)
    t, b = np.zeros(shape), np.zeros(shape)
    dtype = out_type.dtype if out_type is not None else "float32"
    split = sorted({q for q in fpos if q is not None})
    for idx in itertools.product(*(range(n) for n in shape)):
      axes = tuple(domains[k][i] for k, i in enumerate(idx))
      used = [a for k in split for a in axes[k]]
      if len(used) != len(set(used)):
        t[idx] = np.inf
        continue
      shards = math.prod(p.mesh.size(a) for a in used)
      moved = sum(n / math.prod(p.mesh.size(a) for d in tables.mesh_dims(dims, axes)
                                for a in d) for n, dims in traffic)
      total = cost.roofline_time(flops / shards, moved, p.profile, dtype)
      sent = 0.0
      for ttype, src, partial, dst in epos:
        src_d = src.dims if isinstance(src, cost.Layout) else tables.mesh_dims(src, axes)
        dst_d = dst.dims if isinstance(dst, cost.Layout) else tables.mesh_dims(dst, axes)
        edge = tables._edge_cost(ttype.shape, ttype.itemsize, src_d,
                                 tables._eval_partial(partial, axes), dst_d, p.mesh,
                                 p.profile)
        if edge is None:
          self.impossible = getattr(self, "impossible", 0) + 1
          total = np.inf
          break
        total += edge[0]
        sent += edge[1]
      t[idx], b[idx] = total, sent
    return t, b


@pytest.mark.parametrize("family, mesh, fixed", [
    ("gpt", {"data": 2, "model": 4}, None),
    ("llama", {"data": 2, "fsdp": 2, "model": 2}, None),
    # Fixed input layouts (edges from a Layout): dim 0 over "data" ...
    ("t5", {"data": 2, "model": 4}, "data"),
    # ... or over an axis the mesh lacks: every edge from those inputs is impossible
    # (inf, and the bytes of the op's edges before it).
    ("vit", {"data": 2, "model": 4}, "pipe"),
    ("resnet", {"data": 4, "model": 2}, None),
])
def test_tables_are_the_entrywise_sums_bit_for_bit(family, mesh, fixed):
  m = models.get_model(family, "tiny")
  problem = api.prepare(m.train_step(), (m.abstract_state(), m.batch_spec(8)), mesh=mesh,
                        device="h100").problem
  layouts = None
  if fixed:
    g = problem.graph
    layouts = {i.value: cost.Layout(((fixed,),) + ((),) * (len(g.types[i.value].shape) - 1))
               for i in g.inputs if g.types[i.value].shape[:1] and
               g.types[i.value].shape[0] % mesh.get(fixed, 1) == 0}
    assert layouts
  fast = all_tables(problem, TableBuilder(problem, reuse=True, input_layouts=layouts))
  entrywise = _EntrywiseBuilder(problem, reuse=True, input_layouts=layouts)
  slow = all_tables(problem, entrywise)
  assert [t.scope for t in fast] == [t.scope for t in slow]
  assert any(np.isinf(t.value).any() for t in slow), "some choice clashes: inf entries"
  assert any(np.any(t.comm > 0) for t in slow), "some choice sends bytes"
  assert (getattr(entrywise, "impossible", 0) > 0) == (fixed == "pipe")
  for a, b in zip(fast, slow):
    assert a.value.shape == b.value.shape
    assert a.value.tobytes() == b.value.tobytes() and a.comm.tobytes() == b.comm.tobytes()


# -- golden plans -----------------------------------------------------------------------

GOLDEN_DIR = pathlib.Path(__file__).parent / "golden"
UPDATE_GOLDEN = os.environ.get("TAPAS_UPDATE_GOLDEN") == "1"
REGENERATE = "python tests/solver_test.py --update-golden"
JAX_LINE = tuple(int(x) for x in jax.__version__.split(".")[:2])


def golden_path(name: str) -> pathlib.Path:
  """The record this jax line reads: the newest `NAME.jaxX.Y.json` at or below it."""
  lines = []
  for path in GOLDEN_DIR.glob(f"{name}.jax*.json"):
    line = tuple(int(x) for x in path.name[len(name) + 4:-len(".json")].split("."))
    if line <= JAX_LINE:
      lines.append((line, path))
  return max(lines)[1] if lines else GOLDEN_DIR / f"{name}.json"
FIGURES = ("predicted_step_s", "predicted_comm_bytes", "predicted_state_bytes",
           "predicted_memory_bytes")
# (family, memory budget as a fraction of the unbudgeted plan's predicted memory).
# On the cpu profile tiny models split their batch, attention heads and MLP.
# Budgets as a fraction of the free plan's memory: tiny models sit close to their floor
# (the leanest plan takes 0.91x for GPT, 0.82x for LLaMA), so the budget is just under 1.
GOLDEN = [("gpt", None), ("gpt", 0.95), ("llama", None), ("llama", 0.95)]


@functools.lru_cache(maxsize=None)
def golden_plan(family, fraction):
  m = models.get_model(family, "tiny")
  args = (m.train_step(), m.abstract_state(), m.batch_spec(8))
  budget = None
  if fraction is not None:
    budget = fraction * golden_plan(family, None)[0].stats.predicted_memory_bytes
  return tapas.search(*args, mesh=MESH, device="cpu", memory_budget=budget), budget


def _key(k):
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def plan_record(plan, budget):
  """What a golden file pins: every input's spec by pytree path, the split classes, the
  predicted figures."""
  specs = {}
  for arg, tree in enumerate(plan.in_specs):
    flat = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
    for path, spec in flat:
      specs["/".join([f"arg{arg}"] + [_key(k) for k in path])] = [
          e if e is None or isinstance(e, str) else list(e) for e in spec]
  return {
      "regenerate": REGENERATE,
      "mesh": dict(plan.mesh_axes),
      "device": plan.device,
      "memory_budget_bytes": budget,
      "solver_status": plan.stats.solver_status,
      "remat": [list(r) for r in plan.remat],
      "class_axes": [[ex, size, list(axes)] for ex, size, axes in plan.class_axes],
      **{f: getattr(plan.stats, f) for f in FIGURES},
      "in_specs": specs,
  }


def golden_diff(want, got):
  """Readable lines: what moved between the golden record and the current one."""
  lines = []
  for key in ("mesh", "device", "solver_status", "remat"):
    if want.get(key, [] if key == "remat" else None) != got[key]:
      lines.append(f"{key}: {want.get(key)!r} -> {got[key]!r}")
  for key in ("memory_budget_bytes",) + FIGURES:
    a, b = want.get(key), got[key]
    if (a is None) != (b is None) or (a is not None and not math.isclose(a, b, rel_tol=1e-6)):
      lines.append(f"{key}: {a!r} -> {b!r}")
  old, new = want.get("in_specs", {}), got["in_specs"]
  for path in sorted(set(old) | set(new)):
    if old.get(path) != new.get(path):
      lines.append(f"spec {path}: {old.get(path, 'absent')} -> {new.get(path, 'absent')}")
  old_axes = [tuple(map(str, row)) for row in want.get("class_axes", [])]
  new_axes = [tuple(map(str, row)) for row in got["class_axes"]]
  # Rows of equal class size come in the solver's dict order, which means nothing.
  if sorted(old_axes) != sorted(new_axes):
    lines += [f"class_axes lost: {row}" for row in old_axes if row not in new_axes]
    lines += [f"class_axes new: {row}" for row in new_axes if row not in old_axes]
    if set(old_axes) == set(new_axes):
      lines.append("class_axes: the same rows, a different number of times")
  return lines


def _dumps(record):
  """JSON with one line per spec and per class row, so git diffs read like plan diffs."""
  parts = []
  for key in sorted(record):
    v = record[key]
    if key == "in_specs":
      rows = [f"  {json.dumps(p)}: {json.dumps(s)}" for p, s in sorted(v.items())]
    elif key == "class_axes":
      rows = [f"  {json.dumps(row)}" for row in v]
    else:
      parts.append(f" {json.dumps(key)}: {json.dumps(v)}")
      continue
    opening, closing = ("{", "}") if key == "in_specs" else ("[", "]")
    parts.append(f" {json.dumps(key)}: {opening}\n" + ",\n".join(rows) + f"\n {closing}")
  return "{\n" + ",\n".join(parts) + "\n}\n"


@pytest.mark.parametrize("family,fraction", GOLDEN)
def test_golden_plan(family, fraction):
  plan, budget = golden_plan(family, fraction)
  got = plan_record(plan, budget)
  # A plan that splits nothing would pin little.
  assert any(any(e is not None for e in spec) for spec in got["in_specs"].values())
  if budget is not None:
    assert plan.stats.predicted_memory_bytes <= budget
  name = f"{family}_tiny_cpu" + ("" if fraction is None else f"_budget{fraction:g}")
  path = golden_path(name)
  if UPDATE_GOLDEN:
    GOLDEN_DIR.mkdir(exist_ok=True)
    if path.exists() and golden_diff(json.loads(path.read_text()), got):
      path = GOLDEN_DIR / f"{name}.jax{JAX_LINE[0]}.{JAX_LINE[1]}.json"
    path.write_text(_dumps(got))
    return
  if not path.exists():
    pytest.fail(f"no golden plan {path}; write it with: {REGENERATE}")
  want = json.loads(path.read_text())
  diff = golden_diff(want, got)
  if diff:
    pytest.fail(f"{family} tiny plan (mesh {MESH}, cpu, budget {budget}) differs from "
                f"{path.name} (golden -> now):\n  " + "\n  ".join(diff)
                + f"\nIf the change is intended, regenerate with: {REGENERATE}",
                pytrace=False)


def test_a_loop_inside_a_scanned_layer_is_searched_in_place():
  # A chunked attention's lax.map inside a scanned stack: a loop in a loop's body. Kept
  # whole it was priced as one replicated op, every operand gathered to it (data
  # parallel here: 2356 KiB predicted against the 1236 KiB XLA sends).
  m = models.get_model("llama", "tiny", scan_layers=True, num_layers=4, attention="chunked",
                       attention_chunk=16)
  args = (m.train_step(), m.abstract_state(), m.batch_spec(8))
  mesh = {"data": 2, "model": 4}
  prepared = api.prepare(args[0], args[1:], mesh=mesh, device="h100")
  view, graph = prepared.problem.view, prepared.graph
  nested = [i for i in view.loops if graph.ops[i].region != 0]
  assert nested, "the attention loops inside the layer scan are searched in place"
  for i in nested:
    body = next(r for r in graph.ops[i].subregions if graph.regions[r].trip_count)
    op = next(o for o in graph.ops if o.region == body)
    assert view.weight[op.index] == graph.regions[body].trip_count * view.weight[i]
  plan = baselines.baseline("data_parallel", *args, mesh=mesh, device="h100")
  step = tapas.apply(plan, args[0], mesh=tapas.make_mesh(mesh), donate_argnums=0)
  sent = measure.measure(step.lower(*args[1:]).compile(), 8).comm_bytes["total"]
  assert plan.stats.predicted_comm_bytes == pytest.approx(sent, rel=0.05)


if __name__ == "__main__":
  if sys.argv[1:] != ["--update-golden"]:
    sys.exit(f"usage: {sys.argv[0]} --update-golden  (rewrites {GOLDEN_DIR}/*.json)")
  os.environ["TAPAS_UPDATE_GOLDEN"] = "1"
  sys.exit(pytest.main([__file__, "-q", "-k", "golden"]))


# -- the solver's result, in plan terms --------------------------------------------


def test_a_solution_states_itself_in_plan_terms_once():
  problem = gpt_problem(2, fold=True)
  solution = solver.solve(problem)
  terms = solution.terms
  assert solution.terms is terms, "built once, when first read"
  assert solution.status is solver.Status.OPTIMAL and solution.status == "optimal"
  assert [i.path for i in terms.inputs] == [i.path for i in problem.graph.inputs]
  assert any(d.axes for d in terms.decisions) and terms.constraints
  assert any(i.used is not None and i.used != i.stored for i in terms.inputs), "ZeRO"
  assert all(i.used is None or i.used != i.stored for i in terms.inputs)
  with pytest.raises(ValueError, match="not made by solve or evaluate"):
    dataclasses.replace(solution, make_terms=None).terms  # noqa: B018


def test_ops_are_found_asking_each_folded_copy_as_its_representative():
  # `views.Standing.where` (the constraints' and the cut copies' walks) finds what a
  # walk over every op finds asking each op's standing-for op: the same ops, in
  # program order, with copies to map; at the top level or in every region.
  problem = gpt_problem(6, fold=True)
  g, canon = problem.graph, problem.view.op_canon
  assert problem.view.copies, "interior copies to ask as their representative"
  for region, ops in ((0, g.region_ops(0)), (None, g.ops)):
    standing = solver.views.Standing(g, problem.view, region)
    for keep in (lambda i: g.ops[i].primitive == "dot_general", lambda i: i % 3 == 0,
                 lambda i: i in problem.rules):
      assert standing.where(keep) == [op for op in ops if keep(canon.get(op.index, op.index))]


def test_a_layout_stated_by_its_specs_is_stored_as_stated():
  # The solved plan's own layout, stated per input path (stored as, used as), costed
  # again: every input is stored as it was, and the figures are the same.
  problem = gpt_problem(2, fold=True)
  solution = solver.solve(problem)
  inputs = solution.terms.inputs
  layout = solver.layout_choice(problem, stored={i.path: i.stored for i in inputs},
                                used={i.path: i.used or i.stored for i in inputs})
  again = solver.evaluate(problem, layout)
  assert [i.stored for i in again.terms.inputs] == [i.stored for i in inputs]
  assert again.state_bytes == solution.state_bytes


@pytest.mark.parametrize("options, splits", [
    (dict(batch_axes=("data", "model")), "batch"),
    (dict(batch_axes=("data", "model"), fsdp=True), "batch and state"),
    (dict(batch_axes=("data",), split=[("params/Block_0/MLP/fc1/kernel", 1)],
          split_axes=("model",)), "batch and columns"),
])
def test_layout_choice_states_the_expert_layouts(options, splits):
  problem = gpt_problem(2, fold=True)
  terms = solver.evaluate(problem, solver.layout_choice(problem, **options)).terms
  split = {d.name: d.axes for d in terms.decisions if d.axes}
  assert split.get("batch"), split
  stored = {i.path: i.stored for i in terms.inputs}
  if "state" in splits:  # ZeRO-3: every parameter stored split, somewhere
    assert any(s != jax.sharding.PartitionSpec(None, None) for p, s in stored.items()
               if p.endswith("fc1/kernel"))
  if "columns" in splits:
    fc1 = [s for p, s in stored.items() if p == "params/Block_0/MLP/fc1/kernel"]
    assert fc1 == [jax.sharding.PartitionSpec(None, "model")], fc1


def _wide_problem(family: str, device: str):
  """(prepared, its problem with the batch free to take any axis) of a tiny zoo train
  step on data 2 x model 4, as the report's baselines cost it."""
  m = models.get_model(family, "tiny")
  prepared = api.prepare(m.train_step(), (m.abstract_state(), m.batch_spec(8)),
                         mesh={"data": 2, "model": 4}, device=device)
  return prepared, solver.with_batch_axes(prepared.problem, None)


def _figures(solution) -> tuple[float, ...]:
  return (solution.step_s, solution.comm_bytes, solution.state_bytes,
          solution.activation_bytes)


@pytest.mark.parametrize("family,device", [("gpt", "h100"), ("t5", "tpu-v5p"),
                                           ("resnet", "cpu"), ("moe", "h100")])
def test_a_layouts_figures_alone_are_its_full_costs_figures(family, device):
  # `figures_only` builds each table over the chosen options only (or, unpinned, looks
  # up the full costing's): the same floats, for every expert layout, with remat too.
  prepared, problem = _wide_problem(family, device)
  u = prepared.folded.unique_layers[0].index
  for options, remat in ((dict(batch_axes=("data", "model")), None),
                         (dict(batch_axes=("data", "model"), fsdp=True), None),
                         (dict(batch_axes=("data",), fsdp=True), {u: "nothing_saveable"})):
    layout = solver.layout_choice(problem, **options)
    cache: dict = {}
    full = solver.evaluate(problem, layout, table_cache=cache, folded=prepared.folded,
                           remat=remat)
    for pin in (True, False):  # pinned, or looked up in the full costing's tables
      built = cache.copy()
      alone = solver.evaluate(problem, layout, table_cache=built, folded=prepared.folded,
                              remat=remat, figures_only=True, pin_batch=pin)
      assert _figures(alone) == _figures(full), options
      assert (alone.tables_built > 0) == pin  # unpinned: every table is the full one's
    assert full.comm_bytes > 0  # a layout that communicates: nothing trivially equal


@pytest.mark.parametrize("family,device", [("gpt", "h100"), ("t5", "tpu-v5p"),
                                           ("moe", "h100"), ("llama", "tpu-v5p")])
def test_layouts_costed_in_one_cache_share_tables_and_keep_their_own_figures(family, device):
  # The report's baselines share one cache: one pinned problem per batch pin, its op
  # tables kept per fixed layout of what each op reads. Each layout's figures are the
  # ones it gets costed alone, whatever was costed before it, in either order.
  _, problem = _wide_problem(family, device)
  layouts = [solver.layout_choice(problem, batch_axes=("data", "model"), fsdp=fsdp)
             for fsdp in (False, True)]
  alone = [_figures(solver.evaluate(problem, layout, table_cache={}, figures_only=True))
           for layout in layouts]
  assert alone[0] != alone[1]  # the layouts differ in what they cost
  for order in ((0, 1), (1, 0)):
    cache: dict = {}
    shared = {k: solver.evaluate(problem, layouts[k], table_cache=cache, figures_only=True)
              for k in order}
    assert [_figures(shared[k]) for k in (0, 1)] == alone, order
    assert shared[order[1]].tables_built < shared[order[0]].tables_built


def test_op_tables_kept_in_one_cache_are_kept_per_fixed_layout_they_read():
  # An op reading an input with no cut between (a plain function's weight) prices the
  # move from the input's fixed layout in its own table: costed in one cache, each
  # fixed layout keeps its own figures.
  f32 = jax.numpy.float32
  prepared = api.prepare(lambda w, x: jax.numpy.tanh(x @ w),
                         (jax.ShapeDtypeStruct((64, 128), f32),
                          jax.ShapeDtypeStruct((16, 64), f32)),
                         mesh={"data": 2, "model": 4}, device="h100")
  problem = prepared.problem
  w = problem.graph.inputs[0].value
  fixed = [None, {w: cost.Layout(("model", None))}, {w: cost.Layout((None, "data"))}]

  def figures(layouts, cache):
    s = solver.evaluate(problem, {}, input_layouts=layouts, table_cache=cache)
    return s.step_s, s.comm_bytes

  alone = [figures(layouts, {}) for layouts in fixed]
  assert len(set(alone)) == 3, alone
  cache: dict = {}
  assert [figures(layouts, cache) for layouts in fixed] == alone
  assert [figures(layouts, cache) for layouts in fixed[::-1]] == alone[::-1]


def test_layout_choice_names_what_is_not_an_input():
  problem = gpt_problem(2, fold=True)
  with pytest.raises(ValueError, match=r"used names \['no/such/param'\], not inputs"):
    solver.layout_choice(problem, used={"no/such/param": jax.sharding.PartitionSpec()})
  with pytest.raises(ValueError, match="brings its own input_layouts"):
    solver.evaluate(problem, solver.layout_choice(problem), input_layouts={})


def test_an_unknown_stop_keeps_the_solver_s_message():
  assert solver.Status.of("time_limit") is solver.Status.TIME_LIMIT
  assert solver.Status.of("Unbounded.") == "Unbounded."


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_deep_stack_reads_partial_sums_as_the_unfolded_program_does(family):
  # On the TPU profiles a sum of partial values stays partial (the compiler reduces
  # once after the add), so whether a value is partial follows the residual stream
  # back through every layer. Folded, a layer's input stands for its own output: read
  # through the values standing for them, the walk went round that cycle without end
  # (RecursionError on any zoo model of 4 layers or more under a TPU profile).
  m = models.get_model(family, "tiny", num_layers=6)
  graph = tapas.trace.trace(m.train_step(), m.abstract_state(), m.batch_spec(8))
  profile = cost.get_profile("tpu-v5p")
  assert profile.reassociates_all_reduces
  mesh = cost.mesh_spec({"data": 2, "model": 4}, profile, None)
  builders = {}
  for fold, view in ((True, solver.folded_view(tapas.fold.fold(graph))),
                     (False, solver.unfolded_view(graph))):
    problem = solver.build_problem(graph, mesh, profile, None, view=view)
    builders[fold] = TableBuilder(problem, reuse=True)
  values = [v for op in graph.region_ops(0) for v in op.outputs if graph.types[v].shape]
  partial = [v for v in values if builders[False].partial_expr(v) is not None]
  assert len(partial) > 6 * 2, "the stream's sums stay partial in every layer"
  # A copy reads as its representative; each value's own walk (the program's values,
  # not the ones standing for them) is the unfolded program's.
  assert [builders[True]._walk(v) is None for v in values] == [
      builders[False].partial_expr(v) is None for v in values]
  plan = tapas.search(m.train_step(), m.abstract_state(), m.batch_spec(8),
                      mesh={"data": 2, "model": 4}, device="tpu-v5p")
  assert plan.stats.predicted_memory_bytes > 0


def _lookup_then_layers(scanned):
  """An embedding lookup from a table whose rows are split (partial sums: each device
  looks up the rows it holds) read by a stack of layers, scanned or unrolled."""
  def f(table, ids, w):
    x = table[ids]
    if scanned:
      x, _ = jax.lax.scan(lambda c, wl: (jax.numpy.tanh(c @ wl), None), x, w)
    else:
      for wl in w:
        x = jax.numpy.tanh(x @ wl)
    return x.sum()
  f32 = jax.numpy.float32
  return api.prepare(f, (jax.ShapeDtypeStruct((1024, 256), f32),
                         jax.ShapeDtypeStruct((64,), jax.numpy.int32),
                         jax.ShapeDtypeStruct((4, 256, 256), f32)),
                     mesh=MESH, device="cpu", fold=False).problem


def test_a_partial_sum_read_only_by_a_scan_is_reduced_where_priced():
  # A scan is no op of the search: the lookup's partial sums, read only by the loop
  # (its carry in), were reduced by the compiler and priced nowhere (0 bytes).
  sent = []
  for scanned in (True, False):
    problem = _lookup_then_layers(scanned)
    table = problem.graph.inputs[0].path
    choice = solver.layout_choice(problem, split=[(table, 0)], split_axes=("model",))
    sent.append(solver.evaluate(problem, choice).comm_bytes)
  assert sent[0] > 0
  assert sent[0] == pytest.approx(sent[1], rel=1e-6)
