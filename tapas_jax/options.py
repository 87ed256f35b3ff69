"""The options of `search`, `apply`, `place`, `make_mesh` and the baselines, checked
before anything is traced, each with a message that names the fix.

One parser per option, shared by every entry point, so a mesh or a budget means the
same thing everywhere and a typo fails in a second rather than deep inside a search.

Memory sizes: a number of bytes, or a string with a unit. Decimal units count in
powers of 1000 (kB/KB, MB, GB, TB, PB), binary ones in powers of 1024 (KiB, MiB,
GiB, TiB, PiB): "16GB" is 16e9 bytes, "16GiB" is 16 * 2**30 (device specs usually
quote HBM in GiB: an H100 has 80 GiB).

Example:
  >>> from tapas_jax import options
  >>> options.memory_bytes("16GiB"), options.memory_bytes("1.5 TB")
  (17179869184.0, 1500000000000.0)
  >>> options.batch_axes("data", {"data": 2, "model": 4})
  ('data',)
  >>> options.SearchConfig(fold=False, memory_budget="1GiB").memory_budget
  1073741824.0
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
import re
from typing import Any, Mapping, Sequence

import numpy as np
from jax.sharding import AxisType

from tapas_jax.errors import TapasError
from tapas_jax.profiles import PROFILES

__all__ = ["LAYOUTS", "SEARCH_OPTIONS", "SOLVERS", "MeshError", "OptionError", "SearchConfig",
           "Solver", "batch_axes", "check_auto", "device", "donate_argnums", "flag",
           "format_bytes", "kwargs", "layouts", "links", "memory_bytes", "mesh_axes",
           "search_config", "solver", "time_limit", "topology"]


class Solver(enum.StrEnum):
  """The solvers `tapas_jax.solver.solve` runs: variable elimination over the folded
  view's layers, or the integer program over every op. Each equals its name as a
  string (`Solver.ILP == "ilp"`)."""

  ELIMINATION = "elimination"
  ILP = "ilp"


SOLVERS = tuple(s.value for s in Solver)

# What `batch_axes="default"` meant before None did (every axis): still read, as None.
_OLD_DEFAULT = "default"

_UNITS = {"": 1, "b": 1,
          "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "p": 1e15, "pb": 1e15,
          "kib": 2.0**10, "mib": 2.0**20, "gib": 2.0**30, "tib": 2.0**40, "pib": 2.0**50}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


class OptionError(TapasError, ValueError):
  """An option of a tapas_jax entry point has a value it cannot use."""


class MeshError(OptionError):
  """A mesh the planner cannot use."""


def _is_int(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def mesh_axes(mesh: Any, where: str = "search") -> dict[str, int]:
  """Axis name -> size of a dict, a `jax.sharding.Mesh` or an `AbstractMesh`.

  Dicts must map non-empty strings to positive ints (not bools, not floats: 2.5 or
  True would plan for another mesh than meant); meshes must have Auto axes.

  Raises:
    MeshError: what is wrong, naming the axis; or the mesh has Explicit axes.

  Example:
    >>> mesh_axes({"data": 2, "model": 4})
    {'data': 2, 'model': 4}
  """
  if isinstance(mesh, Mapping):
    items = list(mesh.items())
  elif hasattr(mesh, "shape") and hasattr(mesh, "axis_names"):
    if hasattr(mesh, "axis_types"):
      check_auto(mesh)
    items = list(dict(mesh.shape).items())
  else:
    raise MeshError(
        f"{where}: mesh={mesh!r:.80} is a {type(mesh).__name__}; pass a dict of axis "
        "sizes like {'data': 2, 'model': 4}, or a mesh from tapas.make_mesh(...).")
  if not items:
    raise MeshError(f"{where}: mesh has no axes; give at least one, e.g. {{'data': 8}}")
  out: dict[str, int] = {}
  for name, size in items:
    if not isinstance(name, str) or not name:
      raise MeshError(f"{where}: mesh axis name {name!r} is a {type(name).__name__}; "
                        "axis names are non-empty strings, e.g. {'data': 8}.")
    if not _is_int(size) or size < 1:
      hint = f" (did you mean {int(size)}?)" if _is_number(size) and size >= 1 else ""
      raise MeshError(f"{where}: mesh axis {name!r} has size {size!r} "
                        f"({type(size).__name__}); sizes are positive ints{hint}.")
    out[name] = int(size)
  return out


def check_auto(mesh: Any) -> Any:
  """Returns `mesh` if every axis is Auto; else a `MeshError` that says how to fix it.

  Example:
    >>> import jax
    >>> from jax.sharding import AxisType
    >>> check_auto(jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))).axis_names
    ('data',)
  """
  types = getattr(mesh, "axis_types", None) or ()
  explicit = [n for n, t in zip(mesh.axis_names, types) if t != AxisType.Auto]
  if explicit:
    raise MeshError(
        f"mesh axes {explicit} are not AxisType.Auto ({[str(t) for t in types]}); sharding "
        "constraints on Explicit axes are only checks and cannot steer the compiler. "
        "Build the mesh with tapas_jax.make_mesh(...) or pass "
        "axis_types=(jax.sharding.AxisType.Auto,) * n to jax.make_mesh.")
  return mesh


def device(name: Any, where: str = "search") -> str | None:
  """A known device profile name, or None for the local platform's.

  Example:
    >>> device("h100")
    'h100'
  """
  if name is None or (isinstance(name, str) and name in PROFILES):
    return name
  if hasattr(name, "peak_flops") and hasattr(name, "name"):
    return name  # a DeviceProfile object: passes through
  raise OptionError(f"{where}: device={name!r} is not a known device profile; use one "
                    f"of: {', '.join(sorted(PROFILES))} (or None for the local platform).")


def memory_bytes(value: Any, where: str = "search", name: str = "memory_budget"
                 ) -> float | None:
  """Bytes from a number or a string like "16GiB", "16GB", "1.5 TiB", "512MiB".

  GB, MB, ... count in powers of 1000; GiB, MiB, ... in powers of 1024. None (the
  device's memory) stays None; `float("inf")` (no limit) stays inf.

  Example:
    >>> memory_bytes("512MiB"), memory_bytes(1e9), memory_bytes(None)
    (536870912.0, 1000000000.0, None)
  """
  if value is None:
    return None
  if isinstance(value, str):
    m = _SIZE.match(value)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
      raise OptionError(
          f"{where}: {name}={value!r} is not a memory size; write bytes as a number or a "
          "string with a unit: '16GiB' (2**30 bytes each), '16GB' (1e9 bytes each), "
          "'512MiB', '1.5 TiB'.")
    value_bytes = float(m.group(1)) * _UNITS[unit]
  elif _is_number(value):
    value_bytes = float(value)
  else:
    raise OptionError(f"{where}: {name}={value!r} is a {type(value).__name__}; give bytes "
                      "as a number, or a string like '16GiB', None for the device's "
                      "memory or float('inf') for no limit.")
  if math.isnan(value_bytes) or value_bytes <= 0:
    raise OptionError(f"{where}: {name}={value!r} must be a positive number of bytes "
                      "(or None for the device's memory, float('inf') for no limit).")
  return value_bytes


def format_bytes(nbytes: float) -> str:
  """Bytes in the largest binary unit that keeps the figure at least 1, so that small
  sizes keep their digits ("727.04 KiB", not "0.001 GiB").

  Example:
    >>> format_bytes(0.71 * 2**20), format_bytes(3 * 2**30), format_bytes(100)
    ('727.04 KiB', '3.00 GiB', '100 B')
  """
  if not math.isfinite(nbytes):
    return f"{nbytes} B"
  size = abs(float(nbytes))
  for unit in ("PiB", "TiB", "GiB", "MiB", "KiB"):
    scale = _UNITS[unit.lower()]
    if size >= scale:
      return f"{nbytes / scale:.2f} {unit}"
  return f"{nbytes:.0f} B"


# A TPU topology name as libtpu spells it: generation, colon, chips per torus axis.
_TOPOLOGY = re.compile(r"^v\d+[a-z]*:\d+(x\d+)*$")


def topology(value: Any, where: str = "search", name: str = "verify") -> str | None:
  """None, or a TPU topology name such as "v5e:2x2", "v5p:4x4x4", "v6e:16x16".

  Example:
    >>> topology("v5p:2x2x1")
    'v5p:2x2x1'
  """
  if value is None:
    return None
  if isinstance(value, str) and _TOPOLOGY.match(value):
    return value
  raise OptionError(f"{where}: {name}={value!r} is not a TPU topology name; write "
                    "generation:chips per axis, e.g. 'v5e:2x2', 'v5p:2x2x1', 'v6e:16x16' "
                    "(or None not to compile).")


# The state's in-memory layouts a step runs in (`tapas.apply`'s `layouts=`).
LAYOUTS = ("default", "auto")


def layouts(value: Any, where: str = "search") -> str:
  """"default" (JAX's layouts) or "auto" (the compiler's, for the carried state).

  Example:
    >>> layouts("auto")
    'auto'
  """
  if isinstance(value, str) and value in LAYOUTS:
    return value
  raise OptionError(f"{where}: layouts={value!r}; pass 'default' (JAX's layouts) or "
                    "'auto' (the compiler lays out the state the step carries).")


def batch_axes(value: Any, axes: Mapping[str, int] | None, where: str = "search"
               ) -> tuple[str, ...] | None:
  """One axis name, a sequence of them (each a mesh axis), or None (any axis).

  A single string is one axis, never read letter by letter; "default", where the mesh
  has no axis of that name, is None (what older callers passed for every axis).
  `axes` None (the mesh not known yet): the names are checked for their form only.
  """
  if value is None:
    return None
  if isinstance(value, str):
    if value == _OLD_DEFAULT and (axes is None or value not in axes):
      return None
    names: Sequence[Any] = (value,)
  elif isinstance(value, (Sequence, set, frozenset)) and not isinstance(value, bytes):
    names = tuple(value)
  else:
    raise OptionError(f"{where}: batch_axes={value!r} is a {type(value).__name__}; give "
                      "one mesh axis name ('data'), a sequence of them (('data', 'fsdp')) "
                      "or None for any axis.")
  for a in names:
    if not isinstance(a, str) or (axes is not None and a not in axes):
      known = "" if axes is None else f" of the mesh {dict(axes)}; use some of {list(axes)}"
      raise OptionError(f"{where}: batch_axes names {a!r}, which is not an axis{known}.")
  if len(set(names)) != len(names):
    raise OptionError(f"{where}: batch_axes={value!r} names an axis twice.")
  return tuple(names)


def flag(value: Any, name: str, where: str = "search") -> bool:
  """A bool (numpy bools too); 0, 1, "yes" and None are refused rather than guessed."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  raise OptionError(f"{where}: {name}={value!r} is a {type(value).__name__}; use True or "
                    "False.")


