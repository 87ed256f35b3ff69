"""Analytic cost model for the search stage: meshes, layouts, collectives, resharding.

The chips' figures it prices with are the device profiles (`tapas_jax.profiles`; the
names stay importable from here: `cost.get_profile`, `cost.PROFILES`, ...).

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
  model is all-reduced once over both): it sends the flat ring's bytes, (n-1)/n of
  the buffer (twice that for an all-reduce). A reduce-scatter or all-gather over
  several axes is timed as one ring per axis, fastest link first on the whole
  buffer, each next axis on what the one before it left, as TPU per-dimension rings
  and NCCL's hierarchical algorithms run it; an all-reduce as twice that. An
  all-to-all over several axes is one flat exchange, paced by the slowest of their
  links and the longest latency.

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

# The device profiles are the cost model's inputs; their names stay importable here.
from tapas_jax.profiles import (INTER, INTRA, LINKS, PROFILES, DeviceProfile,  # noqa: F401
                                compiled_by_xla_cpu, compute_time, get_profile,
                                profile_for_kind, profile_for_topology, roofline_time)

ALL_REDUCE = "all-reduce"
ALL_GATHER = "all-gather"
REDUCE_SCATTER = "reduce-scatter"
ALL_TO_ALL = "all-to-all"


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
      if link not in LINKS:
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
    if link not in LINKS:
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



def stored_bytes(shape: Sequence[int], itemsize: int, profile: str | DeviceProfile) -> int:
  """Bytes a device's compiler allocates for an array of this (per-device) shape.

  Where the profile has a `memory_tile` (the TPU compiler's), the array is stored in
  tiles: its minor dim rounded up to the tile's lanes, its second-minor dim to the
  tile's rows (a power of two below them: 1, 2, 4), in the dim order that pads least
  (the compiler picks each array's layout), and the whole rounded up to
  `buffer_granule_bytes`. Elsewhere the plain bytes.

  Example:
    >>> stored_bytes((64, 64), 4, "tpu-v5p"), stored_bytes((64, 64), 4, "h100")
    (32768, 16384)
  """
  profile = get_profile(profile)
  nbytes = math.prod(shape) * itemsize
  if not profile.memory_tile or not nbytes:
    return nbytes
  rows, lanes = profile.memory_tile
  shape = tuple(shape) or (1,)
  if len(shape) == 1:
    padded = -(-shape[0] // lanes) * lanes * itemsize
  else:
    padded = min(math.prod(shape) // (shape[i] * shape[j]) * _tile_rows(shape[i], rows)
                 * (-(-shape[j] // lanes) * lanes) * itemsize
                 for i in range(len(shape)) for j in range(len(shape)) if i != j)
  granule = profile.buffer_granule_bytes
  return -(-padded // granule) * granule


def conv_copy_bytes(shape: Sequence[int], itemsize: int, batch: int, feature: int,
                    profile: str | DeviceProfile) -> int | None:
  """Bytes of the copy of a convolution's input (activation operand) that a compiler
  laying such operands out for its convolutions makes
  (`DeviceProfile.copies_conv_inputs`): the copy puts the operand's `batch` and
  `feature` dims in the tiles, the one that pads less in the lanes, the other in the
  rows, spatial dims major. None where there is no copy: the array's own layout (the
  one that pads least, `stored_bytes`) already has one of the two in the lanes, or the
  profile makes none.

  Example:
    >>> conv_copy_bytes((8, 224, 224, 3), 2, 0, 3, "tpu-v5p") / 2**20  # the ViT stem's
    49.0
    >>> conv_copy_bytes((8, 224, 224, 128), 2, 0, 3, "tpu-v5p") is None
    True
  """
  profile = get_profile(profile)
  if not profile.copies_conv_inputs or not profile.memory_tile or len(shape) < 3:
    return None
  rows, lanes = profile.memory_tile
  def padded(i, j):  # dim i in the rows, dim j in the lanes
    return (math.prod(shape) // (shape[i] * shape[j]) * _tile_rows(shape[i], rows)
            * (-(-shape[j] // lanes) * lanes) * itemsize)
  pairs = [(i, j) for i in range(len(shape)) for j in range(len(shape)) if i != j]
  if min(padded(i, j) for i, j in pairs if j in (batch, feature)) <= min(
      padded(i, j) for i, j in pairs):
    return None
  copy = min(padded(feature, batch), padded(batch, feature))
  granule = profile.buffer_granule_bytes
  return -(-copy // granule) * granule


def _tile_rows(n: int, rows: int) -> int:
  """A second-minor dim of n rounded up to the tile (a power of two for short dims)."""
  if n >= rows:
    return -(-n // rows) * rows
  return 1 << (n - 1).bit_length()


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
    sent_as: the collective the compiler emits for it, whose bytes and time these are
      (the TPU compiler's all-gathers over more than 32 chips, on v5e and v6e those
      into at most 16 MiB, and its reduce-scatters are all-reduces:
      `DeviceProfile.all_gather_as_all_reduce_above`,
      `all_gather_as_all_reduce_up_to_bytes`); `kind` if "" (the default).

  Example:
    >>> m = MeshSpec(("data",), (64,), ("intra",))
    >>> c = all_gather(1024, "data", m, "tpu-v5p")
    >>> c.sent_as, c.bytes_sent_per_device  # 2 * 63/64 * 1 KiB, not 63/64
    ('all-reduce', 2016.0)
  """

  kind: str
  axes: tuple[str, ...]
  bytes_sent_per_device: float
  time_s: float
  sent_as: str = ""

  def __post_init__(self):
    object.__setattr__(self, "sent_as", self.sent_as or self.kind)


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
  # steps and twice the bytes of either. A gather or reduce-scatter the compiler
  # runs as an all-reduce of the same buffer (`sent_as`) is priced as that.
  sent_as = _lowered(kind, n, local_bytes, profile)
  factor = 2 if sent_as == ALL_REDUCE else 1
  sent = factor * (n - 1) / n * local_bytes
  if kind == ALL_TO_ALL or len(axes) == 1:
    links = {mesh.link(a) for a in axes}
    bandwidth = min(profile.bandwidth(link) for link in links)
    alpha = max(profile.latency(link) for link in links)
    return Collective(kind, axes, sent, alpha * factor * (n - 1) + sent / bandwidth, sent_as)
  return Collective(kind, axes, sent, factor * _staged_time(local_bytes, axes, mesh, profile),
                    sent_as)


def _lowered(kind: str, n: int, local_bytes: float, profile: DeviceProfile) -> str:
  """The collective the compiler emits for `kind` over `n` devices of a `local_bytes`
  buffer (`DeviceProfile`'s `all_gather_as_all_reduce_above`,
  `all_gather_as_all_reduce_up_to_bytes`, `reduce_scatter_as_all_reduce`)."""
  if (kind == ALL_GATHER and n > profile.all_gather_as_all_reduce_above
      and local_bytes <= profile.all_gather_as_all_reduce_up_to_bytes):
    return ALL_REDUCE  # of a zero-filled buffer holding the shard
  if kind == REDUCE_SCATTER and profile.reduce_scatter_as_all_reduce:
    return ALL_REDUCE  # then a slice
  return kind


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


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
  """How many leading axes `a` and `b` share."""
  return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


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

  if math.isfinite(profile.all_gather_as_all_reduce_above) and not all(is_prefix):
    # Where the compiler lowers a gather over many devices as an all-reduce, XLA emits
    # one gather over every axis the value sheds, on whichever dims they split (a
    # weight split over model on one dim and data on the other gathers over all 64
    # chips of an 8 x 8 mesh at once: an all-reduce), so that is the only gather.
    new, shed = dims, ()
    for i, axes in enumerate(dims):
      keep = _common_prefix(axes, target[i]) if not is_prefix[i] else len(axes)
      new, shed = with_dim(new, i, axes[:keep]), shed + axes[keep:]
    shed = tuple(sorted(shed, key=mesh.axis_names.index))
    yield (new, partial), all_gather(local_bytes(new), shed, mesh, profile)
  for i, axes in enumerate(dims):
    if not is_prefix[i]:
      # Gather the minor-most axis. Gathering several at once costs the same
      # bytes with more α steps, so one at a time is never worse (but see above).
      if not math.isfinite(profile.all_gather_as_all_reduce_above):
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
