"""Predicted memory and bytes sent next to the TPU compiler's (libtpu's ahead-of-time
compile; no TPU needed).

The zoo at its tiny configs on a v5p:2x2x1 topology, and at its small ones
(`models.SMALL`: real widths, two layers), or the train steps in other libraries'
styles the tests use (flax linen and nnx remat, nn.scan, equinox-style pytrees, Keras-
style layers, stacked parameters):

  JAX_PLATFORMS=cpu python scripts/bench_verify.py --topology=v5p:2x2x1 --batch=8
  JAX_PLATFORMS=cpu python scripts/bench_verify.py --topology=v5p:2x2x1 --zoo_config=small
  JAX_PLATFORMS=cpu python scripts/bench_verify.py --topology=v5p:2x2x1 --zoo_config=small \
      --scan --families=gpt,vit,llama --state_layouts=auto
  JAX_PLATFORMS=cpu python scripts/bench_verify.py --topology=v5p:4x4x4 --mesh=data:8,model:8 \
      --batch=64 --layouts=data_parallel,fsdp,megatron
  JAX_PLATFORMS=cpu python scripts/bench_verify.py --styles=all --layers=4 \
      --layouts=data_parallel,fsdp

Each row: predicted and compiled memory, and bytes sent per device (predicted by the
cost model; compiled: the TPU HLO's collectives by kind, counted as compiled). With
`--dumps`, also the peak of live buffers that the compiler's own live-range dump lists
(`scripts/tpu_peak.py`), which does not move with the heap's packing as
`peak_memory_in_bytes` does between libtpu releases (BENCHMARKS.md, "Two compilers, one
live set").

LLaMA-3-8B at MaxText's recipe shape (seq 8192, 3 per chip, bf16 compute, f32 weights,
adamw, chunked attention), mesh data 8 x model 8 on v5p:4x4x4, with the compiler's
breakdown (arguments, temporaries, outputs, aliased) beside the model's (state, live
intermediates at the peak):

  JAX_PLATFORMS=cpu python scripts/bench_verify.py --real --layers=2 \
      --layouts=tapas,fsdp,fsdp:nothing_saveable,fsdp:dots_saveable [--dump=DIR]

Needs libtpu: pip install 'tapas_jax[tpu]'.
"""

import argparse
import os
import shutil
import tempfile
import time
import warnings

import jax

import tapas_jax as tapas
from tapas_jax import baselines, measure, models
from tapas_jax.verify import USABLE_HBM, tpu_mesh

import tpu_peak  # scripts/ is on the path when a script runs


