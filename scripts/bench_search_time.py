"""End-to-end search time: trace, fold, search and the report's baseline figures.

Times one `tapas.search` call on a zoo model (nothing compiled or allocated) until the
plan returns or `InfeasibleBudgetError` is raised, and prints the outcome so that runs
at two commits can be compared (BENCHMARKS.md, "Search time at scale"). One search per
process: a second one in the same process finds JAX's tracing caches warm. Run from
the checkout to time with `PYTHONPATH=.` (else the installed package is imported).

  python scripts/bench_search_time.py                        # LLaMA-3-8B, 32 layers, 8 x 8
  python scripts/bench_search_time.py --budget=inf --device=tpu-v5p --batch=192
  python scripts/bench_search_time.py --model=t5 --config=tiny --mesh=data=2,model=4 \
      --batch=8 --budget=0.7x                               # 0.7 x the default plan's memory

With --depths, the search's flatness in depth instead (issue 19 item 6, issue 20 item 5):
per depth, the stages of `plan.stats` (trace, fold, search, plan, report) beside the
call's wall time ("other": what no stage counts), and the ratios: the work after trace
and fold (wall less the two) at the deepest over the shallowest depth, and fold / trace
at each depth. Each
run is a fresh process, `--repeat` per depth, the depths in turn (the machine may be
shared): per depth the fastest run's row, and the fastest 'after' of any of its runs.
`--style` times a `tests/styles.py` train step instead of a zoo model.

  python scripts/bench_search_time.py --depths=12,48,96 --model=gpt --config=tiny \
      --mesh=data=2,model=4 --batch=8 --repeat=2           # GPT width 64
  python scripts/bench_search_time.py --depths=4,12,48 --style=linen_remat --repeat=2

With --vs-jaxpr=N, the call at N layers end to end against a bare `jax.make_jaxpr` of
the same step on the same abstract inputs (issue 19 item 6: within 1.25x), each in a
fresh process, the fastest of `--repeat`:

  python scripts/bench_search_time.py --vs-jaxpr=32 --batch-axes=data --repeat=2
  python scripts/bench_search_time.py --vs-jaxpr=32 --batch-axes=data --budget=inf

With --walk=N, the walk alone (`Graph.walk_s`, the closed jaxpr to our graph), the
fastest of `--repeat` traces in one process:

  python scripts/bench_search_time.py --walk=32 --repeat=7 --clock=cpu

(`--budget`: "default", "inf" or bytes with --vs-jaxpr and --depths.)
"""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # styles

import tapas_jax as tapas  # noqa: E402
from tapas_jax import models  # noqa: E402
from tapas_jax import trace as tracelib  # noqa: E402
from tapas_jax.trace import collector_paused  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="llama")
  parser.add_argument("--config", default="llama3-8b")
  parser.add_argument("--mesh", default="data=8,model=8")
  parser.add_argument("--device", default="h100")
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--budget", default="default",
                      help="'default' (the device's memory less headroom), 'inf', bytes, "
                      "or '<f>x': f times the memory of the plan under the default")
  parser.add_argument("--depths", default="",
                      help="comma-separated layer counts: time each, print the ratios")
  parser.add_argument("--style", default="", help="a tests/styles.py style (--depths)")
  parser.add_argument("--repeat", type=int, default=1, help="runs per depth (--depths)")
  parser.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                      help="--depths: 'cpu' times every stage in this process's CPU "
                      "seconds (`time.process_time`), steadier than wall time on a loaded "
                      "machine")
  parser.add_argument("--batch-axes", default="",
                      help="comma-separated mesh axes the batch may take (default: any)")
  parser.add_argument("--vs-jaxpr", type=int, default=0,
                      help="layers: time the call end to end against a bare make_jaxpr")
  parser.add_argument("--walk", type=int, default=0,
                      help="layers: time the walk alone (the jaxpr to our graph), the "
                      "fastest of --repeat traces in this process")
  parser.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--bare", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--paused", action="store_true", help=argparse.SUPPRESS)
  flags = parser.parse_args()
  if flags.clock == "cpu":
    # The stages read `time.perf_counter` when they run: read CPU seconds instead.
    time.perf_counter = time.process_time
  if flags.one:
    return _one(flags)
  if flags.walk:
    return _walk(flags)
  if flags.bare:
    return _bare(flags)
  if flags.vs_jaxpr:
    return _vs_jaxpr(flags)
  if flags.depths:
    return _depths(flags)
  m = models.get_model(flags.model, flags.config)
  mesh = {k: int(v) for k, v in (item.split("=") for item in flags.mesh.split(","))}
  args = (m.train_step(), m.abstract_state(), m.batch_spec(flags.batch))
  budget = {"default": None, "inf": float("inf")}.get(flags.budget)
  if flags.budget.endswith("x"):
    free = tapas.search(*args, mesh=mesh, device=flags.device)
    budget = float(flags.budget[:-1]) * free.stats.predicted_memory_bytes
  elif flags.budget not in ("default", "inf"):
    budget = float(flags.budget)
  start = time.perf_counter()
  try:
    plan = tapas.search(*args, mesh=mesh, device=flags.device, memory_budget=budget,
                        batch_axes=_batch_axes(flags))
    s = plan.stats
    outcome = (f"{s.predicted_step_s * 1e3:.4g} ms/step, "
               f"{s.predicted_memory_bytes / 2**30:.4g} GiB/device, remat {plan.remat or '-'}; "
               f"trace {s.trace_s:.2f} s, fold {s.fold_s:.2f} s, search {s.search_s:.2f} s")
  except tapas.InfeasibleBudgetError as e:
    outcome = f"infeasible: leanest {e.leanest_bytes / 2**30:.3f} GiB"
  seconds = time.perf_counter() - start
  print(f"{flags.model} {flags.config} batch {flags.batch} mesh {mesh} {flags.device} "
        f"budget {flags.budget}: {seconds:.2f} s end to end; {outcome}")

