"""What XLA actually runs: the collectives and memory of a compiled program.

A plan is only as good as the partitioned program the compiler makes of it, so plans
are judged on the compiled HLO, with the same ring accounting as `cost.py`: bytes sent
per device are 2(n-1)/n * S for an all-reduce, (n-1)/n * S for all-gather (S the
gathered result), reduce-scatter (S the
operand, n times its result) and all-to-all, and S for a
collective-permute, with n the replica group size. Async pairs (`all-gather-start` /
`-done`, `all-reduce-start`, `collective-permute-start`, as TPU and GPU HLO have them)
count once, at their `-start`, with the bytes of the `-done`'s result (a `-start`'s
tuple type lists the operand too). Collectives inside fusions and async computations
count once each where they stand; inside a loop's body (a scanned layer stack, a
chunked attention's `lax.map`) they count once per iteration, by the trip count the
compiler annotates (`known_trip_count`) or, in TPU HLO, which has no annotation, the
loop condition's `i < N` (a loop with neither counts once), since the cost model
prices a loop body times its trip count too.

An all-reduce whose every reader keeps only a 1/n slice of it (a `dynamic-slice`, on
its own or inside a fusion) is counted as the reduce-scatter it stands for: XLA's GPU
and TPU pipelines rewrite that pattern into one (`ReduceScatterCreator`); XLA:CPU has
no such pass and sends twice the bytes. The bytes so counted are also reported under
`SLICED` (part of "reduce-scatter", not added to "total" again). XLA:CPU itself sends
"total" + `SLICED` (an all-reduce sends twice a reduce-scatter's bytes), which is what
`reduce_scatter_creator=False` counts.

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
from typing import Any, Iterable

from tapas_jax import _jax_internals as jx

__all__ = ["Compiled", "SLICED", "collective_bytes", "collectives_by_op", "measure"]

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
             "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
             "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# `%name = <result type> <kind>[-start](<operands>), ... replica_groups=...`
_LINE = re.compile(r"=\s*(?P<result>\(.*?\)|\S+)\s+(?P<kind>" + "|".join(_KINDS)
                   + r")(?P<start>-start)?\((?P<operands>.*?)\)(?P<attrs>.*)$")
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
  # Shardy's form: replica_groups=mesh['a'=2,'b'=4] {'b'} -> the listed axes' sizes,
  # maybe with the devices' order between: mesh[...], device_ids=([2,4]T(1,0)) {'a'}.
  mesh = re.search(r"replica_groups=mesh\[(.*?)\][^{]*\{(.*?)\}", attrs)
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


SLICED = "reduce-scatter (all-reduce + slice)"


def collective_bytes(hlo_text: str, num_devices: int = 8,
                     reduce_scatter_creator: bool = True) -> dict[str, float]:
  """Bytes sent per device by each kind of collective in partitioned HLO text.

  Args:
    hlo_text: `compiled.as_text()`.
    num_devices: devices in the program (for collectives over all of them).
    reduce_scatter_creator: count an all-reduce read only as 1/n slices as the
      reduce-scatter XLA's GPU and TPU pipelines make of it (module docstring).

  Returns:
    kind -> bytes per device per execution of the program (a loop body's times its
    trip count), plus "total" and `SLICED` (the part of "reduce-scatter" that XLA:CPU
    runs as all-reduce + slice).
  """
  return _by_kind(_collectives(hlo_text, num_devices, reduce_scatter_creator))


def _by_kind(collectives: Iterable[_Collective]) -> dict[str, float]:
  out = {k: 0.0 for k in _KINDS}
  out[SLICED] = 0.0
  for c in collectives:
    out[c.kind] += c.sent
    if c.sliced:
      out[SLICED] += c.sent
  out["total"] = sum(out[k] for k in _KINDS)
  return out


def collectives_by_op(hlo_text: str, num_devices: int = 8, top: int = 10,
                      reduce_scatter_creator: bool = True) -> tuple[tuple[str, str, float], ...]:
  """The `top` (op name, kind, bytes sent per device per step) of partitioned HLO text,
  most bytes first: the collectives grouped by the JAX op they were made for (their
  `op_name` metadata, the step's `jit(...)/` prefix dropped; "?" where the compiler
  left none), so that a profile of a planned step says which layer sends what.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from tapas_jax import make_mesh
    >>> split = NamedSharding(make_mesh({"data": 8}), P("data"))
    >>> text = jax.jit(lambda x: jnp.max(x, axis=0), in_shardings=split).lower(
    ...     jax.ShapeDtypeStruct((64, 1024), jnp.float32)).compile().as_text()
    >>> collectives_by_op(text)
    (('reduce_max', 'all-reduce', 7168.0),)
  """
  return _by_op(_collectives(hlo_text, num_devices, reduce_scatter_creator), top)


def _by_op(collectives: Iterable[_Collective], top: int) -> tuple[tuple[str, str, float], ...]:
  out: dict[tuple[str, str], float] = {}
  for c in collectives:
    out[(c.op_name, c.kind)] = out.get((c.op_name, c.kind), 0.0) + c.sent
  ranked = sorted(out.items(), key=lambda kv: -kv[1])[:top]
  return tuple((name, kind, sent) for (name, kind), sent in ranked)


@dataclasses.dataclass(frozen=True)
class _Collective:
  kind: str
  sent: float  # bytes per device per execution of the program
  op_name: str
  sliced: bool = False  # an all-reduce read as slices, counted as a reduce-scatter


_OP_NAME = re.compile(r'op_name="(?P<name>[^"]*)"')


def _op_name(line: str) -> str:
  """The op a collective was made for, as a profile names it. One the compiler's
  combiner made of several is named by the first and how many ("(a:b:c)" in HLO)."""
  m = _OP_NAME.search(line)
  if m is None:
    return "?"
  # "jit(step)/(a:b:c)": the names of the ops the combiner merged, under the step's.
  name = re.sub(r"^jit\([^)]*\)/", "", m.group("name"))
  parts = [re.sub(r"^jit\([^)]*\)/", "", p.strip("()")).replace("\\'", "'")
           for p in name.split(":")]
  return parts[0] if len(parts) == 1 else f"{parts[0]} and {len(parts) - 1} more, combined"


def _collectives(hlo_text: str, num_devices: int, reduce_scatter_creator: bool):
  """Each collective of the text, with the bytes it sends per device per step."""
  hlo = _Hlo.parse(hlo_text)
  runs = hlo.executions()
  for line in hlo_text.splitlines():
    m = _LINE.search(line)
    if m is None:
      continue
    kind, n = m.group("kind"), _group_size(m.group("attrs"), num_devices)
    if n <= 1:
      continue
    name = _INSTR.match(line)
    times = runs.get(hlo.where.get(name.group("name"), ""), 1) if name else 1
    op_name = _op_name(line)
    if m.group("start"):
      result = _async_result(hlo, line, kind, m.group("result"))
    elif kind == "all-reduce" and reduce_scatter_creator:
      for nbytes, sliced in hlo.all_reduce_parts(line, m.group("result"), n):
        if sliced:
          yield _Collective("reduce-scatter", times * (n - 1) / n * nbytes, op_name, True)
        else:
          yield _Collective("all-reduce", times * 2 * (n - 1) / n * nbytes, op_name)
      continue
    else:
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
    yield _Collective(kind, times * sent, op_name)


def _async_result(hlo: "_Hlo", line: str, kind: str, start_type: str) -> int:
  """Bytes an async collective makes: its `-done`'s type. A `-start`'s own type also
  holds the operands (all-gather: (operand, result); collective-permute: (operand,
  result, contexts)), so it is read only where no `-done` reads it."""
  m = _INSTR.match(line)
  name = m.group("name") if m else ""
  for reader, _ in hlo.readers.get(name, []):
    if reader.op == f"{kind}-done":
      return _bytes(reader.type)
  arrays = [f"{t}[{d}]" for t, d in _ARRAY.findall(start_type) if t in _ITEMSIZE]
  if kind == "all-gather" and len(arrays) >= 2:
    return sum(_bytes(a) for a in arrays[len(arrays) // 2:])
  if kind == "collective-permute" and len(arrays) >= 2:
    return _bytes(arrays[1])
  return _bytes(start_type)


# `[ROOT ]%name = <type> <opcode>(<operands>)<attributes>`
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>\(.*?\)|\S+)\s+"
                    r"(?P<op>[\w\-]+)\(")
# `[ENTRY ]%name (<parameters>) -> <type> {`
_HEADER = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
# `body=%b`, `calls=%f`, `to_apply=%r`, ...: the computations an instruction runs.
_CALLS = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)"
                    r"=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# Readers that pass a value on whole: a slice of what they make is a slice of it.
_WHOLE = ("bitcast", "copy", "reshape")


@dataclasses.dataclass(frozen=True)
class _Instr:
  name: str
  type: str
  op: str
  args: str  # the text between the opcode's parentheses
  attrs: str
  operands: tuple[str, ...]


def _elements(array_type: str) -> int:
  n = 1
  for d in filter(None, _ARRAY.findall(array_type)[0][1].split(",")):
    n *= int(d)
  return n


def _close(rest: str) -> int:
  """The index of the parenthesis closing an opened one in `rest`."""
  depth = 1
  for i, ch in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return i
  return len(rest)


@dataclasses.dataclass(frozen=True)
class _Hlo:
  """Just enough of an HLO module to follow an all-reduce's result to its readers."""

  computations: dict[str, list[_Instr]]
  where: dict[str, str]  # instruction name -> the computation holding it
  readers: dict[str, list[tuple[_Instr, int]]]  # name -> (reader, operand slot)
  entry: str = ""  # the ENTRY computation's name

  @classmethod
  def parse(cls, text: str) -> "_Hlo":
    computations: dict[str, list[_Instr]] = {}
    where: dict[str, str] = {}
    readers: dict[str, list[tuple[_Instr, int]]] = {}
    current = entry = ""
    for line in text.splitlines():
      head = _HEADER.match(line)
      if head and " = " not in line.split("(", 1)[0]:
        current = head.group("name")
        entry = current if line.startswith("ENTRY") else entry
        continue
      m = _INSTR.match(line)
      if m is None:
        continue
      rest = line[m.end():]
      end = _close(rest)
      instr = _Instr(m.group("name"), m.group("type"), m.group("op"), rest[:end],
                     rest[end + 1:], tuple(re.findall(r"%([\w.\-]+)", rest[:end])))
      computations.setdefault(current, []).append(instr)
      where[instr.name] = current
      for slot, operand in enumerate(instr.operands):
        readers.setdefault(operand, []).append((instr, slot))
    return cls(computations, where, readers, entry)

  def executions(self) -> dict[str, int]:
    """Computation name -> how many times one run of the program runs it: a loop's
    body (and condition) its trip count times per run of the loop, anything else
    called once per call. Computations not reached from ENTRY are absent."""
    runs: dict[str, int] = {}

    def visit(name: str, times: int, depth: int) -> None:
      runs[name] = runs.get(name, 0) + times
      if depth > 64:  # HLO's call graph is acyclic; this only guards bad text
        return
      for instr in self.computations.get(name, []):
        if instr.op.endswith(("-done", "-update")):  # names its -start's computation
          continue
        loop = self.trip_count(instr) if instr.op == "while" else 1
        called = [(c, loop if role in ("body", "condition") else 1)
                  for role, c in _CALLS.findall(instr.attrs)]
        for branches in _BRANCHES.findall(instr.attrs):
          called += [(c, 1) for c in re.findall(r"%([\w.\-]+)", branches)]
        for callee, factor in called:
          visit(callee, times * factor, depth + 1)

    if self.entry:
      visit(self.entry, 1, 0)
    return runs

  def trip_count(self, loop: _Instr) -> int:
    """Iterations of a while loop: the compiler's `known_trip_count` (XLA:CPU, GPU), else
    its condition's `i < N` against the induction variable's initial constant (TPU HLO
    carries no annotation); 1 where neither is readable."""
    known = _TRIP.search(loop.attrs)
    if known:
      return int(known.group(1))
    cond = re.search(r"condition=%([\w.\-]+)", loop.attrs)
    body = {i.name: i for i in self.computations.get(cond.group(1) if cond else "", [])}

    def constant(name: str, where: dict[str, _Instr]) -> int | None:
      i = where.get(name)
      return int(i.args) if i and i.op == "constant" and i.args.lstrip("-").isdigit() else None

    for i in body.values():
      direction = re.search(r"direction=(LT|LE)", i.attrs)
      if i.op != "compare" or not direction or len(i.operands) != 2:
        continue
      limit = constant(i.operands[1], body)
      if limit is None:
        continue
      start = 0
      outer = {j.name: j for j in self.computations.get(self.where.get(loop.name, ""), [])}
      init = outer.get(loop.operands[0]) if loop.operands else None
      if init is not None and init.op == "tuple" and init.operands:
        start = constant(init.operands[0], outer) or 0
      return max(limit - start + (direction.group(1) == "LE"), 1)
    return 1

  def _sliced(self, name: str, elements: int, n: int) -> bool:
    """Whether `name` is read, and every reader keeps just 1/n of its elements."""
    readers = self.readers.get(name, [])
    for instr, slot in readers:
      if instr.op == "dynamic-slice" and slot == 0:
        ok = _elements(instr.type) * n == elements
      elif instr.op in _WHOLE:
        ok = self._sliced(instr.name, elements, n)
      elif instr.op == "fusion" and instr.operands.count(name) == 1:
        called = re.search(r"calls=%([\w.\-]+)", instr.attrs)
        body = called.group(1) if called else ""
        params = [i.name for i in self.computations.get(body, [])
                  if i.op == "parameter" and i.args.strip() == str(slot)]
        ok = len(params) == 1 and self._sliced(params[0], elements, n)
      else:
        ok = False
      if not ok:
        return False
    return bool(readers)

  def all_reduce_parts(self, line: str, result: str, n: int) -> list[tuple[int, bool]]:
    """(bytes, whether read only as 1/n slices) per array an all-reduce makes."""
    m = _INSTR.match(line)
    arrays = [f"{t}[{d}]" for t, d in _ARRAY.findall(result) if t in _ITEMSIZE]
    if m is None or m.group("name") not in self.where:
      return [(_bytes(a), False) for a in arrays]
    name = m.group("name")
    if not result.startswith("("):
      return [(_bytes(arrays[0]), self._sliced(name, _elements(arrays[0]), n))]
    elements: dict[int, list[str]] = {}  # tuple index -> its get-tuple-elements
    for instr, _ in self.readers.get(name, []):
      index = re.search(r"index=(\d+)", instr.attrs)
      if instr.op == "get-tuple-element" and index:
        elements.setdefault(int(index.group(1)), []).append(instr.name)
    return [(_bytes(a), bool(elements.get(k)) and all(
        self._sliced(g, _elements(a), n) for g in elements[k]))
            for k, a in enumerate(arrays)]


