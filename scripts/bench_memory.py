"""Predicted per-device memory against what XLA allocates for the compiled step.

Every zoo model's train step is searched on an 8-device CPU mesh, compiled through
`tapas.apply` with the state donated (updated in place, as a training loop runs it)
and never run. XLA's figure is `Compiled.memory_bytes` from `compiled.memory_analysis()`:
argument + temporary + output bytes, less the output bytes aliased to donated
arguments. The prediction is `plan.stats.predicted_memory_bytes`: the inputs plus the
intermediates live at the activation peak (outputs that replace donated state take the
state's buffers; other outputs live to the end).

  python scripts/bench_memory.py                      # tiny configs, search + baselines
  python scripts/bench_memory.py --models gpt --config gpt2-small --set num_layers=2
"""

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import tapas_jax as tapas  # noqa: E402
from tapas_jax import baselines, measure, models  # noqa: E402

MESH = {"data": 2, "model": 4}


def compiled_memory(plan, step, state, batch, mesh) -> measure.Compiled:
  """XLA's figures for the step compiled the plan's way, state donated."""
  jitted = tapas.apply(plan, step, mesh=mesh, donate_argnums=0)
  return measure.measure(jitted.lower(state, batch).compile(), mesh.size)


def plans_for(family, step, state, batch, kinds, device):
  out = {}
  for kind in kinds:
    if kind == "search":
      out[kind] = tapas.search(step, state, batch, mesh=MESH, device=device)
    else:
      out[kind] = baselines.baseline(kind, step, state, batch, mesh=MESH, device=device,
                                     family=family)
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--models", default=",".join(models.FAMILIES))
  parser.add_argument("--config", default="tiny")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--plans", default="search," + ",".join(baselines.BASELINES))
  parser.add_argument("--device", default="h100")
  parser.add_argument("--set", action="append", default=[],
                      help="config field override, e.g. num_layers=2 (integers)")
  args = parser.parse_args()
  overrides = {k: int(v) for k, v in (item.split("=", 1) for item in args.set)}
  mesh = tapas.make_mesh(MESH)
  print(f"## Predicted vs compiled memory: zoo at config {args.config!r} {overrides or ''}, "
        f"batch "
        f"{args.batch}, mesh {MESH}, {args.device} profile, state donated, jax "
        f"{jax.__version__}")
  print(f"{'model':<10} {'plan':<14} {'pred MiB':>9} {'XLA MiB':>9} {'pred/XLA':>8} "
        f"{'args MiB':>9} {'temp MiB':>9} {'out-alias':>9} {'s':>5}")
  for family in args.models.split(","):
    m = models.get_model(family, args.config, **overrides)
    step, state, batch = m.train_step(), m.abstract_state(), m.batch_spec(args.batch)
    kinds = args.plans.split(",")
    for kind, plan in plans_for(family, step, state, batch, kinds, args.device).items():
      start = time.perf_counter()
      got = compiled_memory(plan, step, state, batch, mesh)
      pred = plan.stats.predicted_memory_bytes
      print(f"{family:<10} {kind:<14} {pred / 2**20:>9.3f} {got.memory_bytes / 2**20:>9.3f} "
            f"{pred / got.memory_bytes:>8.2f} {got.argument_bytes / 2**20:>9.3f} "
            f"{got.temp_bytes / 2**20:>9.3f} "
            f"{(got.output_bytes - got.alias_bytes) / 2**20:>9.3f} "
            f"{time.perf_counter() - start:>5.1f}", flush=True)


if __name__ == "__main__":
  main()
