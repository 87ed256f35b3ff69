"""Plans at real scale: ours next to the expert layouts, all under the device's HBM.

For LLaMA-3-8B and -70B at MaxText's recipe shape (seq 8192) on 64- and 256-chip meshes
(data x model 8) with the tpu-v5p and h100 profiles, prints per row: our plan (batch
allowed on every mesh axis, so FSDP over the whole slice is in its space; default
budget = the device's HBM less 10% headroom, remat chosen by the search), and three
expert layouts, each with the fastest remat policy of the three the cost model knows
that fits (as recipes tune `remat_policy`; MaxText's "full" is nothing_saveable,
"minimal" saves the dots): MaxText-style FSDP (batch and every parameter and optimizer
state over every axis), Megatron tensor parallel on `model` x data parallel, and
plain data parallel; and our search without sequence parallelism ("tapas, no SP"),
to show what it adds. All are costed by the same model: predicted step time, bytes
sent, memory per device, whether it fits. Nothing is compiled or allocated. Each
row's search time (trace, fold, search, end to end) is printed; the 8B 64-chip one
is the 32-layer LLaMA-3-8B on 8 x 8.

  python scripts/bench_scale.py                  # all rows (minutes each on 2 cores)
  python scripts/bench_scale.py --models=llama3-8b --chips=64 --devices=h100
  python scripts/bench_scale.py --models=llama3-8b --chips=64 --batch_axes=data \
      --per_device_batch=1   # tensor parallelism on `model`: where sequence parallelism pays

The model: the zoo's LLaMA (`tapas_jax.models.llama`, adamw) as MaxText runs it:
bfloat16 activations with float32 weights and optimizer state (MaxText's `dtype`
bfloat16, `weight_dtype` float32; the loss in float32), and `attention="chunked"`
(query blocks of 512 in a rematerialised `lax.map`: no [seq, seq] tensor outlives a
block, the memory behaviour of MaxText's flash/splash attention; its FLOPs are the
full, unskipped causal attention; a block's scores are counted live while the loop
runs). Host offload is not modelled.

Per-device batch, from MaxText's tuned recipes (AI-Hypercomputer/maxtext
`benchmarks/maxtext_trillium_model_configs.py`, also in AI-Hypercomputer/tpu-recipes
`training/trillium/Llama3.1-8B-MaxText`): `llama3_1_8b_8192_no_collective_matmul`
per_device_batch_size 3 (others: 4, and 5 on v6e-64), `llama3_1_70b_8192_bs2`
per_device_batch_size 2 ("Config for v6e-64"; others 4 and 5); all with
max_target_length 8192, ici_fsdp_parallelism -1, attention "flash", remat_policy
"custom" offloading the layer input and q/k/v(/out) projections to host memory. Host
offload is not modelled here; the remat policies are. Those recipes are for v6e
(32 GiB HBM); the same per-device batch is used on v5p (95 GiB) and H100 (80 GB).
"""

import argparse
import time
import warnings

from tapas_jax import InfeasibleBudgetError, api, baselines, cost, models, search
from tapas_jax.solver import remat as rematlib

PER_DEVICE_BATCH = {"llama3-8b": 3, "llama3-70b": 2}
CHUNK = 512


def row(name, plan, budget, note=""):
  s = plan.stats
  fits = s.predicted_memory_bytes <= budget
  print(f"  {name:<16} {s.predicted_step_s * 1e3:>11.1f} {s.predicted_comm_bytes / 2**30:>10.2f} "
        f"{s.predicted_memory_bytes / 2**30:>12.1f} {'yes' if fits else 'NO':>5}  {note}",
        flush=True)
  return s.predicted_step_s, fits


def tuned(name, args, mesh, device, budget):
  """The expert layout with the fastest remat policy that fits (else the leanest)."""
  plans = []
  for policy in rematlib.POLICIES:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")  # "it would not fit": the table says so
      plans.append(baselines.baseline(name, *args, mesh=mesh, device=device,
                                       family="llama", remat=policy))
  fitting = [p for p in plans if p.stats.predicted_memory_bytes <= budget]
  if fitting:
    return min(fitting, key=lambda p: p.stats.predicted_step_s)
  return min(plans, key=lambda p: p.stats.predicted_memory_bytes)


def remat_note(plan):
  return "remat " + ",".join(sorted({p for _, p in plan.remat})) if plan.remat else "no remat"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="llama3-8b,llama3-70b")
  parser.add_argument("--chips", default="64,256")
  parser.add_argument("--devices", default="tpu-v5p,h100")
  parser.add_argument("--batch_axes", default=None,
                      help="mesh axes our search may split the batch over, comma-separated "
                      "(default: every axis); e.g. data, for tensor parallelism on model")
  parser.add_argument("--per_device_batch", type=int, default=None,
                      help="default: the recipe's (PER_DEVICE_BATCH)")
  a = parser.parse_args()
  batch_axes = None if a.batch_axes is None else tuple(a.batch_axes.split(","))
  for size in a.models.split(","):
    for chips in map(int, a.chips.split(",")):
      for device in a.devices.split(","):
        m = models.get_model("llama", size, attention="chunked", attention_chunk=CHUNK,
                             dtype="bfloat16", param_dtype="float32")
        per_device = a.per_device_batch or PER_DEVICE_BATCH[size]
        batch = per_device * chips
        args = (m.train_step(), m.abstract_state(), m.batch_spec(batch))
        mesh = {"data": chips // 8, "model": 8}
        profile = cost.get_profile(device)
        budget = api.default_budget(profile)
        print(f"\n## {size}, {m.config.num_layers} layers, seq {m.config.seq_len}, batch "
              f"{batch} ({per_device}/chip), mesh {mesh}, {device} "
              f"({profile.hbm_bytes / 2**30:.1f} GiB HBM, budget {budget / 2**30:.1f} GiB)")
        print(f"  {'layout':<16} {'step ms':>11} {'sent GiB':>10} {'memory GiB':>12} "
              f"{'fits':>5}")
        start = time.perf_counter()
        try:
          ours = search(*args, mesh=mesh, device=device, batch_axes=batch_axes)
          took = time.perf_counter() - start
          best = row("tapas", ours, budget, f"{remat_note(ours)}; search {took:.1f} s "
                     "end to end")
        except InfeasibleBudgetError as e:
          print(f"  tapas: no plan fits ({time.perf_counter() - start:.1f} s): "
                f"{str(e)[:400]}", flush=True)
          best = None
        start = time.perf_counter()
        try:  # the same search without sequence parallelism, to show what it adds
          plain = search(*args, mesh=mesh, device=device, batch_axes=batch_axes,
                         sequence_parallel=False)
          row("tapas, no SP", plain, budget, f"{remat_note(plain)}; search "
              f"{time.perf_counter() - start:.1f} s")
        except InfeasibleBudgetError:
          print("  tapas, no SP: no plan fits", flush=True)
        others = []
        for name in ("fsdp", "megatron", "data_parallel"):
          plan = tuned(name, args, mesh, device, budget)
          others.append(row(name, plan, budget, remat_note(plan)))
        fitting = [t for t, fits in others if fits]
        if best is not None and fitting:
          print(f"  ours / best fitting baseline: {best[0] / min(fitting):.3f}", flush=True)


if __name__ == "__main__":
  main()
