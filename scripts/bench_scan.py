"""Scanned layer stacks next to unrolled ones: remat, predictions, search time.

Four measurements on the zoo's LLaMA at tiny width, mesh data=2 x model=4, on 8 fake
CPU devices (BENCHMARKS.md, "Scanned layer stacks"):

  python scripts/bench_scan.py remat          # budget = half the free plan's memory
  python scripts/bench_scan.py depth 2 4 8    # scanned vs unrolled, cost model and XLA:CPU
  python scripts/bench_scan.py comm           # bytes sent: predicted vs XLA:CPU, chunked
                                              # attention (a loop in the layer loop)
  python scripts/bench_scan.py time 32        # one end-to-end search (run one per process:
                                              # a second finds JAX's tracing caches warm)

`remat`, `depth` and `comm` compile the applied steps with XLA:CPU; `time` compiles nothing.
Run from the checkout with `PYTHONPATH=.`.
"""

import functools
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import dataclasses  # noqa: E402

import jax  # noqa: E402

import tapas_jax as tapas  # noqa: E402
from tapas_jax import baselines, cost, measure, models  # noqa: E402

MESH = {"data": 2, "model": 4}


def _sgd(loss_fn, params, model_state, batch):
  (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, model_state, batch)
  return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def remat():
  """The scanned stack under half its free plan's memory: the plan, its compiled FLOPs
  and temporaries with the plan's remat and without it."""
  m = models.get_model("llama", "tiny", num_layers=8, seq_len=64, scan_layers=True)
  step = functools.partial(_sgd, m.loss_fn())
  st = m.abstract_state()
  args = (st.params, st.model_state, m.batch_spec(8))
  free = tapas.search(step, *args, mesh=MESH, device="cpu")
  budget = 0.5 * free.stats.predicted_memory_bytes
  try:
    plan = tapas.search(step, *args, mesh=MESH, device="cpu", memory_budget=budget)
  except tapas.InfeasibleBudgetError as e:
    print(f"budget {budget / 2**20:.2f} MiB: infeasible, leanest {e.leanest_bytes / 2**20:.2f}"
          " MiB")
    return
  print("plan | remat | predicted MiB | predicted ms | XLA:CPU MFLOP | XLA:CPU temp MB")
  for name, p in (("free", free), ("budget 0.5x", plan),
                  ("budget plan, remat dropped", dataclasses.replace(plan, remat=()))):
    compiled = tapas.apply(p, step).lower(*args).compile()
    # The last row is the same plan run without its remat: its stats are not its own.
    predicted = (f"{p.stats.predicted_memory_bytes / 2**20:.2f} | "
                 f"{p.stats.predicted_step_s * 1e3:.3f}") if p.remat or p is free else "- | -"
    print(f"{name} | {p.remat or '-'} | {predicted} | "
          f"{measure.measure(compiled, 8).flops / 1e6:.1f} | "
          f"{compiled.memory_analysis().temp_size_in_bytes / 1e6:.2f}")


def depth(layers):
  """Scanned vs unrolled at each depth: the searched plan's predicted step and memory
  (adamw train step, state donated, XLA:CPU's layout profile) and XLA:CPU's memory."""
  profile = cost.compiled_by_xla_cpu("h100")
  print("layers | program | predicted ms | predicted MiB | XLA:CPU MiB | predicted / XLA")
  for n in layers:
    for scan in (False, True):
      m = models.get_model("llama", "tiny", num_layers=n, seq_len=64, scan_layers=scan)
      step, state, batch = m.train_step(), m.abstract_state(), m.batch_spec(8)
      plan = tapas.search(step, state, batch, mesh=MESH, device=profile)
      got = measure.measure(tapas.apply(plan, step, donate_argnums=0).lower(state, batch)
                            .compile(), 8).memory_bytes
      pm = plan.stats.predicted_memory_bytes
      print(f"{n} | {'scanned' if scan else 'unrolled'} | "
            f"{plan.stats.predicted_step_s * 1e3:.4f} | {pm / 2**20:.2f} | {got / 2**20:.2f} | "
            f"{pm / got:.3f}", flush=True)


def comm():
  """Bytes sent per device, predicted and as XLA:CPU compiled them (`measure`: a loop
  body's collectives times its trip count), unrolled and scanned, with a chunked
  attention's `lax.map` inside each layer (inside the layer loop when scanned)."""
  print("| program | plan | predicted KiB | XLA:CPU KiB | predicted / XLA:CPU |")
  print("|---|---|---|---|---|")
  for scan in (False, True):
    m = models.get_model("llama", "tiny", num_layers=4, scan_layers=scan,
                         attention="chunked", attention_chunk=16)
    args = (m.train_step(), m.abstract_state(), m.batch_spec(8))
    for name in ("data_parallel", "fsdp", "megatron"):
      plan = baselines.baseline(name, *args, mesh=MESH, device="h100", family="llama")
      step = tapas.apply(plan, args[0], mesh=tapas.make_mesh(MESH), donate_argnums=0)
      sent = measure.measure(step.lower(*args[1:]).compile(), 8).comm_bytes["total"]
      predicted = plan.stats.predicted_comm_bytes
      print(f"| {'scanned' if scan else 'unrolled'} | {name} | {predicted / 2**10:.1f} | "
            f"{sent / 2**10:.1f} | {predicted / sent:.2f} |", flush=True)


def timed(n):
  """One end-to-end search of the scanned stack (cold: the first in this process)."""
  m = models.get_model("llama", "tiny", num_layers=n, scan_layers=True)
  args = (m.train_step(), m.abstract_state(), m.batch_spec(8))
  start = time.perf_counter()
  plan = tapas.search(*args, mesh=MESH, device="cpu")
  wall = time.perf_counter() - start
  s = plan.stats
  print(f"{n} layers: {wall:.2f} s end to end; trace {s.trace_s:.2f} s, fold {s.fold_s:.2f} s, "
        f"search {s.search_s:.2f} s; {s.num_equations} equations")


def main(argv):
  if argv[:1] == ["remat"]:
    remat()
  elif argv[:1] == ["depth"]:
    depth([int(a) for a in argv[1:]] or [2, 4, 8])
  elif argv[:1] == ["comm"]:
    comm()
  elif argv[:1] == ["time"] and len(argv) == 2:
    timed(int(argv[1]))
  else:
    sys.exit(__doc__)


if __name__ == "__main__":
  main(sys.argv[1:])