def _plan(layout, args, mesh, family, device):
  """A searched plan ("tapas", "tapas@2MiB" under that budget) or a baseline ("fsdp",
  "fsdp:nothing_saveable")."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    if layout.startswith("tapas"):  # "tapas@2MiB": under that budget
      budget = layout.partition("@")[2] or None
      return tapas.search(*args, mesh=mesh, device=device, memory_budget=budget)
    name, _, remat = layout.partition(":")
    return baselines.baseline(name, *args, mesh=mesh, family=family, device=device,
                              remat=remat or None)


# The compiled HLO's collectives by kind, as `measure.collective_bytes` names them.
_SHORT = {"all-gather": "ag", "all-reduce": "ar", "reduce-scatter": "rs", "all-to-all": "a2a",
          "collective-permute": "cp"}


def zoo(a, mesh):
  what = f"styles at {a.layers} layers" if a.styles else f"zoo at {a.zoo_config}"
  print(f"jax {jax.__version__}; {what}; topology {a.topology}; mesh {mesh}; "
        f"batch {a.batch}; profile {a.device}; state layouts {a.state_layouts}")
  print("| model | layout | predicted MiB | compiled MiB (args + temp + out - alias) | "
        "pred / comp | live MiB | pred / live | predicted sent KiB | compiled sent KiB ("
        + ", ".join(_SHORT.values()) + ") | sent pred / comp | compile s |"
        + (" dump's peak MiB | pred / dump's |" if a.dumps else ""))
  print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if a.dumps else ""))
  for family, args in _programs(a):
    for layout in a.layouts.split(","):
      try:
        plan = _plan(layout, args, mesh, family, a.device)
      except Exception as e:  # noqa: BLE001 - a row per failure, the table goes on
        print(f"| {family} | {layout} | planning failed: {type(e).__name__} | | | | | | | | |")
        continue
      folder = tempfile.mkdtemp(prefix="bench_verify_") if a.dumps else None
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = tapas.verify(plan, args[0], *args[1:], topology=a.topology, donate_argnums=0,
                         compiler_options={"xla_dump_to": folder} if folder else None,
                         layouts=a.state_layouts)
      dumped = ""
      if folder:  # the peak the compiler's own live-range dump lists
        own = tpu_peak.listed(folder)[0]
        dumped = f" {own / 2**20:.2f} | {r.predicted_memory_bytes / own:.2f} |"
        shutil.rmtree(folder, ignore_errors=True)
      sent = r.comm_bytes.get("total", 0.0)
      kinds = ", ".join(f"{short} {r.comm_bytes.get(kind, 0.0) / 2**10:.1f}"
                        for kind, short in _SHORT.items() if r.comm_bytes.get(kind))
      print(f"| {family} | {layout} | {r.predicted_memory_bytes / 2**20:.2f} | "
            f"{r.peak_bytes / 2**20:.2f} | {r.memory_ratio:.2f} | "
            f"{r.live_peak_bytes / 2**20:.2f} | {r.live_ratio:.2f} | "
            f"{r.predicted_comm_bytes / 2**10:.1f} | {sent / 2**10:.1f}"
            f"{f' ({kinds})' if kinds else ''} | "
            f"{r.predicted_comm_bytes / sent if sent else float('nan'):.2f} | "
            f"{r.compile_s:.1f} |{dumped}", flush=True)


def _dumped_live(folder, predicted) -> str:
  """Table cells: the arguments whole plus the temporaries' live peak, as the compiler's
  dumps list its buffers (`tpu_peak.temporaries_peak`), and the prediction over it."""
  if not folder:
    return ""
  args, temps, _, _ = tpu_peak.temporaries_peak(folder, 0)
  shutil.rmtree(folder, ignore_errors=True)
  return f" {(args + temps) / 2**30:.2f} | {predicted / (args + temps):.2f} |"


def _programs(a):
  """(name, (step, *args)) of the zoo's models, or of the library styles (`--styles`)."""
  if a.styles:
    import sys  # noqa: PLC0415 - the styles live with the tests
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import styles  # noqa: PLC0415
    names = list(styles.STYLES) if a.styles == "all" else a.styles.split(",")
    for name in names:
      p = styles.STYLES[name](a.layers)
      yield name, (p.step, p.state, p.batch)
    return
  families = a.families or ",".join(models.SMALL if a.zoo_config == "small"
                                    else models.FAMILIES)
  for family in families.split(","):
    config, trimmed = (models.SMALL[family] if a.zoo_config == "small"
                       else (a.zoo_config, {}))
    m = models.get_model(family, config, **trimmed, **({"scan_layers": True} if a.scan else {}))
    yield family, (m.train_step(), m.abstract_state(), m.batch_spec(a.batch))


def real(a, mesh):
  """One row per layout: the model's state and intermediates beside the compiler's
  arguments, temporaries and outputs. Compiles directly (not through `tapas.verify`)
  to keep the TPU HLO for `--dump`."""
  chips = a.data * a.model
  m = models.get_model("llama", a.config, num_layers=a.layers, seq_len=a.seq,
                       attention="chunked", attention_chunk=512, dtype="bfloat16",
                       param_dtype="float32", scan_layers=a.scan, **_overrides(a.overrides))
  args = (m.train_step(), m.abstract_state(), m.batch_spec(a.per_device_batch * chips))
  import libtpu  # noqa: PLC0415 - only to print its version
  print(f"jax {jax.__version__}, libtpu {getattr(libtpu, '__version__', '?')}; {a.config} "
        f"{a.layers} layers{' scanned' if a.scan else ''}, seq {a.seq}, batch "
        f"{a.per_device_batch * chips}, mesh {mesh} on {a.topology}, profile {a.device}"
        f"{', ' + a.overrides if a.overrides else ''}; state layouts {a.state_layouts}")
  print("GiB per device. Predicted: state (inputs) + intermediates at the peak. Compiled: "
        "arguments + temporaries + outputs - aliased; live peak: the compiler's "
        "peak_memory_in_bytes.")
  print("| layers | layout | remat | pred state | pred interm. | **pred total** | args | "
        "temp | out | alias | **compiled** | pred / comp | live peak | pred / live | plan s | "
        "compile s |" + (" dump's args + live temp | pred / dump's |" if a.dumps else ""))
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        + ("---|---|" if a.dumps else ""))
  tmesh = tpu_mesh(a.topology, mesh)
  for layout in a.layouts.split(","):
    t = time.perf_counter()
    try:
      plan = _plan(layout, args, mesh, "llama", a.device)
    except Exception as e:  # noqa: BLE001 - a row per failure, the table goes on
      print(f"| {a.layers} | {layout} | planning failed: {type(e).__name__}: "
            f"{str(e)[:160]} |", flush=True)
      continue
    plan_s = time.perf_counter() - t
    s = plan.stats
    remat = ",".join(sorted({p for _, p in plan.remat})) or "-"
    pred = (s.predicted_state_bytes, s.predicted_memory_bytes - s.predicted_state_bytes,
            s.predicted_memory_bytes)
    t = time.perf_counter()
    step = tapas.apply(plan, args[0], mesh=tmesh, donate_argnums=0, layouts=a.state_layouts)
    folder = tempfile.mkdtemp(prefix="bench_verify_") if a.dumps else None
    try:
      compiled = step.lower(*args[1:]).compile(
          {"xla_dump_to": folder} if folder else None)
    except Exception as e:  # noqa: BLE001 - the compiler's refusal is a row
      print(f"| {a.layers} | {layout} | {remat} | " + " | ".join(f"{x / 2**30:.2f}"
            for x in pred) + f" | compile failed: {str(e).splitlines()[0][:200]} |",
            flush=True)
      continue
    compile_s = time.perf_counter() - t
    got = measure.measure(compiled, chips, reduce_scatter_creator=False)
    peak = got.argument_bytes + got.temp_bytes + got.output_bytes - got.alias_bytes
    if a.dump:
      os.makedirs(a.dump, exist_ok=True)
      name = f"{a.layers}L_{layout.replace(':', '_')}"
      with open(os.path.join(a.dump, f"{name}.hlo.txt"), "w") as f:
        f.write(compiled.as_text())
    comp = (got.argument_bytes, got.temp_bytes, got.output_bytes, got.alias_bytes, peak)
    print(f"| {a.layers} | {layout} | {remat} | " + " | ".join(f"{x / 2**30:.2f}" for x in pred)
          + " | " + " | ".join(f"{x / 2**30:.2f}" for x in comp)
          + f" | {pred[2] / peak:.2f} | {got.live_peak_bytes / 2**30:.2f} | "
          f"{pred[2] / got.live_peak_bytes if got.live_peak_bytes else float('nan'):.2f} | "
          f"{plan_s:.1f} | {compile_s:.0f} |{_dumped_live(folder, pred[2])}", flush=True)
  hbm = USABLE_HBM.get(tmesh.devices.flat[0].device_kind)
  if hbm:
    print(f"usable HBM per device (compiler): {hbm / 2**30:.2f} GiB")


