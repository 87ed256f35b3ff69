"""The budgeted search against the expert layouts that fit the same budget.

For each zoo model (tiny config, batch 8), mesh and budget (the default, just above the
leanest baseline's predicted memory, unlimited), prints the searched plan's predicted
step and memory next to the fastest baseline that fits (data parallel, FSDP, Megatron,
each with every remat policy). Every figure is our cost model's (`--device` profile).
`--real` instead costs the scanned LLaMA-3-8B train step (plain attention, seq 8192,
batch 192, mesh data 8 x model 8, tpu-v5p) once: the baselines with full remat and the
search at the default budget.

  python scripts/bench_budget.py
  python scripts/bench_budget.py --families=gpt,llama --device=cpu
  python scripts/bench_budget.py --real
"""

import argparse
import os
import time
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import tapas_jax as tapas  # noqa: E402
from tapas_jax import api, baselines, cost, models, solver  # noqa: E402

MESHES = {"data2_model4": {"data": 2, "model": 4}, "data8": {"data": 8},
          "data4_model2": {"data": 4, "model": 2}}
REMATS = (None, "dots_saveable", "nothing_saveable")


def experts(args, mesh, device, family):
  """{baseline name: (step seconds, bytes per device)}."""
  out = {}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # a baseline over the device's memory says so
    for kind in baselines.BASELINES:
      for remat in REMATS:
        plan = baselines.baseline(kind, *args, mesh=mesh, device=device, family=family,
                                  remat=remat)
        out[plan.name] = (plan.stats.predicted_step_s, plan.stats.predicted_memory_bytes)
  return out


def searched(args, mesh, device, budget):
  """(step seconds, bytes per device, wall seconds) of the search; inf step: no plan."""
  start = time.perf_counter()
  try:
    plan = tapas.search(*args, mesh=mesh, device=device, memory_budget=budget)
    figures = plan.stats.predicted_step_s, plan.stats.predicted_memory_bytes
  except solver.InfeasibleBudgetError as e:
    figures = float("inf"), e.leanest_bytes
  return figures + (time.perf_counter() - start,)


def zoo_table(families, device):
  print(f"{'model':7} {'mesh':13} {'budget':9} {'search ms':>9} {'MiB':>7} "
        f"{'best fitting baseline':24} {'ms':>8} {'MiB':>7}  search s")
  worse = 0
  for family in families:
    m = models.get_model(family, "tiny")
    args = (m.train_step(), m.abstract_state(), m.batch_spec(8))
    for mesh_name, mesh in MESHES.items():
      figs = experts(args, mesh, device, family)
      leanest = min(b for _, b in figs.values()) * (1 + 1e-4)
      for label, budget, limit in (
          ("default", None, api.default_budget(cost.get_profile(device))),
          ("tight", leanest, leanest), ("unlimited", float("inf"), float("inf"))):
        step_s, nbytes, wall = searched(args, mesh, device, budget)
        name, (b_step, b_bytes) = min(((k, v) for k, v in figs.items() if v[1] <= limit),
                                      key=lambda kv: kv[1][0])
        worse += step_s > b_step * (1 + 1e-9)
        print(f"{family:7} {mesh_name:13} {label:9} {step_s * 1e3:9.3f} "
              f"{nbytes / 2**20:7.3f} {name:24} {b_step * 1e3:8.3f} {b_bytes / 2**20:7.3f}"
              f"  {wall:.2f}")
  print(f"rows where the search is slower than a fitting baseline or finds no plan: {worse}")


def real_scale():
  m = models.get_model("llama", "llama3-8b", num_layers=32, seq_len=8192, dtype="bfloat16",
                       param_dtype="float32", scan_layers=True)
  args = (m.train_step(), m.abstract_state(), m.batch_spec(192))
  mesh, device = {"data": 8, "model": 8}, "tpu-v5p"
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for kind in baselines.BASELINES:
      plan = baselines.baseline(kind, *args, mesh=mesh, device=device, family="llama",
                                remat="nothing_saveable")
      print(f"{plan.name:28} {plan.stats.predicted_memory_bytes / 2**30:9.2f} GiB "
            f"{plan.stats.predicted_step_s * 1e3:8.0f} ms")
  step_s, nbytes, wall = searched(args, mesh, device, None)
  print(f"{'search, default budget':28} {nbytes / 2**30:9.2f} GiB {step_s * 1e3:8.0f} ms "
        f"(inf: no plan, leanest shown); {wall:.1f} s")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--families", default="gpt,llama,moe,resnet,t5,vit")
  parser.add_argument("--device", default="cpu")
  parser.add_argument("--real", action="store_true")
  a = parser.parse_args()
  if a.real:
    real_scale()
  else:
    zoo_table(a.families.split(","), a.device)


if __name__ == "__main__":
  main()
