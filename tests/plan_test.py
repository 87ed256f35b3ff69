"""Readable plans: the summary table, HTML, dimension names users know, and why each
choice was made — checked against the numbers the search and the baselines produce."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import tapas_jax as tapas
from tapas_jax import api, baselines, models, solver

CASES = [("gpt", {"data": 2, "model": 4}, "cpu"), ("llama", {"data": 2, "model": 4}, "h100"),
         ("t5", {"data": 4, "model": 2}, "cpu"), ("vit", {"data": 8}, "tpu-v5e")]


@functools.lru_cache(maxsize=None)
def searched(family, mesh_items, device, batch=64):
  m = models.get_model(family, "tiny")
  args = (m.train_step(), m.abstract_state(), m.batch_spec(batch))
  return args, tapas.search(*args, mesh=dict(mesh_items), device=device)


@pytest.mark.parametrize("family,mesh,device", CASES)
def test_summary_is_a_table_of_lines_at_most_100_characters(family, mesh, device):
  _, plan = searched(family, tuple(mesh.items()), device)
  text = plan.summary()
  assert max(map(len, text.splitlines())) <= 100
  axes = " x ".join(f"{a}={n}" for a, n in mesh.items())
  assert text.splitlines()[0] == f"Plan 'tapas' on mesh {axes}, profile {device}"
  for row in ("tapas", "data_parallel", "fsdp"):
    assert any(line.split()[:1] == [row] for line in text.splitlines()), row
  for d in plan.decisions:
    if d.axes:  # every split dimension is listed
      assert any(line.strip().startswith(d.name[:30]) and "x".join(d.axes) in line
                 for line in text.splitlines()), d
  assert max(map(len, plan.summary(width=80).splitlines())) <= 80


@pytest.mark.parametrize("family,mesh,device", CASES[:2])
def test_baselines_beside_the_plan_are_the_baselines_figures(family, mesh, device):
  args, plan = searched(family, tuple(mesh.items()), device)
  figures = {b.name: b for b in plan.baselines}
  assert set(figures) == {"data_parallel", "fsdp"}
  for name in figures:
    expert = baselines.baseline(name, *args, mesh=mesh, device=device)
    assert figures[name].step_s == pytest.approx(expert.stats.predicted_step_s, rel=1e-9)
    assert figures[name].comm_bytes == pytest.approx(expert.stats.predicted_comm_bytes,
                                                     rel=1e-9, abs=1e-6)
    assert figures[name].memory_bytes == pytest.approx(
        expert.stats.predicted_memory_bytes, rel=1e-9)
    # The search is exact without a budget: no baseline is cheaper.
    assert plan.stats.predicted_step_s <= figures[name].step_s * (1 + 1e-9)


@pytest.mark.parametrize("family,mesh,device", CASES)
def test_no_single_change_beats_an_unbudgeted_plan(family, mesh, device):
  """The reasons are the objective's own prices: at an exact optimum every single
  change costs at least as much (delta >= 0), and the text says by how much."""
  _, plan = searched(family, tuple(mesh.items()), device)
  assert plan.decisions
  for d in plan.decisions:
    assert d.why, d
    assert "-" not in d.why.split("/step")[0].split(":")[-1], d  # no negative price
  names = [d.name for d in plan.decisions]
  assert "batch" in names


def test_reasons_are_priced_by_the_objective():
  def fn(w, x):
    return jnp.sum(jnp.tanh(x @ w))

  args = (jax.ShapeDtypeStruct((4096, 4096), jnp.float32),
          jax.ShapeDtypeStruct((65536, 4096), jnp.float32))
  plan = tapas.search(fn, *args, mesh={"data": 8}, device="h100")
  batch = next(d for d in plan.decisions if d.name == "batch")
  assert batch.axes == ("data",) and batch.size == 65536
  # Its price: the plan with the batch alone unsplit, costed by the same model.
  problem = api.prepare(fn, args, mesh={"data": 8}, device="h100").problem
  solution = solver.solve(problem)
  c = next(c.index for c in problem.classes if c.batch)
  unsplit = solver.evaluate(problem, {k: a for k, a in solution.choice.items() if k != c})
  delta = unsplit.step_s - solution.step_s
  assert delta > 0 and batch.why.startswith(f"unsplit: +{delta * 1e3:.3f} ms/step")


class LogicalMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    h = nn.Dense(1024, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")),
                 use_bias=False)(x)
    return nn.Dense(256, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")),
                    use_bias=False)(nn.relu(h))


def test_dimensions_take_the_logical_axis_names_the_program_gives():
  mesh = tapas.make_mesh({"data": 2, "model": 4})
  x = jax.ShapeDtypeStruct((512, 256), jnp.float32)
  with jax.set_mesh(mesh):
    variables = jax.eval_shape(LogicalMLP().init, jax.random.key(0), x)

  def loss(variables, x):
    return jnp.mean(LogicalMLP().apply(variables, x) ** 2)

  plan = tapas.search(loss, variables, x, mesh=mesh, device="h100")
  names = {d.name for d in plan.decisions}
  assert {"embed", "mlp"} <= names, names
  assert not any("kernel" in n for n in names), names


def test_html_has_the_tables_and_escapes_names():
  _, plan = searched("gpt", (("data", 2), ("model", 4)), "cpu")
  page = plan._repr_html_()
  assert page.count("<table>") == 2 + len(plan.layers)
  assert "data_parallel" in page and "fsdp" in page
  odd = tapas.Plan(**{**plan.__dict__, "name": "<b>x</b>"})
  assert "&lt;b&gt;x&lt;/b&gt;" in odd._repr_html_()


def test_decisions_and_baselines_survive_save_and_load(tmp_path):
  _, plan = searched("llama", (("data", 2), ("model", 4)), "h100")
  plan.save(tmp_path / "plan.json")
  loaded = tapas.Plan.load(tmp_path / "plan.json")
  assert loaded.decisions == plan.decisions
  assert loaded.baselines == plan.baselines
  assert loaded.summary().splitlines()[2:] == plan.summary().splitlines()[2:]
  assert math.isfinite(loaded.baselines[0].step_s)
