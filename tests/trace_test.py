"""trace: jaxpr walker, graph IR, canonical signatures, errors."""

import functools
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive

import tapas_jax as tapas
from tapas_jax import models
from tapas_jax import trace as trace_module
from tapas_jax.trace import Graph, TraceError, trace

F32 = jnp.float32


def sds(*shape, dtype=F32):
  return jax.ShapeDtypeStruct(shape, dtype)


def prims(g: Graph, region: int = 0) -> list[str]:
  return [op.primitive for op in g.region_ops(region)]


@functools.lru_cache(maxsize=None)
def gpt_train_graph(num_layers: int = 2, scan: bool = False) -> Graph:
  m = models.get_model("gpt", "tiny", num_layers=num_layers, scan_layers=scan)
  return trace(m.train_step(), m.abstract_state(), m.batch_spec(2))


def test_plain_function_ops_types_and_wiring():
  g = trace(lambda w, x: jnp.tanh(x @ w), sds(4, 8), sds(2, 4))
  assert prims(g) == ["dot_general", "tanh"]
  dot, tanh = g.ops
  assert [str(g.types[v]) for v in dot.inputs] == ["float32[2,4]", "float32[4,8]"]
  assert tanh.inputs == dot.outputs
  assert g.outputs == tanh.outputs
  assert [i.path for i in g.inputs] == ["arg0", "arg1"]
  assert ("dimension_numbers", "(((1,),(0,)),((),()))") in dot.params


def test_train_state_inputs_keep_pytree_paths():
  g = gpt_train_graph()
  paths = {i.path for i in g.inputs}
  assert "params/Block_1/MLP/fc1/kernel" in paths
  assert "opt_state/0/mu/Block_1/MLP/fc1/kernel" in paths
  assert "inputs" in paths and "targets" in paths
  by_path = {i.path: g.types[i.value] for i in g.inputs}
  assert by_path["params/Block_1/MLP/fc1/kernel"].shape == (64, 256)
  assert {i.arg for i in g.inputs if i.path.startswith("params/")} == {0}
  assert {i.arg for i in g.inputs if i.path == "inputs"} == {1}


def test_name_stacks_prefix_parent_scope_inside_inlined_calls():
  g = gpt_train_graph()
  # The embedding lookup runs inside a jitted `_take`: its gather keeps the module path.
  wte = next(i.value for i in g.inputs if i.path == "params/wte/embedding")
  gathers = [op for op in g.ops if op.primitive == "gather" and wte in op.inputs]
  assert len(gathers) == 1 and gathers[0].name_stack == "jvp(GPT)/wte"
  assert gathers[0].site[1:3] == ("jaxpr", 0)  # it sat one level down, in the jit
  backward = [op for op in g.ops if op.name_stack.startswith("transpose(jvp(GPT))/Block_1")]
  assert backward, "backward ops keep their module path"


def test_call_like_primitives_are_inlined():
  def body(x):
    return jnp.sin(x) * 2.0

  @jax.custom_vjp
  def cvjp(x):
    return jnp.cos(x)

  cvjp.defvjp(lambda x: (jnp.cos(x), x), lambda x, g: (-jnp.sin(x) * g,))
  plain = trace(body, sds(3))
  for wrapped in (jax.jit(body), jax.checkpoint(body)):
    g = trace(wrapped, sds(3))
    assert [op.signature for op in g.ops] == [op.signature for op in plain.ops]
  assert prims(trace(jax.nn.relu, sds(3))) == ["max"]  # relu is a custom_jvp
  assert prims(trace(cvjp, sds(3))) == ["cos"]


def test_scan_keeps_trip_count_and_body_region():
  def f(w, x):
    def step(c, wi):
      return jnp.tanh(c @ wi), None
    return jax.lax.scan(step, x, w)[0]

  g = trace(f, sds(5, 8, 8), sds(2, 8))
  scan = next(op for op in g.ops if op.primitive == "scan")
  assert scan.region == 0 and len(scan.subregions) == 1
  region = g.regions[scan.subregions[0]]
  assert region.trip_count == 5 and region.kind == "scan.jaxpr"
  assert prims(g, region.index) == ["dot_general", "tanh"]
  assert g.types[region.inputs[-1]].shape == (8, 8)  # one slice of the stacked weights


def test_cond_and_while_regions():
  def f(x):
    y = jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x)
    return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, y))[1]

  g = trace(f, sds(4))
  kinds = sorted(r.kind for r in g.regions[1:])
  assert kinds == ["cond.branches", "cond.branches", "while.body_jaxpr", "while.cond_jaxpr"]
  assert all(r.trip_count is None for r in g.regions[1:])


