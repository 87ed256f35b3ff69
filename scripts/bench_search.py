"""Search figures: folded vs unfolded, flatness in depth, 175B, rediscovery, memory.

Every program is a full train step (forward, backward, adamw) traced abstractly.
Search time excludes trace and fold (both printed where asked).

  python scripts/bench_search.py                 # everything (several minutes)
  python scripts/bench_search.py --only=fold     # one section: fold, flat, 175b,
                                                 # rediscover, memory
  python scripts/bench_search.py --plot_dir=figures   # also a PNG per section
  python scripts/bench_search.py --quick --only=flat  # tiny widths: a smoke run
"""

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import tapas_jax as tapas  # noqa: E402
from tapas_jax import baselines, models, solver  # noqa: E402
from tapas_jax import cost as costlib  # noqa: E402
from tapas_jax.fold import fold  # noqa: E402
from tapas_jax.trace import trace  # noqa: E402

MESH = {"data": 2, "model": 4}

# Model sizes per section; `--quick` swaps in tiny ones (a smoke run of the script and
# its plots, not figures to quote).
FULL = dict(width="gpt2-small", fold_layers=(2, 4, 8, 12, 24, 48),
            flat_layers=(12, 24, 48, 96), rediscover=(("gpt", "gpt2-small"),
                                                      ("llama", "llama3-8b")),
            memory_layers=4, quick=False)
QUICK = dict(width="tiny", fold_layers=(2, 4), flat_layers=(2, 4, 8),
             rediscover=(("gpt", "tiny"), ("llama", "tiny")), memory_layers=2, quick=True)
SIZES = dict(FULL)


def gpt(layers, config=None):
  m = models.get_model("gpt", config or SIZES["width"], num_layers=layers)
  return m.train_step(), m.abstract_state(), m.batch_spec(8)


def timed_solve(graph, folded, view_fold, solver_fold, time_limit=None, device="h100",
                mesh=MESH):
  profile = costlib.get_profile(device)
  spec = costlib.mesh_spec(mesh, profile)
  start = time.perf_counter()
  view = solver.folded_view(folded) if view_fold else solver.unfolded_view(graph)
  problem = solver.build_problem(graph, spec, profile, ("data",), view=view)
  solution = solver.solve(problem, reuse=solver_fold,
                          solver="elimination" if solver_fold else "ilp", time_limit=time_limit)
  return solution, time.perf_counter() - start


def section_fold(time_limit):
  print(f"\n## Folded vs unfolded ({SIZES['width']} width, train step, mesh data=2 x model=4, "
        "h100)")
  print(f"{'layers':>6} {'eqns':>7} {'folded obj ms':>14} {'folded s':>9} "
        f"{'unfolded obj ms':>16} {'unfolded s':>11} {'status':>10} {'obj diff':>9} "
        f"{'speedup':>8}")
  rows = []
  for layers in SIZES["fold_layers"]:
    graph = trace(*gpt(layers))
    folded = fold(graph)
    a, ta = timed_solve(graph, folded, True, True)
    b, tb = timed_solve(graph, folded, False, False, time_limit=time_limit)
    diff = (a.step_s - b.step_s) / b.step_s
    print(f"{layers:>6} {len(graph.ops):>7} {a.step_s * 1e3:>14.4f} {ta:>9.3f} "
          f"{b.step_s * 1e3:>16.4f} {tb:>11.2f} {b.status:>10} {diff:>+9.2%} "
          f"{tb / ta:>7.0f}x", flush=True)
    rows.append(dict(layers=layers, folded_s=ta, unfolded_s=tb, folded_ms=a.step_s * 1e3,
                     unfolded_ms=b.step_s * 1e3))
  return rows


def section_flat():
  print(f"\n## Flatness: folded search time vs depth ({SIZES['width']} width, h100)")
  times = {}
  for layers in SIZES["flat_layers"]:
    graph = trace(*gpt(layers))
    folded = fold(graph)
    runs = [timed_solve(graph, folded, True, True)[1] for _ in range(3)]
    times[layers] = min(runs)
    print(f"  L={layers:>3}: search {times[layers]:.3f} s (best of 3)", flush=True)
  deep, shallow = max(times), min(times)
  print(f"  ratio {deep}/{shallow}: {times[deep] / times[shallow]:.2f}x (target <= 1.5x)")
  return times


