"""What XLA actually runs: the collectives and memory of a compiled program.

A plan is only as good as the partitioned program the compiler makes of it, so plans
are judged on the compiled HLO, with the same ring accounting as `cost.py`: bytes sent
per device are 2(n-1)/n * S for an all-reduce, (n-1)/n * S for all-gather (S the
gathered result), reduce-scatter (S the
operand, n times its result) and all-to-all, and S for a
collective-permute, with n the replica group size. Async pairs count at their
`-start` (on GPU an all-gather-start's result also lists its operand: 1/n too much).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> from tapas_jax import make_mesh
  >>> mesh = make_mesh({"data": 8})
  >>> f = jax.jit(lambda x: x.sum(axis=0), in_shardings=NamedSharding(mesh, P("data")),
  ...             out_shardings=NamedSharding(mesh, P()))
  >>> compiled = f.lower(jax.ShapeDtypeStruct((64, 1024), jnp.float32)).compile()
  >>> collective_bytes(compiled.as_text())["all-reduce"]  # 2 * 7/8 * 4 KiB
  7168.0
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

__all__ = ["Compiled", "collective_bytes", "measure"]

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
             "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
             "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# `%name = <result type> <kind>[-start](<operands>), ... replica_groups=...`
_LINE = re.compile(r"=\s*(?P<result>\(.*?\)|\S+)\s+(?P<kind>" + "|".join(_KINDS)
                   + r")(?:-start)?\((?P<operands>.*?)\)(?P<attrs>.*)$")
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


def _bytes(types: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(types):
    if dtype not in _ITEMSIZE:
      continue
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _ITEMSIZE[dtype]
  return total


def _group_size(attrs: str, num_devices: int) -> int:
  # Shardy's form: replica_groups=mesh['a'=2,'b'=4] {'b'} -> the listed axes' sizes.
  mesh = re.search(r"replica_groups=mesh\[(.*?)\]\s*\{(.*?)\}", attrs)
  if mesh:
    sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
    n = 1
    for axis in re.findall(r"'([^']+)'", mesh.group(2)):
      n *= sizes.get(axis, 1)
    return n
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
  if iota:
    return int(iota.group(2))
  explicit = re.search(r"replica_groups=\{\{([0-9,]*)\}", attrs)
  if explicit:
    return len(explicit.group(1).split(","))
  pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
  if pairs:
    return 2
  return num_devices  # empty replica_groups: every device


def collective_bytes(hlo_text: str, num_devices: int = 8) -> dict[str, float]:
  """Bytes sent per device by each kind of collective in partitioned HLO text.

  Args:
    hlo_text: `compiled.as_text()`.
    num_devices: devices in the program (for collectives over all of them).

  Returns:
    kind -> bytes per device per execution (a loop body counts once), plus "total".
  """
  out = {k: 0.0 for k in _KINDS}
  for line in hlo_text.splitlines():
    m = _LINE.search(line)
    if m is None:
      continue
    kind, n = m.group("kind"), _group_size(m.group("attrs"), num_devices)
    if n <= 1:
      continue
    result = _bytes(m.group("result"))
    if kind == "all-reduce":
      sent = 2 * (n - 1) / n * result
    elif kind == "all-gather":
      sent = (n - 1) / n * result
    elif kind == "reduce-scatter":  # the operand is n results (operands carry no type)
      sent = (n - 1) * result
    elif kind == "all-to-all":
      sent = (n - 1) / n * result
    else:
      sent = float(result)
    out[kind] += sent
  out["total"] = sum(out[k] for k in _KINDS)
  return out


@dataclasses.dataclass(frozen=True)
class Compiled:
  """Figures of one compiled program, per device.

  Attributes:
    comm_bytes: kind -> bytes sent per step (see `collective_bytes`), with "total".
    argument_bytes, output_bytes, alias_bytes, temp_bytes: from `memory_analysis()`.
    flops: from `cost_analysis()` (a loop body counts once).
  """

  comm_bytes: dict[str, float]
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  flops: float

  @property
  def memory_bytes(self) -> int:
    """Peak-ish per-device footprint: arguments, temporaries and unaliased outputs."""
    return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes


def measure(compiled: Any, num_devices: int) -> Compiled:
  """Reads collectives, memory and FLOPs off a `jax.stages.Compiled`."""
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
    cost = cost[0] if cost else {}
  return Compiled(comm_bytes=collective_bytes(compiled.as_text(), num_devices),
                  argument_bytes=int(mem.argument_size_in_bytes),
                  output_bytes=int(mem.output_size_in_bytes),
                  alias_bytes=int(mem.alias_size_in_bytes),
                  temp_bytes=int(mem.temp_size_in_bytes),
                  flops=float((cost or {}).get("flops", 0.0)))
