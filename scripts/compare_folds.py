"""Records the folds of the styles and the zoo, or compares them with a record.

A change to folding that means to keep its results (a speed-up) must leave every fold
unchanged: record at the old commit, compare at the new one.

  python scripts/compare_folds.py record OUT.pkl     # ~4 min on 2 cores
  python scripts/compare_folds.py compare OUT.pkl    # exit 1 on any difference

Each case: every `tests/styles.py` style at 4, 12 and 48 layers, the tiny zoo, and the
tiny GPT at 12 and 96 layers, each folded with names and by structure alone
(`use_names=False`). Recorded per fold: the method, each instance (name, unique layer,
ops, inputs, outputs, trip count), each unique layer (name, fingerprint, instances, ops,
repeats) and the glue segments.
"""

import os
import pickle
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import styles  # noqa: E402 - a test helper, on the path only here

from tapas_jax import models  # noqa: E402
from tapas_jax.fold import fold  # noqa: E402
from tapas_jax.trace import trace  # noqa: E402


def _summary(f) -> tuple:
  return (f.method,
          tuple((i.name, i.layer, i.ops, i.inputs, i.outputs, i.trip_count)
                for i in f.instances),
          tuple((u.name, u.fingerprint, u.instances, u.num_ops, u.repeats)
                for u in f.unique_layers),
          tuple((s.name, s.ops) for s in f.glue))


def _zoo(name: str, **overrides):
  m = models.get_model(name, "tiny", **overrides)
  return m.train_step(), m.abstract_state(), m.batch_spec(8)


def _cases():
  for name, build in styles.STYLES.items():
    for layers in (4, 12, 48):
      yield f"{name}@{layers}", lambda b=build, n=layers: (lambda p: (p.step, p.state,
                                                                      p.batch))(b(n))
  for name in ("gpt", "llama", "t5", "vit", "resnet", "moe"):
    yield f"zoo:{name}", lambda n=name: _zoo(n)
  for layers in (12, 96):
    yield f"zoo:gpt@{layers}", lambda n=layers: _zoo("gpt", num_layers=n)


def main() -> int:
  if len(sys.argv) != 3 or sys.argv[1] not in ("record", "compare"):
    print(__doc__)
    return 2
  mode, path = sys.argv[1:]
  if mode == "compare":
    with open(path, "rb") as f:
      old = pickle.load(f)
  out, differences = {}, 0
  for key, make in _cases():
    graph = trace(*make())
    for use_names in (True, False):
      start = time.process_time()
      got = out[(key, use_names)] = _summary(fold(graph, use_names=use_names))
      seconds = time.process_time() - start
      same = mode == "record" or old.get((key, use_names)) == got
      differences += not same
      print(f"{key:28s} names={use_names!s:5s} {got[0]:9s} {len(got[1]):3d} instances "
            f"fold {seconds:.3f} s{'' if same else '  DIFFERENT'}", flush=True)
  if mode == "record":
    with open(path, "wb") as f:
      pickle.dump(out, f)
    print(f"recorded {len(out)} folds")
    return 0
  print(f"{len(out)} folds, {differences} differences")
  return int(differences > 0)


if __name__ == "__main__":
  sys.exit(main())