def section_175b():
  print("\n## GPT-3 175B shape, abstract mesh data=8 x model=8, tpu-v5p")
  m = models.get_model("gpt", "gpt3-175b")
  args = (m.train_step(), m.abstract_state(), m.batch_spec(64))
  start = time.perf_counter()
  jax.make_jaxpr(models.get_model("gpt", "gpt3-175b").train_step())(*args[1:])
  bare = time.perf_counter() - start
  mesh = jax.sharding.AbstractMesh((8, 8), ("data", "model"),
                                   axis_types=(jax.sharding.AxisType.Auto,) * 2)
  # Unlimited memory: the shape is planned to time the search; 96 layers of saved
  # activations at batch 64 do not fit a v5p chip without rematerialisation.
  plan = tapas.search(*args, mesh=mesh, device="tpu-v5p", memory_budget=float("inf"))
  s = plan.stats
  total = s.trace_s + s.fold_s + s.search_s
  print(f"  equations {s.num_equations}, {s.num_layer_instances} instances of "
        f"{s.num_unique_layers} unique layer(s)")
  print(f"  bare make_jaxpr {bare:.2f} s | trace {s.trace_s:.2f} s + fold "
        f"{s.fold_s:.2f} s + search {s.search_s:.3f} s = {total:.2f} s")
  print(f"  search (excluding trace) under 1 s: {s.search_s < 1.0}")
  print("  " + plan.summary().replace("\n", "\n  "))


def section_rediscover():
  print("\n## Rediscovery on mesh data=2 x model=4 (batch on data only), h100")
  results = {}
  for family, config in SIZES["rediscover"]:
    m = models.get_model(family, config, num_layers=4)
    args = (m.train_step(), m.abstract_state(), m.batch_spec(8))
    plan = tapas.search(*args, mesh=MESH, device="h100", batch_axes=("data",))
    print(f"\n### {family} {config} (4 layers)")
    print("  " + plan.summary().replace("\n", "\n  "))
    rows = []
    for name in baselines.BASELINES:
      base = baselines.baseline(name, *args, mesh=MESH, device="h100", family=family)
      print(f"  baseline {name:<14} {base.stats.predicted_step_s * 1e3:9.3f} ms/step "
            f"{base.stats.predicted_comm_bytes / 2**20:9.1f} MiB sent "
            f"{base.stats.predicted_state_bytes / 2**30:7.3f} GiB state/device")
      rows.append(_figures(name, base))
    print(f"  search         {plan.stats.predicted_step_s * 1e3:16.3f} ms/step "
          f"{plan.stats.predicted_comm_bytes / 2**20:9.1f} MiB sent "
          f"{plan.stats.predicted_state_bytes / 2**30:7.3f} GiB state/device")
    results[f"{family} {config} (4 layers)"] = [_figures("search", plan)] + rows
  return results


def _figures(name, plan):
  s = plan.stats
  return dict(plan=name, ms=s.predicted_step_s * 1e3, mib=s.predicted_comm_bytes / 2**20,
              gib=s.predicted_state_bytes / 2**30)


