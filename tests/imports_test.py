"""The package's modules import only stages below them: no circles, no upward edges,
and no import inside a function but the documented lazy ones; none is over 800 lines.

The graph is read from the source with `ast` (nothing is imported): every `import x`,
`from x import y` (y a module when it is one), `from . import y` and relative form, at
the top of a module or inside a function, plus `importlib.import_module("literal")`.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "tapas_jax"

# The stages, lower first: a module may import modules of its own stage (the cycle
# check keeps those acyclic) and of stages before it, never one after it. The same
# order is drawn in tapas_jax/README.md. An entry ending in "." is every module of
# that package.
STAGES = (
    ("tapas_jax.errors",),
    ("tapas_jax._jax_internals",),
    ("tapas_jax.profiles",),
    ("tapas_jax.options",),
    ("tapas_jax.mesh",),
    ("tapas_jax.trace",),
    ("tapas_jax.op_rule",),
    ("tapas_jax.rules",),
    ("tapas_jax.repeats",),
    ("tapas_jax.fold",),
    ("tapas_jax.cost",),
    ("tapas_jax.solver", "tapas_jax.solver."),
    ("tapas_jax.plan_records",),
    ("tapas_jax.plan_file",),
    ("tapas_jax.plan",),
    ("tapas_jax.apply", "tapas_jax.fences"),
    ("tapas_jax.measure",),
    ("tapas_jax.verify",),
    ("tapas_jax.api",),
    ("tapas_jax.baselines",),
    ("tapas_jax.shard_flax",),
    ("tapas_jax.shard",),
    ("tapas_jax.models", "tapas_jax.models."),
    ("tapas_jax",),
)

# (importing module, imported module) -> why the import waits for a call. Third-party
# imports are named by their top-level package.
LAZY = {
    ("tapas_jax", "tapas_jax.models"): "the zoo imports flax and optax",
    ("tapas_jax.shard", "tapas_jax.shard_flax"): "shard_flax imports flax and optax",
    ("tapas_jax.verify", "jax"): "jax.experimental.topologies: only for TPU targets",
    ("tapas_jax.verify", "libtpu"): "the TPU compiler, an optional extra",
    ("tapas_jax.solver.ilp", "scipy"): "only the reference integer program needs it",
}


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
  return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(node: ast.ImportFrom, name: str, is_package: bool) -> str:
  """The absolute module of a `from ... import` (relative levels counted from `name`)."""
  if not node.level:
    return node.module or ""
  base = name.split(".")
  base = base[:len(base) - node.level + (1 if is_package else 0)]
  return ".".join(base + ([node.module] if node.module else []))


def imports(name: str, source: str, is_package: bool, known: set[str]
            ) -> list[tuple[str, int, bool]]:
  """(imported module, line, inside a function) for every import in `source`.

  `from p import x` counts as importing `p.x` where that is a module of the package,
  else `p`. A package's own `__init__` is not counted for its submodules: importing
  `tapas_jax.solver.problem` runs `tapas_jax.solver` first, but that is Python's
  loading order, not a dependency one module states on another.
  """
  out = []

  def visit(node: ast.AST, in_function: bool) -> None:
    for child in ast.iter_child_nodes(node):
      inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                ast.Lambda))
      if isinstance(child, ast.Import):
        out.extend((a.name, child.lineno, in_function) for a in child.names)
      elif isinstance(child, ast.ImportFrom):
        base = _resolve(child, name, is_package)
        for a in child.names:
          sub = f"{base}.{a.name}" if base else a.name
          out.append((sub if sub in known else base, child.lineno, in_function))
      elif (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
            and child.func.attr == "import_module" and child.args
            and isinstance(child.args[0], ast.Constant)
            and isinstance(child.args[0].value, str)):
        out.append((child.args[0].value, child.lineno, in_function))
      visit(child, inner)

  visit(ast.parse(source), False)
  return out


def stage_of(name: str) -> int:
  for i, stage in enumerate(STAGES):
    if any(name == s or (s.endswith(".") and name.startswith(s)) for s in stage):
      return i
  raise AssertionError(f"module {name} is in no stage of STAGES: add it where it belongs")


def graph(sources: dict[str, str]) -> dict[str, list[tuple[str, int, bool]]]:
  """module -> its imports of other tapas_jax modules and of third-party packages."""
  known = set(sources)
  out = {}
  for name, source in sources.items():
    is_package = name in known and any(k.startswith(name + ".") for k in known)
    edges = []
    for target, line, lazy in imports(name, source, is_package, known):
      if target.startswith("tapas_jax"):
        while target not in known and "." in target:  # `import tapas_jax.x.y` etc.
          target = target.rsplit(".", 1)[0]
        if target == name or name.startswith(target + "."):
          continue  # itself, or its own package (see `imports`)
      edges.append((target, line, lazy))
    out[name] = edges
  return out


def cycles(edges: dict[str, list[tuple[str, int, bool]]]) -> list[list[str]]:
  """Every import circle among the package's modules (one per strongly connected
  component, as a path that starts and ends on the same module)."""
  inner = {m: sorted({t for t, _, _ in e if t in edges}) for m, e in edges.items()}
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def connect(v: str) -> None:  # Tarjan's strongly connected components
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in inner[v]:
      if w not in index:
        connect(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(_loop(sorted(component), inner))

  for v in sorted(inner):
    if v not in index:
      connect(v)
  return found


def _loop(component: list[str], inner: dict[str, list[str]]) -> list[str]:
  """A shortest circle through the component's first module, by breadth-first search."""
  start, members = component[0], set(component)
  paths = {start: [start]}
  queue = [start]
  while queue:
    v = queue.pop(0)
    for w in inner[v]:
      if w == start:
        return paths[v] + [start]
      if w in members and w not in paths:
        paths[w] = paths[v] + [w]
        queue.append(w)
  raise AssertionError(component)


