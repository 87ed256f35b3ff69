"""live: the folded path (interior copies' entries mapped from their representative's,
`template`) builds the same `Activations` as the walk over every op (`per_op=True`),
entry for entry and in the same order, on every zoo family, library styles (remat'd,
scanned, a CNN), each device profile's layout choices, two meshes, with and without
sequence cuts."""

import numpy as np
import pytest

from tapas_jax import cost, fold, models, trace
from tapas_jax.solver import build_problem, donated, folded_view, fusion, live
import styles  # tests/styles.py: train steps in common library styles

# Six layers (ten for the MoE's alternating blocks, five blocks a ResNet stage): the
# view folds interior copies onto a representative.
ZOO = (
    ("gpt", {"num_layers": 6}),
    ("gpt", {"num_layers": 6, "scan_layers": True}),
    ("gpt_nnx", {"num_layers": 6}),
    ("llama", {"num_layers": 6}),
    ("llama", {"num_layers": 6, "attention": "chunked", "attention_chunk": 8}),
    ("llama_nnx", {"num_layers": 6}),
    ("moe", {"num_layers": 10}),
    ("resnet", {"stage_sizes": (5, 5)}),
    ("t5", {"num_encoder_layers": 6, "num_decoder_layers": 6}),
    ("vit", {"num_layers": 6}),
)
STYLES = ("linen_remat", "linen_remat_dots", "linen_scan_remat", "nnx_remat",
          "keras_resnet", "stacked_vmap")
PROFILES = ("h100", "cpu", "tpu-v5p")
# (mesh, sequence cuts: activations read through a cut get copies of their own)
MESHES = (({"data": 2, "model": 4}, False), ({"data": 8}, False),
          ({"data": 2, "model": 4}, True))


def assert_same(a: live.Activations, b: live.Activations) -> None:
  for field in ("start", "stop", "nbytes"):
    x, y = getattr(a, field), getattr(b, field)
    assert x.dtype == y.dtype and x.shape == y.shape, field
    np.testing.assert_array_equal(x, y, err_msg=field)
  for field in ("dims", "length", "values", "stored", "unless", "only"):
    assert getattr(a, field) == getattr(b, field), field


def _assert_folded_path_is_the_walk(graph):
  view = folded_view(fold.fold(graph))
  top = graph.region_ops(0)
  alive = fusion.live_ops(graph, top)
  for duplicate, dots in ((True, False), (False, False), (True, True)):
    # The fused values with the interior copies mapped (`copies=`) are the walk's.
    walked, mapped = (fusion.fused_values(graph, top, alive, reductions_duplicate=duplicate,
                                          dot_operands=dots, copies=copies)
                      for copies in ((), view.copies))
    assert walked == mapped, (duplicate, dots)
  for device in PROFILES:
    for mesh, cuts in MESHES:
      p = build_problem(graph, cost.mesh_spec(mesh, device), cost.get_profile(device),
                        None, view=view, sequence_cuts=cuts)
      assert_same(live.activations(p, per_op=True), live.activations(p))


@pytest.mark.parametrize("family,overrides", ZOO, ids=lambda x: str(x))
def test_mapped_copies_match_the_walk_on_the_zoo(family, overrides):
  m = models.get_model(family, "tiny", **overrides)
  _assert_folded_path_is_the_walk(trace.trace(m.train_step(), m.abstract_state(),
                                              m.batch_spec(8)))


@pytest.mark.parametrize("style", STYLES)
def test_mapped_copies_match_the_walk_on_library_styles(style):
  p = styles.STYLES[style](6)
  _assert_folded_path_is_the_walk(trace.trace(p.step, p.state, p.batch))


def _folded_gpt_problem(layers: int, device: str):
  """The tiny GPT's train step at `layers` layers, folded, posed on 8 devices."""
  m = models.get_model("gpt", "tiny", num_layers=layers)
  g = trace.trace(m.train_step(), m.abstract_state(), m.batch_spec(8))
  return build_problem(g, cost.mesh_spec({"data": 8}, device), cost.get_profile(device), None,
                       view=folded_view(fold.fold(g)))


def _spied_at_6_and_12_layers(monkeypatch, module, name, count, device):
  """How much `module.name` handled (`count(args, result)`) when the liveness of the
  folded GPT at 6 and then 12 layers is computed, and the 12-layer top-level op count."""
  seen = []
  real = getattr(module, name)

  def spy(*args):
    result = real(*args)
    seen.append(count(args, result))
    return result

  monkeypatch.setattr(module, name, spy)
  for layers in (6, 12):
    p = _folded_gpt_problem(layers, device)
    live.activations(p)
  return seen, len(p.graph.region_ops(0))


def test_interior_copies_are_mapped_not_walked(monkeypatch):
  # The check above would pass with nothing mapped: most of the copies' ops must not
  # be walked, and the walk must not grow with depth.
  walked, top = _spied_at_6_and_12_layers(monkeypatch, live, "_add_made",
                                          lambda args, _: len(args[5]), "h100")
  assert walked[1] < top / 2, (walked, top)
  # Of each copy's ~550 ops, only those making a value read outside it (the residual
  # stream's cotangent, ...) or extended past it are walked.
  assert walked[1] - walked[0] < 6 * 10, walked


def test_donated_inputs_walk_few_of_the_copies_ops(monkeypatch):
  # Which donated inputs XLA copies is asked of the readers that do not feed their next
  # value inside their own copy, and of what they reach past it: the walk (and its
  # answer, checked against walking every op above) must not grow by a layer's ops per
  # layer.
  reached, top = _spied_at_6_and_12_layers(monkeypatch, donated, "_reached",
                                           lambda _, found: len(found), "cpu")
  assert reached[1] < top / 2, (reached, top)
  assert reached[1] - reached[0] < 6 * 30, reached  # ~16 a layer
