"""Analytic cost model for the search stage: devices, meshes, layouts, collectives.

Everything here is plain Python (no JAX) so the solver can call it many
thousands of times; the expensive entry points are memoised on their
(hashable) arguments.

Conventions used throughout:

* Bytes are per device. A collective's cost is `bytes_sent_per_device`, the
  traffic one device pushes onto its links under ring accounting.
* Bandwidths are **unidirectional** (bytes/s one device can send while it also
  receives at the same rate), which is what ring accounting needs.
* Time of a collective = α · steps + bytes / bandwidth. A collective over several
  mesh axes is one collective, as XLA emits it (a value partial over data and
  model is all-reduced once over both): it sends the flat ring's bytes, and is
  timed as one ring per axis, fastest link first, each axis on what the one
  before it left, as TPU per-dimension rings and NCCL's hierarchical algorithms
  run it.

Example:
  >>> from tapas_jax import cost
  >>> mesh = cost.mesh_spec({"data": 2, "model": 4}, "h100")
  >>> src = cost.Layout((("data",), ()), partial=("model",))
  >>> dst = cost.Layout((("data",), ("model",)))
  >>> [c.kind for c in cost.reshard((8, 16), 4, src, dst, mesh, "h100")]
  ['reduce-scatter']
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence

INTRA = "intra"
INTER = "inter"
_LINKS = (INTRA, INTER)

ALL_REDUCE = "all-reduce"
ALL_GATHER = "all-gather"
REDUCE_SCATTER = "reduce-scatter"
ALL_TO_ALL = "all-to-all"

_GB = 1e9
_GIB = 2**30


# ---------------------------------------------------------------------------
# Device profiles
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
  """Peak figures of one accelerator chip and its interconnect.

  Attributes:
    name: profile key in `PROFILES`.
    peak_flops: dense bf16 FLOP/s per chip.
    peak_flops_f32: FLOP/s per chip for float32 matmuls under JAX's DEFAULT
      precision, which runs them as one bf16 pass on TPU and as TF32 on
      A100/H100/H200 (https://docs.jax.dev/en/latest/201/precision.html).
    hbm_bytes: device memory per chip.
    hbm_bandwidth: device memory bandwidth per chip, bytes/s.
    intra_bandwidth: unidirectional bytes/s one chip can push into a ring
      collective along ONE mesh axis over the fast fabric. NVSwitch GPUs: the
      whole NVLink, i.e. half the bidirectional headline. TPU torus: the two
      links of one torus dimension (a bidirectional ring), i.e. 2 x per-link
      one-way bandwidth.
    inter_bandwidth: unidirectional bytes/s per chip across hosts or slices
      (InfiniBand NIC per GPU, TPU DCN share per chip).
    intra_latency_s: α, seconds per ring step on the fast fabric (estimate).
    inter_latency_s: α, seconds per ring step across hosts (estimate).
    devices_per_host: chips attached to one host.
    intra_domain_size: chips reachable over the fast fabric. Equals
      `devices_per_host` for NVLink boxes; a whole ICI slice for TPUs, where
      ICI crosses host boundaries. `mesh_spec` uses this to pick links.
    reduce_scatter: whether the compiler turns an all-reduce read only as 1/n
      slices into a reduce-scatter (XLA's GPU and TPU pipelines do). XLA:CPU has no
      such pass: it holds the whole all-reduced value, then slices it, and the
      memory model counts that. Collectives are priced as the reduce-scatter on
      every profile, as `measure` counts them, since a CPU mesh stands in for an
      accelerator's.
    canonical_convolutions: whether the compiler runs only convolutions in
      canonical dimension order (input batch, spatial, feature; kernel spatial, in,
      out) and copies other operands and results transposed into it (XLA:CPU's
      convolution canonicalization; the backward pass's weight-gradient convs put
      the activations in non-canonical slots). The memory model counts the copies.
    combine_threshold_bytes: most bytes of gradients the compiler's combiner puts
      into one reduction (XLA GPU's `xla_gpu_all_reduce_combine_threshold_bytes`
      and its reduce-scatter twin default to 30 MiB; assumed the same on TPU, whose
      flags are not public). XLA:CPU combines every gradient into one reduction at
      the end of the backward pass (measured on the zoo: its temporaries hold every
      gradient twice there), which is infinite here. Gradients wait for their
      combined reduction, so this sets how many are live at once.
    reductions_duplicate: whether a reduction's fusion recomputes a cheap operand
      that other ops also read (XLA's GPU and TPU fusions do). XLA:CPU's reduction
      fusions (YNNPACK) do not: the operand is written out, as a batch norm's
      centred activations are.
    dot_operand_fusion: whether the compiler reads elementwise chains inside a dot's
      own fusion (where that reads no more bytes), recomputes transcendental ops in
      each reader, and makes a one-hot scatter-add a select (`fusion.fused_values`).
      The TPU compiler does (libtpu 0.0.42.1, read off its HLO for LLaMA-3-8B: a
      norm's output and the logits' cotangent are never written; BENCHMARKS.md
      "Predicted vs TPU-compiled memory at real scale"); XLA:CPU and the GPU
      profiles are modelled without it.

  Example:
    >>> get_profile("h100").intra_bandwidth
    450000000000.0
  """

  name: str
  peak_flops: float
  peak_flops_f32: float
  hbm_bytes: float
  hbm_bandwidth: float
  intra_bandwidth: float
  inter_bandwidth: float
  intra_latency_s: float
  inter_latency_s: float
  devices_per_host: int
  intra_domain_size: int
  reduce_scatter: bool = True
  canonical_convolutions: bool = False
  reductions_duplicate: bool = True
  combine_threshold_bytes: float = 30 * 2**20
  dot_operand_fusion: bool = False

  def bandwidth(self, link: str) -> float:
    """Unidirectional bytes/s per chip on an "intra" or "inter" link."""
    return self.intra_bandwidth if _check_link(link) == INTRA else self.inter_bandwidth

  def latency(self, link: str) -> float:
    """α in seconds per ring step on an "intra" or "inter" link."""
    return self.intra_latency_s if _check_link(link) == INTRA else self.inter_latency_s


# Sources, one per number. Google's "Interchip Interconnect BW" in Gbps is the
# one-way aggregate over all ICI ports of a chip (v5e: 1600 Gbps = 4 ports x
# 50 GB/s; the same page now states it as 400 GBps bidirectional), so one
# torus dimension gets 2/ports of it one way.
PROFILES: dict[str, DeviceProfile] = {
    "tpu-v4": DeviceProfile(
        name="tpu-v4",
        # https://cloud.google.com/tpu/docs/v4: 275 TFLOPS (bf16 or int8).
        peak_flops=275e12,
        # One bf16 MXU pass under DEFAULT precision (JAX precision doc above).
        peak_flops_f32=275e12,
        # https://cloud.google.com/tpu/docs/v4: HBM2 32 GiB, 1200 GBps.
        hbm_bytes=32 * _GIB,
        hbm_bandwidth=1200 * _GB,
        # TPU v4 paper (Jouppi et al., ISCA 2023, arXiv 2304.01433): 6 ICI
        # links per chip, 400 Gb/s (50 GB/s) each way; 3D torus -> 2 links
        # per torus dimension.
        intra_bandwidth=2 * 50 * _GB,
        # Assumption: Google publishes no per-chip DCN figure for v4; taken
        # equal to v5p's 50 Gbps per chip (https://cloud.google.com/tpu/docs/v5p).
        inter_bandwidth=50e9 / 8,
        # Estimates: ~1 us per ICI hop, ~10 us per DCN message.
        intra_latency_s=1e-6,
        inter_latency_s=10e-6,
        # https://cloud.google.com/tpu/docs/v4: 4 chips per host (2x2x1
        # tray), 4096-chip pod all on ICI.
        devices_per_host=4,
        intra_domain_size=4096,
        dot_operand_fusion=True,  # the TPU compiler's fusions (field doc)
    ),
    "tpu-v5e": DeviceProfile(
        name="tpu-v5e",
        # https://cloud.google.com/tpu/docs/v5e: 197 TFLOPS bf16.
        peak_flops=197e12,
        peak_flops_f32=197e12,
        # https://cloud.google.com/tpu/docs/v5e: HBM2 16 GB, 819 GBps.
        hbm_bytes=16 * _GB,
        hbm_bandwidth=819 * _GB,
        # https://cloud.google.com/tpu/docs/v5e: 1600 Gbps ICI (400 GBps
        # bidirectional), 4 ICI ports, 2D torus -> 2 of 4 ports per axis.
        intra_bandwidth=1600e9 / 8 * 2 / 4,
        # https://cloud.google.com/tpu/docs/v5e: 2 x 100 Gbps NIC per host of
        # 8 chips.
        inter_bandwidth=2 * 100e9 / 8 / 8,
        intra_latency_s=1e-6,
        inter_latency_s=10e-6,
        # https://cloud.google.com/tpu/docs/v5e: 8 chips per host, 256-chip pod.
        devices_per_host=8,
        intra_domain_size=256,
        dot_operand_fusion=True,  # the TPU compiler's fusions (field doc)
    ),
    "tpu-v5p": DeviceProfile(
        name="tpu-v5p",
        # https://cloud.google.com/tpu/docs/v5p: 459 TFLOPS bf16.
        peak_flops=459e12,
        peak_flops_f32=459e12,
        # https://cloud.google.com/tpu/docs/v5p: 95 GiB HBM, 2765 GBps.
        hbm_bytes=95 * _GIB,
        hbm_bandwidth=2765 * _GB,
        # https://cloud.google.com/tpu/docs/v5p: 4800 Gbps ICI (1200 GBps
        # bidirectional), 3D torus, 6 ports -> 2 of 6 per axis.
        intra_bandwidth=4800e9 / 8 * 2 / 6,
        # https://cloud.google.com/tpu/docs/v5p: DCN 50 Gbps per chip.
        inter_bandwidth=50e9 / 8,
        intra_latency_s=1e-6,
        inter_latency_s=10e-6,
        # https://cloud.google.com/tpu/docs/v5p: 4 chips per host; largest
        # schedulable ICI slice 6144 chips (96 cubes).
        devices_per_host=4,
        intra_domain_size=6144,
        dot_operand_fusion=True,  # the TPU compiler's fusions (field doc)
    ),
    "tpu-v6e": DeviceProfile(
        name="tpu-v6e",
        # https://cloud.google.com/tpu/docs/v6e (Trillium): 918 TFLOPs bf16 per chip.
        peak_flops=918e12,
        peak_flops_f32=918e12,
        # The datasheet's 32 GB HBM less what the runtime keeps: 31.25 GiB is what the
        # TPU compiler (libtpu 0.0.42.1) reports as available HBM on v6e.
        hbm_bytes=31.25 * _GIB,
        # https://cloud.google.com/tpu/docs/v6e: 1640 GBps (the page's current revision
        # states 1638 GBps).
        hbm_bandwidth=1640 * _GB,
        # https://cloud.google.com/tpu/docs/v6e: 800 GBps bidirectional ICI per chip
        # (an earlier revision: 3584 Gbps), 4 ports, 2D torus -> 2 of 4 ports per axis.
        intra_bandwidth=800 * _GB / 2 * 2 / 4,
        # https://cloud.google.com/tpu/docs/v6e: 4 x 200 Gbps NIC per host of 8 chips.
        inter_bandwidth=4 * 200e9 / 8 / 8,
        intra_latency_s=1e-6,
        inter_latency_s=10e-6,
        # https://cloud.google.com/tpu/docs/v6e: 8 chips per host, 256-chip pod.
        devices_per_host=8,
        intra_domain_size=256,
        dot_operand_fusion=True,  # the TPU compiler's fusions (field doc)
    ),
    "a100": DeviceProfile(
        name="a100",
        # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): BF16 312 TFLOPS
        # dense, TF32 156 TFLOPS dense, 80 GB HBM2e at 2039 GB/s, NVLink
        # 600 GB/s bidirectional.
        peak_flops=312e12,
        peak_flops_f32=156e12,
        hbm_bytes=80 * _GB,
        hbm_bandwidth=2039 * _GB,
        intra_bandwidth=600 * _GB / 2,
        # NVIDIA DGX A100 datasheet: 8 x 200 Gb/s HDR InfiniBand (ConnectX-6),
        # one per GPU.
        inter_bandwidth=200e9 / 8,
        # Estimates of the same order as NCCL's own tuning model
        # (nccl src/graph/tuning.cc hwLat: NVLink ring ~2.5-5.7 us/step,
        # network ring ~6.6-9.6 us/step).
        intra_latency_s=5e-6,
        inter_latency_s=10e-6,
        devices_per_host=8,
        intra_domain_size=8,
    ),
    "h100": DeviceProfile(
        name="h100",
        # NVIDIA H100 Tensor Core GPU datasheet (SXM): BF16 1979 TFLOPS with
        # sparsity (989.5 dense), TF32 989 with sparsity (494.5 dense), 80 GB
        # HBM3 at 3.35 TB/s, NVLink 900 GB/s bidirectional.
        peak_flops=989.5e12,
        peak_flops_f32=494.5e12,
        hbm_bytes=80 * _GB,
        hbm_bandwidth=3350 * _GB,
        intra_bandwidth=900 * _GB / 2,
        # NVIDIA DGX H100 datasheet: 8 x 400 Gb/s ConnectX-7 (NDR), one per GPU.
        inter_bandwidth=400e9 / 8,
        intra_latency_s=5e-6,
        inter_latency_s=10e-6,
        devices_per_host=8,
        intra_domain_size=8,
    ),
    "h200": DeviceProfile(
        name="h200",
        # NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1979 TFLOPS with
        # sparsity (989.5 dense), TF32 989 with sparsity (494.5 dense), 141 GB
        # HBM3e at 4.8 TB/s, NVLink 900 GB/s bidirectional.
        peak_flops=989.5e12,
        peak_flops_f32=494.5e12,
        hbm_bytes=141 * _GB,
        hbm_bandwidth=4800 * _GB,
        intra_bandwidth=900 * _GB / 2,
        # NVIDIA DGX H200 datasheet: 8 x 400 Gb/s ConnectX-7, one per GPU.
        inter_bandwidth=400e9 / 8,
        intra_latency_s=5e-6,
        inter_latency_s=10e-6,
        devices_per_host=8,
        intra_domain_size=8,
    ),
    # Assumptions, not a datasheet: one commodity host (16 AVX2 cores, ~1.5
    # TFLOP/s f32, 64 GiB DDR at ~50 GB/s, 10 GbE) split into 8 XLA CPU
    # devices, as with --xla_force_host_platform_device_count=8. Every figure
    # is per device and rounded down.
    "cpu": DeviceProfile(
        name="cpu",
        peak_flops=1e11,
        peak_flops_f32=1e11,
        hbm_bytes=64 * _GIB / 8,
        hbm_bandwidth=50 * _GB / 8,
        intra_bandwidth=5 * _GB,
        inter_bandwidth=10e9 / 8 / 8,
        intra_latency_s=10e-6,
        inter_latency_s=50e-6,
        devices_per_host=8,
        intra_domain_size=8,
        reduce_scatter=False,
        canonical_convolutions=True,
        reductions_duplicate=False,
        combine_threshold_bytes=math.inf,
    ),
}


# The DeviceProfile fields that describe its compiler's memory layout, not the chip.
_COMPILER_LAYOUT = ("reduce_scatter", "canonical_convolutions", "reductions_duplicate",
                    "combine_threshold_bytes", "dot_operand_fusion")


def compiled_by_xla_cpu(profile: str | DeviceProfile) -> DeviceProfile:
  """A profile's figures with XLA:CPU's memory layout: to compare a plan's predicted
  memory with what a CPU mesh standing in for that device compiles it to.

  Example:
    >>> compiled_by_xla_cpu("h100").name, compiled_by_xla_cpu("h100").reduce_scatter
    ('h100 on XLA:CPU', False)
  """
  profile = get_profile(profile)
  cpu = PROFILES["cpu"]
  if profile.name == cpu.name or profile.name.endswith(" on XLA:CPU"):
    return profile
  return dataclasses.replace(profile, name=f"{profile.name} on XLA:CPU",
                             **{f: getattr(cpu, f) for f in _COMPILER_LAYOUT})


# `jax.devices()[0].device_kind` -> profile, matched in order on the lower-cased kind:
# the TPU runtime says "TPU v5 lite" for v5e, "TPU v5" (or "TPU v5p") for v5p, "TPU v6
# lite" for v6e; CUDA names the board ("NVIDIA H100 80GB HBM3").
_KINDS = (("v6 lite", "tpu-v6e"), ("v6e", "tpu-v6e"), ("v5 lite", "tpu-v5e"),
          ("v5e", "tpu-v5e"), ("v5p", "tpu-v5p"), ("tpu v5", "tpu-v5p"),
          ("tpu v4", "tpu-v4"), ("h200", "h200"), ("h100", "h100"), ("a100", "a100"))
# A TPU topology name's generation ("v5p:4x4x4") -> profile.
_GENERATIONS = {"v4": "tpu-v4", "v5e": "tpu-v5e", "v5litepod": "tpu-v5e",
                "v5p": "tpu-v5p", "v6e": "tpu-v6e"}


def profile_for_kind(device_kind: str, platform: str = "") -> str:
  """The profile of a device, from its `device_kind` (and platform, for the fallback).

  Example:
    >>> profile_for_kind("TPU v5 lite"), profile_for_kind("NVIDIA H100 80GB HBM3")
    ('tpu-v5e', 'h100')
  """
  kind = device_kind.lower()
  for part, name in _KINDS:
    if part in kind:
      return name
  # An unknown generation: the nearest profile of its platform, not a crash.
  return {"gpu": "h100", "tpu": "tpu-v5e"}.get(platform, "cpu")


def profile_for_topology(topology: str) -> str:
  """The profile of a TPU topology name ("v5p:4x4x4" -> "tpu-v5p").

  Raises:
    ValueError: a generation no profile describes.

  Example:
    >>> profile_for_topology("v6e:16x16")
    'tpu-v6e'
  """
  generation = topology.split(":", 1)[0].lower()
  if generation not in _GENERATIONS:
    raise ValueError(f"TPU topology {topology!r}: no device profile for generation "
                     f"{generation!r}; known: {', '.join(sorted(_GENERATIONS))}.")
  return _GENERATIONS[generation]


def get_profile(name: str | DeviceProfile) -> DeviceProfile:
  """Looks up a device profile by name (a profile passes through).

  Args:
    name: a key of `PROFILES`, e.g. "tpu-v5e", or a `DeviceProfile`.

  Returns:
    The profile.

  Raises:
    ValueError: unknown name; the message lists the valid ones.

  Example:
    >>> get_profile("tpu-v5e").peak_flops
    197000000000000.0
  """
  if isinstance(name, DeviceProfile):
    return name
  try:
    return PROFILES[name]
  except (KeyError, TypeError):
    raise ValueError(
        f"Unknown device profile {name!r}; valid names: {', '.join(sorted(PROFILES))}."
    ) from None


def compute_time(flops: float, profile: str | DeviceProfile, dtype: str = "bfloat16") -> float:
  """Seconds to run `flops` on one chip at peak.

  Args:
    flops: floating-point operations per device.
    profile: device profile or its name.
    dtype: operand dtype name; 32/64-bit floats use `peak_flops_f32`, anything
      narrower uses the bf16 peak.

  Returns:
    flops / peak FLOP/s.

  Example:
    >>> compute_time(989.5e12, "h100")
    1.0
  """
  profile = get_profile(profile)
  wide = dtype in ("float32", "float64", "complex64", "complex128", "f32", "f64")
  return flops / (profile.peak_flops_f32 if wide else profile.peak_flops)


def roofline_time(flops: float, nbytes: float, profile: str | DeviceProfile,
                  dtype: str = "bfloat16") -> float:
  """Seconds one op takes on one chip: bound by its FLOPs or by its memory traffic.

  Args:
    flops: floating-point operations per device.
    nbytes: bytes the op reads from and writes to device memory, per device.
    profile: device profile or its name.
    dtype: as for `compute_time`.

  Returns:
    max(flops / peak FLOP/s, nbytes / HBM bandwidth).

  Example:
    >>> roofline_time(0, 3350e9, "h100")  # an elementwise op over 3.35 TB: 1 s
    1.0
    >>> roofline_time(989.5e12, 1.0, "h100")  # a matmul: compute bound
    1.0
  """
  profile = get_profile(profile)
  moved = nbytes / profile.hbm_bandwidth
  return max(compute_time(flops, profile, dtype) if flops else 0.0, moved)


def _check_link(link: str) -> str:
  if link not in _LINKS:
    raise ValueError(f"Unknown link kind {link!r}; use 'intra' or 'inter'.")
  return link


# ---------------------------------------------------------------------------
# Meshes
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """Named mesh axes, their sizes and the fabric each axis runs over.

  Attributes:
    axis_names: mesh axis names, major to minor (as in `jax.sharding.Mesh`).
    axis_sizes: devices along each axis.
    axis_links: "intra" (ICI / NVLink) or "inter" (DCN / InfiniBand) per axis.

  Example:
    >>> MeshSpec(("data", "model"), (2, 4), ("inter", "intra")).size("model")
    4
  """

  axis_names: tuple[str, ...]
  axis_sizes: tuple[int, ...]
  axis_links: tuple[str, ...]

  def __post_init__(self):
    object.__setattr__(self, "axis_names", tuple(self.axis_names))
    object.__setattr__(self, "axis_sizes", tuple(self.axis_sizes))
    object.__setattr__(self, "axis_links", tuple(self.axis_links))
    n = len(self.axis_names)
    if len(self.axis_sizes) != n or len(self.axis_links) != n:
      raise ValueError(
          f"MeshSpec needs one size and one link per axis; got {n} names, "
          f"{len(self.axis_sizes)} sizes, {len(self.axis_links)} links."
      )
    seen = set()
    for name, size, link in zip(self.axis_names, self.axis_sizes, self.axis_links):
      if not isinstance(name, str) or not name:
        raise ValueError(f"Mesh axis names must be non-empty strings; got {name!r}.")
      if name in seen:
        raise ValueError(f"Mesh axis {name!r} appears twice; give each axis a unique name.")
      seen.add(name)
      if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"Mesh axis {name!r} has size {size!r}; use a positive int.")
      if link not in _LINKS:
        raise ValueError(f"Mesh axis {name!r} has link {link!r}; use 'intra' or 'inter'.")

  @property
  def num_devices(self) -> int:
    return math.prod(self.axis_sizes)

  def size(self, axis: str) -> int:
    """Devices along `axis`."""
    return self.axis_sizes[self._index(axis)]

  def link(self, axis: str) -> str:
    """Fabric ("intra" or "inter") that `axis` runs over."""
    return self.axis_links[self._index(axis)]

  def group_size(self, axes: Iterable[str]) -> int:
    """Product of the sizes of `axes`."""
    return math.prod(self.size(a) for a in axes)

  def _index(self, axis: str) -> int:
    try:
      return self.axis_names.index(axis)
    except ValueError:
      raise ValueError(
          f"Axis {axis!r} is not in the mesh; mesh axes are {self.axis_names}."
      ) from None


def mesh_spec(
    axis_sizes: Mapping[str, int],
    profile: str | DeviceProfile,
    links: Mapping[str, str] | None = None,
) -> MeshSpec:
  """Describes a mesh, guessing which axes stay on the fast fabric.

  By default the innermost (last) axes get "intra" while the product of their
  sizes, counted from the last axis, fits in `profile.intra_domain_size` (one
  NVLink box on GPUs, one ICI slice on TPUs); the outer axes get "inter". This
  matches how `jax.make_mesh` lays devices out: minor axes are neighbours.

  Args:
    axis_sizes: ordered mapping axis name -> size, major to minor (a
      `jax.sharding.Mesh.shape` works as is).
    profile: device profile or its name.
    links: optional overrides, axis name -> "intra" or "inter".

  Returns:
    The `MeshSpec`.

  Raises:
    ValueError: bad sizes or links; the message names the axis.

  Example:
    >>> mesh_spec({"data": 4, "model": 8}, "h100").axis_links
    ('inter', 'intra')
  """
  profile = get_profile(profile)
  names = tuple(axis_sizes)
  sizes = tuple(axis_sizes[n] for n in names)
  links = dict(links or {})
  for name, link in links.items():
    if name not in axis_sizes:
      raise ValueError(
          f"links names axis {name!r}, which is not in the mesh {names}; "
          "drop it or add the axis to axis_sizes."
      )
    if link not in _LINKS:
      raise ValueError(f"links[{name!r}] is {link!r}; use 'intra' or 'inter'.")
  for name, size in zip(names, sizes):
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
      raise ValueError(f"Mesh axis {name!r} has size {size!r}; use a positive int.")
  sizes = tuple(int(s) for s in sizes)
  # The running product only grows, so once an axis spills out of the fast
  # domain every axis outside it does too.
  spans = itertools.accumulate(reversed(sizes), lambda a, b: a * b)
  default = [INTRA if s <= profile.intra_domain_size else INTER for s in spans][::-1]
  axis_links = tuple(links.get(n, d) for n, d in zip(names, default))
  return MeshSpec(names, sizes, axis_links)


# ---------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------


def _axes_entry(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one tensor is laid out over the mesh.

  Attributes:
    dims: per tensor dim, the mesh axes splitting it, major to minor, exactly
      like a `PartitionSpec` entry. Entries may be given as None, a str or a
      sequence; they are normalised to tuples.
    partial: mesh axes over which each device holds an un-reduced partial sum
      (e.g. after a dot_general whose contracting dim is split).

  Example:
    >>> Layout(("data", None, ("x", "y"))).to_partition_spec()
    ('data', None, ('x', 'y'))
  """

  dims: tuple[tuple[str, ...], ...]
  partial: tuple[str, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "dims", tuple(_axes_entry(d) for d in self.dims))
    object.__setattr__(self, "partial", _axes_entry(self.partial))
    seen = set()
    for axis in itertools.chain(itertools.chain.from_iterable(self.dims), self.partial):
      if not isinstance(axis, str):
        raise ValueError(f"Layout axes must be mesh axis names (str); got {axis!r}.")
      if axis in seen:
        raise ValueError(
            f"Mesh axis {axis!r} is used twice in layout {self.dims} partial={self.partial}; "
            "a mesh axis may split at most one dim (or mark partial sums) per tensor."
        )
      seen.add(axis)

  @classmethod
  def replicated(cls, rank: int) -> Layout:
    """Fully replicated layout of a rank-`rank` tensor.

    Example:
      >>> Layout.replicated(2).dims
      ((), ())
    """
    return cls(((),) * rank)

  @property
  def rank(self) -> int:
    return len(self.dims)

  @property
  def axes(self) -> tuple[str, ...]:
    """Mesh axes that split some dim, in dim order."""
    return tuple(itertools.chain.from_iterable(self.dims))

  def to_partition_spec(self) -> tuple:
    """Entries for `jax.sharding.PartitionSpec(*entries)`.

    None for an unsplit dim, a str for one axis, a tuple for several. Partial
    sums have no PartitionSpec form and are dropped.

    Example:
      >>> Layout(((), ("model",))).to_partition_spec()
      (None, 'model')
    """
    return tuple(None if not d else d[0] if len(d) == 1 else d for d in self.dims)


def _check_layout(layout: Layout, shape: Sequence[int], mesh: MeshSpec, what: str = "layout"):
  if layout.rank != len(shape):
    raise ValueError(
        f"{what} has {layout.rank} dims but the tensor shape {tuple(shape)} has {len(shape)}; "
        "give one PartitionSpec entry per tensor dim."
    )
  for axis in itertools.chain(layout.axes, layout.partial):
    if axis not in mesh.axis_names:
      raise ValueError(
          f"{what} uses axis {axis!r}, which is not in the mesh {mesh.axis_names}; "
          "rename it or add it to the mesh."
      )


def local_shape(shape: Sequence[int], layout: Layout, mesh: MeshSpec) -> tuple[int, ...]:
  """Per-device shard shape (ceil division, as XLA pads uneven shards).

  Example:
    >>> m = MeshSpec(("data", "model"), (2, 4), ("intra", "intra"))
    >>> local_shape((10, 16), Layout(("data", "model")), m)
    (5, 4)
  """
  _check_layout(layout, shape, mesh)
  return tuple(-(-d // mesh.group_size(axes)) for d, axes in zip(shape, layout.dims))


def num_shards(layout: Layout, mesh: MeshSpec) -> int:
  """Number of distinct shards (devices holding different slices).

  Example:
    >>> m = MeshSpec(("data", "model"), (2, 4), ("intra", "intra"))
    >>> num_shards(Layout(("model", None)), m)
    4
  """
  return mesh.group_size(layout.axes)


def tensor_bytes(shape: Sequence[int], itemsize: int, layout: Layout, mesh: MeshSpec) -> int:
  """Bytes one device holds for a tensor in `layout`.

  Example:
    >>> m = MeshSpec(("model",), (4,), ("intra",))
    >>> tensor_bytes((8, 16), 4, Layout((None, "model")), m)
    128
  """
  return math.prod(local_shape(shape, layout, mesh)) * itemsize


# ---------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective over some mesh axes, costed per device.

  Attributes:
    kind: "all-reduce", "all-gather", "reduce-scatter" or "all-to-all".
    axes: mesh axes the collective runs over (one ring over their product).
    bytes_sent_per_device: ring-accounted bytes each device sends.
    time_s: α · steps + bytes / slowest-link bandwidth.
  """

  kind: str
  axes: tuple[str, ...]
  bytes_sent_per_device: float
  time_s: float


def _axes_arg(axes: str | Iterable[str]) -> tuple[str, ...]:
  return (axes,) if isinstance(axes, str) else tuple(axes)


@functools.lru_cache(maxsize=1 << 16)
def _collective(
    kind: str, local_bytes: float, axes: tuple[str, ...], mesh: MeshSpec, profile: DeviceProfile
) -> Collective:
  if len(set(axes)) != len(axes):
    raise ValueError(f"{kind} over {axes}: a mesh axis appears twice; list each axis once.")
  n = mesh.group_size(axes)
  if n == 1:
    return Collective(kind, axes, 0.0, 0.0)
  # Ring: an all-reduce is a reduce-scatter plus an all-gather, twice the
  # steps and twice the bytes of either.
  factor = 2 if kind == ALL_REDUCE else 1
  sent = factor * (n - 1) / n * local_bytes
  if kind == ALL_TO_ALL or len(axes) == 1:
    links = {mesh.link(a) for a in axes}
    bandwidth = min(profile.bandwidth(link) for link in links)
    alpha = max(profile.latency(link) for link in links)
    return Collective(kind, axes, sent, alpha * factor * (n - 1) + sent / bandwidth)
  return Collective(kind, axes, sent, factor * _staged_time(local_bytes, axes, mesh, profile))


def _staged_time(local_bytes: float, axes: tuple[str, ...], mesh: MeshSpec,
                 profile: DeviceProfile) -> float:
  """Seconds of a reduce-scatter (or all-gather) over several mesh axes, one ring per
  axis, the fastest link first on the whole buffer and each next on what is left:
  what TPUs' per-dimension rings and NCCL's hierarchical algorithms do with the one
  collective XLA emits over the axes together. The bytes are the flat ring's,
  (n-1)/n of the buffer; the steps and the slow links' share are fewer."""
  order = sorted(axes, key=lambda a: -profile.bandwidth(mesh.link(a)))
  time, buffer = 0.0, local_bytes
  for a in order:
    k, link = mesh.size(a), mesh.link(a)
    time += profile.latency(link) * (k - 1) + (k - 1) / k * buffer / profile.bandwidth(link)
    buffer /= k
  return time


def all_reduce(
    local_bytes: float, axes: str | Iterable[str], mesh: MeshSpec, profile: str | DeviceProfile
) -> Collective:
  """Ring all-reduce of a `local_bytes` buffer: sends 2(n-1)/n · S.

  Example:
    >>> m = MeshSpec(("model",), (4,), ("intra",))
    >>> all_reduce(1024, "model", m, "h100").bytes_sent_per_device
    1536.0
  """
  return _collective(ALL_REDUCE, float(local_bytes), _axes_arg(axes), mesh, get_profile(profile))


def all_gather(
    local_bytes: float, axes: str | Iterable[str], mesh: MeshSpec, profile: str | DeviceProfile
) -> Collective:
  """Ring all-gather; `local_bytes` is the gathered (output) buffer: (n-1)/n · S.

  Example:
    >>> m = MeshSpec(("model",), (4,), ("intra",))
    >>> all_gather(1024, "model", m, "h100").bytes_sent_per_device
    768.0
  """
  return _collective(ALL_GATHER, float(local_bytes), _axes_arg(axes), mesh, get_profile(profile))


def reduce_scatter(
    local_bytes: float, axes: str | Iterable[str], mesh: MeshSpec, profile: str | DeviceProfile
) -> Collective:
  """Ring reduce-scatter; `local_bytes` is the input buffer: (n-1)/n · S.

  Example:
    >>> m = MeshSpec(("model",), (4,), ("intra",))
    >>> reduce_scatter(1024, "model", m, "h100").bytes_sent_per_device
    768.0
  """
  return _collective(
      REDUCE_SCATTER, float(local_bytes), _axes_arg(axes), mesh, get_profile(profile))


def all_to_all(
    local_bytes: float, axes: str | Iterable[str], mesh: MeshSpec, profile: str | DeviceProfile
) -> Collective:
  """All-to-all of a `local_bytes` buffer: each device keeps 1/n, sends (n-1)/n · S.

  Example:
    >>> m = MeshSpec(("model",), (4,), ("intra",))
    >>> all_to_all(1024, "model", m, "h100").bytes_sent_per_device
    768.0
  """
  return _collective(ALL_TO_ALL, float(local_bytes), _axes_arg(axes), mesh, get_profile(profile))


# ---------------------------------------------------------------------------
# Resharding
# ---------------------------------------------------------------------------

# A search state: the axes on each dim (major to minor) and the partial axes.
_State = tuple[tuple[tuple[str, ...], ...], frozenset]


def reshard(
    shape: Sequence[int],
    itemsize: int,
    src: Layout,
    dst: Layout,
    mesh: MeshSpec,
    profile: str | DeviceProfile,
) -> tuple[Collective, ...]:
  """Cheapest sequence of collectives turning layout `src` into `dst`.

  Per mesh axis: kept on the same dim -> nothing; split -> unsplit is an
  all-gather; unsplit -> split a free local slice; moved between dims an
  all-to-all; partial -> unsplit an all-reduce; partial -> split a
  reduce-scatter (or an all-reduce then a slice, when cheaper). Axes on one dim
  must keep their major-to-minor order, so axes past the longest common prefix
  of src and dst on a dim are taken off (minor first) and put back on.

  The order is found by a shortest-path search over intermediate layouts,
  costing each step on the buffer as it is at that point; it therefore does
  slices and reduce-scatters first and all-gathers last, and merges all-reduces
  or all-to-alls over several axes into one collective when that is cheaper.
  Axes of size 1 are ignored. Results are memoised.

  Args:
    shape: global tensor shape.
    itemsize: bytes per element.
    src: current layout.
    dst: wanted layout.
    mesh: the mesh.
    profile: device profile or its name.

  Returns:
    The collectives in execution order (empty when nothing moves).

  Raises:
    ValueError: layouts that do not fit the shape or mesh, or a `dst` partial
      over an axis on which `src` is not partial (a reshard cannot un-reduce).

  Example:
    >>> m = mesh_spec({"model": 4}, "h100")
    >>> c, = reshard((8, 16), 4, Layout(("model", None)), Layout((None, "model")), m, "h100")
    >>> c.kind, c.bytes_sent_per_device
    ('all-to-all', 96.0)
  """
  return _reshard(tuple(shape), int(itemsize), src, dst, mesh, get_profile(profile))


def reshard_time(shape, itemsize, src, dst, mesh, profile) -> float:
  """Total seconds of `reshard` (same arguments).

  Example:
    >>> m = mesh_spec({"model": 4}, "h100")
    >>> reshard_time((8,), 4, Layout(("model",)), Layout(("model",)), m, "h100")
    0.0
  """
  return math.fsum(c.time_s for c in reshard(shape, itemsize, src, dst, mesh, profile))


def reshard_bytes(shape, itemsize, src, dst, mesh, profile) -> float:
  """Total bytes sent per device by `reshard` (same arguments).

  Example:
    >>> m = mesh_spec({"model": 4}, "h100")
    >>> reshard_bytes((8,), 4, Layout(("model",)), Layout((None,)), m, "h100")
    24.0
  """
  steps = reshard(shape, itemsize, src, dst, mesh, profile)
  return math.fsum(c.bytes_sent_per_device for c in steps)


def _drop_trivial(layout: Layout, mesh: MeshSpec) -> Layout:
  # Size-1 axes move no data; dropping them keeps the search small and keeps
  # zero-byte collectives out of the answer.
  def keep(axes):
    return tuple(a for a in axes if mesh.size(a) > 1)
  return Layout(tuple(keep(d) for d in layout.dims), keep(layout.partial))


@functools.lru_cache(maxsize=1 << 16)
def _reshard(
    shape: tuple[int, ...],
    itemsize: int,
    src: Layout,
    dst: Layout,
    mesh: MeshSpec,
    profile: DeviceProfile,
) -> tuple[Collective, ...]:
  _check_layout(src, shape, mesh, "src layout")
  _check_layout(dst, shape, mesh, "dst layout")
  for axis in dst.partial:
    if axis not in src.partial:
      raise ValueError(
          f"dst layout is partial over mesh axis {axis!r} but src is not; a reshard cannot "
          f"create partial sums. Drop {axis!r} from dst.partial."
      )
  src, dst = _drop_trivial(src, mesh), _drop_trivial(dst, mesh)
  start = (src.dims, frozenset(src.partial))
  goal = (dst.dims, frozenset(dst.partial))
  if start == goal:
    return ()

  def local_bytes(dims) -> int:
    return itemsize * math.prod(-(-d // mesh.group_size(axes)) for d, axes in zip(shape, dims))

  # Dijkstra on (time, bytes, steps); the counter keeps heap order total and
  # deterministic.
  tie = itertools.count()
  best = {start: (0.0, 0.0, 0)}
  heap = [(0.0, 0.0, 0, next(tie), start, ())]
  while heap:
    t, b, k, _, state, path = heapq.heappop(heap)
    if state == goal:
      return path
    if best.get(state, (math.inf,)) < (t, b, k):
      continue
    for nxt, coll in _moves(state, goal, mesh, profile, local_bytes):
      key = (t + coll.time_s, b + coll.bytes_sent_per_device, k + (coll.kind != "slice"))
      if key < best.get(nxt, (math.inf,)):
        best[nxt] = key
        step = () if coll.kind == "slice" else (coll,)
        heapq.heappush(heap, (*key, next(tie), nxt, path + step))
  raise AssertionError(f"no reshard path from {src} to {dst}")  # unreachable


def _moves(state: _State, goal: _State, mesh: MeshSpec, profile: DeviceProfile, local_bytes):
  """Yields (next state, collective) for every step that makes progress.

  A dim whose axes are not a prefix of its target must shed its minor axes
  (all-gather, or all-to-all onto a dim that wants them next); a dim whose
  axes are a prefix may take the next target axis (slice if the axis is free,
  reduce-scatter if it is partial). Partial axes not kept may be all-reduced,
  several at once. Slices carry a zero-cost pseudo-collective.
  """
  dims, partial = state
  target, keep_partial = goal
  used = set(itertools.chain.from_iterable(dims))
  is_prefix = [t[: len(d)] == d for d, t in zip(dims, target)]
  size = local_bytes(dims)

  def with_dim(base, i, axes):
    return base[:i] + (axes,) + base[i + 1 :]

  for i, axes in enumerate(dims):
    if not is_prefix[i]:
      # Gather the minor-most axis. Gathering several at once costs the same
      # bytes with more α steps, so one at a time is never worse.
      new = with_dim(dims, i, axes[:-1])
      yield (new, partial), all_gather(local_bytes(new), axes[-1:], mesh, profile)
      for k in range(1, len(axes) + 1):
        moved = axes[-k:]
        for j, (other, want) in enumerate(zip(dims, target)):
          if j != i and is_prefix[j] and want[len(other) : len(other) + k] == moved:
            new = with_dim(with_dim(dims, i, axes[:-k]), j, other + moved)
            yield (new, partial), all_to_all(size, moved, mesh, profile)
    elif len(axes) < len(target[i]):
      axis = target[i][len(axes)]
      new = with_dim(dims, i, axes + (axis,))
      if axis not in used and axis not in partial:
        yield (new, partial), Collective("slice", (axis,), 0.0, 0.0)
      elif axis in partial:
        yield (new, partial - {axis}), reduce_scatter(size, (axis,), mesh, profile)
  reducible = sorted(partial - keep_partial, key=mesh.axis_names.index)
  for k in range(1, len(reducible) + 1):
    for group in itertools.combinations(reducible, k):
      yield (dims, partial - set(group)), all_reduce(size, group, mesh, profile)
