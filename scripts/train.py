"""Training launcher: plan a zoo model's train step with tapas, then train with the plan.

Usage:
  python scripts/train.py                                   # configs/default.py
  python scripts/train.py --config=configs/gpt2.py:tiny --mesh=data:2,model:4 \\
      --steps=3 --workdir=/tmp/run
  python scripts/train.py --config=configs/llama.py:tiny --config.model.num_layers=4 \\
      --strategy=fsdp
  python scripts/train.py --config=configs/gpt2.py:gpt3-175b --mesh=data:16,model:16 \\
      --device=tpu-v5p --plan_only --workdir=/tmp/plan175b   # no devices needed
  python scripts/train.py ... --coordinator_address=host0:1234 --num_processes=4 \\
      --process_id=0                                         # one line per host
  python scripts/prepare_data.py README.md /tmp/readme.bin   # text -> byte tokens
  python scripts/train.py --config=configs/gpt2.py:tiny --config.data=tokens:/tmp/readme.bin \\
      --config.eval_every=10 --config.eval_steps=2 --steps=100

Configs are `ml_collections` files (`configs/<family>.py:<size>`, see configs/base.py),
locked: override any field as `--config.model.num_layers=4`, `--config.learning_rate=1e-2`.

Data (`--config.data`): `learnable` (a synthetic pattern the loss visibly learns),
`random` (uniform: nothing to learn), `tokens:PATH` (a token file: raw uint16 ids as
nanoGPT writes them, `--config.token_dtype=uint32` for wider ones, or a `.npy` of ids;
scripts/prepare_data.py writes one from text) or `images:IMAGES.npy,LABELS.npy`. Files
are read through grain (tapas_jax/models/data.py), shuffled with the seed; each process
reads only the rows of the global batch its devices hold. `--config.eval_every=N` holds
out the last `--config.eval_steps` batches of the file and reports their loss every N
steps (and at the last); on synthetic data it draws fresh batches.

`--compare` prints the plan beside data parallel, FSDP and Megatron (predicted, and what
XLA compiles of each); `--batch_axes=any` lets the search put the batch on any axis.

The workdir gets `plan.json` (`tapas.Plan.load` reads it; `--strategy=plan:PATH` trains
with it) and `plan.txt` (its summary), `config.json`,
`metrics.jsonl` (one JSON object per step: step, loss, step_s, tokens_per_s or
images_per_s, mfu, and eval_loss where evaluated) and orbax checkpoints under
`checkpoints/` (the train state, and a data file's read position), restored with the
plan's shardings: run again with more `--steps` to continue where the data left off.
On CPU the launcher makes `--host_devices` fake devices (unless XLA_FLAGS already sets a
count). With several processes only process 0 prints and writes files (checkpoints are
written by all).

Bad input (a malformed mesh, unknown config key, size, model or strategy, an unreadable
plan file, a non-positive step count, an unwritable workdir, a model that will not fit
the host; a data file that is missing or unreadable, not a whole number of tokens, holds
ids at or above the model's vocab, is shorter than one global batch, or is too short for
its held-out split) is refused with one line on stderr and exit status 2, before anything is
written.
"""

import dataclasses
import json
import math
import os
import re
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The checkout this script sits in is the one imported (its tapas_jax and configs/), even
# where another copy of tapas_jax is installed.
sys.path.insert(0, _ROOT)

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(_ROOT, "configs", "default.py"),
    "Config file and size, e.g. configs/gpt2.py:tiny. Fields override as "
    "--config.model.num_layers=4.", lock_config=True)
_MESH = flags.DEFINE_string("mesh", None, "Mesh axes as name:size pairs, outermost first, "
                            "e.g. data:2,model:4; default: the config's mesh.")
_DEVICE = flags.DEFINE_string("device", None, "Cost profile of the device (tpu-v4, tpu-v5e, "
                              "tpu-v5p, tpu-v6e, a100, h100, h200, cpu); default: --verify's "
                              "topology's, else the local devices' generation.")
_MEMORY_BUDGET = flags.DEFINE_string("memory_budget", None, "Per-device memory the plan may "
                                     "take: bytes, or with a unit (16GiB, 512MiB, 80GB).")
_STRATEGY = flags.DEFINE_string("strategy", "tapas", "tapas (search), dp, fsdp, megatron "
                                "(expert baselines), or plan:PATH (a saved plan).")
