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
"""

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import tapas_jax as tapas  # noqa: E402
from tapas_jax import models  # noqa: E402


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
  flags = parser.parse_args()
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
    plan = tapas.search(*args, mesh=mesh, device=flags.device, memory_budget=budget)
    s = plan.stats
    outcome = (f"{s.predicted_step_s * 1e3:.4g} ms/step, "
               f"{s.predicted_memory_bytes / 2**30:.4g} GiB/device, remat {plan.remat or '-'}; "
               f"trace {s.trace_s:.2f} s, fold {s.fold_s:.2f} s, search {s.search_s:.2f} s")
  except tapas.InfeasibleBudgetError as e:
    outcome = f"infeasible: leanest {e.leanest_bytes / 2**30:.3f} GiB"
  seconds = time.perf_counter() - start
  print(f"{flags.model} {flags.config} batch {flags.batch} mesh {mesh} {flags.device} "
        f"budget {flags.budget}: {seconds:.2f} s end to end; {outcome}")

if __name__ == "__main__":
  main()