@dataclasses.dataclass(frozen=True)
class Compiled:
  """Figures of one compiled program, per device.

  Attributes:
    comm_bytes: kind -> bytes sent per step (see `collective_bytes`), with "total".
    argument_bytes, output_bytes, alias_bytes, temp_bytes: from `memory_analysis()`.
    flops: from `cost_analysis()` (a loop body counts once).
    live_peak_bytes: the compiler's own peak of live buffers (`memory_analysis()`'s
      `peak_memory_in_bytes`; 0 where it gives none). On the TPU compiler it can be far
      below `memory_bytes` for a loop nested in a scanned stack (BENCHMARKS.md, "What
      memory_analysis counts").
    comm_by_op: the ten largest (op name, kind, bytes) (`collectives_by_op`).
  """

  comm_bytes: dict[str, float]
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  flops: float
  live_peak_bytes: int = 0
  comm_by_op: tuple[tuple[str, str, float], ...] = ()

  @property
  def memory_bytes(self) -> int:
    """Peak-ish per-device footprint: arguments, temporaries and unaliased outputs."""
    return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes


def measure(compiled: Any, num_devices: int, reduce_scatter_creator: bool = True) -> Compiled:
  """Reads collectives, memory and FLOPs off a `jax.stages.Compiled`.

  Args:
    compiled: the compiled program.
    num_devices: devices in it.
    reduce_scatter_creator: as for `collective_bytes`; False counts the program as
      compiled (for a TPU or GPU program, whose pipeline has had its chance to form
      reduce-scatters).
  """
  mem = compiled.memory_analysis()
  found = list(_collectives(compiled.as_text(), num_devices, reduce_scatter_creator))
  return Compiled(comm_bytes=_by_kind(found), comm_by_op=_by_op(found, 10),
                  argument_bytes=int(mem.argument_size_in_bytes),
                  output_bytes=int(mem.output_size_in_bytes),
                  alias_bytes=int(mem.alias_size_in_bytes),
                  temp_bytes=int(mem.temp_size_in_bytes),
                  flops=jx.cost_flops(compiled.cost_analysis()),
                  live_peak_bytes=jx.memory_peak(mem))