_BATCH_AXES = flags.DEFINE_string("batch_axes", None, "Mesh axes the search may split the "
                                  "batch over, comma-separated, or 'any'; default: every axis.")
_SEQUENCE_PARALLEL = flags.DEFINE_bool(
    "sequence_parallel", True, "Let the search also split positions between contractions "
    "(Megatron-SP: gathered into the dots, reduce-scattered out) where cheaper; "
    "--strategy=tapas only. --nosequence_parallel searches without it.")
_VERIFY = flags.DEFINE_string(
    "verify", None, "TPU topology (v5p:4x4x4, v6e:16x16) to compile the plan for through "
    "libtpu, on this machine: the search runs again under a lower budget until the TPU "
    "compiler's peak fits (--strategy=tapas). Works with --plan_only; needs "
    "pip install 'tapas_jax[tpu]'.")
_LAYOUTS = flags.DEFINE_enum(
    "layouts", "default", ["default", "auto"], "The state's in-memory layouts: default "
    "(JAX's) or auto (the compiler's; on TPU, no relayout copies of each kernel and its "
    "optimizer state around its update). --verify compiles the same.")
_STEPS = flags.DEFINE_integer("steps", None, "Train until this step; default: config.steps.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None, "Global batch size; default: "
                                   "config.batch_size.")
_SEED = flags.DEFINE_integer("seed", None, "Init and data seed; default: config.seed.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for the plan, metrics and "
                               "checkpoints; none: nothing is written.")
_PLAN_ONLY = flags.DEFINE_bool("plan_only", False, "Search, print and save the plan, then "
                               "stop: any mesh size, no devices needed.")
_COMPARE = flags.DEFINE_bool("compare", False, "Print the plan next to the data parallel, "
                             "FSDP and Megatron baselines: predicted figures, and what XLA "
                             "compiles of each (unless --plan_only).")
_HOST_DEVICES = flags.DEFINE_integer("host_devices", 8, "Fake CPU devices per process when "
                                     "XLA_FLAGS does not set a count.")
_DISTRIBUTED = flags.DEFINE_bool("distributed", None, "Call jax.distributed.initialize() and "
                                 "let it detect the cluster (Cloud TPU, SLURM, ...); default: "
                                 "on when TPU_WORKER_HOSTNAMES names several hosts.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0, "
                                   "for jax.distributed off Cloud TPU.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")

_STRATEGIES = {"tapas": None, "dp": "data_parallel", "fsdp": "fsdp", "megatron": "megatron"}
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class LaunchError(Exception):
  """Bad input: the launcher prints the message as one line and exits with status 2."""


# -- parsing and checks (before anything is written) --------------------------------------


def parse_mesh(text: str) -> dict[str, int]:
  """`"data:2,model:4"` -> `{"data": 2, "model": 4}`."""
  axes: dict[str, int] = {}
  for item in text.split(","):
    name, sep, size = (s.strip() for s in item.partition(":"))
    if not sep or not re.fullmatch(r"[A-Za-z_]\w*", name) or not re.fullmatch(r"\d+", size):
      raise LaunchError(f"--mesh={text}: expected name:size pairs such as data:2,model:4, "
                        f"got {item.strip()!r}")
    if name in axes:
      raise LaunchError(f"--mesh={text}: axis {name!r} appears twice")
    if int(size) < 1:
      raise LaunchError(f"--mesh={text}: axis {name!r} has size {size}; sizes are >= 1")
    axes[name] = int(size)
  return axes


def parse_bytes(text: str) -> float:
  """`"16GiB"` -> 17179869184.0; a bare number is bytes."""
  match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
  unit = match and match.group(2).lower()
  try:
    value = float(match.group(1)) * _UNITS[unit] if match else -1.0
  except (ValueError, KeyError):
    value = -1.0
  if value <= 0:
    raise LaunchError(f"--memory_budget={text}: expected a positive size such as 16GiB, "
                      "512MiB, 80GB or a number of bytes")
  return value


def parse_strategy(text: str) -> tuple[str, str | None]:
  """`(kind, plan_path)`; the plan file is read here, so an unreadable one fails early."""
  if text.startswith("plan:"):
    path = text[len("plan:"):]
    try:
      with open(path) as f:
        json.load(f)
    except (OSError, ValueError) as e:
      raise LaunchError(f"--strategy={text}: cannot read the plan file ({e})") from None
    return "plan", path
  if text not in _STRATEGIES:
    raise LaunchError(f"--strategy={text}: choose one of {', '.join(_STRATEGIES)} or "
                      "plan:PATH")
  return text, None


