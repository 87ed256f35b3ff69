"""Plans as files: save -> load gives the plan back, a loaded plan applies and runs
like the searched one, bad files and mismatched programs or meshes say what differs."""

import dataclasses
import functools
import copy
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import tapas_jax as tapas
from tapas_jax import models, plan_file

MESH = {"data": 2, "model": 4}
W = jax.ShapeDtypeStruct((512, 512), jnp.float32)
X = jax.ShapeDtypeStruct((4096, 512), jnp.float32)


def small(w, x):
  return jnp.sum(jnp.tanh(x @ w) ** 2)


def nested(p, xs):
  return small(p["w"], xs[0])


@functools.lru_cache(maxsize=None)
def small_plan():
  return tapas.search(nested, {"w": W, "extra": None}, [X], mesh=MESH, device="h100")


@functools.lru_cache(maxsize=None)
def zoo_plan(family):
  m = models.get_model(family, "tiny")
  return m, tapas.search(m.train_step(), m.abstract_state(), m.batch_spec(8), mesh=MESH,
                         device="cpu")


def leaves_with_paths(tree):
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, P))[0]
  return [(tapas.trace.key_path_str(p), s) for p, s in flat]


def test_a_plan_of_builtin_containers_comes_back_equal(tmp_path):
  plan = small_plan()
  assert any(s != P() for _, s in leaves_with_paths(plan.in_specs)), "nothing split"
  plan.save(tmp_path / "plan.json")
  loaded = tapas.Plan.load(tmp_path / "plan.json")
  assert loaded == plan
  assert type(loaded.in_specs[0]) is dict and type(loaded.in_specs[1]) is list
  assert loaded.in_specs[0]["extra"] is None
  assert json.loads((tmp_path / "plan.json").read_text())["version"] == plan_file.VERSION


def test_a_file_from_before_the_plan_and_report_timings_loads(tmp_path):
  """`PlanStats.plan_s` / `report_s` came after version 1's first files: a file
  without them loads, with the timings 0; the other fields are still required."""
  plan = small_plan()
  assert plan.stats.plan_s > 0 and plan.stats.report_s > 0
  plan.save(tmp_path / "plan.json")
  data = json.loads((tmp_path / "plan.json").read_text())
  for key in ("plan_s", "report_s"):
    del data["stats"][key]
  (tmp_path / "old.json").write_text(json.dumps(data))
  loaded = tapas.Plan.load(tmp_path / "old.json")
  assert loaded.stats == dataclasses.replace(plan.stats, plan_s=0.0, report_s=0.0)
  del data["stats"]["fold_s"]
  (tmp_path / "bad.json").write_text(json.dumps(data))
  with pytest.raises(plan_file.PlanFileError, match="stats.fold_s"):
    tapas.Plan.load(tmp_path / "bad.json")


@pytest.mark.parametrize("family", ["gpt", "llama_nnx"])
def test_train_state_specs_round_trip_by_key_path(tmp_path, family):
  m, plan = zoo_plan(family)
  plan.save(tmp_path / "plan.json")
  loaded = tapas.Plan.load(tmp_path / "plan.json")
  assert leaves_with_paths(loaded.in_specs) == leaves_with_paths(plan.in_specs)
  assert loaded.constraints == plan.constraints and loaded.layers == plan.layers
  assert loaded.stats == plan.stats and loaded.class_axes == plan.class_axes
  # The file is a fixed point: what a loaded plan writes is what was read.
  assert plan_file.to_json(loaded) == plan_file.to_json(plan)
  # TrainState, optax and nnx nodes come back as stand-ins that bind to the real ones.
  assert isinstance(loaded.in_specs[0], plan_file.StoredNode)
  assert loaded.in_specs[0].type_name.endswith("TrainState")
  bound = loaded.bind(m.abstract_state(), m.batch_spec(8))
  assert bound.in_specs == plan.in_specs  # the real TrainState, optax and nnx nodes again
  with pytest.raises(ValueError, match="argument 1 has 1 leaves, the plan 2; leaf 1 is "
                     "nothing here and 'targets' in the plan"):
    loaded.bind(m.abstract_state(), {"inputs": m.batch_spec(8)["inputs"]})
  lowered = tapas.apply(loaded, m.train_step()).lower(m.abstract_state(), m.batch_spec(8))
  want = tapas.apply(plan, m.train_step()).lower(m.abstract_state(), m.batch_spec(8))
  assert lowered.as_text() == want.as_text()