def test_loop_bodies_with_different_ops_get_different_signatures():
  def f(act):
    return lambda x: jax.lax.scan(lambda c, _: (act(c), None), x, None, length=3)[0]

  a, b = trace(f(jnp.tanh), sds(4)), trace(f(jnp.sin), sds(4))
  def sig(g):
    return next(op.signature for op in g.ops if op.primitive == "scan")
  assert sig(a) != sig(b)
  assert sig(a) == sig(trace(f(jnp.tanh), sds(4)))


@pytest.mark.parametrize("change,same", [
    (lambda: (sds(4, 8), sds(2, 4)), True),             # same shapes
    (lambda: (sds(4, 16), sds(2, 4)), False),           # a shape
    (lambda: (sds(4, 8, dtype=jnp.bfloat16), sds(2, 4, dtype=jnp.bfloat16)), False),  # dtype
])
def test_signature_sees_shapes_and_dtypes(change, same):
  def f(w, x):
    return x @ w
  base = trace(f, sds(4, 8), sds(2, 4)).ops[0].signature
  assert (trace(f, *change()).ops[0].signature == base) is same


def test_signature_blind_to_values_and_sensitive_to_precision():
  def f(w, x):
    return x @ w
  zeros = trace(f, jnp.zeros((4, 8)), jnp.zeros((2, 4)))
  ones = trace(f, np.ones((4, 8), np.float32), np.ones((2, 4), np.float32))
  assert zeros.ops[0].signature == ones.ops[0].signature
  hi = trace(lambda w, x: jnp.dot(x, w, precision="highest"), sds(4, 8), sds(2, 4))
  assert hi.ops[0].signature != zeros.ops[0].signature


def test_big_shapes_trace_without_allocating():
  m = models.get_model("gpt", "gpt3-175b", num_layers=1)
  g = trace(m.train_step(), m.abstract_state(), m.batch_spec(8))
  big = max(g.types[i.value].nbytes for i in g.inputs)
  assert big >= 50257 * 12288 * 4  # the embedding: 2.5 GB, never materialized
  assert len(g.ops) > 500


def test_unknown_primitive_is_kept_as_an_opaque_op():
  mystery = Primitive("tapas_test_mystery")
  mystery.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
  g = trace(lambda x: jnp.sin(mystery.bind(x)), sds(3))
  assert prims(g) == ["tapas_test_mystery", "sin"]
  assert g.ops[1].inputs == g.ops[0].outputs


def test_not_callable():
  with pytest.raises(TraceError, match="fn must be callable, got int"):
    trace(3, sds(2))


def test_bad_leaf_names_the_argument_path():
  with pytest.raises(TraceError, match=r"argument 1 at path 'layers/0/scale' is a str"):
    trace(lambda a, b: a, sds(2), {"layers": [{"scale": "big"}]})


def test_trace_failure_is_reported_with_arguments():
  def bad(x, y):
    return x @ y

  with pytest.raises(TraceError, match=r"bad failed to trace.*TypeError"):
    trace(bad, sds(2, 3), sds(4, 5))


def test_the_step_is_traced_with_the_collector_paused_and_it_is_restored():
  # Tracing a deep step allocates enough objects to set off full collections of the
  # whole heap (`trace.collector_paused`); the caller's collector is left as it was,
  # after a failed trace too.
  seen = []

  def step(x):
    seen.append(gc.isenabled())  # runs once, while JAX traces it
    return x * 2

  def bad(x):
    seen.append(gc.isenabled())
    return x @ x

  assert gc.isenabled()
  trace(step, sds(4))
  with pytest.raises(TraceError):
    trace(bad, sds(2, 3))
  assert seen == [False, False]
  assert gc.isenabled()
  gc.disable()
  try:
    trace(step, sds(4))
    assert not gc.isenabled()  # a caller's paused collector stays paused
  finally:
    gc.enable()


def test_what_the_trace_made_goes_to_the_oldest_generation_unscanned():
  # Left young, the trace's objects would all be walked by the collector's next young
  # collection; they outlive the call, so they are promoted without a look.
  def step(x):
    return x * 2

  graph = trace(step, sds(4))
  assert gc.is_tracked(graph.ops[0])
  assert any(o is graph.ops[0] for o in gc.get_objects(generation=2))
  assert gc.get_count()[0] < 100


def test_summary_mentions_loops():
  text = gpt_train_graph(num_layers=3, scan=True).summary()
  assert "loop scan.jaxpr x3" in text