def check_workdir(path: str) -> bool:
  """Creates `path` if needed and proves a file can be written there.

  Returns:
    Whether the directory was created here (so a refused run can remove it).
  """
  created = not os.path.exists(path)
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
      pass
  except OSError as e:
    raise LaunchError(f"--workdir={path}: not a writable directory ({e.strerror or e})") \
        from None
  return created


def build_model(config):
  """The zoo model the config names, with its optimizer settings."""
  from tapas_jax import models  # noqa: PLC0415 - after sys.path is set
  try:
    model = models.get_model(config.family, config.size, **config.model.to_dict())
  except ValueError as e:
    raise LaunchError(f"--config: {e}") from None
  return dataclasses.replace(model, learning_rate=config.learning_rate,
                             weight_decay=config.weight_decay)


def open_data(config, model, batch_size: int):
  """The dataset `--config.data` names (None for synthetic data), checked against the model."""
  if config.data in ("learnable", "random"):
    return None
  from tapas_jax.models import data  # noqa: PLC0415 - after sys.path is set
  if not config.data.startswith(("tokens:", "images:")):
    raise LaunchError(f"--config.data={config.data}: choose learnable, random, tokens:PATH "
                      "or images:IMAGES.npy,LABELS.npy")
  num_eval = config.eval_steps * batch_size if config.eval_every else 0
  try:
    return data.open_data(config.data, model.batch_spec(batch_size), num_eval=num_eval,
                          model_config=model.config, token_dtype=config.token_dtype)
  except data.DataError as e:
    raise LaunchError(f"--config.data: {e}") from None  # the message names the file