_STAGES = ("trace_s", "fold_s", "search_s", "plan_s", "report_s")


def _batch_axes(flags):
  return tuple(flags.batch_axes.split(",")) if flags.batch_axes else None


def _step(flags, layers: int) -> tuple:
  """(step, *abstract args) at `layers` layers: a zoo model or a `tests/styles.py` one."""
  if flags.style:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import styles  # noqa: PLC0415 - a test helper, on the path only here
    p = styles.STYLES[flags.style](layers)
    return p.step, p.state, p.batch
  m = models.get_model(flags.model, flags.config, num_layers=layers)
  return m.train_step(), m.abstract_state(), m.batch_spec(flags.batch)


def _bare(flags) -> None:
  """A bare `jax.make_jaxpr` of the step at depth `flags.bare`, its seconds as JSON."""
  import jax  # noqa: PLC0415 - only this mode traces by itself

  step, *args = _step(flags, flags.bare)
  with collector_paused() if flags.paused else contextlib.nullcontext():
    start = time.perf_counter()
    jax.make_jaxpr(step)(*args)
    jaxpr_s = time.perf_counter() - start
  print(json.dumps(dict(jaxpr_s=jaxpr_s)))


def _vs_jaxpr(flags) -> None:
  """The call end to end over a bare make_jaxpr of its step, each in fresh processes."""
  common = [f"--model={flags.model}", f"--config={flags.config}", f"--mesh={flags.mesh}",
            f"--device={flags.device}", f"--batch={flags.batch}", f"--style={flags.style}",
            f"--clock={flags.clock}", f"--batch-axes={flags.batch_axes}",
            f"--budget={flags.budget}"]
  bare, paused, calls = [], [], []
  for _ in range(flags.repeat):
    for mode, out in (([f"--bare={flags.vs_jaxpr}"], bare),
                      ([f"--bare={flags.vs_jaxpr}", "--paused"], paused),
                      ([f"--one={flags.vs_jaxpr}"], calls)):
      res = subprocess.run([sys.executable, __file__, *mode, *common], check=True,
                           capture_output=True, text=True).stdout
      out.append(json.loads(res.strip().splitlines()[-1]))
  b = min(r["jaxpr_s"] for r in bare)
  p = min(r["jaxpr_s"] for r in paused)
  c = min(calls, key=lambda r: r["wall_s"])
  what = f"style {flags.style}" if flags.style else f"{flags.model} {flags.config}"
  print(f"{what}, {flags.vs_jaxpr} layers, batch {flags.batch}, mesh {flags.mesh}, "
        f"{flags.device}, batch_axes {_batch_axes(flags)}, budget {flags.budget}; fastest "
        f"of {flags.repeat}, "
        f"{flags.clock} seconds")
  print(f"bare make_jaxpr {b:.2f} s; tapas.search {c['wall_s']:.2f} s end to end (trace "
        f"{c['trace_s']:.2f}, fold {c['fold_s']:.2f}, search {c['search_s']:.2f}, plan "
        f"{c['plan_s']:.2f}, report {c['report_s']:.2f}); ratio {c['wall_s'] / b:.2f}x")
  # tapas traces with the collector paused (`trace.collector_paused`): the same against
  # a make_jaxpr that does too, so that the ratio above is not read as the search's alone.
  print(f"bare make_jaxpr with the collector paused {p:.2f} s; ratio {c['wall_s'] / p:.2f}x")


