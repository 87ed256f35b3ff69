"""`tapas.verify`: the compiler's judgement of a plan, beside the plan's predictions.

A plan's memory and communication are predictions of the cost model. `verify` compiles
the applied plan (`tapas.apply(plan, fn)`) and reads what the compiler made of it:
per-device argument, temporary, output and aliased bytes (`memory_analysis()`), the
collectives of the partitioned HLO by kind (`tapas_jax.measure`), the FLOPs
(`cost_analysis()`), and whether it fits the chip's memory (a TPU program by the
compiler's own live peak, `Verified.fit_bytes`). It compiles for the
local devices, or for a named TPU topology ("v5e:2x2", "v5p:4x4x4") through libtpu's
ahead-of-time path, on any machine: no TPU is needed (`pip install 'tapas_jax[tpu]'`
brings libtpu). A program the TPU compiler rejects for memory (RESOURCE_EXHAUSTED) gives
a record that says it does not fit and by how much, not an exception.

Example:
  >>> import jax, jax.numpy as jnp
  >>> import tapas_jax as tapas
  >>> f = lambda w, x: jnp.sum(jnp.tanh(x @ w))
  >>> args = (jax.ShapeDtypeStruct((256, 256), jnp.float32),
  ...         jax.ShapeDtypeStruct((1024, 256), jnp.float32))
  >>> plan = tapas.search(f, *args, mesh={"data": 8}, device="cpu")
  >>> record = tapas.verify(plan, f, *args)  # the local (CPU) devices
  >>> record.fits, record.argument_bytes == (256 * 256 + 1024 * 256 // 8) * 4
  (True, True)
"""

from __future__ import annotations

import dataclasses
import functools
import html
import re
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from tapas_jax import cost as costlib
from tapas_jax import measure
from tapas_jax import options
from tapas_jax import plan as planlib
from tapas_jax.apply import apply as apply_plan
from tapas_jax.errors import TapasError
from tapas_jax.mesh import make_mesh

__all__ = ["TPU_EXTRA", "USABLE_HBM", "LibtpuMissingError", "Verified",
           "parse_out_of_memory", "tpu_mesh", "verify"]

TPU_EXTRA = "pip install 'tapas_jax[tpu]'"

# Per-device HBM the TPU compiler lets a program use, as its RESOURCE_EXHAUSTED message
# states it ("exceeds available HBM (15.75G)", G = GiB), libtpu 0.0.42.1; a little less
# than the datasheet's, the rest reserved by the runtime. Keyed by `device_kind`.
USABLE_HBM: dict[str, float] = {
    "TPU v4": 15.25 * 2**30,  # v4 topologies list one device per TensorCore
    "TPU v5 lite": 15.75 * 2**30,
    "TPU v5": 95.74 * 2**30,
    "TPU v6 lite": 31.25 * 2**30,
}

_UNIT = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}
# "the total memory required for HLO temporaries (26.84G) exceeds available HBM (15.75G)"
_NEEDS = re.compile(r"required for (?P<what>[\w ]+?) \((?P<need>[\d.]+)(?P<nu>[KMGTP]?)i?B?\)"
                    r" exceeds available HBM \((?P<have>[\d.]+)(?P<hu>[KMGTP]?)i?B?\)")
# "Used 20.50G of 15.75G hbm. Exceeded hbm capacity by 4.75G."
_USED = re.compile(r"Used (?P<need>[\d.]+)(?P<nu>[KMGTP]?)i?B? of (?P<have>[\d.]+)"
                   r"(?P<hu>[KMGTP]?)i?B? hbm")


class LibtpuMissingError(TapasError, ImportError):
  """A TPU topology was asked for, and libtpu (the TPU compiler) cannot be loaded."""