def host_memory_bytes() -> float:
  """Memory this host can still hand out (MemAvailable), else its physical memory."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return float(line.split()[1]) * 1024
  except OSError:
    pass
  return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_fits(plan, devices, process_index: int, what: str) -> None:
  """Refuses, before compiling, a plan whose predicted memory the machine lacks."""
  per_device = plan.stats.predicted_memory_bytes
  local = [d for d in devices if d.process_index == process_index]
  if devices[0].platform == "cpu":
    need, have = per_device * len(local), host_memory_bytes()
    where = f"{len(local)} CPU devices share this host's {have / 2**30:.1f} GiB available"
  else:
    stats = devices[0].memory_stats() or {}
    need, have = per_device, float(stats.get("bytes_limit", math.inf))
    where = f"one {devices[0].device_kind} holds {have / 2**30:.1f} GiB"
  if need > have:
    raise LaunchError(
        f"{what} does not fit: the plan predicts {per_device / 2**30:.2f} GiB per device "
        f"and {where}; use a smaller size, a larger mesh, or --plan_only")


# -- files ---------------------------------------------------------------------------------


def write_atomic(path: str, text: str) -> None:
  """Writes `text` to `path` via a temporary file and a rename: never half a file."""
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-")
  try:
    with os.fdopen(fd, "w") as f:
      f.write(text)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def load_plan(path: str):
  import tapas_jax as tapas  # noqa: PLC0415
  try:
    return tapas.Plan.load(path)
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise LaunchError(f"--strategy=plan:{path}: {e}") from None


# -- the run -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
  """Every input of a run, checked."""

  config: object
  model: object
  mesh_axes: dict
  strategy: str
  plan_path: str | None
  search: object  # a tapas_jax.options.SearchConfig: every search option, checked
  steps: int
  batch_size: int
  seed: int
  workdir: str | None
  data: object  # a tapas_jax.models.data.Dataset (`open_data`, once jax runs), or None
  eval_every: int
  eval_steps: int


def read_settings() -> Settings:
  """Flags and config, checked; raises LaunchError on the first bad one."""
  try:  # the config file may load lazily, on first use
    config = _CONFIG.value
    config.family  # noqa: B018 - a config that failed to load raises here
  except (AttributeError, KeyError, OSError, TypeError, ValueError) as e:
    raise LaunchError(f"--config: {one_line(e)}") from None
  steps = config.steps if _STEPS.value is None else _STEPS.value
  batch_size = config.batch_size if _BATCH_SIZE.value is None else _BATCH_SIZE.value
  if steps < 1:
    raise LaunchError(f"--steps={steps}: the step count must be positive")
  if batch_size < 1:
    raise LaunchError(f"--batch_size={batch_size}: the batch size must be positive")
  if config.eval_every < 0 or config.eval_steps < 1:
    raise LaunchError(f"--config.eval_every={config.eval_every}, --config.eval_steps="
                      f"{config.eval_steps}: evaluate every N >= 0 steps (0: never) on "
                      "eval_steps >= 1 batches")
  mesh_axes = parse_mesh(_MESH.value or config.mesh)
  strategy, plan_path = parse_strategy(_STRATEGY.value)
  budget = parse_bytes(_MEMORY_BUDGET.value) if _MEMORY_BUDGET.value else None
  if _SEQUENCE_PARALLEL.value and flags.FLAGS["sequence_parallel"].present \
      and strategy != "tapas":
    raise LaunchError(f"--sequence_parallel: only the search (--strategy=tapas) chooses "
                      f"sequence parallelism; --strategy={_STRATEGY.value} is a fixed layout. "
                      f"Drop the flag or use --strategy=tapas")
  batch_axes = None  # tapas.search's own default: any axis
  if _BATCH_AXES.value and _BATCH_AXES.value != "any":
    batch_axes = tuple(a.strip() for a in _BATCH_AXES.value.split(","))
    unknown = [a for a in batch_axes if a not in mesh_axes]
    if unknown:
      raise LaunchError(f"--batch_axes={_BATCH_AXES.value}: {unknown} not in the mesh "
                        f"axes {list(mesh_axes)}")
  from tapas_jax import options  # noqa: PLC0415 - a flag error needs no jax; none starts here
  if _VERIFY.value is not None:
    try:
      options.topology(_VERIFY.value, "--verify", "verify")
    except ValueError as e:
      raise LaunchError(str(e)) from None
    if strategy != "tapas":
      raise LaunchError(f"--verify: only the search (--strategy=tapas) searches again "
                        f"under the compiler's figures; --strategy={_STRATEGY.value} is "
                        "fixed. Drop the flag or use --strategy=tapas")
  if _DEVICE.value is not None:
    from tapas_jax import cost  # noqa: PLC0415
    try:
      cost.get_profile(_DEVICE.value)
    except ValueError as e:
      raise LaunchError(f"--device: {e}") from None
  try:
    search = options.SearchConfig(device=_DEVICE.value, memory_budget=budget,
                                  batch_axes=batch_axes,
                                  sequence_parallel=_SEQUENCE_PARALLEL.value,
                                  verify=_VERIFY.value, layouts=_LAYOUTS.value,
                                  where="train.py")
  except ValueError as e:
    raise LaunchError(str(e)) from None
  model = build_model(config)
  return Settings(config=config, model=model, mesh_axes=mesh_axes,
                  strategy=strategy, plan_path=plan_path, search=search,
                  steps=steps,
                  batch_size=batch_size,
                  seed=config.seed if _SEED.value is None else _SEED.value,
                  workdir=_WORKDIR.value, data=None,
                  eval_every=config.eval_every, eval_steps=config.eval_steps)


def start_jax(settings: Settings):
  """Configures fake CPU devices and the multi-process runtime, then imports jax."""
  import jax  # noqa: PLC0415
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    jax.config.update("jax_num_cpu_devices", _HOST_DEVICES.value)
  hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
  distributed = _DISTRIBUTED.value if _DISTRIBUTED.value is not None else "," in hosts
  if _COORDINATOR.value or _NUM_PROCESSES.value or _PROCESS_ID.value is not None:
    if not (_COORDINATOR.value and _NUM_PROCESSES.value and _PROCESS_ID.value is not None):
      raise LaunchError("multi-process runs need all of --coordinator_address, "
                        "--num_processes and --process_id")
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  elif distributed:
    jax.distributed.initialize()
  return jax


class Reporter:
  """Prints and writes from process 0 only."""

  def __init__(self, jax, workdir: str | None):
    self.lead = jax.process_index() == 0
    self.workdir = workdir

  def say(self, text: str) -> None:
    if self.lead:
      print(text, flush=True)

  def write(self, name: str, text: str) -> None:
    if self.lead and self.workdir:
      write_atomic(os.path.join(self.workdir, name), text)


def make_plan(settings: Settings, train_step, state_spec, batch_spec, mesh):
  """Searches (or builds, or loads) the plan the strategy asks for."""
  import tapas_jax as tapas  # noqa: PLC0415
  from tapas_jax import baselines  # noqa: PLC0415
  try:
    if settings.strategy == "plan":  # its flax/optax nodes come back as stand-ins
      return load_plan(settings.plan_path).bind(state_spec, batch_spec)
    if settings.strategy == "tapas":
      return tapas.search(train_step, state_spec, batch_spec, mesh=mesh,
                          config=settings.search)
    return baselines.baseline(_STRATEGIES[settings.strategy], train_step, state_spec,
                              batch_spec, mesh=mesh, device=settings.search.device,
                              family=settings.config.family)
  except (ValueError, ImportError) as e:  # an infeasible budget, no libtpu, ...
    raise LaunchError(f"--strategy={_STRATEGY.value}: {e}") from None


def compare(settings: Settings, plan, train_step, state_spec, batch_spec, mesh, say) -> None:
  """Prints `plan` beside the expert baselines, predicted and (with devices) compiled."""
  import tapas_jax as tapas  # noqa: PLC0415
  from tapas_jax import baselines, measure  # noqa: PLC0415
  plans = {plan.name: plan}
  for name in baselines.BASELINES:
    if name != plan.name:
      plans[name] = baselines.baseline(name, train_step, state_spec, batch_spec, mesh=mesh,
                                       device=plan.device, family=settings.config.family)
  compiled = not isinstance(mesh, dict)
  head = f"{'plan':<14} {'pred ms':>8} {'pred comm MiB':>13} {'pred mem MiB':>12}"
  say("plans per device per step" + (" (XLA: the compiled program; on CPU XLA makes no "
                                     "reduce-scatter, so ZeRO gradients count as "
                                     "all-reduces)" if compiled else ""))
  say(head + (f" {'XLA comm MiB':>12} {'XLA mem MiB':>11}" if compiled else ""))
  for name, p in plans.items():
    s = p.stats
    line = (f"{name:<14} {s.predicted_step_s * 1e3:>8.3f} "
            f"{s.predicted_comm_bytes / 2**20:>13.2f} {s.predicted_memory_bytes / 2**20:>12.2f}")
    if compiled:
      step = tapas.apply(p, train_step, mesh=mesh)
      got = measure.measure(step.lower(state_spec, batch_spec).compile(), mesh.size)
      line += f" {got.comm_bytes['total'] / 2**20:>12.2f} {got.memory_bytes / 2**20:>11.2f}"
    say(line)


def batch_items(batch_spec) -> tuple[float, str]:
  """Examples one batch counts in the unit people quote: images, or tokens."""
  if "images" in batch_spec:
    return float(batch_spec["images"].shape[0]), "images"
  tokens = [batch_spec[k].size for k in ("inputs", "decoder_inputs") if k in batch_spec]
  return float(sum(tokens)), "tokens"


def model_flops(jax, train_step, state_spec, batch_spec) -> float:
  """FLOPs of one unsharded step as XLA counts them (lowered only; loops count once)."""
  from tapas_jax import _jax_internals as jx  # noqa: PLC0415 - after jax is configured
  try:
    cost = jax.jit(train_step).lower(state_spec, batch_spec).cost_analysis()
  except Exception:  # noqa: BLE001 - a missing estimate only drops the MFU column
    return 0.0
  return jx.cost_flops(cost)


def read_metrics(path: str, upto: int) -> list[str]:
  """The lines of a previous run's metrics.jsonl up to step `upto` (a resume keeps them)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  return [line for line in lines if json.loads(line)["step"] <= upto]


