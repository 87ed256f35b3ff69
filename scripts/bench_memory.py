"""Predicted per-device memory against what XLA allocates for the compiled step.

Every zoo model's train step is searched on an 8-device CPU mesh, compiled through
`tapas.apply` with the state donated (updated in place, as a training loop runs it)
and never run. XLA's figure is `Compiled.memory_bytes` from `compiled.memory_analysis()`:
argument + temporary + output bytes, less the output bytes aliased to donated
arguments. The prediction is `plan.stats.predicted_memory_bytes`: the inputs plus the
intermediates live at the activation peak (outputs that replace donated state take the
state's buffers; other outputs live to the end).

  python scripts/bench_memory.py                      # tiny configs, search + baselines
  python scripts/bench_memory.py --config small       # models.SMALL: real widths, 2 layers
  python scripts/bench_memory.py --models gpt --config gpt2-small --set num_layers=2
  python scripts/bench_memory.py --config small --plans search,search-no-sp
      # the search with and without sequence parallelism, side by side

Also printed: the predicted step and the bytes each device sends, predicted and as XLA
compiles them (`tapas_jax.measure`: an all-reduce read only as 1/n slices counts as
the reduce-scatter GPUs and TPUs run).
"""

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import tapas_jax as tapas  # noqa: E402
from tapas_jax import baselines, cost, measure, models  # noqa: E402

MESH = {"data": 2, "model": 4}
# `--config small`: each family at a real small model's widths (GPT-2 small, a
# LLaMA of GPT-2-small width with grouped-query attention, T5-small, ViT-B/16,
# a GPT-2-small-width MoE, a ResNet with one bottleneck block per stage), trimmed to
# two layers (one block per stage) and short sequences so each compile takes under a
# minute on a 2-core CPU. The nnx families trace to the same programs as gpt/llama.
SMALL = models.SMALL


def compiled_memory(plan, step, state, batch, mesh) -> measure.Compiled:
  """XLA's figures for the step compiled the plan's way, state donated."""
  jitted = tapas.apply(plan, step, mesh=mesh, donate_argnums=0)
  return measure.measure(jitted.lower(state, batch).compile(), mesh.size)


def plans_for(family, step, state, batch, kinds, device):
  out = {}
  for kind in kinds:
    if kind == "search":
      out[kind] = tapas.search(step, state, batch, mesh=MESH, device=device)
    elif kind == "search-no-sp":  # without sequence parallelism, to compare
      out[kind] = tapas.search(step, state, batch, mesh=MESH, device=device,
                               sequence_parallel=False)
    else:
      out[kind] = baselines.baseline(kind, step, state, batch, mesh=MESH, device=device,
                                     family=family)
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--models", default=None,
                      help="families (default: the zoo; with --config small, SMALL's)")
  parser.add_argument("--config", default="tiny")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--plans", default="search," + ",".join(baselines.BASELINES))
  parser.add_argument("--device", default="h100")
  parser.add_argument("--set", action="append", default=[],
                      help="config field override, e.g. num_layers=2 or stage_sizes=1,1 "
                      "(integers, or a tuple of them)")
  args = parser.parse_args()
  overrides = {k: _int_or_tuple(v) for k, v in (item.split("=", 1) for item in args.set)}
  families = args.models or ",".join(SMALL if args.config == "small" else models.FAMILIES)
  mesh = tapas.make_mesh(MESH)
  # The plan is costed for the device; its memory is predicted as the backend that
  # compiles it here lays it out (XLA:CPU: no reduce-scatter, canonical convolutions).
  device = (cost.compiled_by_xla_cpu(args.device) if jax.default_backend() == "cpu"
            else cost.get_profile(args.device))
  if args.config == "small":
    for family in families.split(","):
      print(f"# small {family}: {SMALL[family][0]} with {SMALL[family][1]}")
  print(f"## Predicted vs compiled memory: zoo at config {args.config!r} {overrides or ''}, "
        f"batch "
        f"{args.batch}, mesh {MESH}, {device.name} profile, state donated, jax "
        f"{jax.__version__}")
  print(f"{'model':<10} {'plan':<14} {'pred MiB':>9} {'XLA MiB':>9} {'pred/XLA':>8} "
        f"{'args MiB':>9} {'temp MiB':>9} {'out-alias':>9} {'pred ms':>8} "
        f"{'sent: pred':>10} {'XLA MiB':>8} {'s':>5}")
  for family in families.split(","):
    config, trimmed = SMALL[family] if args.config == "small" else (args.config, {})
    m = models.get_model(family, config, **{**trimmed, **overrides})
    step, state, batch = m.train_step(), m.abstract_state(), m.batch_spec(args.batch)
    kinds = args.plans.split(",")
    for kind, plan in plans_for(family, step, state, batch, kinds, device).items():
      start = time.perf_counter()
      got = compiled_memory(plan, step, state, batch, mesh)
      pred = plan.stats.predicted_memory_bytes
      print(f"{family:<10} {kind:<14} {pred / 2**20:>9.3f} {got.memory_bytes / 2**20:>9.3f} "
            f"{pred / got.memory_bytes:>8.2f} {got.argument_bytes / 2**20:>9.3f} "
            f"{got.temp_bytes / 2**20:>9.3f} "
            f"{(got.output_bytes - got.alias_bytes) / 2**20:>9.3f} "
            f"{plan.stats.predicted_step_s * 1e3:>8.3f} "
            f"{plan.stats.predicted_comm_bytes / 2**20:>10.2f} "
            f"{got.comm_bytes['total'] / 2**20:>8.2f} "
            f"{time.perf_counter() - start:>5.1f}", flush=True)


def _int_or_tuple(text: str):
  return tuple(int(x) for x in text.split(",")) if "," in text else int(text)


if __name__ == "__main__":
  main()