def _overrides(text: str | None) -> dict:
  """--overrides' `key=value,...` as the config's fields (integers where they read as one)."""
  out = {}
  for item in filter(None, (text or "").split(",")):
    key, value = item.split("=")
    out[key] = int(value) if value.lstrip("-").isdigit() else value
  return out


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--real", action="store_true",
                 help="LLaMA at a recipe shape on --topology (default v5p:4x4x4)")
  p.add_argument("--topology", default=None)
  p.add_argument("--mesh", default=None, help="data:2,model:2 (zoo), data:8,model:8 (real)")
  p.add_argument("--device", default="tpu-v5p")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--families", default=None,
                 help="default: the zoo (with --zoo_config=small, models.SMALL's)")
  p.add_argument("--layouts", default=None)
  p.add_argument("--state_layouts", default="default",
                 help="the state's in-memory layouts (tapas.apply's layouts=): default or auto")
  p.add_argument("--config", default="llama3-8b", help="--real: the LLaMA config")
  p.add_argument("--zoo_config", default="tiny",
                 help="the zoo's config: 'tiny', or 'small' (models.SMALL: real widths, "
                 "two layers)")
  p.add_argument("--styles", default=None,
                 help="instead of the zoo, these train steps in library styles "
                 "(tests/styles.py; 'all'), at --layers layers")
  p.add_argument("--overrides", default=None,
                 help="--real: config fields set over --config's, as d_model=1024,d_ff=2816")
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--seq", type=int, default=8192)
  p.add_argument("--per_device_batch", type=int, default=3)
  p.add_argument("--scan", action="store_true",
                 help="layers under nn.scan (--real; the zoo families that have scan_layers)")
  p.add_argument("--dump", default=None, help="folder for the compiled TPU HLO (--real)")
  p.add_argument("--dumps", action="store_true",
                 help="zoo: a column more, the peak the compiler's live-range dump lists "
                 "(scripts/tpu_peak.py), beside `peak_memory_in_bytes`; --real: the "
                 "arguments plus the temporaries' live peak its dumps list")
  a = p.parse_args()
  a.topology = a.topology or ("v5p:4x4x4" if a.real else "v5p:2x2x1")
  a.mesh = a.mesh or ("data:8,model:8" if a.real else "data:2,model:2")
  a.layouts = a.layouts or ("tapas,fsdp,fsdp:nothing_saveable,fsdp:dots_saveable" if a.real
                            else "tapas,fsdp")
  mesh = {k: int(v) for k, v in (kv.split(":") for kv in a.mesh.split(","))}
  a.data, a.model = mesh.get("data", 1), mesh.get("model", 1)
  (real if a.real else zoo)(a, mesh)


if __name__ == "__main__":
  main()