def progress(step: int, steps: int, width: int = 20) -> str:
  done = width * step // steps
  return "[" + "#" * done + "." * (width - done) + f"] {step}/{steps}"


def train(settings: Settings) -> int:
  """Checks the devices and the workdir, then plans (and trains, unless --plan_only)."""
  jax = start_jax(settings)
  # After start_jax: the batch spec runs jax, which must not start before its device flags.
  # A plan reads no data: --plan_only leaves the file alone (it may be on another machine).
  if not _PLAN_ONLY.value:
    settings = dataclasses.replace(settings, data=open_data(settings.config, settings.model,
                                                            settings.batch_size))
  num_devices = math.prod(settings.mesh_axes.values())
  mesh_text = ",".join(f"{k}:{v}" for k, v in settings.mesh_axes.items())
  if not _PLAN_ONLY.value and num_devices > jax.device_count():
    raise LaunchError(f"--mesh={mesh_text} needs {num_devices} devices and "
                      f"{jax.device_count()} are available; plan it with --plan_only, or "
                      f"use a mesh of {jax.device_count()} devices")
  workdir = settings.workdir
  created = bool(workdir) and jax.process_index() == 0 and check_workdir(workdir)
  try:
    return _train(jax, settings, workdir)
  except LaunchError:
    if created and not os.listdir(workdir):  # refused before writing: leave no trace
      os.rmdir(workdir)
    raise
  finally:
    if jax.process_count() > 1:
      # Every process leaves through the shutdown barrier while all are alive: left to
      # interpreter teardown, process 0 can drop the coordination service under a peer
      # still exiting, and gRPC aborts (SIGABRT, "server.cc Check failed: queue.Pop()").
      jax.distributed.shutdown()


