"""Plans judged by what XLA compiles of them: predicted vs compiled comm and memory.

Each plan is compiled twice for an 8-device CPU mesh (never run): through
`tapas.apply` (the plan's shardings and the constraints it pins inside the step), and
with its `in_specs` as `in_shardings` alone. Compiled figures are read off the
partitioned HLO (`tapas_jax.measure`). XLA on CPU forms no reduce-scatter: it does an
all-reduce and a slice, which `measure` counts as the reduce-scatter XLA's GPU and TPU
pipelines make of it; the "CPU sends" column is what XLA:CPU itself sends.

  python scripts/bench_compiled.py                  # GPT-2 small width, 4 layers
  python scripts/bench_compiled.py --layers 2 --seq 256
  python scripts/bench_compiled.py --plot_dir=figures   # also figures/compiled.png
  python scripts/bench_compiled.py --config=tiny --layers=1 --seq=32 \
      --plans=search,megatron --plot_dir=/tmp/x          # a smoke run (seconds)
"""

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import tapas_jax as tapas  # noqa: E402
from tapas_jax import baselines, measure, models  # noqa: E402

MESH = {"data": 2, "model": 4}


def compiled_figures(plan, step, state, batch, mesh, constrained):
  """Compiles the step with the plan: through `tapas.apply` (shardings and the plan's
  constraints), or with `in_shardings` alone."""
  start = time.perf_counter()
  if constrained:
    jitted = tapas.apply(plan, step, mesh=mesh, donate_argnums=0)
  else:
    sh = jax.tree.map(lambda s: NamedSharding(mesh, s), plan.in_specs,
                      is_leaf=lambda x: isinstance(x, PartitionSpec))
    metrics = jax.eval_shape(step, state, batch)[1]
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), metrics)
    jitted = jax.jit(step, in_shardings=sh, out_shardings=(sh[0], replicated),
                     donate_argnums=0)
  compiled = jitted.lower(state, batch).compile()
  return measure.measure(compiled, mesh.size), time.perf_counter() - start


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--config", default="gpt2-small")
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=1024)
  parser.add_argument("--plans", default=None,
                      help="comma-separated plans to compile (default: all); the names "
                           "are the table's first column")
  parser.add_argument("--plot_dir", default=None,
                      help="also write compiled.png (predicted vs compiled) here")
  args = parser.parse_args(argv)
  m = models.get_model("gpt", args.config, num_layers=args.layers, seq_len=args.seq)
  step, state, batch = m.train_step(), m.abstract_state(), m.batch_spec(args.batch)
  mesh = tapas.make_mesh(MESH)
  print(f"## Predicted vs compiled: GPT {args.config} width, {args.layers} layers, batch "
        f"{args.batch}x{args.seq}, mesh {MESH}, h100 profile, jax {jax.__version__}")
  search = lambda **kw: tapas.search(step, state, batch, mesh=mesh, device="h100", **kw)  # noqa: E731
  unlimited = float("inf")  # the free plan; the default budget is the device's HBM
  makers = {"search": lambda: search(memory_budget=unlimited),
            "search, batch on data": lambda: search(memory_budget=unlimited,
                                                    batch_axes=("data",)),
            "search, no seq. parallel": lambda: search(memory_budget=unlimited,
                                                       sequence_parallel=False)}
  for name in baselines.BASELINES:
    makers[name] = lambda name=name: baselines.baseline(name, step, state, batch, mesh=MESH,
                                                        device="h100", family="gpt")
  free = lambda: search(memory_budget=unlimited).stats.predicted_memory_bytes  # noqa: E731
  for frac in (0.75, 0.68):
    makers[f"search, budget {frac:.2f}x"] = lambda frac=frac: search(
        memory_budget=frac * free())
  wanted = list(makers) if args.plans is None else [p.strip() for p in args.plans.split(",")]
  unknown = [p for p in wanted if p not in makers]
  if unknown:
    parser.error(f"--plans: unknown {unknown}; choose from {list(makers)}")
  plans = {name: makers[name]() for name in wanted}
  print(f"{'plan':<26} {'pred ms':>8} {'pred MiB':>9} {'XLA MiB':>8} {'CPU sends':>9} "
        f"{'in_specs only':>13} "
        f"{'XLA AR/AG/RS/A2A/CP MiB':>24} {'pred GiB':>9} {'XLA GiB':>8} {'in_specs only':>13} "
        f"{'pins':>5}")
  rows = []
  for name, plan in plans.items():
    got, _ = compiled_figures(plan, step, state, batch, mesh, constrained=True)
    bare, _ = compiled_figures(plan, step, state, batch, mesh, constrained=False)
    s, c = plan.stats, got.comm_bytes
    kinds = "/".join(f"{c[k] / 2**20:.0f}" for k in measure._KINDS)
    print(f"{name:<26} {s.predicted_step_s * 1e3:>8.3f} "
          f"{s.predicted_comm_bytes / 2**20:>9.1f} {c['total'] / 2**20:>8.1f} "
          f"{(c['total'] + c[measure.SLICED]) / 2**20:>9.1f} "
          f"{bare.comm_bytes['total'] / 2**20:>13.1f} {kinds:>24} "
          f"{s.predicted_memory_bytes / 2**30:>9.3f} {got.memory_bytes / 2**30:>8.3f} "
          f"{bare.memory_bytes / 2**30:>13.3f} {len(plan.constraints):>5}", flush=True)
    rows.append(dict(plan=name, pred_mib=s.predicted_comm_bytes / 2**20,
                     xla_mib=c["total"] / 2**20, bare_mib=bare.comm_bytes["total"] / 2**20,
                     pred_gib=s.predicted_memory_bytes / 2**30,
                     xla_gib=got.memory_bytes / 2**30, bare_gib=bare.memory_bytes / 2**30))
  if args.plot_dir:
    import bench_plots  # noqa: PLC0415 - matplotlib only when a plot is asked for
    title = (f"GPT {args.config} width, {args.layers} layers, batch {args.batch}x{args.seq}, "
             f"mesh {MESH}, h100 profile; compiled for CPU")
    print("wrote", bench_plots.save(bench_plots.compiled(rows, title), args.plot_dir,
                                    "compiled"))


if __name__ == "__main__":
  main()