def problems(sources: dict[str, str]) -> list[str]:
  """What is wrong with the import graph of `sources` (module name -> source text)."""
  edges = graph(sources)
  found = [f"import circle: {' -> '.join(c)}" for c in cycles(edges)]
  for name, targets in sorted(edges.items()):
    for target, line, lazy in sorted(set(targets), key=lambda t: (t[1], t[0])):
      ours = target in edges
      if ours and stage_of(target) > stage_of(name):
        found.append(f"upward import: {name} (stage {stage_of(name)}) imports {target} "
                     f"(stage {stage_of(target)}), line {line}")
      key = (name, target if ours else target.split(".")[0])
      if lazy and key not in LAZY:
        found.append(f"import inside a function: {name} imports {target}, line {line}; "
                     "import it at the top, or document it in LAZY")
  return found


def package_sources() -> dict[str, str]:
  return {name: path.read_text() for name, path in modules().items()}


def test_every_module_is_in_a_stage():
  for name in modules():
    stage_of(name)


def test_no_circles_no_upward_imports_no_undocumented_lazy_imports():
  found = problems(package_sources())
  assert not found, "\n".join(found)


def test_lazy_imports_say_why():
  # Each documented lazy import statement carries `noqa: PLC0415 - <why>` on its line
  # (`importlib.import_module` calls are not what the lint rule flags).
  sources = package_sources()
  for name, targets in graph(sources).items():
    lines = sources[name].splitlines()
    for _, line, lazy in targets:
      text = lines[line - 1]
      if lazy and "import_module(" not in text:
        assert "PLC0415 - " in text, f"{name}:{line}: {text.strip()}"


def test_every_lazy_import_listed_is_used():
  used = set()
  for name, targets in graph(package_sources()).items():
    for target, _, lazy in targets:
      if lazy:
        used.add((name, target if target.startswith("tapas_jax") else target.split(".")[0]))
  assert set(LAZY) <= used, sorted(set(LAZY) - used)


# The modules above the solver that build plans see only its result and its public
# names (`tapas_jax/solver/__init__.py` `__all__`): no submodule, no class id read off
# a `Problem` by hand (issue 19).
SOLVER_CLIENTS = ("tapas_jax.plan", "tapas_jax.plan_records", "tapas_jax.plan_file",
                  "tapas_jax.baselines", "tapas_jax.shard_flax", "tapas_jax.api",
                  "tapas_jax.apply")


def solver_surface(init_source: str) -> set[str]:
  """The names in the solver package's `__all__`."""
  for node in ast.parse(init_source).body:
    if (isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)):
      return set(ast.literal_eval(node.value))
  raise AssertionError("tapas_jax/solver/__init__.py has no __all__")


def solver_leaks(name: str, source: str, surface: set[str]) -> list[str]:
  """Where `source` reaches into the solver past `surface`: a submodule imported
  (`from tapas_jax.solver import remat`, `import tapas_jax.solver.tables`), a name
  imported or read (`solver.experts`, `solverlib.problem.x`) that is not public."""
  out, aliases = [], set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith("tapas_jax.solver."):
          out.append(f"{name}:{node.lineno} imports {a.name}")
    elif isinstance(node, ast.ImportFrom) and node.module:
      if node.module.startswith("tapas_jax.solver."):
        out.append(f"{name}:{node.lineno} imports from {node.module}")
      elif node.module == "tapas_jax.solver":
        out += [f"{name}:{node.lineno} imports tapas_jax.solver.{a.name}, not public"
                for a in node.names if a.name not in surface]
      elif node.module == "tapas_jax":
        aliases |= {a.asname or a.name for a in node.names if a.name == "solver"}
  for node in ast.walk(ast.parse(source)):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in aliases and node.attr not in surface):
      out.append(f"{name}:{node.lineno} reads {node.value.id}.{node.attr}, not public")
  return out


# What a `Problem` or `Solution` says in class ids: the plan, the baselines and the
# forward plans state layouts in plan terms (`solver.layout_choice`) and read the
# solver's result in plan terms (`Solution.terms`) instead.
CLASS_ID_READS = frozenset({"choice", "classes", "cv", "domains", "factor_class",
                            "read_class", "reader_dims", "scan_cuts", "value_class",
                            "vclass"})