def _train(jax, settings: Settings, workdir: str | None) -> int:
  """Plans, reports and writes the plan; then `fit`, unless --plan_only."""
  import tapas_jax as tapas  # noqa: PLC0415
  from tapas_jax import cost  # noqa: PLC0415

  model, config = settings.model, settings.config
  num_devices = math.prod(settings.mesh_axes.values())
  mesh_text = ",".join(f"{k}:{v}" for k, v in settings.mesh_axes.items())
  what = f"{config.family}:{config.size}"
  out = Reporter(jax, workdir)
  config_json = json.dumps({"family": config.family, "size": config.size,
                            "model": config.model.to_dict(),
                            "batch_size": settings.batch_size, "data": config.data},
                           sort_keys=True, default=str)
  ckpt_dir = os.path.join(os.path.abspath(workdir), "checkpoints") if workdir else None
  if ckpt_dir and os.path.isdir(ckpt_dir) and not _PLAN_ONLY.value:
    old = os.path.join(workdir, "config.json")
    if os.path.exists(old) and open(old).read() != config_json:
      raise LaunchError(f"--workdir={workdir} holds checkpoints of another model, batch "
                        f"size or data ({old}); use a fresh workdir")

  out.say(f"model {what} ({model.param_count():,} params) {model.config}")
  out.say(f"mesh {mesh_text}, strategy {_STRATEGY.value}, "
          f"{jax.process_count()} process(es)")
  train_step = model.train_step()
  state_spec = model.abstract_state()
  batch_spec = model.batch_spec(settings.batch_size)
  if _PLAN_ONLY.value:
    mesh = dict(settings.mesh_axes)
  else:
    mesh = tapas.make_mesh(settings.mesh_axes, devices=jax.devices()[:num_devices])
  start = time.perf_counter()
  plan = make_plan(settings, train_step, state_spec, batch_spec, mesh)
  plan_s = time.perf_counter() - start
  s = plan.stats
  device = plan.device
  out.say(f"stage trace {s.trace_s:.2f}s  fold {s.fold_s:.2f}s  search {s.search_s:.2f}s  "
          f"(plan in {plan_s:.2f}s)")
  out.say(plan.summary())
  hbm = cost.get_profile(device).hbm_bytes
  if s.predicted_memory_bytes > hbm:
    out.say(f"note: the plan predicts {s.predicted_memory_bytes / 2**30:.1f} GiB per device "
            f"and a {device} holds {hbm / 2**30:.0f} GiB: pass --memory_budget="
            f"{hbm / 2**30:.0f}GiB, a larger mesh or a smaller batch")
  if _COMPARE.value:
    compare(settings, plan, train_step, state_spec, batch_spec, mesh, out.say)
  compiled = None
  if not _PLAN_ONLY.value:
    check_fits(plan, list(mesh.devices.flat), jax.process_index(), what)
    compiled = compile_step(jax, plan, train_step, (state_spec, batch_spec), mesh, out,
                            settings.search.layouts)
  out.write("config.json", config_json)
  if out.lead and workdir:
    plan.save(os.path.join(workdir, "plan.json"))  # atomic, as write_atomic
  out.write("plan.txt", plan.summary() + "\n")
  if _PLAN_ONLY.value:
    return 0
  return fit(jax, settings, plan, mesh, (train_step, state_spec, batch_spec), compiled,
             out, ckpt_dir)