def test_fingerprint_is_the_same_with_and_without_a_mesh_context():
  # Under jax.set_mesh, jit equations gain ctx_mesh and broadcast_in_dim, reshape,
  # dot_general, reduce_sum ... gain sharding=NamedSharding(AbstractMesh, P(None, ...)).
  m = models.get_model("gpt", "tiny")
  args = (m.train_step(), m.abstract_state(), m.batch_spec(2))
  plain = trace(*args)
  with jax.set_mesh(tapas.make_mesh({"data": 2, "model": 4})):
    under = trace(*args)
  raw = [op.raw_params.get("sharding") for op in under.ops]
  assert any(isinstance(s, jax.sharding.NamedSharding) for s in raw), \
      "this jax no longer records shardings under a mesh: the test checks nothing"
  assert [op.signature for op in under.ops] == [op.signature for op in plain.ops]
  assert under.regions[0].fingerprint == plain.regions[0].fingerprint


@pytest.mark.parametrize("sharding,canon", [
    (None, "None"),
    (jax.sharding.PartitionSpec(None, None), "None"),
    (jax.sharding.PartitionSpec("data", None), "P('data',None)"),
    (jax.sharding.PartitionSpec(("data", "model")), "P(('data','model'),)"),
])
def test_shardings_in_params_canonicalize_to_their_axes(sharding, canon):
  assert trace_module._canon(sharding) == canon
  if isinstance(sharding, jax.sharding.PartitionSpec):
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    assert trace_module._canon(jax.sharding.NamedSharding(mesh, sharding)) == canon


def test_keyword_arguments_trace_after_the_positional_ones_in_name_order():
  def f(w, *, x, b):
    return jnp.tanh(x @ w + b["bias"])
  g = trace(f, sds(4, 8), kwargs={"x": sds(2, 4), "b": {"bias": sds(8)}})
  assert [(i.path, i.arg) for i in g.inputs] == [("arg0", 0), ("b/bias", 1), ("x", 2)]
  assert g.num_args == 3
  same = trace(lambda w, b, x: f(w, x=x, b=b), sds(4, 8), {"bias": sds(8)}, sds(2, 4))
  assert same.regions[0].fingerprint == g.regions[0].fingerprint


def test_params_kept_by_value_keep_the_text_of_their_own_types():
  """The walk keeps equations' canonical params by value (a layer's repeat in every
  copy); values equal across types (8 and np.int64(8), in a named tuple too) keep the
  text each type gives, as canonicalising each equation anew does."""
  walker = trace_module._Walker()
  dn = jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,),
                                      start_index_map=(0,))
  dn64 = jax.lax.GatherDimensionNumbers(offset_dims=(np.int64(1),),
                                        collapsed_slice_dims=(0,), start_index_map=(0,))
  cases = [{"sizes": (8, 8), "axis": 3}, {"sizes": (np.int64(8), np.int64(8)), "axis": 3},
           {"axes": (True,)}, {"axes": (1,)}, {"dimension_numbers": dn},
           {"dimension_numbers": dn64}, {"sizes": (8, 8), "axis": 3, "name": "x"},
           {"y": 0.0}, {"y": -0.0}, {"y": np.float32(-0.0)}, {"y": True}, {"y": 1},
           {"y": None}]
  fresh = [tuple(sorted((k, trace_module._canon(v)) for k, v in c.items()
                        if k not in trace_module._IGNORED_PARAMS)) for c in cases]
  assert [walker._params(c) for c in cases] == fresh
  assert [walker._params(c) for c in reversed(cases)] == fresh[::-1]  # from the cache
  assert len({fresh[0], fresh[1]}) == 2 and len({fresh[4], fresh[5]}) == 2
  assert len({fresh[7], fresh[8], fresh[9]}) == 3
  assert len({fresh[10], fresh[11], fresh[12]}) == 3


def test_ops_the_walk_makes_equal_the_dataclass_ones_and_miss_no_field():
  """`Op.made`, the walk's constructor, gives what `Op(...)` gives, and refuses to make
  an op with a field left out rather than one without the attribute."""
  g = trace(lambda w, x: jnp.tanh(x @ w), sds(4, 8), sds(2, 4))
  for op in g.ops:
    fields = {f: getattr(op, f) for f in op.__dataclass_fields__}
    again = trace_module.Op(**fields)
    assert again == op and hash(again) == hash(op)
    assert {f: getattr(again, f) for f in fields} == fields
  with pytest.raises(TypeError, match="missing.*'barrier'"):
    trace_module.Op.made(**{f: v for f, v in fields.items() if f != "barrier"})
