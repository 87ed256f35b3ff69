"""The TPU compiler's HBM peak, buffer by buffer, rebuilt from its dumps (no TPU needed).

`memory_analysis()` gives one peak figure; this script says what is in it. It compiles
a zoo model's plan (searched, or a baseline) for a TPU topology through libtpu with
`xla_dump_to`, then rebuilds the peak from the dumps: each buffer's live range from
`*live-range.txt` ("BufferLiveRange"), its allocation, offset, padded size and memory
space from `*buffer-assignment.txt`. Buffers in memory space S(1) (on-chip copies the
memory-space assignment makes) are left out, and buffers at one offset of one
allocation whose live ranges meet are one buffer (an in-place op's result, such as an
all-reduce's, shares its operand's); the peak with every buffer counted on its own is
printed beside it. Both count the arguments by their live ranges, so neither is
`peak_memory_in_bytes` (see below). Prints the largest buffers live at the peak, and
the bytes the compiler keeps on chip (S(1)) there and at most.

Also printed (`temporaries_peak`): the arguments' allocations whole, plus the most
bytes the temporaries' allocation holds live at once (its buffers merged as above),
with the temporaries live there. On the six small-zoo rows read on both libtpu lines
(BENCHMARKS.md, "The compiler's peak is its arguments and its live temporaries") their
sum is `peak_memory_in_bytes` to 0.01 MiB: no gaps of the heap's packing in it. On a
tiny GPT (FSDP, v5p:2x2x1) it is 0.56 MB under the compiler's 2.93 MB, not understood.

  ALLOW_MULTIPLE_LIBTPU_LOAD=1 JAX_PLATFORMS=cpu python scripts/tpu_peak.py \
      --family=vit --layout=fsdp                  # the small ViT, FSDP, v5p:2x2x1
  python scripts/tpu_peak.py --read=DIR           # dumps already written there
  ... --state_layouts=auto --model_peak           # the state in the compiler's layouts,
                                                  # and the model's own peak beside it
  ... --for_backward                              # what it keeps for the backward pass,
                                                  # each buffer with the op that made it

(BENCHMARKS.md, "Reading the compiler's peak from its dumps".)
"""

import argparse
import collections
import glob
import os
import re
import tempfile
import warnings

import numpy as np

# A loop's results are listed as "(phi)" values: the loop writes them in place.
_VALUE = re.compile(r"value: <\d+ (\S+?)(?: \(phi\))?(?: @\d+)?> "
                    r"\(size=(\d+),offset=(\d+)\): (\S+)")
_RANGE = re.compile(r"^\s+(\S+\{[\d,]*\}):(\d+)-(\d+)", re.M)
_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*)$", re.M)


def _read(folder: str, pattern: str) -> str:
  with open(glob.glob(os.path.join(folder, pattern))[0]) as f:
    return f.read()


def _buffers(folder: str, on_chip: bool = False
             ) -> list[tuple[int, int, int, str, tuple[int, int]]]:
  """(start, end, padded bytes, name, (allocation, offset)) of every HBM buffer, or with
  `on_chip` of every buffer in memory space S(1) (VMEM)."""
  ranges = _read(folder, "*after_optimizations-live-range.txt")
  assignment = _read(folder, "*after_optimizations-buffer-assignment.txt")
  where: dict[str, tuple[int, tuple[int, int], str]] = {}
  allocation = -1
  for line in assignment.splitlines():
    if line.startswith("allocation "):
      allocation = int(line.split()[1].rstrip(":"))
    elif (m := _VALUE.search(line)):
      name = m.group(1) if "{" in m.group(1) else m.group(1) + "{}"
      where[name] = (int(m.group(2)), (allocation, int(m.group(3))), m.group(4))
  section = ranges[ranges.index("BufferLiveRange:"):ranges.index("Live ranges at")]
  out = []
  for m in _RANGE.finditer(section):
    if m.group(1) in where:
      size, key, shape = where[m.group(1)]
      space = shape.rsplit(":", 1)[-1]
      if ("S(1)" in space) if on_chip else ("S(" not in space):  # memory space 0: HBM
        out.append((int(m.group(2)), int(m.group(3)), size, m.group(1), key))
  return out


