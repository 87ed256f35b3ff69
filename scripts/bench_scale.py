"""Plans at real scale: ours next to the expert layouts, all under the device's HBM.

For LLaMA-3-8B and -70B at MaxText's recipe shape (seq 8192) on 64- and 256-chip meshes
with the tpu-v5p and h100 profiles, prints per row: our plan (batch allowed on every
mesh axis, so FSDP over the whole slice is in its space; default budget = the device's
HBM less headroom), MaxText-style FSDP (batch and parameters over every axis),
Megatron tensor parallel on `model` x data parallel, and plain data parallel, all
costed by the same model: predicted step time, bytes sent, memory per device, and
whether it fits. Nothing is compiled or allocated. Also the end-to-end search time of
LLaMA-3-8B, 32 layers, on 8 x 8.

  python scripts/bench_scale.py                  # all rows (several minutes on 2 cores)
  python scripts/bench_scale.py --models=llama3-8b --chips=64 --devices=h100

Per-device batch: 3 for 8B (MaxText tpu-recipes `llama3_1_8b_8192`, v6e: bs 3-4 with
host offload and a custom remat policy), 2 for 70B. The baselines here have no remat.
"""

import argparse
import time

from tapas_jax import InfeasibleBudgetError, baselines, cost, models, search

PER_DEVICE_BATCH = {"llama3-8b": 3, "llama3-70b": 2}
HEADROOM = 0.9  # as the default budget (tapas_jax.solver: device HBM less 10%)


def row(name, plan, hbm):
  s = plan.stats
  fits = "yes" if s.predicted_memory_bytes <= HEADROOM * hbm else "NO"
  print(f"  {name:<16} {s.predicted_step_s * 1e3:>11.1f} {s.predicted_comm_bytes / 2**30:>10.2f} "
        f"{s.predicted_memory_bytes / 2**30:>12.1f} {fits:>5}", flush=True)
  return s.predicted_step_s, s.predicted_memory_bytes <= HEADROOM * hbm


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="llama3-8b,llama3-70b")
  parser.add_argument("--chips", default="64,256")
  parser.add_argument("--devices", default="tpu-v5p,h100")
  a = parser.parse_args()
  for size in a.models.split(","):
    for chips in map(int, a.chips.split(",")):
      for device in a.devices.split(","):
        m = models.get_model("llama", size)
        args = (m.train_step(), m.abstract_state(), m.batch_spec(PER_DEVICE_BATCH[size] * chips))
        mesh = {"data": chips // 8, "model": 8}
        hbm = cost.get_profile(device).hbm_bytes
        print(f"\n## {size}, seq {m.config.seq_len}, batch {PER_DEVICE_BATCH[size] * chips}, "
              f"mesh {mesh}, {device} ({hbm / 2**30:.0f} GiB HBM)")
        print(f"  {'layout':<16} {'step ms':>11} {'sent GiB':>10} {'memory GiB':>12} {'fits':>5}")
        start = time.perf_counter()
        try:
          ours = search(*args, mesh=mesh, device=device, batch_axes=None)
          took = time.perf_counter() - start
          best = row("tapas", ours, hbm)
          print(f"  (search end to end {took:.1f} s)")
        except InfeasibleBudgetError as e:
          print(f"  tapas: no plan fits: {str(e)[:300]}")
          best = None
        others = []
        for name in ("fsdp", "megatron", "data_parallel"):
          plan = baselines.baseline(name, *args, mesh=mesh, device=device, family="llama")
          others.append(row(name, plan, hbm))
        fitting = [t for t, fits in others if fits]
        if best is not None and fitting:
          print(f"  ours / best fitting baseline: {best[0] / min(fitting):.3f}")


if __name__ == "__main__":
  main()
