"""The public surface is small and pinned."""

import dataclasses
import gc
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tapas_jax as tapas
import tapas_jax.fold
import tapas_jax.trace
from tapas_jax import baselines, models, options

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_public_api_is_pinned():
  assert sorted(tapas.__all__) == [
      "Folded", "Graph", "InfeasibleBudgetError", "MeshError", "Plan", "PlanStats",
      "SearchConfig", "Solver", "TapasError", "TraceError", "Verified", "apply", "fold",
      "make_mesh", "models", "place", "remat_policy", "search", "shard", "tpu_mesh", "trace",
      "verify"]
  for name in tapas.__all__:
    assert hasattr(tapas, name), name


def test_stage_functions_are_importable_from_their_modules():
  trace, fold = tapas_jax.trace.trace, tapas_jax.fold.fold
  graph = trace(lambda x: jnp.sum(x * 2), jax.ShapeDtypeStruct((4, 4), jnp.float32))
  folded = fold(graph)
  assert isinstance(graph, tapas.Graph) and isinstance(folded, tapas.Folded)
  assert [op.primitive for op in graph.ops] == ["mul", "reduce_sum"]
  assert folded.graph is graph
  assert tapas.trace.trace is trace and tapas.fold.fold is fold


def _python(code: str) -> str:
  """Runs `code` in a fresh interpreter on this checkout; returns its stdout."""
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=120, check=False)
  assert done.returncode == 0, done.stderr
  return done.stdout.strip()


def test_import_tapas_jax_loads_no_flax_or_optax():
  # The zoo (flax, optax) loads on first use of `tapas.models`, and the flax module
  # integration (`shard_flax`) when `tapas.shard` first meets a Module class; the rest of
  # the library needs neither.
  code = "import tapas_jax, sys; print('flax' in sys.modules, 'optax' in sys.modules)"
  assert _python(code) == "False False"
  every_module = """
import importlib, pkgutil, sys
import tapas_jax, tapas_jax.solver
names = [m.name for pkg in (tapas_jax, tapas_jax.solver)  # not walk_packages: it imports
         for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + ".")]  # the zoo
for name in names:
  if name not in ("tapas_jax.models", "tapas_jax.shard_flax"):
    importlib.import_module(name)
print(len(names) > 10, [m for m in ("flax", "optax") if m in sys.modules])
"""
  assert _python(every_module) == "True []"


def test_models_loads_lazily_and_is_the_zoo():
  code = """
import sys
import tapas_jax as tapas
assert "tapas_jax.models" not in sys.modules and "models" in dir(tapas)
zoo = tapas.models
from tapas_jax import models
assert zoo is models is sys.modules["tapas_jax.models"]
print("gpt" in models.FAMILIES, "flax" in sys.modules)
"""
  assert _python(code) == "True True"
  with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
    tapas.no_such_thing  # noqa: B018


def test_make_mesh_gives_auto_axes():
  mesh = tapas.make_mesh({"data": 2, "model": 4})
  assert dict(mesh.shape) == {"data": 2, "model": 4}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  assert tapas.mesh.check_auto(mesh) is mesh


def test_make_mesh_wrong_size_says_how_to_fix():
  with pytest.raises(tapas.MeshError, match=r"need 6 devices, 8 are available.*multiply"):
    tapas.make_mesh({"data": 2, "model": 3})