def peak(folder: str, top: int = 15, in_place: bool = True, allocations=None
         ) -> tuple[float, int, list[tuple[int, str, int, int]]]:
  """(peak bytes, program point, the `top` largest buffers live there). `in_place`:
  buffers at one offset whose live ranges meet count once; else each on its own.
  `allocations`: only the buffers of these allocations (default: every HBM buffer)."""
  by_key = collections.defaultdict(list)
  for start, end, size, name, key in _buffers(folder):
    if allocations is None or key[0] in allocations:
      by_key[key if in_place else (name,)].append((start, end, size, name))
  merged = []  # one buffer per run of meeting live ranges at one offset
  for spans in by_key.values():
    spans.sort()
    cur = list(spans[0])
    for start, end, size, name in spans[1:]:
      if start <= cur[1]:  # meets the previous one: the same memory, reused in place
        cur[1], cur[2], cur[3] = max(cur[1], end), max(cur[2], size), f"{cur[3]}+{name}"
      else:
        merged.append(tuple(cur))
        cur = [start, end, size, name]
    merged.append(tuple(cur))
  live = _curve(merged)
  at = int(np.argmax(live))
  here = sorted(((size, name, start, end) for start, end, size, name in merged
                 if start <= at <= end), reverse=True)
  return float(live[at]), at, here[:top]


def temporaries_peak(folder: str, top: int = 15
                     ) -> tuple[float, float, int, list[tuple[int, str, int, int]]]:
  """`peak_memory_in_bytes` rebuilt: (the arguments' allocations, the temporaries'
  live peak, its program point, the `top` largest temporaries live there). The
  arguments count whole, as the compiler reserves them for the whole step; the
  temporaries by their live ranges, merged in place as `peak` merges them."""
  text = _read(folder, "*after_optimizations-buffer-assignment.txt")
  temps = {int(m.group(1)) for m in _ALLOCATION.finditer(text)
           if "preallocated-temp" in m.group(3) and "color" not in m.group(3)}
  live, at, here = peak(folder, top, allocations=temps)
  return listed(folder)[2], live, at, here


def on_chip(folder: str) -> np.ndarray:
  """Bytes in memory space S(1) (VMEM) live at each program point: buffers the
  memory-space assignment keeps on chip, which `peak_memory_in_bytes` leaves out."""
  return _curve(_buffers(folder, on_chip=True))


def listed(folder: str) -> tuple[float, int, float, float]:
  """The compiler's own figures in its dumps: (the peak its live-range dump lists, at
  which program point, the bytes of the arguments' allocations, the bytes of the
  preallocated temporaries' allocation in HBM)."""
  ranges = _read(folder, "*after_optimizations-live-range.txt")
  point = re.search(r"Live ranges at (\d+) \(peak\)", ranges)
  total = re.search(r"Stack trace breakdown for peak usage: ([\d ]+) bytes", ranges)
  args = temp = 0.0
  for m in _ALLOCATION.finditer(_read(folder, "*after_optimizations-buffer-assignment.txt")):
    if "color" in m.group(3):  # another memory space than HBM
      continue
    if "parameter" in m.group(3):
      args += int(m.group(2))
    elif "preallocated-temp" in m.group(3):
      temp += int(m.group(2))
  return (float(total.group(1).replace(" ", "")) if total else float("nan"),
          int(point.group(1)) if point else -1, args, temp)