@dataclasses.dataclass(frozen=True)
class Verified:
  """What the compiler made of one applied plan, per device, beside the prediction.

  Attributes:
    plan_name: the plan's name ("tapas", "fsdp", ...).
    target: "v5p:2x2x1" for a TPU topology, else "local <platform>".
    device_kind: the compiled-for devices' `device_kind` ("TPU v5", "cpu").
    num_devices: devices in the mesh.
    argument_bytes, output_bytes, alias_bytes, temp_bytes: `memory_analysis()`; for a
      program the compiler rejected, 0 but `temp_bytes`: the requirement its message
      states ("memory required for HLO temporaries"), 0 where it states none. The
      arguments are not in that figure, so the program is at least `missing_bytes` short.
    hbm_bytes: memory a device may use: the compiler's usable HBM for a TPU
      (`USABLE_HBM`, or the figure its error states), the runtime's `bytes_limit` for
      a local accelerator, else the plan's device profile.
    hbm_source: where `hbm_bytes` comes from ("compiler", "runtime", "profile", "given").
    comm_bytes: collective kind -> bytes sent per device per step, with "total"
      (`measure.collective_bytes`: for a TPU or GPU program as compiled, an all-reduce
      read as slices still an all-reduce; for XLA:CPU as the accelerator pipelines
      would make it; empty when the compile failed).
    flops: the compiler's FLOPs per device (a loop body counts once).
    predicted_memory_bytes, predicted_comm_bytes: the plan's `PlanStats`.
    compile_s: seconds lowering and compiling.
    error: the compiler's message when it rejected the program, else "".
    live_peak_bytes: the compiler's own peak of live buffers (`measure.Compiled`); 0
      where it gives none or the compile failed. The memory model predicts this figure.
      With a loop nested in a scanned stack the TPU compiler's `temp_bytes` holds more
      than any buffer it assigns (its heap included), so `peak_bytes` can be 1.3x the
      live peak at scale (BENCHMARKS.md, "What memory_analysis counts").
    comm_by_op: the largest collectives by the op of the step they were made for:
      (op name as in a profile, kind, bytes sent per device per step), most first
      (`measure.collectives_by_op`): which layer sends what.
  """

  plan_name: str
  target: str
  device_kind: str
  num_devices: int
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  hbm_bytes: float
  hbm_source: str
  comm_bytes: Mapping[str, float]
  flops: float
  predicted_memory_bytes: float
  predicted_comm_bytes: float
  compile_s: float
  error: str = ""
  live_peak_bytes: int = 0
  comm_by_op: tuple[tuple[str, str, float], ...] = ()

  @property
  def peak_bytes(self) -> int:
    """Arguments + temporaries + outputs - aliased outputs: the per-device peak."""
    return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

  @property
  def compiled(self) -> bool:
    """Whether the compiler accepted the program."""
    return not self.error

  @property
  def fit_bytes(self) -> int:
    """The figure `fits` judges. For a TPU program, the compiler's live peak: the TPU
    compiler accepts a program by its own buffer assignment, and with a loop nested in
    a scanned stack `memory_analysis()`'s temp holds more than any buffer it assigns
    (BENCHMARKS.md, "What memory_analysis counts": LLaMA-3-8B plans it compiled read up
    to 1.35x their live peak there). Against the chip's own HBM this is the compiler's
    verdict (a program whose buffers do not fit it refuses); against a smaller
    `hbm_bytes` or budget it leaves out how the compiler packs buffers (its heap sat
    2.15 GiB above the live peak at 8B scale). Elsewhere, or with no live peak,
    `peak_bytes`."""
    tpu = self.device_kind.lower().startswith("tpu")
    return self.live_peak_bytes if tpu and self.live_peak_bytes else self.peak_bytes

  @property
  def fits(self) -> bool:
    """Compiled, and `fit_bytes` is within `hbm_bytes`."""
    return self.compiled and self.fit_bytes <= self.hbm_bytes

  @property
  def missing_bytes(self) -> float:
    """How much `fit_bytes` exceeds `hbm_bytes` (0 when it fits)."""
    return max(0.0, self.fit_bytes - self.hbm_bytes)

  @property
  def memory_ratio(self) -> float:
    """Predicted / compiled peak memory (nan when nothing compiled)."""
    return _ratio(self.predicted_memory_bytes, self.peak_bytes)

  @property
  def live_ratio(self) -> float:
    """Predicted / the compiler's live peak (nan where it gives none)."""
    return _ratio(self.predicted_memory_bytes, self.live_peak_bytes)

  @property
  def comm_ratio(self) -> float:
    """Predicted / compiled bytes sent (nan when the compiled program sends none)."""
    return _ratio(self.predicted_comm_bytes, self.comm_bytes.get("total", 0.0))

  def summary(self) -> str:
    """Readable report: memory, fit, collectives, predicted next to compiled.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import tapas_jax as tapas
      >>> f = lambda w: jnp.sum(w * 2)
      >>> w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
      >>> print(tapas.verify(tapas.search(f, w, mesh={"data": 8}, device="cpu"), f,
      ...                    w).summary())  # doctest: +ELLIPSIS
      Plan 'tapas' compiled for local cpu (8 x cpu) in ... s
      ...
    """
    gib = _size
    head = f"Plan {self.plan_name!r} compiled for {self.target} ({self.num_devices} x " \
           f"{self.device_kind}) in {self.compile_s:.2f} s"
    judged = "live peak" if self.fit_bytes != self.peak_bytes else "peak"
    verdict = (f"fits: {judged} {gib(self.fit_bytes)} of {gib(self.hbm_bytes)} "
               f"({self.hbm_source})" if self.fits else
               f"DOES NOT FIT: needs {gib(self.fit_bytes)}, {gib(self.hbm_bytes)} "
               f"available ({self.hbm_source}), {'at least ' if self.error else ''}"
               f"{gib(self.missing_bytes)} short")
    if self.error and not self.temp_bytes:
      verdict = "DOES NOT FIT: the compiler ran out of memory (its message states no size)"
    lines = [head, f"  {verdict}"]
    if self.error:
      lines.append(f"  compiler: {self.error.strip().splitlines()[0][:200]}")
    lines += [f"  {'per device':<22} {'compiled':>12} {'predicted':>12} {'pred/comp':>10}",
              f"  {'arguments':<22} {gib(self.argument_bytes):>12}",
              f"  {'temporaries':<22} {gib(self.temp_bytes):>12}",
              f"  {'outputs - aliased':<22} {gib(self.output_bytes - self.alias_bytes):>12}",
              f"  {'peak memory':<22} {gib(self.peak_bytes):>12} "
              f"{gib(self.predicted_memory_bytes):>12} {self.memory_ratio:>10.2f}"]
    if self.live_peak_bytes:
      lines.append(f"  {'live peak (compiler)':<22} {gib(self.live_peak_bytes):>12} "
                   f"{gib(self.predicted_memory_bytes):>12} {self.live_ratio:>10.2f}")
    lines += [f"  {'bytes sent':<22} {gib(self.comm_bytes.get('total', 0.0)):>12} "
              f"{gib(self.predicted_comm_bytes):>12} {self.comm_ratio:>10.2f}"]
    for kind, sent in self.comm_bytes.items():
      if kind != "total" and sent:
        lines.append(f"    {kind:<38} {gib(sent):>12}")
    lines.append(f"  {'compiler FLOPs':<22} {self.flops:>12.4g}")
    if self.comm_by_op:
      lines.append("  largest collectives, by the op they were made for:")
      lines += [f"    {gib(sent):>12}  {kind:<15} {name if len(name) < 80 else '...' + name[-77:]}"
                for name, kind, sent in self.comm_by_op[:5]]
    return "\n".join(lines)

  def _repr_html_(self) -> str:
    """The summary as an HTML table, for notebooks."""
    esc = html.escape
    rows = [("arguments", _size(self.argument_bytes), "", ""),
            ("temporaries", _size(self.temp_bytes), "", ""),
            ("outputs - aliased", _size(self.output_bytes - self.alias_bytes), "", ""),
            ("peak memory", _size(self.peak_bytes), _size(self.predicted_memory_bytes),
             f"{self.memory_ratio:.2f}"),
            ("bytes sent", _size(self.comm_bytes.get("total", 0.0)),
             _size(self.predicted_comm_bytes), f"{self.comm_ratio:.2f}")]
    rows += [(f"&nbsp;&nbsp;{esc(k)}", _size(v), "", "") for k, v in self.comm_bytes.items()
             if k != "total" and v]
    rows.append(("compiler FLOPs", f"{self.flops:.4g}", "", ""))
    rows += [(f"&nbsp;&nbsp;{esc(kind)}: {esc(name)}", _size(sent), "", "")
             for name, kind, sent in self.comm_by_op[:5]]
    verdict = (f"fits ({_size(self.fit_bytes)} of {_size(self.hbm_bytes)})" if self.fits
               else f"<b>does not fit</b>: {_size(self.missing_bytes)} short of "
               f"{_size(self.hbm_bytes)}")
    body = "".join(f"<tr><td>{r[0]}</td>" + "".join(f"<td>{esc(c)}</td>" for c in r[1:])
                   + "</tr>" for r in rows)
    return (f"<div><b>Plan {esc(self.plan_name)}</b> compiled for {esc(self.target)} "
            f"({self.num_devices} &times; {esc(self.device_kind)}): {verdict}"
            "<table><tr><th>per device</th><th>compiled</th><th>predicted</th>"
            f"<th>predicted / compiled</th></tr>{body}</table></div>")

  def figures(self) -> planlib.CompiledFigures:
    """The record as the plan carries it (`Plan.compiled`, saved with the plan)."""
    return planlib.CompiledFigures(
        target=self.target, argument_bytes=self.argument_bytes,
        output_bytes=self.output_bytes, alias_bytes=self.alias_bytes,
        temp_bytes=self.temp_bytes, hbm_bytes=float(self.hbm_bytes), fits=self.fits,
        flops=self.flops, comm_bytes=tuple(sorted(self.comm_bytes.items())),
        error=self.error.strip().splitlines()[0][:300] if self.error else "",
        live_peak_bytes=self.fit_bytes if self.fit_bytes != self.peak_bytes else 0)