def solver(value: Any, where: str = "search") -> Solver | None:
  """None (the view's default) or a `Solver` (by its name: "elimination", "ilp")."""
  if value is None:
    return None
  if isinstance(value, str) and value in SOLVERS:
    return Solver(value)
  raise OptionError(f"{where}: solver={value!r} is not a solver; use one of "
                    f"{', '.join(map(repr, SOLVERS))} or None for the default.")


def time_limit(value: Any, where: str = "search") -> float | None:
  """None (no limit) or a positive number of seconds."""
  if value is None:
    return None
  if _is_number(value) and math.isfinite(value) and value > 0:
    return float(value)
  raise OptionError(f"{where}: time_limit={value!r} must be a positive number of "
                    "seconds, or None for no limit.")


def kwargs(value: Any, where: str = "search") -> dict[str, Any]:
  """The step's keyword arguments: None or a mapping with string keys."""
  if value is None:
    return {}
  if not isinstance(value, Mapping):
    raise OptionError(f"{where}: kwargs={value!r:.80} is a {type(value).__name__}; pass "
                      "the step's keyword arguments as a dict, e.g. kwargs={'batch': b}.")
  bad = [k for k in value if not isinstance(k, str)]
  if bad:
    raise OptionError(f"{where}: kwargs keys must be argument names (str); got {bad[0]!r}.")
  return dict(value)


