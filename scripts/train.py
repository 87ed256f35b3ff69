"""Training launcher: plan the train step with tapas, then train with that plan.

The step is traced and folded, a sharding plan is searched for the mesh, and the
state and batch are placed and jitted with the plan's PartitionSpecs. `--noplan`
trains data parallel instead (batch over every axis, state replicated).

Usage:
  python scripts/train.py                                 # configs/default.py
  python scripts/train.py --config=configs/gpt2_small.py --steps=1
  python scripts/train.py --model=llama --set=num_layers=6 --mesh=data=8
  python scripts/train.py --coordinator=host0:1234 --num_processes=4 --process_id=0
"""

import dataclasses
import importlib.util
import os
import sys
import time

from absl import app
from absl import flags
from absl import logging

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLAGS = flags.FLAGS
flags.DEFINE_string("config", os.path.join(_ROOT, "configs", "default.py"),
                    "Python file with get_config() -> dict.")
flags.DEFINE_string("model", None, "Override the config's model family.")
flags.DEFINE_string("model_config", None, "Override the named model config.")
flags.DEFINE_multi_string("set", [], "Model config field overrides, field=value.")
flags.DEFINE_string("mesh", None, "Mesh axes, e.g. 'data=2,model=4'.")
flags.DEFINE_integer("steps", None, "Train steps.")
flags.DEFINE_integer("batch_size", None, "Global batch size.")
flags.DEFINE_bool("plan", True, "Search a tapas plan (else data parallel).")
flags.DEFINE_float("memory_budget_gib", None, "Per-device memory the plan may take (inputs "
                   "and live activations), GiB; default: the device profile's memory less 10%; "
                   "inf: unlimited.")
flags.DEFINE_string("device", None, "Cost profile (tpu-v5e, h100, cpu, ...); default local.")
flags.DEFINE_integer("host_devices", 8,
                     "On CPU: fake devices (XLA_FLAGS) when no accelerator is present.")
flags.DEFINE_string("coordinator", None, "jax.distributed coordinator address (multi-host).")
flags.DEFINE_integer("num_processes", None, "jax.distributed process count.")
flags.DEFINE_integer("process_id", None, "jax.distributed process id.")


def load_config(path: str) -> dict:
  spec = importlib.util.spec_from_file_location("tapas_config", path)
  if spec is None or spec.loader is None:
    raise app.UsageError(f"--config={path}: not a Python file")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def parse_value(text: str):
  for cast in (int, float):
    try:
      return cast(text)
    except ValueError:
      pass
  return {"true": True, "false": False}.get(text.lower(), text)


def parse_pairs(items, flag: str) -> dict:
  out = {}
  for item in items:
    key, sep, value = item.partition("=")
    if not sep or not key:
      raise app.UsageError(f"--{flag}: expected field=value, got {item!r}")
    out[key.strip()] = parse_value(value.strip())
  return out


def main(argv):
  del argv
  if "jax" not in sys.modules and FLAGS.host_devices > 1:
    os.environ.setdefault(
        "XLA_FLAGS", f"--xla_force_host_platform_device_count={FLAGS.host_devices}")
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  import tapas_jax as tapas
  from tapas_jax import models

  if FLAGS.coordinator:
    jax.distributed.initialize(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)

  cfg = load_config(FLAGS.config)
  name = FLAGS.model or cfg["model"]
  overrides = dict(cfg.get("overrides", {})) if not FLAGS.model else {}
  overrides.update(parse_pairs(FLAGS.set, "set"))
  model = models.get_model(name, FLAGS.model_config or cfg["config"], **overrides)
  model = dataclasses.replace(model, learning_rate=cfg.get("learning_rate", 1e-3))
  mesh_axes = parse_pairs(FLAGS.mesh.split(","), "mesh") if FLAGS.mesh else cfg["mesh"]
  mesh = tapas.make_mesh(mesh_axes)
  steps = FLAGS.steps or cfg["steps"]
  batch_size = FLAGS.batch_size or cfg["batch_size"]
  print(f"model {name} {model.config}")
  print(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} "
        f"device(s), {jax.process_count()} process(es)")

  train_step = model.train_step()
  state_spec = model.abstract_state()
  batch_spec = model.batch_spec(batch_size)
  if FLAGS.plan:
    budget = FLAGS.memory_budget_gib * 2**30 if FLAGS.memory_budget_gib else None
    plan = tapas.search(train_step, state_spec, batch_spec, mesh=mesh, device=FLAGS.device,
                        memory_budget=budget)
    print(plan.summary())
    to_sharding = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    state_sharding = jax.tree.map(to_sharding, plan.in_specs[0], is_leaf=is_spec)
    batch_sharding = jax.tree.map(to_sharding, plan.in_specs[1], is_leaf=is_spec)
  else:
    graph = tapas.trace.trace(train_step, state_spec, batch_spec)
    print(tapas.fold.fold(graph).summary())
    state_sharding = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
  replicated = NamedSharding(mesh, P())
  state = jax.jit(model.init, out_shardings=state_sharding)(jax.random.key(cfg.get("seed", 0)))
  if FLAGS.plan:  # the plan's shardings plus the constraints it pins inside the step
    step = tapas.apply(plan, train_step, mesh=mesh, donate_argnums=0)
  else:
    step = jax.jit(train_step, in_shardings=(state_sharding, batch_sharding),
                   out_shardings=(state_sharding, replicated), donate_argnums=0)
  rng = np.random.default_rng(cfg.get("seed", 0))
  for k in range(steps):
    batch = model.make_batch(jax.random.key(int(rng.integers(1 << 30))), batch_size)
    batch = jax.device_put(batch, batch_sharding)
    start = time.perf_counter()
    state, metrics = step(state, batch)
    loss = float(metrics["loss"])
    print(f"step {k + 1}/{steps}: loss {loss:.4f} ({time.perf_counter() - start:.2f}s)")
    if not np.isfinite(loss):
      logging.error("loss is not finite; stopping")
      return 1
  return 0


if __name__ == "__main__":
  app.run(main)
