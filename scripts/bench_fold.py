"""Trace and fold figures: equations, unique layers, and fold time beside make_jaxpr.

Every program is a full train step (forward, backward, adamw update) traced
abstractly: nothing is allocated, so published shapes run on a laptop.

  python scripts/bench_fold.py            # GPT-2 small width at 12/24/48/96 layers,
                                          # LLaMA-3-70B and T5-11B shapes
  python scripts/bench_fold.py --quick    # tiny widths, for a smoke run
"""

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from tapas_jax import models  # noqa: E402
from tapas_jax.fold import fold  # noqa: E402
from tapas_jax.trace import trace  # noqa: E402


def measure(label: str, model: models.ZooModel, batch_size: int) -> dict:
  state, batch = model.abstract_state(), model.batch_spec(batch_size)
  # The bare, unavoidable linear cost. The first call also fills jax's caches of inner
  # jitted helpers; the second, on a fresh closure, is the warm figure compared with.
  bare = []
  for _ in range(2):
    start = time.perf_counter()
    jax.make_jaxpr(model.train_step())(state, batch)
    bare.append(time.perf_counter() - start)
  cold, bare = bare
  graph = trace(model.train_step(), state, batch)
  folded = fold(graph)
  return dict(label=label, eqns=len(graph.ops), instances=len(folded.instances),
              unique=len(folded.unique_layers), method=folded.method, bare=bare, cold=cold,
              trace=graph.trace_s + graph.walk_s, walk=graph.walk_s, fold=folded.fold_s,
              ratio=folded.fold_s / bare, fold_ratio=folded.fold_ratio)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="tiny widths and depths")
  args = parser.parse_args()
  if args.quick:
    cases = [(f"gpt tiny L={n}", models.get_model("gpt", "tiny", num_layers=n), 2)
             for n in (2, 4, 8)]
  else:
    cases = [(f"gpt2-small width, L={n}",
              models.get_model("gpt", "gpt2-small", num_layers=n), 8)
             for n in (12, 24, 48, 96)]
    cases += [("llama3-70b (80 layers)", models.get_model("llama", "llama3-70b"), 8),
              ("t5-11b (24+24 layers)", models.get_model("t5", "t5-11b"), 8)]
  head = (f"{'program':<26} {'eqns':>7} {'inst':>5} {'uniq':>5} "
          f"{'make_jaxpr cold/warm s':>22} {'trace s':>8} {'walk s':>7} {'fold s':>7} "
          f"{'fold/warm make_jaxpr':>20} {'fold ratio':>10}")
  print(head)
  print("-" * len(head))
  for label, model, batch in cases:
    r = measure(label, model, batch)
    print(f"{r['label']:<26} {r['eqns']:>7} {r['instances']:>5} {r['unique']:>5} "
          f"{r['cold']:>12.2f} /{r['bare']:>8.2f} {r['trace']:>8.2f} {r['walk']:>7.2f} "
          f"{r['fold']:>7.2f} "
          f"{r['ratio']:>19.1%} {r['fold_ratio']:>9.1f}x", flush=True)


if __name__ == "__main__":
  main()