def donate_argnums(value: Any, num_args: int | None = None, where: str = "apply"
                   ) -> tuple[int, ...]:
  """An int or a sequence of ints, each a positional argument index."""
  nums = (value,) if _is_int(value) else value
  if not isinstance(nums, Sequence) or not all(_is_int(n) for n in nums):
    raise OptionError(f"{where}: donate_argnums={value!r} must be an int or a sequence of "
                      "ints (positional argument indices).")
  if num_args is not None:
    for n in nums:
      if not -num_args <= n < num_args:
        raise OptionError(f"{where}: donate_argnums={value!r} names argument {n}, but the "
                          f"plan has {num_args} positional argument(s).")
  return tuple(int(n) for n in nums)


def links(value: Any, where: str = "search") -> tuple[tuple[str, str], ...] | None:
  """None (the device profile's links) or mesh axis -> "intra" / "inter", as sorted
  (axis, link) pairs; the axes and link names are checked against the mesh where it
  is built (`cost.mesh_spec`)."""
  if value is None:
    return None
  # A tuple of pairs is what this returns: taken back unchanged.
  items = list(value.items() if isinstance(value, Mapping) else
               value if isinstance(value, tuple) else [None])
  if not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in items):
    raise OptionError(f"{where}: links={value!r:.80} is not a mapping of mesh axis names to "
                      "'intra' or 'inter'; e.g. links={'data': 'inter', 'model': 'intra'}.")
  return tuple(sorted(items))