def compile_step(jax, plan, train_step, specs, mesh, out: Reporter, layouts: str):
  """The train step compiled with the plan (the state in `layouts`), from the argument
  shapes alone.

  A plan of another program (a saved one, say) is refused here, before any state is
  allocated or any file written.
  """
  import tapas_jax as tapas  # noqa: PLC0415
  abstract = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                          specs, plan.shardings(mesh))
  start = time.perf_counter()
  try:
    step = tapas.apply(plan, train_step, mesh=mesh, donate_argnums=0, layouts=layouts)
    compiled = step.lower(*abstract).compile()
  except ValueError as e:
    raise LaunchError(f"--strategy={_STRATEGY.value}: {e}") from None
  out.say(f"stage compile {time.perf_counter() - start:.2f}s")
  return compiled


_EVAL_STREAM = 2**31 - 1  # synthetic eval batches fold this in; train steps fold in k < it


class Inputs:
  """The batches of a run in the plan's batch sharding: train, eval, and their position.

  Synthetic data draws step k's batch from the seed and k. A data file is read through
  grain, this process reading only the rows its devices hold; the read position goes into
  each checkpoint beside the state (`save_args`) and comes back with it (`restore`).
  """

  def __init__(self, jax, settings: Settings, batch_spec, batch_sharding, out: Reporter):
    from tapas_jax.models import data, synthetic  # noqa: PLC0415
    self.jax, self.settings, self.spec, self.sharding = jax, settings, batch_spec, batch_sharding
    self.seed_key = jax.random.key(settings.seed)
    self.data = data if settings.data is not None else None
    if self.data is None:
      make = synthetic.learnable_batch if settings.config.data == "learnable" else \
          (lambda m, k, n: m.make_batch(k, n))
      self._make = jax.jit(lambda k: make(settings.model, k, settings.batch_size),
                           out_shardings=batch_sharding)
      return
    self.rows = data.process_rows(batch_sharding, batch_spec)
    self._train = iter(self._loader(settings.data.train, shuffle=True))
    out.say(f"data {settings.data.name}: {settings.data.num_train:,} training and "
            f"{settings.data.num_eval:,} held-out examples; process 0 reads "
            f"{self.rows.size} of the {settings.batch_size} rows of each global batch")

  def _loader(self, source, shuffle: bool):
    return self.data.loader(source, batch_size=self.settings.batch_size, rows=self.rows,
                            seed=self.settings.seed, shuffle=shuffle)

  def _place(self, local):
    return self.data.global_batch(local, self.sharding, self.spec, self.rows)

  def train_batch(self, k: int):
    """The batch of step `k` (from 0); a data file's is the next one it reads."""
    if self.data is None:
      return self._make(self.jax.random.fold_in(self.seed_key, k))
    return self._place(next(self._train))

  def eval_batches(self):
    """The held-out batches (the same ones at every evaluation)."""
    if self.data is None:
      key = self.jax.random.fold_in(self.seed_key, _EVAL_STREAM)
      return (self._make(self.jax.random.fold_in(key, j))
              for j in range(self.settings.eval_steps))
    return (self._place(b) for b in self._loader(self.settings.data.eval, shuffle=False))

  def save_args(self, ocp) -> dict:
    if self.data is None:
      return {}
    return {"data": ocp.args.JsonSave({"position": self._train.get_state(),
                                       "file": self.settings.data.name})}

  def restore_args(self, ocp) -> dict:
    return {} if self.data is None else {"data": ocp.args.JsonRestore()}

  def restore(self, restored) -> None:
    if self.data is not None:
      self._train.set_state(restored["data"]["position"])