def op_names(folder: str) -> dict[str, str]:
  """Instruction -> its `metadata.op_name` in the optimized HLO: the program's own name
  stack ("jit(train_step)/jvp(ViT)/ViT.features/Block_1/..."), which `tapas.apply` keeps."""
  hlo = _read(folder, "*after_optimizations.txt")
  return dict(re.findall(r'^\s*(?:ROOT )?%(\S+) = .*?op_name="([^"]*)"', hlo, re.M))


def kept_for_backward(folder: str, top: int = 15, at: int = -1
                      ) -> tuple[int, list[tuple[int, str, int, int, str]]]:
  """(a program point, the `top` largest HBM buffers live across it other than the
  arguments, with their op names): what the compiler keeps from the forward pass for
  the backward. The point: `at`, else where the buffers forward ops made ("jvp(" and
  not "transpose(" in their names) hold the most bytes, the turn from the forward to
  the backward (its first instruction is no mark: the scheduler runs backward ops that
  depend on nothing early)."""
  names = op_names(folder)
  buffers = [(start, end, size, name, names.get(name.split("{")[0], ""))
             for start, end, size, name, _ in _buffers(folder) if not name.startswith("param")]
  if at < 0:
    at = int(np.argmax(_curve([b for b in buffers
                               if "jvp(" in b[4] and "transpose(" not in b[4]])))
  kept = sorted(((size, name, start, end, op) for start, end, size, name, op in buffers
                 if start < at <= end), reverse=True)
  return at, kept[:top]


def _curve(spans) -> np.ndarray:
  """Bytes live at each program point, of (start, end, size, ...) spans, ends included."""
  delta = np.zeros(max((end for _, end, *_ in spans), default=0) + 2)
  for start, end, size, *_ in spans:
    delta[start] += size
    delta[end + 1] -= size
  return np.cumsum(delta)


def _compile(a) -> str:
  import tapas_jax as tapas  # noqa: PLC0415 - only when compiling
  from tapas_jax import baselines, models  # noqa: PLC0415

  config, trimmed = models.SMALL[a.family] if a.config == "small" else (a.config, {})
  m = models.get_model(a.family, config, **trimmed)
  args = (m.train_step(), m.abstract_state(), m.batch_spec(a.batch))
  axes = dict((k, int(v)) for k, v in (kv.split(":") for kv in a.mesh.split(",")))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    plan = (tapas.search(*args, mesh=axes, device=a.device) if a.layout == "tapas" else
            baselines.baseline(a.layout, *args, mesh=axes, family=a.family, device=a.device))
  folder = tempfile.mkdtemp(prefix="tpu_peak_")
  got = tapas.verify(plan, *args, topology=a.topology, donate_argnums=0,
                     compiler_options={"xla_dump_to": folder}, layouts=a.state_layouts)
  print(f"{a.family} ({a.config}) {a.layout} on {a.topology}, batch {a.batch}: predicted "
        f"{plan.stats.predicted_memory_bytes / 2**20:.2f} MiB, peak_memory_in_bytes "
        f"{got.live_peak_bytes / 2**20:.2f} MiB; dumps in {folder}")
  return folder


