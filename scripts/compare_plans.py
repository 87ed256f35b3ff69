"""Dumps searched and baseline plans over the zoo, or compares two dumps.

A refactor of the search must leave every plan and figure unchanged: dump at the old
commit, dump at the new one, compare.

  python scripts/compare_plans.py dump OUT.json          # ~5 min on 2 cores
  python scripts/compare_plans.py diff OLD.json NEW.json  # exit 1 on any difference

Each case: a zoo train step (tiny, and GPT-2 small width at 4 layers) on a mesh, searched
unbudgeted folded, unfolded (integer program), and under a budget of 0.7x the free plan's
memory, plus the data-parallel, FSDP and Megatron baselines. Recorded: every input's
PartitionSpec, predicted step time, bytes sent, memory, state bytes, solver status and
the summary (timings masked when compared).
"""

import json
import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

CASES = [
    ("gpt", "tiny", {}, {"data": 2, "model": 4}),
    ("llama", "tiny", {}, {"data": 2, "model": 4}),
    ("t5", "tiny", {}, {"data": 2, "model": 4}),
    ("moe", "tiny", {}, {"data": 2, "model": 4}),
    ("vit", "tiny", {}, {"data": 4, "model": 2}),
    ("resnet", "tiny", {}, {"data": 8}),
    ("gpt", "gpt2-small", {"num_layers": 4}, {"data": 2, "model": 4}),
    ("llama", "tiny", {}, {"data": 2, "fsdp": 2, "model": 2}),
]
# The summary's timings line ("trace 0.12 s, fold 0.01 s, search 1.88 s; solver ...")
# is cut to the summary's width, so what follows the timings shifts with their digits:
# everything from them to the line's end is masked.
_TIMINGS = re.compile(r"trace [\d.]+ ?s, fold [\d.]+ ?s, search [\d.]+ ?s.*")


def _record(plan) -> dict:
  # Commits before the solver split kept stats as a dict.
  s = plan.stats if isinstance(plan.stats, dict) else vars(plan.stats)
  return dict(specs=str(plan.in_specs), step=s["predicted_step_s"],
              comm=s["predicted_comm_bytes"], mem=s["predicted_memory_bytes"],
              state=s["predicted_state_bytes"], status=s["solver_status"],
              summary=_TIMINGS.sub("", plan.summary()))


def _masked(field):
  # Dumps made before the timings pattern matched the summary hold them unmasked.
  return _TIMINGS.sub("", field) if isinstance(field, str) else field


def dump(path: str) -> None:
  import tapas_jax as tapas  # noqa: PLC0415 - after XLA_FLAGS
  from tapas_jax import baselines, models  # noqa: PLC0415

  out = {}
  for family, size, overrides, mesh in CASES:
    m = models.get_model(family, size, **overrides)
    args = (m.train_step(), m.abstract_state(), m.batch_spec(8))
    key = f"{family}/{size}/{overrides}/{mesh}"
    free = tapas.search(*args, mesh=mesh, device="h100")
    out[f"{key}/free"] = _record(free)
    if size == "tiny":
      out[f"{key}/unfolded"] = _record(tapas.search(*args, mesh=mesh, device="h100",
                                                    fold=False, time_limit=600))
    budget = 0.7 * _record(free)["mem"]
    out[f"{key}/budget0.7"] = _record(tapas.search(*args, mesh=mesh, device="h100",
                                                   memory_budget=budget))
    for name in baselines.BASELINES:
      out[f"{key}/{name}"] = _record(baselines.baseline(name, *args, mesh=mesh, device="h100",
                                                        family=family))
    print(key, flush=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=1, sort_keys=True)


def diff(old_path: str, new_path: str) -> int:
  with open(old_path) as f:
    old = json.load(f)
  with open(new_path) as f:
    new = json.load(f)
  bad = sorted(set(old) ^ set(new))
  for key in sorted(set(old) & set(new)):
    bad += [f"{key}: {field}" for field in old[key]
            if _masked(old[key][field]) != _masked(new[key].get(field))]
  split = sum("'" in v["specs"].replace("None", "") for v in new.values())
  print(f"{len(new)} plans ({split} split something), {len(bad)} differences")
  for line in bad:
    print("  ", line)
  return 1 if bad else 0


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "dump":
    dump(sys.argv[2])
  elif len(sys.argv) == 4 and sys.argv[1] == "diff":
    sys.exit(diff(sys.argv[2], sys.argv[3]))
  else:
    sys.exit(__doc__)