def test_explicit_mesh_is_rejected_with_a_fix():
  explicit = jax.make_mesh((2, 4), ("data", "model"),
                           axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  with pytest.raises(tapas.MeshError, match="not AxisType.Auto.*tapas_jax.make_mesh"):
    tapas.mesh.check_auto(explicit)


# -- options are checked before anything is traced ----------------------------------

W, X = jax.ShapeDtypeStruct((8, 8), jnp.float32), jax.ShapeDtypeStruct((64, 8), jnp.float32)
GOOD = dict(mesh={"data": 2, "model": 4}, device="cpu")

BAD_SEARCH_OPTIONS = [
    ({"mesh": {"data": 2.5, "model": 4}}, tapas.MeshError, r"'data' has size 2.5 .*positive int"),
    ({"mesh": {"data": True, "model": 8}}, tapas.MeshError, r"'data' has size True \(bool\)"),
    ({"mesh": {"data": 0, "model": 8}}, tapas.MeshError, r"'data' has size 0"),
    ({"mesh": {"data": -2}}, tapas.MeshError, r"'data' has size -2"),
    ({"mesh": {1: 8}}, tapas.MeshError, r"axis name 1 is a int.*strings"),
    ({"mesh": {}}, tapas.MeshError, "no axes"),
    ({"mesh": (2, 4)}, tapas.MeshError, r"is a tuple; pass a dict of axis sizes"),
    ({"device": "h1000"}, ValueError, r"device='h1000' is not a known device profile.*h100"),
    ({"memory_budget": "16 gigs"}, ValueError,
     r"memory_budget='16 gigs' is not a memory size.*GiB"),
    ({"memory_budget": -1}, ValueError, "must be a positive number of bytes"),
    ({"memory_budget": 0}, ValueError, "must be a positive number of bytes"),
    ({"memory_budget": "-3GB"}, ValueError, "is not a memory size"),
    ({"memory_budget": float("nan")}, ValueError, "must be a positive number of bytes"),
    ({"memory_budget": [16]}, ValueError, r"memory_budget=\[16\] is a list"),
    ({"batch_axes": "dat"}, ValueError, r"batch_axes names 'dat', which is not an axis.*'data'"),
    ({"batch_axes": ("data", "pipe")}, ValueError, "batch_axes names 'pipe'"),
    ({"batch_axes": 3}, ValueError, r"batch_axes=3 is a int; give one mesh axis name"),
    ({"batch_axes": ("data", "data")}, ValueError, "names an axis twice"),
    ({"fold": "yes"}, ValueError, r"fold='yes' is a str; use True or False"),
    ({"fold": 1}, ValueError, r"fold=1 is a int; use True or False"),
    ({"solver": "cplex"}, ValueError, r"solver='cplex' is not a solver.*'elimination', 'ilp'"),
    ({"time_limit": 0}, ValueError, "time_limit=0 must be a positive number of seconds"),
    ({"time_limit": "10s"}, ValueError, "time_limit='10s' must be a positive number"),
    ({"links": {"pipe": "inter"}}, ValueError, "links names axis 'pipe'"),
    ({"kwargs": [("x", X)]}, ValueError, "kwargs=.* is a list; pass the step's keyword"),
    ({"verify": "v5p"}, ValueError, r"verify='v5p' is not a TPU topology name.*'v5e:2x2'"),
    ({"verify": 8}, ValueError, r"verify=8 is not a TPU topology name"),
    ({"layouts": "tiled"}, ValueError, r"layouts='tiled'; pass 'default' .* or 'auto'"),
]


@pytest.mark.parametrize("bad,error,message", BAD_SEARCH_OPTIONS,
                         ids=[repr(b)[:40] for b, _, _ in BAD_SEARCH_OPTIONS])
def test_search_checks_each_option_before_tracing(bad, error, message):
  traced = []

  def loss(w, x):
    traced.append(1)
    return jnp.sum(x @ w)

  with pytest.raises(error, match=message):
    tapas.search(loss, W, X, **{**GOOD, **bad})
  assert not traced, "the option was checked only after tracing"


@pytest.mark.parametrize("text,expected", [
    ("16GiB", 16 * 2**30), ("16GB", 16e9), ("1.5 TiB", 1.5 * 2**40), ("512MiB", 512 * 2**20),
    ("512 mib", 512 * 2**20), ("2e9", 2e9), ("100B", 100), (3 * 2**30, 3 * 2**30),
    (None, None)])
def test_memory_sizes_count_decimal_and_binary_units(text, expected):
  assert options.memory_bytes(text) == expected


@pytest.mark.parametrize("value,expected", [
    ("data", ("data",)), (["data", "model"], ("data", "model")), (None, None),
    ((), ()), ("default", None)])
def test_batch_axes_take_one_name_or_a_sequence(value, expected):
  assert options.batch_axes(value, {"data": 2, "model": 4}) == expected


def test_one_batch_axis_name_is_not_read_letter_by_letter():
  big = (jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
         jax.ShapeDtypeStruct((65536, 4096), jnp.float32))
  f = lambda w, x: jnp.sum(jnp.tanh(x @ w))  # noqa: E731
  plan = tapas.search(f, *big, batch_axes="model", mesh={"data": 2, "model": 4}, device="h100")
  assert plan.in_specs[1][0] == "model"
  plan = tapas.search(f, *big, batch_axes=("data", "model"), mesh={"data": 2, "model": 4},
                      device="h100")
  assert plan.in_specs[1][0] == ("data", "model")


def _timings(stats) -> dict:
  """The stats fields that are seconds taken: equal plans differ only in them."""
  return {k: getattr(stats, k) for k in ("trace_s", "fold_s", "search_s", "plan_s",
                                         "report_s")}


def test_memory_budget_string_plans_like_its_bytes():
  f = lambda w, x: jnp.sum(jnp.tanh(x @ w))  # noqa: E731
  a = tapas.search(f, W, X, memory_budget="1MiB", **GOOD)
  b = tapas.search(f, W, X, memory_budget=2**20, **GOOD)
  assert a.in_specs == b.in_specs and a.stats == dataclasses.replace(
      b.stats, **_timings(a.stats))


BAD_MAKE_MESH = [
    ({"data": 2.0, "model": 4}, r"'data' has size 2.0 .*did you mean 2"),
    ({"data": True, "model": 8}, r"size True \(bool\)"),
    ({"data": 8, 3: 1}, "axis name 3"),
    ([("data", 8)], "is a list; pass a dict"),
]


@pytest.mark.parametrize("axes,message", BAD_MAKE_MESH)
def test_make_mesh_checks_names_and_sizes(axes, message):
  with pytest.raises(tapas.MeshError, match=message):
    tapas.make_mesh(axes)


def _plan():
  return tapas.search(lambda w, x: jnp.sum(x @ w), W, X, **GOOD)


@pytest.mark.parametrize("call,message", [
    (lambda plan: tapas.apply("plan.json", lambda w, x: w),
     "first argument must be a tapas Plan"),
    (lambda plan: tapas.apply(plan, None), "fn must be callable"),
    (lambda plan: tapas.apply(plan, lambda w, x: w, donate_argnums=2),
     "names argument 2, but the plan has 2 positional"),
    (lambda plan: tapas.apply(plan, lambda w, x: w, donate_argnums="0"),
     "must be an int or a sequence of ints"),
    (lambda plan: tapas.apply(plan, lambda w, x: w, donate_argnames="state"),
     r"donate_argnames names 'state', which is not an argument of the plan \(positional "
     r"\['w', 'x'\]"),
    (lambda plan: tapas.apply(plan, lambda w, x: w, mesh={"data": 2, "model": 4}),
     r"is a dict; pass a jax.sharding.Mesh"),
    (lambda plan: tapas.place(plan, np.ones((8, 8)), kwargs=3), "kwargs=3 is a int"),
    (lambda plan: tapas.place(plan, np.ones((8, 8))),
     r"called with 2 positional argument\(s\); got 1 positional"),
])
def test_apply_and_place_check_their_options(call, message):
  with pytest.raises(ValueError, match=message):
    call(_plan())


def test_a_mesh_mismatch_names_the_axis():
  with pytest.raises(tapas.MeshError, match="axis 'data' has size 4, the plan's 2"):
    tapas.apply(_plan(), lambda w, x: w, mesh=tapas.make_mesh({"data": 4, "model": 2}))
  with jax.set_mesh(tapas.make_mesh({"data": 8})):
    with pytest.raises(tapas.MeshError, match="the mesh set by jax.set_mesh.*'data' has size 8"):
      tapas.apply(_plan(), lambda w, x: w)


def test_donate_argnames_reach_keyword_and_positional_arguments():
  f = lambda w, x, *, b: jnp.sum(x @ w) + b  # noqa: E731
  plan = tapas.search(f, W, X, kwargs={"b": jax.ShapeDtypeStruct((), jnp.float32)}, **GOOD)
  step = tapas.apply(plan, f, donate_argnames=("b", "w"))
  assert step.donate == (0, 2)  # w first, then x, then the keywords in name order
  w, x = np.ones((8, 8), np.float32), np.ones((64, 8), np.float32)
  b = jnp.float32(1.0)
  np.testing.assert_allclose(step(w, x, b=b), f(w, x, b=1.0), rtol=1e-6)


def test_an_infeasible_budget_prints_sizes_that_show_the_difference():
  f = lambda w, x: jnp.sum(jnp.tanh(x @ w))  # noqa: E731
  big = (jax.ShapeDtypeStruct((512, 512), jnp.float32),
         jax.ShapeDtypeStruct((4096, 512), jnp.float32))
  with pytest.raises(tapas.InfeasibleBudgetError) as e:
    tapas.search(f, *big, mesh={"data": 8}, device="cpu", memory_budget=0.1 * 2**20)
  assert "memory_budget=102.40 KiB per device" in str(e.value)
  assert "GiB" not in str(e.value).split("Largest inputs")[0]
  assert options.format_bytes(0.71 * 2**20) == "727.04 KiB"


# -- one search config ---------------------------------------------------------------

# The options a config holds, bad: the mesh's own checks (axis names) wait for the mesh.
BAD_CONFIG_OPTIONS = [(bad, error, message) for bad, error, message in BAD_SEARCH_OPTIONS
                      if set(bad) <= set(options.SEARCH_OPTIONS) and "links" not in bad
                      and "pipe" not in str(bad) and "which is not an axis" not in message]


@pytest.mark.parametrize("bad,error,message", BAD_CONFIG_OPTIONS,
                         ids=[repr(b)[:40] for b, _, _ in BAD_CONFIG_OPTIONS])
def test_config_checks_each_option_as_the_keyword_does(bad, error, message):
  with pytest.raises(error, match=message):
    tapas.SearchConfig(**bad)
  with pytest.raises(error, match=message):
    tapas.shard(lambda w, x: jnp.sum(x @ w), **bad)  # when decorated, not at the first call


def test_config_holds_checked_values_and_replace_checks_again():
  c = tapas.SearchConfig(memory_budget="1GiB", batch_axes="data", solver="ilp",
                         links={"model": "intra", "data": "inter"}, time_limit=5)
  assert (c.memory_budget, c.batch_axes, c.solver, c.links, c.time_limit) == (
      2.0**30, ("data",), tapas.Solver.ILP, (("data", "inter"), ("model", "intra")), 5.0)
  assert dataclasses.replace(c, memory_budget="2GiB").memory_budget == 2.0**31
  assert dataclasses.replace(c, fold=False) == tapas.SearchConfig(**{
      **{f.name: getattr(c, f.name) for f in dataclasses.fields(c)}, "fold": False})
  with pytest.raises(options.OptionError, match="time_limit=-1"):
    dataclasses.replace(c, time_limit=-1)
  assert hash(c) == hash(dataclasses.replace(c))
  # What older callers passed for every axis is None, said in one place.
  assert tapas.SearchConfig(batch_axes="default").batch_axes is None


def test_search_with_config_plans_as_with_keywords():
  f = lambda w, x: jnp.sum(jnp.tanh(x @ w))  # noqa: E731
  big = (jax.ShapeDtypeStruct((512, 512), jnp.float32),
         jax.ShapeDtypeStruct((4096, 512), jnp.float32))
  keywords = dict(device="h100", memory_budget="6MiB", batch_axes=("data",), fold=False,
                  solver="elimination", sequence_parallel=False)
  a = tapas.search(f, *big, mesh={"data": 2, "model": 4}, **keywords)
  b = tapas.search(f, *big, mesh={"data": 2, "model": 4},
                   config=tapas.SearchConfig(**keywords))
  assert a.in_specs == b.in_specs and a.stats == dataclasses.replace(
      b.stats, **_timings(a.stats))
  assert a.stats.predicted_memory_bytes <= 6 * 2**20


@pytest.mark.parametrize("call,message", [
    (lambda f: tapas.search(f, W, X, config=tapas.SearchConfig(), fold=False, **GOOD),
     r"either as keywords or as config=, not both \(got config= and device, fold="),
    (lambda f: tapas.search(f, W, X, folds=False, **GOOD), r"unknown option\(s\) \['folds'\]"),
    (lambda f: tapas.search(f, W, X, config={"fold": False}, **GOOD),
     "config=.* is a dict; pass a tapas_jax.options.SearchConfig"),
    (lambda f: tapas.shard(f, config=tapas.SearchConfig(), device="cpu"), "not both"),
    (lambda f: tapas.shard(f, solvers="ilp"), r"unknown option\(s\) \['solvers'\]"),
])
def test_config_and_keywords_together_is_an_error(call, message):
  with pytest.raises(TypeError, match=message):
    call(lambda w, x: jnp.sum(x @ w))


def test_baseline_takes_a_config():
  f = lambda w, x: jnp.sum(jnp.tanh(x @ w))  # noqa: E731
  a = baselines.baseline("fsdp", f, W, X, mesh={"data": 8}, device="h100")
  b = baselines.baseline("fsdp", f, W, X, mesh={"data": 8},
                         config=tapas.SearchConfig(device="h100"))
  assert a.in_specs == b.in_specs
  assert a.stats.predicted_step_s == b.stats.predicted_step_s
  with pytest.warns(UserWarning, match="over memory_budget="):
    baselines.baseline("data_parallel", f, W, X, mesh={"data": 8}, device="h100",
                       memory_budget=100)


@pytest.mark.parametrize("name,config,mesh", [
    ("gpt", "tiny", {"data": 2, "model": 4}),
    ("t5", "tiny", {"data": 2, "model": 4}),
    ("moe", "tiny", {"data": 2, "model": 4}),
])
@pytest.mark.parametrize("budget", [None, 0.7])
def test_a_search_leaves_no_cycle_holding_its_graph(name, config, mesh, budget):
  # The trace, `prepare` and the solve hand what they make to the collector's oldest
  # generation unscanned (`trace.collector_paused`): a cycle among it
  # (a recursive closure over the graph, a table holding its builder) would hold it
  # until a full collection.
  m = models.get_model(name, config)
  args = (m.train_step(), m.abstract_state(), m.batch_spec(8))
  kwargs = {}
  if budget is not None:  # the budgeted search's own passes (remat, repair) too
    free = tapas.search(*args, mesh=mesh, device="h100", memory_budget=float("inf"))
    kwargs = dict(memory_budget=budget * free.stats.predicted_memory_bytes)
  gc.collect()
  tapas.search(*args, mesh=mesh, device="h100", **kwargs)
  gc.set_debug(gc.DEBUG_SAVEALL)
  try:
    gc.collect()
    ours = [o for o in gc.garbage
            if type(o).__module__.startswith("tapas_jax")
            or (type(o).__name__ == "function"
                and getattr(o, "__module__", "").startswith("tapas_jax"))]
  finally:
    gc.set_debug(0)
    gc.garbage.clear()
  assert not ours, [getattr(o, "__qualname__", type(o).__name__) for o in ours]
