"""Predicted memory and bytes sent next to the TPU compiler's, for the zoo at its tiny
configs on a v5p:2x2x1 topology (libtpu's ahead-of-time compile; no TPU needed).

  JAX_PLATFORMS=cpu python scripts/bench_verify.py --topology=v5p:2x2x1 --batch=8

Needs libtpu: pip install 'tapas_jax[tpu]'.
"""

import argparse
import warnings

import jax

import tapas_jax as tapas
from tapas_jax import baselines, models


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--topology", default="v5p:2x2x1")
  p.add_argument("--mesh", default="data:2,model:2")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--families", default=",".join(sorted(models.FAMILIES)))
  p.add_argument("--layouts", default="tapas,fsdp")
  a = p.parse_args()
  mesh = {k: int(v) for k, v in (kv.split(":") for kv in a.mesh.split(","))}
  print(f"jax {jax.__version__}; topology {a.topology}; mesh {mesh}; batch {a.batch}")
  print("| model | layout | predicted MiB | compiled MiB (args + temp + out - alias) | "
        "pred / comp | predicted sent KiB | compiled sent KiB | compile s |")
  print("|---|---|---|---|---|---|---|---|")
  for family in a.families.split(","):
    m = models.get_model(family, "tiny")
    args = (m.train_step(), m.abstract_state(), m.batch_spec(a.batch))
    for layout in a.layouts.split(","):
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
          plan = (tapas.search(*args, mesh=mesh, device="tpu-v5p") if layout == "tapas"
                  else baselines.baseline(layout, *args, mesh=mesh, family=family,
                                          device="tpu-v5p"))
        except Exception as e:  # noqa: BLE001 - a row per failure, the table goes on
          print(f"| {family} | {layout} | planning failed: {type(e).__name__} | | | | | |")
          continue
        r = tapas.verify(plan, args[0], *args[1:], topology=a.topology, donate_argnums=0)
      print(f"| {family} | {layout} | {r.predicted_memory_bytes / 2**20:.2f} | "
            f"{r.peak_bytes / 2**20:.2f} | {r.memory_ratio:.2f} | "
            f"{r.predicted_comm_bytes / 2**10:.1f} | "
            f"{r.comm_bytes.get('total', 0.0) / 2**10:.1f} | {r.compile_s:.1f} |", flush=True)


if __name__ == "__main__":
  main()