def _ratio(a: float, b: float) -> float:
  return a / b if b else float("nan")


def _size(nbytes: float) -> str:
  """Bytes in the largest binary unit that keeps the figure >= 1 ("3.20 MiB")."""
  return options.format_bytes(nbytes)


def parse_out_of_memory(message: str) -> tuple[float, float] | None:
  """(bytes needed, bytes available) from the TPU compiler's RESOURCE_EXHAUSTED message,
  or None when the message states neither.

  Example:
    >>> need, have = parse_out_of_memory("RESOURCE_EXHAUSTED: Ran out of memory on HBM, "
    ...   "the total memory required for HLO temporaries (26.84G) exceeds available HBM "
    ...   "(15.75G).")
    >>> need / 2**30, have / 2**30  # XLA's G is GiB
    (26.84, 15.75)
  """
  m = _NEEDS.search(message) or _USED.search(message)
  if m is None:
    return None
  return (float(m.group("need")) * _UNIT[m.group("nu")],
          float(m.group("have")) * _UNIT[m.group("hu")])


def _topologies():
  """`jax.experimental.topologies`, with libtpu loadable, or a clear error."""
  try:
    from jax.experimental import topologies  # noqa: PLC0415 - only for TPU targets
    import libtpu  # noqa: F401, PLC0415 - the TPU compiler; absent without the extra
  except ImportError as e:
    raise LibtpuMissingError(
        f"verify: compiling for a TPU topology needs libtpu (the TPU compiler), which "
        f"cannot be imported ({e}); install it with {TPU_EXTRA} (jax[tpu] at the jax "
        "version in use), or verify for the local devices (topology=None).") from None
  return topologies


