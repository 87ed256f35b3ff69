"""Device profiles: the peak figures of each accelerator chip and its interconnect that
the cost model (`tapas_jax.cost`) prices a plan with, each with its source.

Plain Python (no JAX), as the cost model is. A profile's link kinds: "intra" (ICI,
NVLink: the fast fabric) and "inter" (DCN, InfiniBand: across hosts or slices).

Example:
  >>> from tapas_jax import profiles
  >>> profiles.get_profile("h100").hbm_bytes / 1e9
  80.0
  >>> profiles.profile_for_kind("TPU v5 lite")
  'tpu-v5e'
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["INTER", "INTRA", "LINKS", "PROFILES", "DeviceProfile", "check_link",
           "compiled_by_xla_cpu", "compute_time", "get_profile", "profile_for_kind",
           "profile_for_topology", "roofline_time"]

INTRA = "intra"
INTER = "inter"
LINKS = (INTRA, INTER)

_GB = 1e9
_GIB = 2**30


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
      and its reduce-scatter twin default to 30 MiB; the same on TPU, where libtpu's
      own thresholds are 120 MiB (`xla_jf_crs_combiner_threshold_in_bytes` in its
      dumped environment) but its reductions are not combined up to them: at 120 MiB
      the small zoo's memory reads 18 of 24 rows within 10% of the compiler, 20 at 30
      MiB; BENCHMARKS.md "A scanned stack's weights cast once"). XLA:CPU combines
      every gradient into one reduction at the end of the backward pass (measured on
      the zoo: its temporaries hold every gradient twice there), which is infinite
      here. Gradients wait for their combined reduction, so this sets how many are
      live at once.
    glue_gradients_last: whether the compiler makes a weight gradient that no layer
      holds (an lm_head's, a classifier head's: nothing orders it, `apply`'s fences order
      only the layers') after the backward of every layer below, just before the
      update, its operands held until then. The TPU compiler does (libtpu 0.0.42.1:
      the small LLaMA's lm_head gradient after every block's backward, the f32 logits
      held; a two-matmul toy at 256 to 4,096 tokens per device alike; not past a
      loop: a scanned LLaMA's before its scanned backward; BENCHMARKS.md "The glue's
      weight gradients made last").
    updates_when_ready: whether the compiler runs each parameter's update as soon as
      what it reads is ready (its gradient reduced; every gradient, under a global-norm
      clip), freeing the reduced gradient there, rather than where the program writes
      the update, after the whole backward pass. The TPU compiler does (libtpu
      0.0.50.1, the small T5 under FSDP: its layer gradients reduced at point 1357 of
      2212 and applied one by one by 2073, before the embedding's gradient is made;
      `solver/reductions.py`, BENCHMARKS.md "Each update as soon as its gradient is
      reduced").
    copies_donated_inputs: whether the compiler copies a donated input whole before
      its in-place update where a reader its next value does not depend on (the
      backward pass's `dy @ W.T`) is not ordered before the update (XLA:CPU's copy
      insertion, measured on the zoo). The TPU compiler orders those readers first
      instead (libtpu 0.0.42.1: the compiled train steps of the tiny GPT and the small
      ResNet under unsplit batches copy no kernel; the tiny GPT copies its embedding
      table alone).
    reductions_duplicate: whether a reduction's fusion recomputes a cheap operand
      that other ops also read (XLA's GPU and TPU fusions do). XLA:CPU's reduction
      fusions (YNNPACK) do not: the operand is written out, as a batch norm's
      centred activations are.
    dot_operand_fusion: whether the compiler reads elementwise chains inside a dot's
      own fusion (where that reads no more bytes), recomputes transcendental ops in
      each reader, makes a one-hot scatter-add a select, computes a dot read once
      by a sum inside the sum's fusion, its operands kept until then
      (`fusion.fused_values`), and a dot with the elementwise chain after it that
      converges on one value the next dots read (`fusion.dot_epilogues`).
      The TPU compiler does (libtpu 0.0.42.1, read off its HLO for LLaMA-3-8B: a
      norm's output and the logits' cotangent are never written; BENCHMARKS.md
      "Predicted vs TPU-compiled memory at real scale"; for the small ViT: the
      GELU's backward and its dot one fusion, "The GELU's backward in one fusion");
      XLA:CPU and the GPU profiles are modelled without it.
    all_gather_as_all_reduce_above: the largest replica group the compiler runs an
      all-gather over as one; over more devices it writes the shard into a zero-filled
      buffer of the gathered size (`dynamic-update-slice`) and all-reduces that: an
      all-reduce's ring, twice the bytes and steps. The TPU compiler does so over more
      than 32 chips (libtpu 0.0.42.1 and 0.0.50.1: a gather over 64 chips of v5p:4x4x4,
      v5e:8x8 or v6e:8x8 is an all-reduce, over 32 of v5p:4x4x2 or v5e:4x8 an
      all-gather, whatever the dim, dtype or loop; BENCHMARKS.md "How the TPU compiler
      lowers a gather"). Unbounded elsewhere.
    all_gather_as_all_reduce_up_to_bytes: of those gathers over more devices, the
      largest result (bytes per device) still run as an all-reduce; a bigger one is an
      all-gather. The TPU compiler on the chips of a 2-D torus (v5e, v6e) gathers more
      than 16 MiB with an all-gather, on a 3-D one (v4, v5p) with an all-reduce at any
      size (libtpu 0.0.42.1 and 0.0.50.1, a bf16 or f32 array gathered whole over 64,
      128 or 256 chips: all-reduce up to 16 MiB, all-gather from 17 MiB on v5e:8x8,
      v6e:8x8, v6e:8x16, v5e:16x16, v6e:16x16; all-reduce up to 112 MiB on v4:4x4x4,
      v5p:4x4x4, v5p:4x8x8, v5p:8x8x8; BENCHMARKS.md "Gathers over more than 32
      chips"). Unbounded elsewhere.
    reduce_scatter_as_all_reduce: whether the compiler leaves a partial sum read as
      1/n slices an all-reduce of the whole value and slices it, sending an
      all-reduce's bytes where a reduce-scatter sends half. The TPU compiler does (the
      same libtpu versions: no reduce-scatter formed, at any size or group, in HLO
      where XLA:GPU forms one). The memory model's `reduce_scatter` is a separate
      field; cost.py prices only the collective with this one.
    gathers_dot_operands_in_bf16: whether the compiler gathers an f32 value read only
      by dots and convolutions at DEFAULT precision in bf16 (through ops that only move
      its elements: a kernel reversed for the backward convolution): it runs such a
      contraction as one bf16 pass
      (`peak_flops_f32`) and converts the shard before the gather, half the bytes. The
      TPU compiler does (the same libtpu versions: FSDP's f32 kernels of the tiny zoo
      gathered as bf16, its f32 norm scales and embedding table as f32).
    stores_dot_operands_in_bf16: whether the compiler writes an f32 value read only by
      dots and convolutions at DEFAULT precision (directly or through values fused into
      them) in bf16, converted as it is made: the same single bf16 pass, half the bytes
      held. The TPU
      compiler does (libtpu 0.0.42.1: the tiny zoo's f32 queries, keys, values and MLP
      activations are bf16 buffers in its buffer assignment).
    reassociates_all_reduces: whether the compiler adds partial sums before reducing
      them, one all-reduce of the sum where each operand would have had its own (XLA's
      all-reduce reassociation). The TPU compiler does (the same libtpu versions:
      Megatron's backward sums the partial input gradients of q, k and v, of gate and
      up, and a tied embedding's two gradients, then reduces once); XLA:CPU does not.
    memory_tile: (rows, lanes) of the tiles the compiler stores arrays in, () for none
      (`cost.stored_bytes`). The TPU compiler's are (8, 128) for every dtype, short
      second-minor dims taking 1, 2 or 4 rows, and it lays each array out in the dim
      order that pads least (libtpu 0.0.42.1, `memory_analysis()` of arrays from f32[1,1]
      to f32[2,100,3], bf16 and int8 alike: f32[64,64] takes 32 KiB, f32[3,5] 2 KiB,
      f32[9,5] 4 KiB; BENCHMARKS.md "The TPU compiler's tiles").
    copies_conv_inputs: whether the compiler lays a convolution's input out with its
      batch and feature dims in the tiles (the one that pads less in the lanes, the
      other in the rows, spatial dims major) and, where a program input is stored
      otherwise (its own layout, the one that pads least, has a spatial dim in the
      lanes), reads it through such a copy, converted as it is made (bf16 at DEFAULT
      precision), held from the first convolution reading it to the last (the
      kernel gradient's): `cost.conv_copy_bytes`. The TPU compiler does (libtpu
      0.0.42.1, v5p:2x2x1; images f32[N,H,W,C] into one or two NHWC convolutions, SGD,
      weights donated: at N=8 and 32 per device and C=3, 8 or 64, 16x16 stride-16
      patches of 224x224 and 3x3 stride-1 convolutions of 32x32 and 56x56, the copy
      is there, `bf16[8,224,224,3]{0,3,2,1:T(4,128)(2,1)}` 49.0 MiB for 2.3 of data,
      C=8 N=32 `{0,3,2,1:T(8,128)}` 98 MiB, C=64 N=8 `{3,0,2,1}` 98 MiB; where the
      images' own layout has C or N in the lanes (C=128 or 256; N=128; C=64 at 32x32
      and 56x56) there is none; the small ResNet's 64x64 images at 8 per device: 4.0
      MiB). Below 8 images per device (2 to 7 measured) the compiler lowers the
      forward convolution otherwise, without the copy; the small ViT's kernel
      gradient still reads one, made just before it (libtpu 0.0.50.1: 49 MiB at 4
      images a device, 24.5 MiB at 2), so that entry is counted there alone. Both
      are the copy of each device's shard, padded as the compiler pads it
      (`Activations.shard_bytes`). BENCHMARKS.md "The convolution's own layout" and
      "The images' copy for the kernel gradient".
    buffer_granule_bytes: the size every buffer is rounded up to (TPU: 512 bytes, the
      smallest array it allocates, f32[1] or int8[2,3,5] alike).
    stacks_in_place: whether a loop body's slice that the loop stacks into a result
      goes into its stack as it is made (the dynamic-update-slice in place, an
      elementwise producer read by nothing else, such as a transposed weight gradient,
      computed in the write), rather than held to the iteration's end. The TPU compiler
      does (libtpu 0.0.50.1, the small ViT under `nn.scan`: its backward loop holds no
      gradient slice past the write; BENCHMARKS.md "A scanned stack's loop writes its
      gradients into their stacks"); XLA:CPU is modelled without it (a scanned tiny
      LLaMA at 2 layers would be 0.86 of XLA:CPU's figure with it).
    casts_loop_stacks: whether a stacked program input whose slice a loop's body only
      converts to a narrower float (a scanned layer stack's f32 weights cast to bf16
      for its dots) is converted whole once, before the first loop reading it, and
      that copy read by every loop after it, held until the last. The TPU compiler
      does (libtpu 0.0.50.1, LLaMA-3-70B under `nn.scan` on v5p:4x8x8: `bf16[80,...]`
      converts of the weights' stored shards, 6.1 GiB a device, live from before the
      forward loop to the end of the backward one; BENCHMARKS.md "A scanned stack's
      weights cast once"); XLA:CPU is modelled without it.

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
  copies_donated_inputs: bool = True
  glue_gradients_last: bool = False
  updates_when_ready: bool = False
  combine_threshold_bytes: float = 30 * 2**20
  dot_operand_fusion: bool = False
  all_gather_as_all_reduce_above: float = math.inf
  all_gather_as_all_reduce_up_to_bytes: float = math.inf
  reduce_scatter_as_all_reduce: bool = False
  gathers_dot_operands_in_bf16: bool = False
  stores_dot_operands_in_bf16: bool = False
  reassociates_all_reduces: bool = False
  memory_tile: tuple[int, int] = ()
  buffer_granule_bytes: int = 1
  copies_conv_inputs: bool = False
  stacks_in_place: bool = False
  casts_loop_stacks: bool = False

  def bandwidth(self, link: str) -> float:
    """Unidirectional bytes/s per chip on an "intra" or "inter" link."""
    return self.intra_bandwidth if check_link(link) == INTRA else self.inter_bandwidth

  def latency(self, link: str) -> float:
    """α in seconds per ring step on an "intra" or "inter" link."""
    return self.intra_latency_s if check_link(link) == INTRA else self.inter_latency_s


# How the TPU compiler lowers collectives (the fields' doc): one compiler, every generation.
_TPU_COLLECTIVES = dict(all_gather_as_all_reduce_above=32, reduce_scatter_as_all_reduce=True,
                        gathers_dot_operands_in_bf16=True, reassociates_all_reduces=True)
# The chips of a 2-D torus (v5e, v6e) gather big arrays over many chips with an all-gather
# (the field's doc).
_TPU_2D_GATHERS = dict(all_gather_as_all_reduce_up_to_bytes=16 * 2**20)
# How the TPU compiler stores arrays (the fields' doc): the same on every generation.
_TPU_STORAGE = dict(memory_tile=(8, 128), buffer_granule_bytes=512,
                    stores_dot_operands_in_bf16=True, copies_donated_inputs=False,
                    copies_conv_inputs=True, stacks_in_place=True, casts_loop_stacks=True)
# How the TPU compiler orders the backward (the field's doc): the same on every generation.
_TPU_SCHEDULE = dict(glue_gradients_last=True, updates_when_ready=True)

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
        **_TPU_COLLECTIVES,
        **_TPU_STORAGE,
        **_TPU_SCHEDULE,
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
        **_TPU_COLLECTIVES,
        **_TPU_2D_GATHERS,
        **_TPU_STORAGE,
        **_TPU_SCHEDULE,
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
        **_TPU_COLLECTIVES,
        **_TPU_STORAGE,
        **_TPU_SCHEDULE,
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
        **_TPU_COLLECTIVES,
        **_TPU_2D_GATHERS,
        **_TPU_STORAGE,
        **_TPU_SCHEDULE,
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


# The DeviceProfile fields that describe its compiler (memory layout, how collectives are
# lowered), not the chip.
_COMPILER_LAYOUT = ("reduce_scatter", "canonical_convolutions", "reductions_duplicate",
                    "copies_donated_inputs", "glue_gradients_last", "updates_when_ready",
                    "combine_threshold_bytes", "dot_operand_fusion",
                    "all_gather_as_all_reduce_above", "all_gather_as_all_reduce_up_to_bytes",
                    "reduce_scatter_as_all_reduce",
                    "gathers_dot_operands_in_bf16", "reassociates_all_reduces",
                    "memory_tile", "buffer_granule_bytes", "stores_dot_operands_in_bf16",
                    "copies_conv_inputs", "stacks_in_place", "casts_loop_stacks")


def compiled_by_xla_cpu(profile: str | DeviceProfile) -> DeviceProfile:
  """A profile's figures with XLA:CPU's memory layout and collectives: to compare a plan's
  predictions with what a CPU mesh standing in for that device compiles it to.

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


def check_link(link: str) -> str:
  """`link` if it is a link kind ("intra" or "inter"); else a ValueError."""
  if link not in LINKS:
    raise ValueError(f"Unknown link kind {link!r}; use 'intra' or 'inter'.")
  return link