# `SearchConfig`'s fields: the options every search entry point takes by keyword.
SEARCH_OPTIONS = ("device", "memory_budget", "batch_axes", "fold", "solver", "links",
                  "time_limit", "sequence_parallel", "verify", "layouts")


@dataclasses.dataclass(frozen=True)
class SearchConfig:
  """Every option of a search, checked once when the config is made.

  `tapas.search`, `api.prepare`, `baselines.baseline`, `@tapas.shard` and the
  launcher take these as keywords or as one `config=`; each field means what the
  keyword of the same name means for `tapas.search`. Made with values a parser would
  refuse, it raises the same `OptionError` the keyword would.

  Attributes:
    device: a device profile name (or `DeviceProfile`); None: the local platform's,
      or the `verify` topology's.
    memory_budget: per-device bytes (a number, or a string such as "16GiB", stored as
      bytes); None: the device's memory less headroom; `float("inf")`: no limit.
    batch_axes: the mesh axes that may split the batch, as a tuple; None: any axis.
    fold: search each unique layer once (the folded view) or every op.
    solver: a `Solver`; None: elimination when folded, the integer program when not.
    links: (mesh axis, "intra" or "inter") pairs; None: from the device profile.
    time_limit: seconds for the integer program; None: no limit.
    sequence_parallel: also search Megatron's sequence parallelism.
    verify: a TPU topology to compile the plan for ("v5p:2x2x1"); None: no compile.
    layouts: the state's layouts the step runs in, as `tapas.apply`'s `layouts=`:
      what `verify` compiles, and what `@tapas.shard` runs.
    where: the entry point error messages name (not compared).

  Example:
    >>> c = SearchConfig(batch_axes="data", solver="ilp", links={"data": "inter"})
    >>> c.batch_axes, c.solver is Solver.ILP, c.links
    (('data',), True, (('data', 'inter'),))
  """

  device: Any = None
  memory_budget: float | None = None
  batch_axes: tuple[str, ...] | None = None
  fold: bool = True
  solver: Solver | None = None
  links: tuple[tuple[str, str], ...] | None = None
  time_limit: float | None = None
  sequence_parallel: bool = True
  verify: str | None = None
  layouts: str = "default"
  where: str = dataclasses.field(default="search", compare=False, repr=False)

  def __post_init__(self):
    # Each parser takes its own output unchanged, so `dataclasses.replace` re-checks
    # only what it replaces, to the same values.
    w = self.where
    parsed = dict(device=device(self.device, w), memory_budget=memory_bytes(self.memory_budget, w),
                  batch_axes=batch_axes(self.batch_axes, None, w), fold=flag(self.fold, "fold", w),
                  solver=solver(self.solver, w), links=links(self.links, w),
                  time_limit=time_limit(self.time_limit, w),
                  sequence_parallel=flag(self.sequence_parallel, "sequence_parallel", w),
                  verify=topology(self.verify, w), layouts=layouts(self.layouts, w))
    for name, value in parsed.items():
      object.__setattr__(self, name, value)

  @property
  def links_map(self) -> dict[str, str] | None:
    """`links` as the mapping `cost.mesh_spec` takes."""
    return None if self.links is None else dict(self.links)


def search_config(config: SearchConfig | None, given: Mapping[str, Any],
                  where: str = "search") -> SearchConfig:
  """The config of a call that takes `config=` or the options as keywords (`given`).

  Raises:
    TypeError: an unknown option, or `config=` and keywords together (which would win
      is a guess either way: change the config with `dataclasses.replace` instead).
    OptionError: a bad value (see `SearchConfig`).

  Example:
    >>> search_config(None, {"fold": False}).fold
    False
  """
  unknown = sorted(set(given) - set(SEARCH_OPTIONS))
  if unknown:
    raise TypeError(f"{where}: unknown option(s) {unknown}; the search options are "
                    f"{', '.join(SEARCH_OPTIONS)}")
  if config is None:
    return SearchConfig(**given, where=where)
  if not isinstance(config, SearchConfig):
    raise TypeError(f"{where}: config={config!r:.80} is a {type(config).__name__}; pass a "
                    "tapas_jax.options.SearchConfig")
  if given:
    raise TypeError(f"{where}: pass the search options either as keywords or as config=, "
                    f"not both (got config= and {', '.join(sorted(given))}=); use "
                    "dataclasses.replace(config, ...) to change a config")
  return config