def tpu_mesh(topology: str, mesh_axes: Mapping[str, int]) -> jax.sharding.Mesh:
  """A mesh of `mesh_axes` over the devices of TPU `topology` ("v5p:2x2x1"), with no
  TPU attached: libtpu describes the devices, `jax.jit(...).lower(...).compile()` then
  runs the TPU compiler. The mesh `verify` compiles on: a step whose `jax.shard_map`
  (a Pallas kernel's, say) names its mesh is traced on this one to be verified there.

  Example:
    >>> mesh = tpu_mesh("v5p:2x2x1", {"data": 2, "model": 2})  # doctest: +SKIP
    >>> mesh.devices.shape, mesh.devices.flat[0].platform  # doctest: +SKIP
    ((2, 2), 'tpu')

  Raises:
    LibtpuMissingError: libtpu cannot be loaded (`TPU_EXTRA`).
    ValueError: an unknown topology, or one with another number of devices.
  """
  topology = options.topology(topology, "verify", "topology")
  devices = _topology_devices(topology)
  sizes = tuple(mesh_axes.values())
  if int(np.prod(sizes)) != len(devices):
    raise options.OptionError(
        f"verify: the plan's mesh {dict(mesh_axes)} has {int(np.prod(sizes))} devices, "
        f"topology {topology!r} has {len(devices)}; pick a topology of that many "
        "chips or plan for its mesh.")
  # A plain Mesh: topologies.make_mesh refuses shapes that split a physical axis.
  return jax.sharding.Mesh(np.array(devices).reshape(sizes), tuple(mesh_axes),
                           axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))


