"""The copy of a program input a convolution reads, in the convolution's own layout.

Where the compiler lays a convolution's input out with its batch and feature dims in
the tiles (`DeviceProfile.copies_conv_inputs`: the TPU compiler's), a program input
stored otherwise (images, whose own layout puts a spatial dim in the lanes) is read
through a copy in that layout, as each device's shard is stored
(`cost.conv_copy_bytes` of the shard: a short batch pads to the tile whatever splits
it). With at least a tile's rows of images on a device the copy is held from the first
convolution reading it (the forward one) to the last (the kernel gradient's); with
fewer the compiler lowers the forward convolution otherwise and copies the images only
for the kernel gradient, just before it (the small ViT on v5p:2x2x1: 49 MiB at 4
images a device, 24.5 MiB at 2, live for the one convolution). `add_conv_input_copies`
adds both to `live.activations`' entries, each taking memory where its case holds.
"""

from __future__ import annotations

import functools

from tapas_jax import _jax_internals as jx
from tapas_jax import cost as costlib
from tapas_jax import rules as ruleslib
from tapas_jax.solver.live_program import Entries, LiveProgram, readers_through
from tapas_jax.solver.problem import Problem

__all__ = ["add_conv_input_copies"]


def add_conv_input_copies(entries: Entries, problem: Problem, prog: LiveProgram) -> None:
  """Adds each program input's copy in its convolutions' layout: held from the first
  convolution to the last where a device holds a tile's rows of images or more, made
  for the kernel gradient's convolution alone (a reader whose batch dim is the
  images' feature dim) where it holds fewer."""
  profile = problem.profile
  if not profile.copies_conv_inputs:
    return
  g = prog.graph
  for i in g.inputs:
    v = i.value
    readers = _conv_readers(prog, v)
    if not readers:
      continue
    shape, dtype = g.types[v].shape, g.types[v].dtype
    specs = [jx.conv_dims(prog.top[p].raw_params, len(shape)).lhs_spec for p in readers]
    batch, feature = specs[0][0], specs[0][1]
    narrow = (dtype == "float32" and profile.stores_dot_operands_in_bf16
              and all(ruleslib.default_precision_contraction(prog.top[p]) for p in readers))
    itemsize = 2 if narrow else g.types[v].itemsize
    if (costlib.conv_copy_bytes(shape, itemsize, batch, feature, profile) is None
        or (problem.cv(v), 0) not in problem.value_class):
      continue
    dims = tuple(problem.vclass(v, d) for d in range(len(shape)))
    copy = functools.partial(_copy_bytes, itemsize, batch, feature, profile)
    note = "copied into its convolutions' layout"
    entries.add(readers[0], readers[-1], 0.0, v, dims, padded=True, note=note,
                shard_bytes=functools.partial(copy, True))
    kernel_grads = [p for p, spec in zip(readers, specs) if spec[0] != batch]
    if kernel_grads:
      entries.add(kernel_grads[-1], kernel_grads[-1], 0.0, v, dims, padded=True,
                  note=note + " for its kernel's gradient",
                  shard_bytes=functools.partial(copy, False))


def _copy_bytes(itemsize, batch, feature, profile, held: bool, shard) -> float:
  """Bytes of the copy of one device's shard where its case holds (`held`: a tile's
  rows of images or more on the device), else 0."""
  if (shard[batch] >= profile.memory_tile[0]) != held:
    return 0.0
  return float(costlib.conv_copy_bytes(shard, itemsize, batch, feature, profile) or 0)


def _conv_readers(prog: LiveProgram, v: int) -> list[int]:
  """Positions of the live top-level convolutions reading v as their input, directly
  or through converts fused into them."""
  return sorted({prog.pos[op.index] for x, op in readers_through(
      prog.graph, prog.live, [v], skip=lambda c, x: c not in prog.pos or c in prog.update,
      through=lambda op: (op.primitive == "convert_element_type"
                          and op.outputs[0] in prog.fused))
      if op.primitive == "conv_general_dilated" and op.inputs[0] == x})