def class_id_reads(name: str, source: str) -> list[str]:
  return [f"{name}:{node.lineno} reads .{node.attr}" for node in ast.walk(ast.parse(source))
          if isinstance(node, ast.Attribute) and node.attr in CLASS_ID_READS]


def test_plans_see_the_solver_through_its_public_names_only():
  sources = package_sources()
  surface = solver_surface(sources["tapas_jax.solver"])
  found = [leak for name in SOLVER_CLIENTS
           for leak in solver_leaks(name, sources[name], surface)]
  found += [leak for name in ("tapas_jax.plan", "tapas_jax.baselines", "tapas_jax.shard_flax")
            for leak in class_id_reads(name, sources[name])]
  assert not found, "\n".join(found)


@pytest.mark.parametrize("source, expected", [
    ("from tapas_jax.solver import Solution\nfrom tapas_jax import solver\nsolver.solve\n", []),
    ("from tapas_jax.solver import remat, tables\n",
     ["m:1 imports tapas_jax.solver.remat, not public",
      "m:1 imports tapas_jax.solver.tables, not public"]),
    ("from tapas_jax.solver.problem import Problem\nimport tapas_jax.solver.memory\n",
     ["m:2 imports tapas_jax.solver.memory", "m:1 imports from tapas_jax.solver.problem"]),
    ("from tapas_jax import solver as s\nx = s.experts.fsdp\ny = s.evaluate\n",
     ["m:2 reads s.experts, not public"]),
])
def test_the_solver_surface_check_finds_each_leak(source, expected):
  assert sorted(solver_leaks("m", source, {"Solution", "solve", "evaluate"})) == sorted(expected)


def test_the_class_id_check_finds_each_read():
  source = "c = problem.vclass(v, 0)\nok = problem.mesh\naxes = solution.choice[c]\n"
  assert class_id_reads("m", source) == ["m:1 reads .vclass", "m:3 reads .choice"]


# A module longer than this has more than one job: split it along a seam, each part
# named for its job.
MAX_LINES = 800


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_module_over_max_lines(name):
  lines = modules()[name].read_text().count("\n")
  assert lines <= MAX_LINES, f"{name} has {lines} lines, over {MAX_LINES}"


def test_the_package_readme_draws_the_same_order():
  # tapas_jax/README.md's table: "| stage | `module` | job | imports |", one row a stage.
  rows = re.findall(r"^\| (\d+) \| `([\w/]+)` \|", (PACKAGE / "README.md").read_text(),
                    re.MULTILINE)
  named = {"__init__": "tapas_jax"}
  order = [named.get(m, "tapas_jax." + m.rstrip("/")) for _, m in rows]
  assert [int(n) for n, _ in rows] == list(range(len(STAGES)))
  assert order == [stage[0] for stage in STAGES]


# The checker itself: each kind of fault in a small made-up package.
@pytest.mark.parametrize("sources, expected", [
    ({"tapas_jax.trace": "from tapas_jax import fold\n",
      "tapas_jax.fold": "from tapas_jax.trace import Graph\n"},
     ["import circle: tapas_jax.fold -> tapas_jax.trace -> tapas_jax.fold",
      "upward import: tapas_jax.trace (stage 5) imports tapas_jax.fold (stage 9), line 1"]),
    ({"tapas_jax.plan": "def f():\n  from . import plan_file\n",
      "tapas_jax.plan_file": "from tapas_jax import plan as planlib\n"},
     ["import circle: tapas_jax.plan -> tapas_jax.plan_file -> tapas_jax.plan",
      "import inside a function: tapas_jax.plan imports tapas_jax.plan_file, line 2; "
      "import it at the top, or document it in LAZY",
      "upward import: tapas_jax.plan_file (stage 13) imports tapas_jax.plan (stage 14), "
      "line 1"]),
    ({"tapas_jax.api": "import numpy\ndef f():\n  import jax\n"},
     ["import inside a function: tapas_jax.api imports jax, line 3; import it at the top, "
      "or document it in LAZY"]),
    ({"tapas_jax.solver.solve": "from ..cost import mesh_spec\nfrom . import budget\n",
      "tapas_jax.solver.budget": "from .solve import solve\n",
      "tapas_jax.cost": "import importlib\nimportlib.import_module('tapas_jax.plan')\n",
      "tapas_jax.plan": ""},
     ["import circle: tapas_jax.solver.budget -> tapas_jax.solver.solve -> "
      "tapas_jax.solver.budget",
      "upward import: tapas_jax.cost (stage 10) imports tapas_jax.plan (stage 14), line 2"]),
    ({"tapas_jax.shard": "def f():\n  from tapas_jax import shard_flax  # noqa: PLC0415\n",
      "tapas_jax.shard_flax": "import flax\n"}, []),
])
def test_the_checker_finds_each_fault(sources, expected):
  assert problems(sources) == expected