@functools.lru_cache(maxsize=None)
def _topology_devices(topology: str) -> tuple[Any, ...]:
  """The devices libtpu describes for a topology, once per process: JAX tells devices
  apart by object, so a mesh the user built for their `jax.shard_map` with `tpu_mesh`
  and the one `verify` compiles on must hold the same ones."""
  topologies = _topologies()
  try:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
  except Exception as e:  # noqa: BLE001 - libtpu raises its own runtime errors
    if "lockfile" in str(e):
      raise RuntimeError(
          "verify: libtpu is held by another process (its lockfile, /tmp/libtpu_lockfile); "
          "for ahead-of-time compiles with no TPU attached, set "
          "ALLOW_MULTIPLE_LIBTPU_LOAD=1 in every process that loads it, or wait for the "
          f"other to finish ({str(e).splitlines()[0][:160]}).") from None
    raise options.OptionError(f"verify: topology={topology!r} is not one libtpu knows "
                              f"({str(e).splitlines()[0][:160]}); e.g. 'v5e:2x2', "
                              "'v5p:2x2x1', 'v6e:4x4'.") from None
  return tuple(desc.devices)


def _hbm(devices: Sequence[Any], plan: planlib.Plan, tpu: bool) -> tuple[float, str]:
  kind = devices[0].device_kind
  if tpu and kind in USABLE_HBM:
    return USABLE_HBM[kind], "compiler"
  if not tpu:
    try:
      limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - CPU and AOT devices keep no memory stats
      limit = None
    if limit:
      return float(limit), "runtime"
  return costlib.get_profile(plan.device).hbm_bytes, "profile"


def _abstract(x):
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype) if hasattr(x, "dtype") else x