def section_memory():
  print(f"\n## Memory pressure ({SIZES['width']} width, {SIZES['memory_layers']} layers, "
        "mesh data=2 x model=4, h100)")
  print("  memory = inputs (params, optimizer state, batch) + intermediates live at the peak;")
  print("  budgets are fractions of the unconstrained plan's memory")
  args = gpt(SIZES["memory_layers"])
  mesh = MESH
  replicated = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(args[1:]))
  free = tapas.search(*args, mesh=mesh, device="h100", memory_budget=float("inf"))
  act = free.stats.predicted_memory_bytes - free.stats.predicted_state_bytes
  print(f"  replicated inputs {replicated / 2**30:.3f} GiB/device; unconstrained plan: "
        f"inputs {free.stats.predicted_state_bytes / 2**30:.3f} + activations "
        f"{act / 2**30:.3f} GiB/device, {free.stats.predicted_step_s * 1e3:.3f} ms")
  for name in baselines.BASELINES:
    base = baselines.baseline(name, *args, mesh=mesh, device="h100", family="gpt")
    print(f"  {name} baseline: inputs {base.stats.predicted_state_bytes / 2**30:.3f} GiB, "
          f"memory {base.stats.predicted_memory_bytes / 2**30:.3f} GiB/device, "
          f"{base.stats.predicted_step_s * 1e3:.3f} ms")
  print(f"  {'budget':>6} {'GiB':>6} {'memory GiB':>11} {'inputs GiB':>11} {'ms/step':>8} "
        f"{'heads split':>12} {'stored on data':>15} {'gathered for use':>17} {'search s':>9}")
  rows = []
  for frac in (0.9, 0.75, 0.7, 0.68, 0.66):
    budget = frac * free.stats.predicted_memory_bytes
    start = time.perf_counter()
    try:
      plan = tapas.search(*args, mesh=mesh, device="h100", memory_budget=budget)
    except tapas.InfeasibleBudgetError as e:
      print(f"  {frac:>6.2f} {budget / 2**30:>6.3f} infeasible: ...{str(e)[110:330]}...")
      rows.append(dict(budget_gib=budget / 2**30, memory_gib=None, ms=None))
      continue
    took = time.perf_counter() - start
    specs = jax.tree.leaves(plan.in_specs[0],
                            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    on_data = sum(1 for spec in specs
                  if any(e == "data" or (isinstance(e, tuple) and "data" in e) for e in spec))
    heads = any("model" in str(spec) for path, spec in plan.layers[0].param_specs
                if path.endswith("Attention/query/kernel"))
    gathered = sum(len(layer.use_specs) for layer in plan.layers)
    s = plan.stats
    print(f"  {frac:>6.2f} {budget / 2**30:>6.3f} {s.predicted_memory_bytes / 2**30:>11.3f} "
          f"{s.predicted_state_bytes / 2**30:>11.3f} {s.predicted_step_s * 1e3:>8.3f} "
          f"{str(heads):>12} {on_data:>15} {gathered:>17} {took:>9.2f}")
    rows.append(dict(budget_gib=budget / 2**30, memory_gib=s.predicted_memory_bytes / 2**30,
                     ms=s.predicted_step_s * 1e3))
  if SIZES["quick"]:
    return rows, free.stats.predicted_memory_bytes / 2**30  # the integer program: full only
  # Under a budget the folded search tunes one Lagrange weight: not exact. The integer
  # program takes the budget as a hard row.
  short = models.get_model("gpt", "gpt2-small", num_layers=2, seq_len=64, vocab_size=50304)
  short_args = (short.train_step(), short.abstract_state(), short.batch_spec(8))
  for label, case, frac in (("4 layers, seq 1024", args, 0.7),
                            ("2 layers, seq 64, vocab 50304", short_args, 0.3)):
    unconstrained = tapas.search(*case, mesh=mesh, device="h100",
                                 memory_budget=float("inf"))
    budget = frac * unconstrained.stats.predicted_memory_bytes
    lagrange = tapas.search(*case, mesh=mesh, device="h100", memory_budget=budget)
    start = time.perf_counter()
    exact = tapas.search(*case, mesh=mesh, device="h100", memory_budget=budget, fold=False,
                         time_limit=300)
    print(f"  {label}, budget {frac:.2f}: folded (Lagrange + greedy) "
          f"{lagrange.stats.predicted_step_s * 1e3:.3f} ms vs unfolded integer program "
          f"{exact.stats.predicted_step_s * 1e3:.3f} ms ({exact.stats.solver_status}, "
          f"{time.perf_counter() - start:.1f} s): folded "
          f"{lagrange.stats.predicted_step_s / exact.stats.predicted_step_s - 1:+.2%}")
  return rows, free.stats.predicted_memory_bytes / 2**30


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--only", default=None)
  parser.add_argument("--time_limit", type=float, default=300.0,
                      help="seconds for each unfolded integer program")
  parser.add_argument("--quick", action="store_true",
                      help="tiny widths and depths: a smoke run, not figures to quote")
  parser.add_argument("--plot_dir", default=None,
                      help="also write a PNG per section here (fold, flat, rediscover, "
                           "memory; 175b is one plan: text only)")
  args = parser.parse_args(argv)
  SIZES.clear()
  SIZES.update(QUICK if args.quick else FULL)
  sections = {"fold": lambda: section_fold(args.time_limit), "flat": section_flat,
              "175b": section_175b, "rediscover": section_rediscover, "memory": section_memory}
  if args.only is not None and args.only not in sections:
    parser.error(f"--only: unknown section {args.only!r}; choose from {list(sections)}")
  if args.plot_dir:
    import bench_plots  # noqa: PLC0415 - matplotlib only when a plot is asked for
    plots = {"fold": bench_plots.fold_vs_unfolded, "flat": bench_plots.flatness,
             "rediscover": bench_plots.rediscovery,
             "memory": lambda result: bench_plots.memory_budget(*result)}
  for name, fn in sections.items():
    if args.only in (None, name):
      result = fn()
      if args.plot_dir and name in plots:
        print("wrote", bench_plots.save(plots[name](result), args.plot_dir, f"search_{name}"))


if __name__ == "__main__":
  main()