def fit(jax, settings: Settings, plan, mesh, program, compiled, out: Reporter,
        ckpt_dir: str | None) -> int:
  """Initialises or restores the state with the plan's shardings, compiles and trains."""
  import numpy as np  # noqa: PLC0415
  import orbax.checkpoint as ocp  # noqa: PLC0415

  from tapas_jax import cost  # noqa: PLC0415

  train_step, state_spec, batch_spec = program
  model, config, workdir, device = settings.model, settings.config, settings.workdir, plan.device
  state_sharding, batch_sharding = plan.shardings(mesh)
  inputs = Inputs(jax, settings, batch_spec, batch_sharding, out)

  ckpt = None
  if ckpt_dir:
    ckpt = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(
        max_to_keep=2, create=True, enable_async_checkpointing=False))
  latest = ckpt.latest_step() if ckpt else None
  start = time.perf_counter()
  if latest is not None:
    target = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                          state_spec, state_sharding)
    restored = ckpt.restore(latest, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), **inputs.restore_args(ocp)))
    state = restored["state"]
    inputs.restore(restored)
    out.say(f"stage restore step {latest} from {ckpt_dir} {time.perf_counter() - start:.2f}s")
  else:
    state = jax.jit(model.init, out_shardings=state_sharding)(inputs.seed_key)
    out.say(f"stage init {time.perf_counter() - start:.2f}s")
  if settings.search.layouts == "auto":  # into the layouts the compiler chose, once
    state = jax.device_put(state, compiled.input_formats[0][0], donate=True)
  first = int(state.step)
  if first >= settings.steps:
    out.say(f"already at step {first} >= --steps={settings.steps}; nothing to do")
    return 0

  loss_fn = model.loss_fn()
  eval_loss = jax.jit(lambda st, b: loss_fn(st.params, st.model_state, b)[0])
  batch = inputs.train_batch(first)
  items, unit = batch_items(batch_spec)
  flops = model_flops(jax, train_step, state_spec, batch_spec)
  dtype = str(getattr(model.config, "dtype", "float32"))
  peak = mesh.size / cost.compute_time(1.0, device, dtype)  # FLOP/s of the whole mesh
  metrics_path = os.path.join(workdir, "metrics.jsonl") if workdir else None
  kept = read_metrics(metrics_path, first) if metrics_path and out.lead else []
  out.write("metrics.jsonl", "".join(kept))
  log = open(metrics_path, "a") if metrics_path and out.lead else None
  try:
    for k in range(first, settings.steps):
      if k > first:
        batch = inputs.train_batch(k)
      start = time.perf_counter()
      state, metrics = compiled(state, batch)
      loss = float(metrics["loss"])
      step_s = time.perf_counter() - start
      step = k + 1
      row = {"step": step, "loss": loss, "step_s": step_s,
             f"{unit}_per_s": items / step_s, "mfu": flops / step_s / peak}
      evaluated = ""
      if settings.eval_every and (step % settings.eval_every == 0 or step == settings.steps):
        losses = [float(eval_loss(state, b)) for b in inputs.eval_batches()]
        row["eval_loss"] = sum(losses) / len(losses)
        evaluated = f"  eval loss {row['eval_loss']:.4f}"
      if log:
        log.write(json.dumps(row) + "\n")
        log.flush()
      label = "first step" if k == first else "step"
      out.say(f"{progress(step, settings.steps)} {label} loss {loss:.4f}{evaluated}  "
              f"{step_s:.3f}s  {row[f'{unit}_per_s']:,.0f} {unit}/s  "
              f"MFU {100 * row['mfu']:.3f}% of {device}")
      if not np.isfinite(loss):
        out.say("loss is not finite; stopping")
        return 1
      if ckpt and (step % config.checkpoint_every == 0 or step == settings.steps):
        ckpt.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                **inputs.save_args(ocp)))
  finally:
    if log:
      log.close()
    if ckpt:
      ckpt.wait_until_finished()
      ckpt.close()
  if ckpt:
    out.say(f"checkpoint step {settings.steps} in {ckpt_dir}")
  return 0


def one_line(error: BaseException) -> str:
  """A flag or config error as one line: the config file's own error, not its traceback."""
  text = str(error)
  if isinstance(error, AttributeError):  # config_flags: unknown key, repr'd, "did you mean"
    text = "unknown config key " + text.replace("\\n", "\n").replace("\\'", "'").strip("'")
  cause = error.__cause__
  if cause is not None and "Traceback" not in text:  # config file missing or unreadable
    text = f"{text}: {cause}"
  if "Traceback (most recent call last)" in text or isinstance(error, OSError):
    text = text.rstrip().splitlines()[-1]  # the file's own error, or why it did not load
  return " ".join(text.split())


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a bad flag or config override reported in one line."""
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, OSError, TypeError, ValueError) as e:
    print(f"train.py: error: {one_line(e)}", file=sys.stderr, flush=True)
    sys.exit(2)


def main(argv):
  if not flags.FLAGS["verbosity"].present:  # orbax logs every file it writes at INFO
    logging.set_verbosity(logging.WARNING)
  try:
    if len(argv) > 1:
      raise LaunchError(f"unexpected arguments {argv[1:]}; flags take the form --name=value")
    return train(read_settings())
  except LaunchError as e:
    print(f"train.py: error: {e}", file=sys.stderr, flush=True)
    return 2


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