def _one(flags) -> None:
  """One search at depth `flags.one`, its stages and wall time as a JSON line."""
  mesh = {k: int(v) for k, v in (item.split("=") for item in flags.mesh.split(","))}
  args = _step(flags, flags.one)
  start = time.perf_counter()
  budget = None if flags.budget == "default" else float(flags.budget)  # "inf" too
  plan = tapas.search(*args, mesh=mesh, device=flags.device, batch_axes=_batch_axes(flags),
                      memory_budget=budget)
  wall = time.perf_counter() - start
  # A commit before plan_s / report_s counts them in none (its "other" column).
  row = {k: getattr(plan.stats, k, 0.0) for k in _STAGES}
  print(json.dumps(dict(row, wall_s=wall, ops=plan.stats.num_equations)))


def _walk(flags) -> None:
  """`Graph.walk_s` (the walk from the closed jaxpr to the graph, the arguments'
  flattening included), the fastest of `--repeat` traces of the step in one process."""
  step, *args = _step(flags, flags.walk)
  walks = [tracelib.trace(step, *args).walk_s for _ in range(flags.repeat)]
  print(f"{flags.model} {flags.config}, {flags.walk} layers: the walk {min(walks):.4f} s "
        f"(fastest of {flags.repeat}; {flags.clock} seconds)")


def _depths(flags) -> None:
  depths = [int(d) for d in flags.depths.split(",")]
  what = f"style {flags.style}" if flags.style else f"{flags.model} {flags.config}"
  print(f"{what}, mesh {flags.mesh}, {flags.device}; {flags.repeat} runs per depth, the "
        f"depths in turn; per depth its fastest run, and the fastest 'after' of any run; "
        f"{flags.clock} seconds")
  print(f"{'layers':>6} {'ops':>6} {'trace':>6} {'fold':>6} {'search':>6} {'plan':>6} "
        f"{'report':>6} {'wall':>6} {'other':>6} {'after':>6} {'fold/trace':>10}")
  runs: dict[int, list[dict]] = {d: [] for d in depths}
  # The depths take turns, so that a slower spell of a shared machine falls on each.
  for _ in range(flags.repeat):
    for d in depths:
      cmd = [sys.executable, __file__, f"--one={d}", f"--model={flags.model}",
             f"--config={flags.config}", f"--mesh={flags.mesh}", f"--device={flags.device}",
             f"--batch={flags.batch}", f"--style={flags.style}", f"--clock={flags.clock}",
             f"--budget={flags.budget}"]
      out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
      run = json.loads(out.strip().splitlines()[-1])
      # Everything the call does after tracing and folding (the search, the plan, the
      # report and anything no stage counts): what should not grow with depth.
      run["after_s"] = run["wall_s"] - run["trace_s"] - run["fold_s"]
      runs[d].append(run)
  rows = {}
  for d in depths:
    r = rows[d] = dict(min(runs[d], key=lambda r: r["wall_s"]))
    # The trace's noise (seconds at depth) would otherwise pick which run's 'after'
    # is read: the fastest 'after' of any run is (the fastest run's own, beside it).
    r["own_after_s"] = r["after_s"]
    r["after_s"] = min(run["after_s"] for run in runs[d])
    other = r["wall_s"] - sum(r[k] for k in _STAGES)
    print(f"{d:>6} {r['ops']:>6} {r['trace_s']:>6.2f} {r['fold_s']:>6.2f} "
          f"{r['search_s']:>6.2f} {r['plan_s']:>6.2f} {r['report_s']:>6.2f} "
          f"{r['wall_s']:>6.2f} {other:>6.2f} {r['after_s']:>6.3f} "
          f"{r['fold_s'] / r['trace_s']:>10.1%}")
  lo, hi = rows[depths[0]], rows[depths[-1]]
  print(f"{depths[-1]} / {depths[0]} layers: after trace and fold "
        f"{hi['after_s'] / lo['after_s']:.2f}x (the fastest runs' own: "
        f"{hi['own_after_s'] / lo['own_after_s']:.2f}x), "
        f"search {hi['search_s'] / lo['search_s']:.2f}x, "
        f"wall {hi['wall_s'] / lo['wall_s']:.2f}x; fold / trace at most "
        f"{max(run['fold_s'] / run['trace_s'] for rs in runs.values() for run in rs):.1%}")


if __name__ == "__main__":
  main()