def test_search_save_load_apply_gives_the_unsharded_loss(tmp_path):
  m, plan = zoo_plan("gpt")
  plan.save(tmp_path / "plan.json")
  loaded = tapas.Plan.load(tmp_path / "plan.json")
  state = m.init(jax.random.key(0))
  batch = m.make_batch(jax.random.key(1), 8)
  _, out = tapas.apply(loaded, m.train_step())(*tapas.place(loaded, state, batch))
  _, ref = jax.jit(m.train_step())(state, batch)
  np.testing.assert_allclose(out["loss"], ref["loss"], rtol=2e-6)


def test_keyword_specs_round_trip(tmp_path):
  plan = tapas.search(small, W, kwargs={"x": X}, mesh=MESH, device="h100")
  plan.save(tmp_path / "plan.json")
  loaded = tapas.Plan.load(tmp_path / "plan.json")
  assert loaded == plan and loaded.kwargs_specs["x"] == plan.kwargs_specs["x"]


def test_saving_is_atomic(tmp_path):
  path = tmp_path / "plan.json"
  small_plan().save(path)
  before = path.read_text()
  bad = dataclasses.replace(small_plan(), in_specs=(P(object()),))
  with pytest.raises(plan_file.PlanFileError, match="cannot be written"):
    bad.save(path)
  assert path.read_text() == before, "a failed save changed the file"
  assert os.listdir(tmp_path) == ["plan.json"], "a temporary file was left behind"


def _edit(data, edit):
  data = json.loads(json.dumps(data))
  edit(data)
  return data


def _set(*path_and_value):
  *path, value = path_and_value

  def edit(data):
    for k in path[:-1]:
      data = data[k]
    data[path[-1]] = value
  return edit


def _drop(key):
  return lambda data: data.pop(key)


BAD_FILES = [
    (_set("schema", "other"), r"schema: expected 'tapas_jax.plan', got \"other\""),
    (_set("version", 99), "version 99 was written by a newer tapas_jax"),
    (_set("version", "1"), r"version: expected an int >= 1, got \"1\""),
    (_drop("fingerprint"), "fingerprint: expected a field 'fingerprint', got nothing"),
    (_set("mesh", [["data", "2"], ["model", 4]]), r"mesh\[0\]\[1\]: expected an int >= 1"),
    (_set("mesh", [["data", 0], ["model", 4]]), r"mesh\[0\]\[1\]: expected an int >= 1, got 0"),
    (_set("in_specs", 1, "list", 0, {"P": ["modle"]}),
     r"in_specs\[1\]/0\.P\[0\]: expected a mesh axis \(data, model\), got \"modle\""),
    (_set("in_specs", 0, "dict", 0, 1, {"Q": []}), r"in_specs\[0\]/.*: expected a spec tree"),
    (_set("in_specs", 1, {"list": 3}), r"in_specs\[1\]\.list: expected a list, got 3"),
    (_set("stats", "predicted_step_s", "fast"), "stats.predicted_step_s: expected a number"),
    (_set("stats", "num_equations", 2.5), r"stats.num_equations: expected an int >= 0"),
    (_set("stats", "speed", 1), r"stats: expected only the fields .* also \['speed'\]"),
    (_set("layers", 0, "instances", 0), r"layers\[0\].instances: expected an int >= 1"),
    (_set("class_axes", [["w[1]", 512]]), r"class_axes\[0\]: expected \[example, size"),
    (_set("extra", 1), r"the file: expected only the fields"),
]