def verify(plan: planlib.Plan, fn: Callable[..., Any], *args: Any, topology: str | None = None,
           donate_argnums: int | Sequence[int] = (), kwargs: Mapping[str, Any] | None = None,
           hbm_bytes: float | str | None = None,
           compiler_options: Mapping[str, Any] | None = None,
           layouts: str = "default") -> Verified:
  """Compiles `tapas.apply(plan, fn)` for `topology` (or the local devices) and reads
  the compiler's memory, collectives and FLOPs next to the plan's predictions.

  Args:
    plan: a `Plan` (searched, a baseline, or loaded).
    fn: the step the plan was made for.
    *args: its arguments, arrays or `jax.ShapeDtypeStruct`s (nothing is allocated).
    topology: a TPU topology name ("v5e:2x2", "v5p:4x4x4", "v6e:16x16") to compile for
      through libtpu on this machine, no TPU needed; its device count must be the
      plan's mesh's. None: the local devices.
    donate_argnums: as for `tapas.apply` (donate the state, 0, to count it once).
    kwargs: the step's keyword arguments.
    hbm_bytes: per-device memory to judge the fit against instead of the chip's (bytes
      or "2MiB"): to ask whether a plan fits a smaller share of the chip.
    compiler_options: passed to `compile()` as they are (XLA's debug options, say
      {"xla_dump_to": folder} for the compiler's buffer assignment, which
      `scripts/tpu_peak.py` reads).
    layouts: as for `tapas.apply`: the state's layouts, "default" (JAX's) or "auto"
      (the compiler's); compile the layouts the step will run in.

  Returns:
    A `Verified` record; `record.fits` is False, with `record.missing_bytes`, where the
    compiler rejected the program for memory.

  Raises:
    LibtpuMissingError: a TPU topology without libtpu (`pip install 'tapas_jax[tpu]'`).
    ValueError: a bad option; a compile error other than running out of memory.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import tapas_jax as tapas
    >>> f = lambda w, x: jnp.sum(x @ w)
    >>> args = (jax.ShapeDtypeStruct((64, 64), jnp.float32),
    ...         jax.ShapeDtypeStruct((512, 64), jnp.float32))
    >>> plan = tapas.search(f, *args, mesh={"data": 8}, device="cpu")
    >>> tapas.verify(plan, f, *args, hbm_bytes="1KiB").fits
    False
  """
  if not isinstance(plan, planlib.Plan):
    raise options.OptionError(f"verify: the first argument must be a tapas Plan, got "
                              f"{type(plan).__name__}; pass tapas.search(...)'s result.")
  override = options.memory_bytes(hbm_bytes, "verify", "hbm_bytes")
  tpu = topology is not None
  mesh = tpu_mesh(topology, plan.mesh_axes) if tpu else make_mesh(dict(plan.mesh_axes))
  devices = list(mesh.devices.flat)
  hbm, source = (override, "given") if override else _hbm(devices, plan, tpu)
  abstract = jax.tree_util.tree_map(_abstract, (args, dict(kwargs or {})))
  step = apply_plan(plan, fn, mesh=mesh, donate_argnums=donate_argnums, layouts=layouts)
  base = dict(plan_name=plan.name, target=topology if tpu else f"local {devices[0].platform}",
              device_kind=devices[0].device_kind, num_devices=len(devices),
              predicted_memory_bytes=plan.stats.predicted_memory_bytes,
              predicted_comm_bytes=plan.stats.predicted_comm_bytes)
  start = time.perf_counter()
  try:
    compiled = step.lower(*abstract[0], **abstract[1]).compile(
        compiler_options=dict(compiler_options or {}))
  except Exception as e:  # noqa: BLE001 - the compiler's errors are runtime errors
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    need, have = parse_out_of_memory(str(e)) or (float("nan"), hbm)
    return Verified(argument_bytes=0, output_bytes=0, alias_bytes=0,
                    temp_bytes=int(need) if need == need else 0,
                    hbm_bytes=override or have, hbm_source="given" if override else "compiler",
                    comm_bytes={}, flops=0.0, compile_s=time.perf_counter() - start,
                    error=str(e), **base)
  # A TPU program is counted as compiled: its pipeline has had its chance to turn an
  # all-reduce read as slices into a reduce-scatter (it keeps some: a combined gradient
  # all-reduce, BENCHMARKS.md). A CPU one as `measure` counts it for an accelerator.
  got = measure.measure(compiled, len(devices),
                        reduce_scatter_creator=devices[0].platform == "cpu")
  return Verified(argument_bytes=got.argument_bytes, output_bytes=got.output_bytes,
                  alias_bytes=got.alias_bytes, temp_bytes=got.temp_bytes, hbm_bytes=hbm,
                  hbm_source=source, comm_bytes=dict(got.comm_bytes), flops=got.flops,
                  compile_s=time.perf_counter() - start, live_peak_bytes=got.live_peak_bytes,
                  comm_by_op=got.comm_by_op, **base)