def model_peak(a, top: int) -> None:
  """Prints the model's side for the plan `--layout` names (searched, or a baseline):
  its activation peak and the largest values live there (`memory.largest_live`), to set
  beside the compiler's list."""
  import importlib  # noqa: PLC0415
  from tapas_jax import api, baselines, models, options  # noqa: PLC0415

  memory = importlib.import_module("tapas_jax.solver.memory")
  solve = importlib.import_module("tapas_jax.solver.solve")
  config, trimmed = models.SMALL[a.family] if a.config == "small" else (a.config, {})
  m = models.get_model(a.family, config, **trimmed)
  axes = dict((k, int(v)) for k, v in (kv.split(":") for kv in a.mesh.split(",")))
  search = options.SearchConfig(device=a.device)
  args = (m.abstract_state(), m.batch_spec(a.batch))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    if a.layout == "tapas":
      prepared = api.prepare(m.train_step(), args, mesh=axes, device=a.device)
      found = api._solve(prepared, None, search, cache={})
    else:  # as `baselines.baseline` prepares and costs it (no remat)
      prepared, found, _ = baselines._costed(a.layout, m.train_step(), args, mesh=axes,
                                             family=a.family, kwargs=None, remat=None,
                                             config=search)
  acts = solve.cached_activations(prepared.problem, None)
  total, at = memory.activation_peak(prepared.problem, acts, found.choice)
  print(f"the model ({a.layout}): state {found.state_bytes / 2**20:.2f} MiB + "
        f"activations {total / 2**20:.2f} MiB at op {at}; largest live there:")
  for row in memory.largest_live(prepared.problem, acts, found.choice, top).split("), "):
    print(f"  {row.rstrip(')')})")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--family", default="vit")
  parser.add_argument("--config", default="small", help="'small' (models.SMALL) or a config")
  parser.add_argument("--layout", default="tapas", help="tapas, or a baseline: fsdp, ...")
  parser.add_argument("--topology", default="v5p:2x2x1")
  parser.add_argument("--mesh", default="data:2,model:2")
  parser.add_argument("--device", default="tpu-v5p")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--top", type=int, default=15)
  parser.add_argument("--state_layouts", default="default",
                      help="tapas.apply's layouts=: default or auto")
  parser.add_argument("--read", default="", help="a folder of dumps: read, compile nothing")
  parser.add_argument("--model_peak", action="store_true",
                      help="also print the model's activation peak for the plan --layout names")
  parser.add_argument("--for_backward", action="store_true",
                      help="also print what the compiler keeps for the backward pass, by name")
  parser.add_argument("--at", type=int, default=-1,
                      help="--for_backward: at this program point (default: where what "
                      "forward ops made is largest)")
  a = parser.parse_args()
  if a.model_peak:
    model_peak(a, a.top)
  folder = a.read or _compile(a)
  apart, at_apart, _ = peak(folder, a.top, in_place=False)
  total, at, here = peak(folder, a.top)
  print(f"HBM peak rebuilt from the dumps: {total / 2**20:.2f} MiB at program point {at} "
        f"(every buffer on its own: {apart / 2**20:.2f} MiB at {at_apart})")
  own, own_at, args, temp = listed(folder)
  print(f"the compiler's own live-range dump: peak {own / 2**20:.2f} MiB at point {own_at}; "
        f"allocations: arguments {args / 2**20:.2f} MiB + temporaries {temp / 2**20:.2f} MiB"
        f" = {(args + temp) / 2**20:.2f} MiB")
  args, temps, temps_at, live_temps = temporaries_peak(folder, a.top)
  print(f"arguments whole {args / 2**20:.2f} MiB + temporaries live at point {temps_at} "
        f"{temps / 2**20:.2f} MiB = {(args + temps) / 2**20:.2f} MiB (peak_memory_in_bytes "
        "on the small zoo)")
  for size, name, start, end in live_temps:
    print(f"  {size / 2**20:9.2f} MiB  {name}  live {start}-{end}")
  chip = on_chip(folder)
  print(f"on chip (S(1), not in the HBM peak): "
        f"{(chip[at] if at < len(chip) else 0.0) / 2**20:.2f} MiB at point {at}, "
        f"at most {chip.max() / 2**20:.2f} MiB (point {int(chip.argmax())})")
  for size, name, start, end in here:
    print(f"  {size / 2**20:9.2f} MiB  {name}  live {start}-{end}")
  if a.for_backward:
    first, kept = kept_for_backward(folder, a.top, a.at)
    print(f"live across program point {first} (where what forward ops made is largest, "
          "unless --at), arguments left out:")
    for size, name, start, end, op_name in kept:
      print(f"  {size / 2**20:9.2f} MiB  {name}  live {start}-{end}  {op_name[:100]}")


if __name__ == "__main__":
  main()