@pytest.mark.parametrize("edit,message", BAD_FILES, ids=[m[:30] for _, m in BAD_FILES])
def test_an_edited_file_names_the_field_that_is_wrong(tmp_path, edit, message):
  data = plan_file.to_json(small_plan())
  if "constraints" in message:
    assert data["constraints"]
  path = tmp_path / "plan.json"
  path.write_text(json.dumps(_edit(data, edit)))
  with pytest.raises(plan_file.PlanFileError, match=message):
    tapas.Plan.load(path)


def test_a_truncated_file_says_so(tmp_path):
  path = tmp_path / "plan.json"
  small_plan().save(path)
  text = path.read_text()
  path.write_text(text[:len(text) // 2])
  with pytest.raises(plan_file.PlanFileError, match="not valid JSON .*truncated"):
    tapas.Plan.load(path)
  with pytest.raises(plan_file.PlanFileError, match="cannot read the plan file"):
    tapas.Plan.load(tmp_path / "missing.json")


def test_a_loaded_plan_on_another_program_or_mesh_says_what_differs(tmp_path):
  small_plan().save(tmp_path / "plan.json")
  loaded = tapas.Plan.load(tmp_path / "plan.json")
  step = tapas.apply(loaded, nested)
  other_x = [jax.ShapeDtypeStruct((2048, 512), jnp.float32)]
  with pytest.raises(ValueError, match=r"input '0' is float32\[2048,512\] here, "
                     r"float32\[4096,512\] in the plan"):
    step.lower({"w": W, "extra": None}, other_x)
  with pytest.raises(ValueError, match=r"argument 0 has 1 leaves, the plan 1; leaf 0 is "
                     r"'v' here and 'w' in the plan"):
    step.lower({"v": W, "extra": None}, [X])
  with pytest.raises(ValueError, match="the function or its static options differ"):
    tapas.apply(loaded, lambda p, xs: jnp.sum(xs[0] @ p["w"])).lower(
        {"w": W, "extra": None}, [X])
  with pytest.raises(tapas.MeshError, match="axis 'data' has size 4, the plan's 2"):
    tapas.apply(loaded, nested, mesh=tapas.make_mesh({"data": 4, "model": 2}))


def test_a_plan_with_infinite_numbers_is_refused_by_name(tmp_path):
  plan = dataclasses.replace(small_plan(), stats=dataclasses.replace(
      small_plan().stats, predicted_step_s=float("inf")))
  with pytest.raises(plan_file.PlanFileError, match=r"\['predicted_step_s'\] are not finite"):
    plan.save(tmp_path / "plan.json")
  assert not os.listdir(tmp_path)


def _compiled_plan():
  """A plan carrying the compiler's figures (what `search(..., verify=...)` leaves)."""
  figures = tapas.plan.CompiledFigures(
      target="v5p:2x2x1", argument_bytes=1024, output_bytes=512, alias_bytes=512,
      temp_bytes=4096, hbm_bytes=20 * 2**20, fits=True, flops=1e6,
      comm_bytes=(("all-gather", 100.0), ("total", 100.0)),
      rounds=((float("inf"), 2e7, 3e7), (7e6, 6e6, 5120.0)))
  return dataclasses.replace(small_plan(), compiled=figures)


def test_the_compilers_figures_round_trip(tmp_path):
  plan = _compiled_plan()
  plan.save(tmp_path / "plan.json")
  assert tapas.Plan.load(tmp_path / "plan.json") == plan  # the unlimited budget too
  assert "compiled for v5p:2x2x1: fits, peak 5.00 KiB of 20.00 MiB" in plan.summary()
  assert "search 2 under 6.68 MiB" in plan.summary()
  assert "compiled" not in plan_file.to_json(small_plan())  # older readers: no new field


def test_the_tpu_compilers_live_peak_round_trips_and_older_files_read(tmp_path):
  plan = _compiled_plan()
  live = dataclasses.replace(plan, compiled=dataclasses.replace(plan.compiled,
                                                                live_peak_bytes=3000))
  live.save(tmp_path / "live.json")
  assert tapas.Plan.load(tmp_path / "live.json").compiled.fit_bytes == 3000
  assert "peak 5.00 KiB (live 2.93 KiB, judged)" in live.summary()
  data = copy.deepcopy(plan_file.to_json(plan))
  del data["compiled"]["live_peak_bytes"]  # written before the field
  (tmp_path / "old.json").write_text(json.dumps(data))
  assert tapas.Plan.load(tmp_path / "old.json").compiled == plan.compiled


@pytest.mark.parametrize("field,value,message", [
    ("fits", "yes", r"compiled.fits: expected true or false, got \"yes\""),
    ("temp_bytes", -1, r"compiled.temp_bytes: expected an int >= 0, got -1"),
    ("rounds", [[1, 2]], r"compiled.rounds\[0\]: expected \[budget, predicted, compiled\]"),
    ("speed", 1, r"compiled: expected only the fields")])
def test_a_bad_compiled_field_is_named(tmp_path, field, value, message):
  data = plan_file.to_json(_compiled_plan())
  data["compiled"][field] = value
  path = tmp_path / "plan.json"
  path.write_text(json.dumps(data))
  with pytest.raises(plan_file.PlanFileError, match=message):
    tapas.Plan.load(path)


def test_every_instances_use_specs_round_trip_and_older_files_read_the_layers(tmp_path):
  m = models.get_model("gpt", "tiny")
  plan = tapas.search(m.train_step(), m.abstract_state(), m.batch_spec(8), mesh=MESH,
                      device="cpu", memory_budget="2MiB")
  first = [ps for la in plan.layers for ps in la.use_specs]
  assert first and len(plan.use_specs) > len(first), "the case needs gathered weights"
  plan.save(tmp_path / "plan.json")
  assert tapas.Plan.load(tmp_path / "plan.json").use_specs == plan.use_specs
  data = plan_file.to_json(plan)
  del data["use_specs"]  # written before the field: the layers' first instances only
  (tmp_path / "old.json").write_text(json.dumps(data))
  assert tapas.Plan.load(tmp_path / "old.json").use_specs == tuple(first)
  assert "use_specs" not in plan_file.to_json(small_plan())  # older readers: no new field


def test_sums_past_fences_round_trips_and_older_files_read_without_it(tmp_path):
  plan = dataclasses.replace(small_plan(), sums_past_fences=True)  # as on a TPU profile
  data = plan_file.to_json(plan)
  assert data["sums_past_fences"] is True
  (tmp_path / "new.json").write_text(json.dumps(data))
  assert tapas.Plan.load(tmp_path / "new.json") == plan
  assert "sums_past_fences" not in plan_file.to_json(small_plan())  # h100: not set
  del data["sums_past_fences"]  # a file written before the field
  (tmp_path / "old.json").write_text(json.dumps(data))
  assert tapas.Plan.load(tmp_path / "old.json") == small_plan()


def test_gradient_fences_round_trip_and_older_files_read_without_them(tmp_path):
  plan = small_plan()  # h100: its compiler reduces gradients as they are made
  assert plan.gradient_fences
  data = plan_file.to_json(plan)
  assert data["gradient_fences"] is True
  assert "gradient_fences" not in plan_file.to_json(
      dataclasses.replace(plan, gradient_fences=False))  # older readers: no new field
  del data["gradient_fences"]  # a file written before the field
  (tmp_path / "old.json").write_text(json.dumps(data))
  assert tapas.Plan.load(tmp_path / "old.json") == dataclasses.replace(
      plan, gradient_fences=False)
  data["gradient_fences"] = "yes"
  (tmp_path / "bad.json").write_text(json.dumps(data))
  with pytest.raises(plan_file.PlanFileError,
                     match=r"gradient_fences: expected true or false, got \"yes\""):
    tapas.Plan.load(tmp_path / "bad.json")
