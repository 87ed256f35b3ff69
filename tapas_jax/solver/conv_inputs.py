"""The copy of a program input a convolution reads, in the convolution's own layout.

Where the compiler lays a convolution's input out with its batch and feature dims in
the tiles (`DeviceProfile.copies_conv_inputs`: the TPU compiler's), a program input
stored otherwise (images, whose own layout puts a spatial dim in the lanes) is read
through a copy in that layout, held from the first convolution reading it (the
forward one) to the last (the kernel gradient's): `add_conv_input_copies` adds it to
`live.activations`' entries, its bytes as the compiler stores it
(`cost.conv_copy_bytes`).
"""

from __future__ import annotations

from tapas_jax import _jax_internals as jx
from tapas_jax import cost as costlib
from tapas_jax import rules as ruleslib
from tapas_jax.solver.live_program import Entries, LiveProgram, readers_through
from tapas_jax.solver.problem import Problem

__all__ = ["add_conv_input_copies"]


def add_conv_input_copies(entries: Entries, problem: Problem, prog: LiveProgram) -> None:
  """Adds each program input's copy in its convolutions' layout, as stored. Below the
  tile's rows of images per device the compiler lowers the convolution otherwise and
  makes none: for a batch under twice the rows the entry vanishes where the batch dim
  is split (`unless`); the padding is the unsplit value's, as for every activation
  (`live._as_stored`)."""
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
    first = prog.top[readers[0]]
    spec = jx.conv_dims(first.raw_params, len(shape)).lhs_spec
    batch, feature = spec[0], spec[1]
    narrow = (dtype == "float32" and profile.stores_dot_operands_in_bf16
              and all(ruleslib.default_precision_contraction(prog.top[p]) for p in readers))
    nbytes = costlib.conv_copy_bytes(shape, 2 if narrow else g.types[v].itemsize,
                                     batch, feature, profile)
    if nbytes is None or (problem.cv(v), 0) not in problem.value_class:
      continue
    dims = tuple(problem.vclass(v, d) for d in range(len(shape)))
    unless = (dims[batch],) if shape[batch] < 2 * profile.memory_tile[0] else ()
    entries.add(readers[0], readers[-1], nbytes, v, dims, unless=unless, padded=True,
                note="copied into its convolutions' layout")


def _conv_readers(prog: LiveProgram, v: int) -> list[int]:
  """Positions of the live top-level convolutions reading v as their input, directly
  or through converts fused into them."""
  return sorted({prog.pos[op.index] for x, op in readers_through(
      prog.graph, prog.live, [v], skip=lambda c, x: c not in prog.pos or c in prog.update,
      through=lambda op: (op.primitive == "convert_element_type"
                          and op.outputs[0] in prog.fused))
      if op.primitive == "conv_general_dilated" and op.inputs[0] == x})
