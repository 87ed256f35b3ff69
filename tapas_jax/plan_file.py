"""Plans as files: `Plan.save(path)` and `Plan.load(path)`, JSON with a schema version.

No pickle: a plan file holds names, numbers and PartitionSpecs only, so loading one
runs no code. Writing is atomic (a temporary file in the same folder, then a rename),
so a crash never leaves half a plan under the name. Loading checks every field and
names the first one that is wrong (where, what was expected, what was found); nothing
of a bad file is used.

Pytrees of specs: dicts (string or int keys), lists, tuples and None come back as
they were. Other node types (a flax `TrainState`, optax's named tuples, an nnx
`State` or `Param`) cannot be rebuilt from JSON (their classes and static fields are
code), so they come back as `StoredNode`s that keep the type's name, the children's
keys and their order: `apply` and `place` bind them to the arguments' own node types
when every leaf's key path agrees.

The file: one JSON object with `schema` ("tapas_jax.plan"), `version` (an int; a
reader refuses versions newer than its own), `name`, `device`, `fingerprint`, `mesh`
([axis, size] pairs, in order), `in_specs` (one spec tree per positional argument),
`kwargs_specs` ([name, spec tree] pairs), `input_types` ([path, "float32[8,64]"]),
`class_axes`, `layers`, `stats` (the `PlanStats` fields) and `constraints` ({site,
slot, spec}); a plan searched with `verify=` also has `compiled` (the
`CompiledFigures` fields; `comm_bytes` and `rounds` as lists, an unlimited budget null),
which files of plans without it leave out, so older readers still read them; so do
`remat` and `use_specs` (every argument leaf read in another layout than stored; a file
without it gives the layers' own). A PartitionSpec is a list of null, an axis name or a
list of names; a spec tree node is {"P": spec}, {"dict": [[key, node], ...]}, {"list": [...]},
{"tuple": [...]}, {"node": type name, "keys": [[kind, key], ...], "children": [...]}
or null.

Example:
  >>> import os, tempfile
  >>> import jax, jax.numpy as jnp
  >>> import tapas_jax as tapas
  >>> plan = tapas.search(lambda w, x: jnp.sum(x @ w),
  ...                     jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
  ...                     jax.ShapeDtypeStruct((65536, 4096), jnp.float32),
  ...                     mesh={"data": 8}, device="h100")
  >>> path = os.path.join(tempfile.mkdtemp(), "plan.json")
  >>> plan.save(path)
  >>> tapas.Plan.load(path) == plan
  True
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec

from tapas_jax import plan_records as records
from tapas_jax.errors import TapasError
from tapas_jax.solver import REMAT_POLICIES
from tapas_jax.trace import key_path_str

__all__ = ["SCHEMA", "VERSION", "PlanFileError", "StoredNode", "bind_specs", "from_json",
           "load", "save", "to_json"]

SCHEMA = "tapas_jax.plan"
VERSION = 1

_KEY_KINDS: dict[str, Callable[[Any], Any]] = {
    "attr": jax.tree_util.GetAttrKey,
    "key": jax.tree_util.DictKey,
    "index": jax.tree_util.SequenceKey,
    "flat": jax.tree_util.FlattenedIndexKey,
}


class PlanFileError(TapasError, ValueError):
  """A plan file that cannot be written or read back; the message names the field."""


@jax.tree_util.register_pytree_with_keys_class
class StoredNode:
  """A pytree node of a loaded plan whose type JSON cannot rebuild.

  Attributes:
    type_name: the original node type, "module.QualName".
    keys: (kind, key) per child: kind "attr" (an attribute), "key" (a mapping key),
      "index" (a sequence index) or "flat" (a flattened index), as `jax.tree_util`
      names the child.
    children: the children, in the original order.
  """

  def __init__(self, type_name: str, keys: tuple[tuple[str, Any], ...],
               children: tuple[Any, ...]):
    self.type_name, self.keys, self.children = type_name, tuple(keys), tuple(children)

  def tree_flatten_with_keys(self):
    keys = [_KEY_KINDS[kind](key) for kind, key in self.keys]
    return tuple(zip(keys, self.children)), (self.type_name, self.keys)

  def tree_flatten(self):
    return self.children, (self.type_name, self.keys)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(aux[0], aux[1], tuple(children))

  def __eq__(self, other):
    return isinstance(other, StoredNode) and (self.type_name, self.keys, self.children) == (
        other.type_name, other.keys, other.children)

  def __hash__(self):
    return hash((self.type_name, self.keys))

  def __repr__(self):
    name = self.type_name.rsplit(".", 1)[-1]
    return f"{name}(" + ", ".join(f"{k}={c!r}" for (_, k), c in
                                 zip(self.keys, self.children)) + ")"


def _is_spec(x) -> bool:
  return isinstance(x, PartitionSpec)


def bind_specs(specs: Any, arg: Any, where: str, plan_name: str = "tapas") -> Any:
  """`specs` in `arg`'s pytree structure.

  A plan loaded from a file holds stand-ins for the pytree node types JSON cannot
  rebuild (a flax `TrainState`, optax states, nnx `State`); they are bound to the
  argument's own node types when the key paths of the leaves agree one for one.

  Raises:
    ValueError: the leaves' key paths differ; names the first that does.
  """
  have = jax.tree.structure(arg)
  if jax.tree.structure(specs, is_leaf=_is_spec) == have:
    return specs
  spec_leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[0]
  arg_leaves = jax.tree_util.tree_flatten_with_path(arg)[0]
  spec_paths = [key_path_str(p) for p, _ in spec_leaves]
  arg_paths = [key_path_str(p) for p, _ in arg_leaves]
  if spec_paths == arg_paths and all(_is_spec(s) for _, s in spec_leaves):
    return jax.tree.unflatten(have, [s for _, s in spec_leaves])
  diff = next((k for k, (a, b) in enumerate(zip(arg_paths, spec_paths)) if a != b),
              min(len(arg_paths), len(spec_paths)))
  got = f"'{arg_paths[diff]}'" if diff < len(arg_paths) else "nothing"
  want = f"'{spec_paths[diff]}'" if diff < len(spec_paths) else "nothing"
  raise ValueError(
      f"plan {plan_name!r} was searched for another program: {where} has "
      f"{len(arg_paths)} leaves, the plan {len(spec_paths)}; leaf {diff} is {got} here and "
      f"{want} in the plan. Search again with tapas.search(fn, *args, mesh=...) on what "
      "you run.")


# -- writing ----------------------------------------------------------------------


def _spec_json(spec: PartitionSpec, where: str) -> list:
  out = []
  for e in spec:
    if e is None or isinstance(e, str):
      out.append(e)
    elif isinstance(e, tuple) and all(isinstance(a, str) for a in e):
      out.append(list(e))
    else:
      raise PlanFileError(f"save: {where}: a PartitionSpec entry {e!r} is not an axis name, "
                          "a tuple of them or None; it cannot be written.")
  return out


def _key_json(key: Any, where: str) -> list:
  for kind, cls in _KEY_KINDS.items():
    if isinstance(key, cls):
      value = {"attr": "name", "key": "key", "index": "idx", "flat": "key"}[kind]
      value = getattr(key, value)
      if isinstance(value, bool) or not isinstance(value, (str, int)):
        break
      return [kind, value]
  raise PlanFileError(f"save: {where}: pytree key {key!r} is neither a string nor an int "
                      "attribute, mapping key or index; it cannot be written.")


def _tree_json(tree: Any, where: str) -> Any:
  if isinstance(tree, PartitionSpec):
    return {"P": _spec_json(tree, where)}
  if tree is None:
    return None
  if type(tree) is dict:
    for k in tree:
      if isinstance(k, bool) or not isinstance(k, (str, int)):
        raise PlanFileError(f"save: {where}: dict key {k!r} is not a str or an int.")
    return {"dict": [[k, _tree_json(v, f"{where}/{k}")] for k, v in tree.items()]}
  if type(tree) in (list, tuple):
    return {type(tree).__name__: [_tree_json(v, f"{where}/{i}") for i, v in enumerate(tree)]}
  if isinstance(tree, StoredNode):
    name, keys, children = tree.type_name, tree.keys, tree.children
    keys = [list(k) for k in keys]
  else:
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda y: y is not tree)[0]
    if any(len(path) != 1 for path, _ in flat):
      raise PlanFileError(f"save: {where}: a {type(tree).__name__} node does not name its "
                          "children one key each; it cannot be written.")
    name = f"{type(tree).__module__}.{type(tree).__qualname__}"
    keys = [_key_json(path[0], where) for path, _ in flat]
    children = [child for _, child in flat]
  return {"node": name, "keys": keys,
          "children": [_tree_json(c, f"{where}/{k[1]}") for k, c in zip(keys, children)]}


def to_json(plan: Any) -> dict[str, Any]:
  """The plan (a `tapas_jax.Plan`) as JSON-ready data (dicts, lists, strings, numbers)."""
  out = {
      "schema": SCHEMA,
      "version": VERSION,
      "name": plan.name,
      "device": plan.device,
      "fingerprint": plan.fingerprint,
      "mesh": [[str(k), int(v)] for k, v in dict(plan.mesh_axes).items()],
      "in_specs": [_tree_json(t, f"in_specs[{i}]") for i, t in enumerate(plan.in_specs)],
      "kwargs_specs": [[k, _tree_json(t, f"kwargs_specs[{k!r}]")]
                       for k, t in plan.kwargs_specs.items()],
      "input_types": [list(t) for t in plan.input_types],
      "class_axes": [[ex, int(size), list(axes)] for ex, size, axes in plan.class_axes],
      "layers": [{"name": la.name, "instances": la.instances,
                  "param_specs": [[p, _spec_json(s, f"layers[{j}]")] for p, s in la.param_specs],
                  "use_specs": [[p, _spec_json(s, f"layers[{j}]")] for p, s in la.use_specs]}
                 for j, la in enumerate(plan.layers)],
      "stats": dataclasses.asdict(plan.stats),
      "constraints": [{"site": list(c.site), "slot": c.slot,
                       "spec": _spec_json(c.spec, f"constraints[{j}]")}
                      for j, c in enumerate(plan.constraints)],
      "decisions": [{"name": d.name, "size": d.size, "axes": list(d.axes), "why": d.why}
                    for d in plan.decisions],
      # A baseline that cannot run (an op split twice) costs inf: JSON null.
      "baselines": [{"name": b.name, **{k: (v if math.isfinite(v) else None) for k, v in
                                        (("step_s", b.step_s), ("comm_bytes", b.comm_bytes),
                                         ("memory_bytes", b.memory_bytes))}}
                    for b in plan.baselines],
  }
  if plan.remat:  # only then: a plan without remat stays readable by older releases
    out["remat"] = [[layer, policy] for layer, policy in plan.remat]
  if plan.gradient_fences:  # the same
    out["gradient_fences"] = True
  if plan.sums_past_fences:  # the same
    out["sums_past_fences"] = True
  if plan.use_specs:  # the same
    out["use_specs"] = [[p, _spec_json(s, "use_specs")] for p, s in plan.use_specs]
  if plan.compiled is not None:  # the same: only plans searched with verify= have it
    c = plan.compiled
    out["compiled"] = {**dataclasses.asdict(c), "comm_bytes": [list(kv) for kv in c.comm_bytes],
                       # An unlimited budget is inf: JSON null.
                       "rounds": [[x if math.isfinite(x) else None for x in r]
                                  for r in c.rounds]}
  return out


def save(plan: Any, path: str | os.PathLike) -> None:
  """Writes the plan to `path` as JSON, atomically (temporary file, then rename)."""
  try:
    text = json.dumps(to_json(plan), indent=1, allow_nan=False)
  except ValueError as e:  # NaN or infinity among the numbers: JSON has neither
    if isinstance(e, PlanFileError):
      raise
    bad = [k for k, v in dataclasses.asdict(plan.stats).items()
           if isinstance(v, float) and not math.isfinite(v)]
    raise PlanFileError(f"save: the plan cannot be written as JSON ({e}); stats fields "
                        f"{bad} are not finite.") from e
  path = os.fspath(path)
  folder = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                             dir=folder)
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text + "\n")
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


# -- reading ----------------------------------------------------------------------


class _Reader:
  """Checks each field as it decodes it; the first problem raises `PlanFileError`."""

  def __init__(self, source: str):
    self.source = source
    self.axes: set[str] = set()

  def fail(self, where: str, expected: str, got: Any, raw: bool = False) -> PlanFileError:
    shown = got if raw else json.dumps(got)[:80] if _jsonable(got) else repr(got)[:80]
    return PlanFileError(f"{self.source}: {where}: expected {expected}, got {shown}. The "
                         "file is not a plan this version of tapas_jax wrote; save the plan "
                         "again (plan.save(path)) or search again.")

  def field(self, obj: dict, key: str, where: str) -> Any:
    if key not in obj:
      raise self.fail(where, f"a field {key!r}", "nothing", raw=True)
    return obj[key]

  def of(self, value, kind, where: str, expected: str):
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
      raise self.fail(where, expected, value)
    return value

  def string(self, value, where: str) -> str:
    return self.of(value, str, where, "a string")

  def integer(self, value, where: str, low: int = 0) -> int:
    value = self.of(value, int, where, f"an int >= {low}")
    if value < low:
      raise self.fail(where, f"an int >= {low}", value)
    return value

  def number(self, value, where: str) -> float:
    value = self.of(value, (int, float), where, "a number")
    if not math.isfinite(value) or value < 0:
      raise self.fail(where, "a finite number >= 0", value)
    return value

  def array(self, value, where: str) -> list:
    return self.of(value, list, where, "a list")

  def mapping(self, value, where: str, keys: set[str]) -> dict:
    self.of(value, dict, where, "an object")
    unknown = sorted(set(value) - keys)
    if unknown:
      raise self.fail(where, f"only the fields {sorted(keys)}", f"also {unknown}", raw=True)
    return value

  def axis(self, value, where: str) -> str:
    name = self.string(value, where)
    if self.axes and name not in self.axes:
      raise self.fail(where, f"a mesh axis ({', '.join(sorted(self.axes))})", name)
    return name

  def spec(self, value, where: str) -> PartitionSpec:
    entries = []
    for i, e in enumerate(self.array(value, where)):
      if e is None:
        entries.append(None)
      elif isinstance(e, list):
        entries.append(tuple(self.axis(a, f"{where}[{i}][{j}]") for j, a in enumerate(e)))
      else:
        entries.append(self.axis(e, f"{where}[{i}]"))
    return PartitionSpec(*entries)

  def tree(self, value, where: str) -> Any:
    if value is None:
      return None
    self.of(value, dict, where, "a spec tree node ({'P': ...}, {'dict': ...}, {'list': "
            "...}, {'tuple': ...}, {'node': ...} or null)")
    if set(value) == {"P"}:
      return self.spec(value["P"], f"{where}.P")
    if set(value) == {"dict"}:
      out = {}
      for i, item in enumerate(self.array(value["dict"], f"{where}.dict")):
        k, child = self.pair(item, f"{where}.dict[{i}]")
        self.dict_key(k, f"{where}.dict[{i}][0]")
        out[k] = self.tree(child, f"{where}/{k}")
      return out
    if set(value) in ({"list"}, {"tuple"}):
      (kind, items), = value.items()
      children = [self.tree(c, f"{where}/{i}") for i, c in
                  enumerate(self.array(items, f"{where}.{kind}"))]
      return children if kind == "list" else tuple(children)
    if set(value) == {"node", "keys", "children"}:
      name = self.string(value["node"], f"{where}.node")
      keys = []
      for i, k in enumerate(self.array(value["keys"], f"{where}.keys")):
        kind, key = self.pair(k, f"{where}.keys[{i}]")
        if kind not in _KEY_KINDS:
          raise self.fail(f"{where}.keys[{i}][0]", f"one of {sorted(_KEY_KINDS)}", kind)
        if kind in ("index", "flat"):
          self.integer(key, f"{where}.keys[{i}][1]")
        elif kind == "attr":
          self.string(key, f"{where}.keys[{i}][1]")
        else:
          self.dict_key(key, f"{where}.keys[{i}][1]")
        keys.append((kind, key))
      children = self.array(value["children"], f"{where}.children")
      if len(children) != len(keys):
        raise self.fail(f"{where}.children", f"{len(keys)} children (one per key)",
                        len(children))
      return StoredNode(name, tuple(keys), tuple(
          self.tree(c, f"{where}/{k}") for (_, k), c in zip(keys, children)))
    raise self.fail(where, "a spec tree node ({'P': ...}, {'dict': ...}, {'list': ...}, "
                    "{'tuple': ...}, {'node', 'keys', 'children'} or null)", value)

  def pair(self, value, where: str) -> tuple[Any, Any]:
    if not isinstance(value, list) or len(value) != 2:
      raise self.fail(where, "a [key, value] pair", value)
    return value[0], value[1]

  def dict_key(self, key, where: str) -> None:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
      raise self.fail(where, "a str or int key", key)


def _jsonable(value: Any) -> bool:
  try:
    json.dumps(value)
    return True
  except (TypeError, ValueError):
    return False


_TOP = {"schema", "version", "name", "device", "fingerprint", "mesh", "in_specs",
        "kwargs_specs", "input_types", "class_axes", "layers", "stats", "constraints",
        "decisions", "baselines", "remat", "compiled", "use_specs", "gradient_fences",
        "sums_past_fences"}
# Stats fields added after version 1's first files: absent from older ones.
_LATER_STATS = frozenset({"plan_s", "report_s"})


def from_json(data: Any, plan_type: Callable[..., Any], source: str = "plan") -> Any:
  """A plan from `to_json`'s data, every field checked (`PlanFileError` names the
  first bad one).

  Args:
    data: what `to_json` returned, or `json.load` read.
    plan_type: the class to build, `tapas_jax.Plan` (passed in: the `Plan` class,
      whose `save` and `load` call this module, lives a stage above it).
    source: the file or object named in error messages.
  """
  r = _Reader(source)
  _check_header(r, data)
  mesh = _mesh(r, data)
  r.axes = set(mesh)  # every spec below names these axes only
  layers = _layers(r, data)
  return plan_type(
      mesh_axes=mesh, device=r.string(r.field(data, "device", "device"), "device"),
      in_specs=tuple(r.tree(t, f"in_specs[{i}]") for i, t in
                     enumerate(r.array(r.field(data, "in_specs", "in_specs"), "in_specs"))),
      class_axes=_class_axes(r, data), layers=layers, stats=_stats(r, data),
      fingerprint=r.string(r.field(data, "fingerprint", "fingerprint"), "fingerprint"),
      name=r.string(r.field(data, "name", "name"), "name"),
      constraints=_constraints(r, data), kwargs_specs=_kwargs_specs(r, data),
      input_types=_input_types(r, data), decisions=_decisions(r, data),
      baselines=_baselines(r, data), remat=_remat(r, data),
      gradient_fences=_flag(r, data, "gradient_fences"),
      sums_past_fences=_flag(r, data, "sums_past_fences"),
      compiled=_compiled(r, data["compiled"]) if "compiled" in data else None,
      use_specs=(_path_specs(r, data["use_specs"], "use_specs") if "use_specs" in data
                 # older files: only each unique layer's first instance is known
                 else tuple(ps for la in layers for ps in la.use_specs)))


def _check_header(r: _Reader, data: Any) -> None:
  """A JSON object of this schema, of a version this reader knows, with known fields."""
  if not isinstance(data, dict):
    raise r.fail("the file", "a JSON object", data)
  schema = r.field(data, "schema", "schema")
  if schema != SCHEMA:
    raise r.fail("schema", repr(SCHEMA), schema)
  version = r.integer(r.field(data, "version", "version"), "version", low=1)
  if version > VERSION:
    raise PlanFileError(f"{r.source}: version {version} was written by a newer tapas_jax; "
                        f"this one reads up to version {VERSION}. Upgrade tapas_jax.")
  r.mapping(data, "the file", _TOP)


def _mesh(r: _Reader, data: dict) -> dict[str, int]:
  mesh = {}
  for i, item in enumerate(r.array(r.field(data, "mesh", "mesh"), "mesh")):
    name, size = r.pair(item, f"mesh[{i}]")
    mesh[r.string(name, f"mesh[{i}][0]")] = r.integer(size, f"mesh[{i}][1]", low=1)
  if not mesh:
    raise r.fail("mesh", "at least one [axis, size]", [])
  return mesh


def _kwargs_specs(r: _Reader, data: dict) -> dict[str, Any]:
  out = {}
  for i, item in enumerate(r.array(r.field(data, "kwargs_specs", "kwargs_specs"),
                                   "kwargs_specs")):
    k, tree = r.pair(item, f"kwargs_specs[{i}]")
    out[r.string(k, f"kwargs_specs[{i}][0]")] = r.tree(tree, f"kwargs_specs[{k!r}]")
  return out


def _input_types(r: _Reader, data: dict) -> tuple[tuple[str, str], ...]:
  out = []
  for i, item in enumerate(r.array(r.field(data, "input_types", "input_types"),
                                   "input_types")):
    path, ttype = r.pair(item, f"input_types[{i}]")
    out.append((r.string(path, f"input_types[{i}][0]"),
                r.string(ttype, f"input_types[{i}][1]")))
  return tuple(out)


def _class_axes(r: _Reader, data: dict) -> tuple[tuple[str, int, tuple[str, ...]], ...]:
  out = []
  for i, item in enumerate(r.array(r.field(data, "class_axes", "class_axes"), "class_axes")):
    if not isinstance(item, list) or len(item) != 3:
      raise r.fail(f"class_axes[{i}]", "[example, size, [axes]]", item)
    out.append((r.string(item[0], f"class_axes[{i}][0]"),
                r.integer(item[1], f"class_axes[{i}][1]", low=1),
                tuple(r.axis(a, f"class_axes[{i}][2][{j}]") for j, a in
                      enumerate(r.array(item[2], f"class_axes[{i}][2]")))))
  return tuple(out)


def _path_specs(r: _Reader, value: Any, where: str) -> tuple[tuple[str, PartitionSpec], ...]:
  """A list of [path, spec] pairs."""
  return tuple((r.string(r.pair(ps, f"{where}[{i}]")[0], f"{where}[{i}][0]"),
                r.spec(ps[1], f"{where}[{i}][1]"))
               for i, ps in enumerate(r.array(value, where)))


def _layers(r: _Reader, data: dict) -> tuple[records.LayerStrategy, ...]:
  out = []
  for j, la in enumerate(r.array(r.field(data, "layers", "layers"), "layers")):
    where = f"layers[{j}]"
    r.mapping(la, where, {"name", "instances", "param_specs", "use_specs"})
    specs = {kind: _path_specs(r, r.field(la, kind, f"{where}.{kind}"), f"{where}.{kind}")
             for kind in ("param_specs", "use_specs")}
    out.append(records.LayerStrategy(
        name=r.string(r.field(la, "name", f"{where}.name"), f"{where}.name"),
        instances=r.integer(r.field(la, "instances", f"{where}.instances"),
                            f"{where}.instances", low=1), **specs))
  return tuple(out)


def _stats(r: _Reader, data: dict) -> records.PlanStats:
  stats = r.mapping(r.field(data, "stats", "stats"), "stats",
                    {f.name for f in dataclasses.fields(records.PlanStats)})
  values = {}
  for f in dataclasses.fields(records.PlanStats):
    where = f"stats.{f.name}"
    if f.name in _LATER_STATS and f.name not in stats:
      continue  # a plan written before the field: its default
    value = r.field(stats, f.name, where)
    if f.type in ("int", int):
      values[f.name] = r.integer(value, where)
    elif f.type in ("str", str):
      values[f.name] = r.string(value, where)
    else:
      values[f.name] = float(r.number(value, where))
  return records.PlanStats(**values)


def _constraints(r: _Reader, data: dict) -> tuple[records.Constraint, ...]:
  out = []
  for j, c in enumerate(r.array(r.field(data, "constraints", "constraints"), "constraints")):
    where = f"constraints[{j}]"
    r.mapping(c, where, {"site", "slot", "spec"})
    site = r.array(r.field(c, "site", f"{where}.site"), f"{where}.site")
    for i, s in enumerate(site):
      if isinstance(s, bool) or not isinstance(s, (int, str)):
        raise r.fail(f"{where}.site[{i}]", "an equation index or a param name", s)
    out.append(records.Constraint(
        site=tuple(site), slot=r.integer(r.field(c, "slot", f"{where}.slot"), f"{where}.slot"),
        spec=r.spec(r.field(c, "spec", f"{where}.spec"), f"{where}.spec")))
  return tuple(out)


def _decisions(r: _Reader, data: dict) -> tuple[records.Decision, ...]:
  out = []
  for j, d in enumerate(r.array(data.get("decisions", []), "decisions")):  # a report:
    where = f"decisions[{j}]"                                          # optional
    r.mapping(d, where, {"name", "size", "axes", "why"})
    out.append(records.Decision(
        name=r.string(r.field(d, "name", f"{where}.name"), f"{where}.name"),
        size=r.integer(r.field(d, "size", f"{where}.size"), f"{where}.size", low=1),
        axes=tuple(r.axis(a, f"{where}.axes[{i}]") for i, a in
                   enumerate(r.array(r.field(d, "axes", f"{where}.axes"), f"{where}.axes"))),
        why=r.string(r.field(d, "why", f"{where}.why"), f"{where}.why")))
  return tuple(out)


def _baselines(r: _Reader, data: dict) -> tuple[records.BaselineFigures, ...]:
  out = []
  for j, b in enumerate(r.array(data.get("baselines", []), "baselines")):
    where = f"baselines[{j}]"
    r.mapping(b, where, {"name", "step_s", "comm_bytes", "memory_bytes"})
    figures = {k: math.inf if r.field(b, k, f"{where}.{k}") is None
               else float(r.number(b[k], f"{where}.{k}"))
               for k in ("step_s", "comm_bytes", "memory_bytes")}
    out.append(records.BaselineFigures(
        name=r.string(r.field(b, "name", f"{where}.name"), f"{where}.name"), **figures))
  return tuple(out)


def _flag(r: _Reader, data: dict, name: str) -> bool:
  """An optional boolean field (older files have none: False)."""
  value = data.get(name, False)
  if not isinstance(value, bool):
    raise r.fail(name, "true or false", value)
  return value


def _remat(r: _Reader, data: dict) -> tuple[tuple[str, str], ...]:
  out = []
  for j, item in enumerate(r.array(data.get("remat", []), "remat")):  # optional: older
    layer, policy = r.pair(item, f"remat[{j}]")                      # files have none
    policy = r.string(policy, f"remat[{j}][1]")
    if policy not in REMAT_POLICIES:
      raise r.fail(f"remat[{j}][1]", f"one of {REMAT_POLICIES}", policy)
    out.append((r.string(layer, f"remat[{j}][0]"), policy))
  return tuple(out)


def _compiled(r: _Reader, value: Any) -> records.CompiledFigures:
  """The compiler's figures (`plan.compiled`), every field checked."""
  names = {f.name for f in dataclasses.fields(records.CompiledFigures)}
  c = r.mapping(value, "compiled", names)
  field = lambda k: r.field(c, k, f"compiled.{k}")  # noqa: E731
  ints = {k: r.integer(field(k), f"compiled.{k}") for k in
          ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")}
  comm = tuple((r.string(r.pair(kv, f"compiled.comm_bytes[{i}]")[0],
                         f"compiled.comm_bytes[{i}][0]"),
                float(r.number(kv[1], f"compiled.comm_bytes[{i}][1]")))
               for i, kv in enumerate(r.array(field("comm_bytes"), "compiled.comm_bytes")))
  rounds = []
  for i, item in enumerate(r.array(field("rounds"), "compiled.rounds")):
    if not isinstance(item, list) or len(item) != 3:
      raise r.fail(f"compiled.rounds[{i}]", "[budget, predicted, compiled] bytes", item)
    rounds.append(tuple(math.inf if x is None else float(r.number(
        x, f"compiled.rounds[{i}][{j}]")) for j, x in enumerate(item)))
  return records.CompiledFigures(
      target=r.string(field("target"), "compiled.target"), **ints,
      hbm_bytes=float(r.number(field("hbm_bytes"), "compiled.hbm_bytes")),
      fits=r.of(field("fits"), bool, "compiled.fits", "true or false"),
      flops=float(r.number(field("flops"), "compiled.flops")), comm_bytes=comm,
      rounds=tuple(rounds), error=r.string(field("error"), "compiled.error"),
      # Files written before the compiler's live peak was read have none.
      live_peak_bytes=r.integer(c.get("live_peak_bytes", 0), "compiled.live_peak_bytes"))


def _open_at_end(text: str) -> bool:
  """Whether a string or bracket is still open where the text stops."""
  depth, in_string, escaped = 0, False, False
  for ch in text:
    if in_string:
      escaped, in_string = (not escaped and ch == "\\"), in_string and (escaped or ch != '"')
    elif ch == '"':
      in_string = True
    elif ch in "[{":
      depth += 1
    elif ch in "]}":
      depth -= 1
  return in_string or depth > 0


def load(path: str | os.PathLike, plan_type: Callable[..., Any]) -> Any:
  """Reads a plan `save` wrote, as a `plan_type` (`tapas_jax.Plan`: see `from_json`);
  `PlanFileError` names what is wrong with a bad file."""
  source = os.fspath(path)
  try:
    with open(source, encoding="utf-8") as f:
      text = f.read()
  except OSError as e:
    raise PlanFileError(f"{source}: cannot read the plan file: {e.strerror}") from e
  try:
    data = json.loads(text)
  except json.JSONDecodeError as e:
    cut = " (the file ends before its brackets close: truncated?)" if _open_at_end(text) \
        else ""
    raise PlanFileError(f"{source}: not valid JSON at line {e.lineno}, column {e.colno}: "
                        f"{e.msg}{cut}. Save the plan again.") from None
  return from_json(data, plan_type, source)
