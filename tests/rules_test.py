"""rules: per-primitive sharding rules, checked on the zoo, pinned, run on 8 devices."""

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

import tapas_jax
from tapas_jax import _jax_internals as jx
from tapas_jax import cost, models, op_rule, rules
from tapas_jax.rules import OpRule, rule_for, rule_of
from tapas_jax.solver.problem import build_problem
from tapas_jax.solver.tables import TableBuilder
from tapas_jax.trace import Graph, trace

import styles  # tests/styles.py: train steps in common library styles

F32 = jnp.float32


def sds(*shape, dtype=F32):
  return jax.ShapeDtypeStruct(shape, dtype)


@functools.lru_cache(maxsize=None)
def zoo_graph(name: str) -> Graph:
  m = models.get_model(name, "tiny")
  return trace(m.train_step(), m.abstract_state(), m.batch_spec(2))


def only(graph: Graph, primitive: str):
  """The single op of `primitive` in `graph`."""
  ops = [op for op in graph.ops if op.primitive == primitive]
  assert len(ops) == 1, [op.primitive for op in graph.ops]
  return ops[0]


def assert_rule(rule: OpRule, spec: str, reduce: str = "", sizes: dict | None = None):
  """Checks `rule` against einsum text; `_` = unsplit dim, `reduce` = summed letters."""
  lhs, rhs = spec.split("->")
  tensors = (lhs.split(",") if rule.inputs else []) + rhs.split(",")
  dims = list(rule.inputs) + list(rule.outputs)
  assert [len(t) for t in tensors] == [len(d) for d in dims], (spec, rule.einsum())
  letter_of: dict[int, str] = {}
  factor_of: dict[str, int] = {}
  for text, tensor_dims in zip(tensors, dims):
    for c, f in zip(text, tensor_dims):
      if c == "_":
        assert f is None, (spec, rule.einsum())
        continue
      assert f is not None, (spec, rule.einsum())
      assert factor_of.setdefault(c, f) == f and letter_of.setdefault(f, c) == c, (
          spec, rule.einsum())
  assert {letter_of[f] for f in rule.reduce} == set(reduce), (rule.reduce, reduce)
  for c, size in (sizes or {}).items():
    assert rule.factor_sizes[factor_of[c]] == size, (c, rule.factor_sizes)


MESH_AXES = {"data": 2, "model": 4}


def production_layouts(graph: Graph, op, assignment, axis_sizes=None):
  """(operand layouts, result layouts) of `op` with its factors split as `assignment`
  says ({factor: mesh axes}), derived the way the search prices them.

  The assignment becomes a choice of dimension classes the search could make (each
  class splittable, the axes in its domain), and the solver's cost tables turn that
  choice into layouts (`TableBuilder.op_layouts`: `mesh_dims`, partial sums). The
  op's cost table must price the choice finite. None: it prices it inf (and the
  tables give no layouts).
  """
  spec = cost.mesh_spec(axis_sizes or MESH_AXES, "cpu")
  problem = build_problem(graph, spec, cost.get_profile("cpu"), batch_axes=None)
  fclass = problem.factor_class[op.index]
  choice = {}
  for f, axes in assignment.items():
    assert f is not None, f"assignment {assignment} names a dim the rule keeps whole"
    c, axes = fclass[f], tuple(axes)
    assert c >= 0 and problem.classes[c].splittable, (f, problem.classes[c])
    assert axes in problem.domains[c], (f, axes, problem.domains[c])
    assert choice.setdefault(c, axes) == axes, (f, choice)
  builder = TableBuilder(problem, reuse=False)
  layouts = builder.op_layouts(op, choice)
  (table,) = builder.op_tables(op)
  idx = tuple(problem.domains[c].index(choice.get(c, ())) for c in table.scope)
  assert np.isfinite(table.value[idx]) == (layouts is not None), (table.value[idx], layouts)
  return layouts


def rule_of_fn(fn, *args, primitive=None):
  """(graph, op, rule) of the one interesting op of `fn`."""
  g = trace(fn, *args)
  op = only(g, primitive) if primitive else g.ops[-1]
  return g, op, rule_for(g, op)


# -- (1) every zoo op gets a consistent rule --------------------------------------


@pytest.mark.parametrize("name", models.FAMILIES)
def test_zoo_train_step_rules_are_consistent(name):
  g = zoo_graph(name)
  for op in g.ops:
    ins = [g.types[v].shape for v in op.inputs]
    outs = [g.types[v].shape for v in op.outputs]
    where = f"{name} op {op.index} {op.primitive} {ins}->{outs}"
    fn = rules.RULES.get(op.primitive)
    assert fn is not None or op.subregions, f"no rule: {where}"
    if fn is None:
      continue
    rule = fn(op.raw_params, ins, outs)  # called directly: a failing rule must raise here
    assert [len(d) for d in rule.inputs] == [len(s) for s in ins], where
    assert [len(d) for d in rule.outputs] == [len(s) for s in outs], where
    for dims, shape in zip(rule.inputs + rule.outputs, ins + outs):
      for f, size in zip(dims, shape):
        if f is None:
          continue
        fsize = rule.factor_sizes[f]
        assert fsize > 1, where
        if op.primitive == "reshape":  # gcd factors: they only need to divide the dim
          assert size % fsize == 0, where
        else:
          assert size == fsize, where
    in_only = {f for d in rule.inputs for f in d} - {f for d in rule.outputs for f in d}
    assert in_only - {None} <= set(rule.reduce), where
    assert rule.flops >= 0, where


def test_zoo_has_every_listed_primitive_and_no_warnings():
  seen = set()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for name in models.FAMILIES:
      g = zoo_graph(name)
      for op in g.region_ops(0):
        rule_for(g, op)
        seen.add(op.primitive)
  expected = {
      "mul", "add", "div", "broadcast_in_dim", "reshape", "integer_pow", "reduce_sum",
      "dot_general", "sqrt", "add_any", "transpose", "select_n", "eq", "sub", "neg",
      "square", "convert_element_type", "max", "rsqrt", "iota", "lt", "reduce_max",
      "stop_gradient", "exp", "conv_general_dilated", "scatter-add", "gather",
      "concatenate", "pow", "ge", "split", "gt", "tanh", "log", "abs", "is_finite",
      "sign", "cos", "sin", "rev", "logistic", "slice", "squeeze", "top_k", "cumsum",
      "min", "reduce_window_max", "select_and_scatter_add", "pad"}
  assert expected <= seen, expected - seen
  assert expected <= set(rules.RULES)


@functools.lru_cache(maxsize=None)
def style_program(style: str, layers: int = 2):
  p = styles.STYLES[style](layers)
  return p, trace(p.step, p.state, p.batch)


@pytest.mark.parametrize("style", sorted(styles.STYLES))
def test_style_programs_have_a_rule_for_every_primitive(style):
  _, g = style_program(style)
  missing = sorted({op.primitive for op in g.ops
                    if op.primitive not in rules.RULES and not op.subregions})
  assert not missing, f"{style}: no sharding rule for primitive(s) {missing}"
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for op in g.ops:
      rule_for(g, op)


def test_resnet_weight_gradient_convs_reduce_over_the_batch():
  g = zoo_graph("resnet")
  convs = [op for op in g.ops if op.primitive == "conv_general_dilated"]
  dims = {op.index: jx.conv_dims(op.raw_params, len(g.types[op.inputs[0]].shape))
          for op in convs}
  assert {d.batch_group_count for d in dims.values()} == {1}
  # Backward-pass kernel gradients put the image batch in the lhs feature slot.
  wgrads = [op for op in convs if dims[op.index].lhs_spec[1] == 0]
  assert wgrads
  for op in wgrads:
    rule = rule_for(g, op)
    x, dy = (g.types[v].shape for v in op.inputs)
    (n_factor,) = rule.reduce
    assert rule.inputs[0][0] == rule.inputs[1][0] == n_factor
    assert rule.factor_sizes[n_factor] == x[0] == dy[0]


# -- (2) pinned rules -------------------------------------------------------------


def test_dot_general_attention_scores():
  _, _, r = rule_of_fn(lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k),
                       sds(2, 8, 4, 16), sds(2, 6, 4, 16), primitive="dot_general")
  assert_rule(r, "bqhd,bkhd->bhqk", reduce="d",
              sizes=dict(b=2, q=8, h=4, d=16, k=6))
  assert r.flops == 2 * 2 * 8 * 4 * 16 * 6


def test_matmul_contracting_factor_is_reduce():
  g, op, r = rule_of_fn(lambda x, w: x @ w, sds(2, 8, 32), sds(32, 64))
  assert_rule(r, "bsk,kf->bsf", reduce="k")
  assert r.flops == 2 * 2 * 8 * 32 * 64
  b, k = r.inputs[0][0], r.inputs[0][2]
  ins, outs = production_layouts(g, op, {b: ("data",), k: ("model",)})
  assert ins[0].to_partition_spec() == ("data", None, "model")
  assert ins[1].to_partition_spec() == ("model", None)
  assert outs[0].to_partition_spec() == ("data", None, None)
  assert outs[0].partial == ("model",)
  assert r.flops_per_device({b: ("data",), k: ("model",)}, MESH_AXES) == r.flops / 8
  # One mesh axis on two factors of one op: the cost table rules it out.
  assert production_layouts(g, op, {k: ("model",), r.inputs[1][1]: ("model",)}) is None


def _ragged_grads(w, x, sizes):
  return jax.grad(lambda w, x: (jax.lax.ragged_dot(x, w, sizes) ** 2).sum(), (0, 1))(w, x)


def test_ragged_dot_splits_as_a_dot_and_keeps_the_groups_whole():
  # jax.lax.ragged_dot: 16 rows in 4 groups, each group's rows times its own (8, 32).
  args = (sds(4, 8, 32), sds(16, 8), sds(4, dtype=jnp.int32))
  g = trace(_ragged_grads, *args)
  ops = [op for op in g.ops if op.primitive == "ragged_dot_general"]
  forward, weight_grad, input_grad = (rule_for(g, op) for op in ops)
  # The rows and the groups stay whole; the rest splits as a dot's.
  assert_rule(forward, "_k,_kn,_->_n", reduce="k", sizes=dict(k=8, n=32))
  # The rhs gradient contracts the ragged rows: one result per group, in front.
  assert_rule(weight_grad, "_k,_n,_->_kn", sizes=dict(k=8, n=32))
  assert_rule(input_grad, "_n,_kn,_->_k", reduce="n", sizes=dict(k=8, n=32))
  assert forward.flops == weight_grad.flops == input_grad.flops == 2 * 16 * 8 * 32
  assert rules.facts("ragged_dot_general").contracts  # a layer's matmul, as a dot is


def test_reshape_split_heads_splits_major_only():
  r = rule_of("reshape", {"new_sizes": (2, 8, 4, 16), "dimensions": None},
              [(2, 8, 64)], [(2, 8, 4, 16)])
  assert_rule(r, "blh->blh_", sizes=dict(b=2, l=8, h=4))


def test_reshape_merge_heads_and_other_blocks():
  r = rule_of("reshape", {"new_sizes": (2, 8, 64), "dimensions": None},
              [(2, 8, 4, 16)], [(2, 8, 64)])
  assert_rule(r, "blh_->blh", sizes=dict(h=4))
  # (2, 2, 32, 4) -> (2, 64, 4): the merged block's factor is gcd(2, 64) = 2.
  r = rule_of("reshape", {"new_sizes": (2, 64, 4), "dimensions": None},
              [(2, 2, 32, 4)], [(2, 64, 4)])
  assert_rule(r, "am_c->amc", sizes=dict(m=2))
  # Neither divides the other: (6, 4) -> (4, 6) still splits 2 ways.
  r = rule_of("reshape", {"new_sizes": (4, 6), "dimensions": None}, [(6, 4)], [(4, 6)])
  assert_rule(r, "g_->g_", sizes=dict(g=2))
  # Size-1 dims are never split; coprime majors never split.
  r = rule_of("reshape", {"new_sizes": (1, 3, 5), "dimensions": None}, [(5, 3)],
              [(1, 3, 5)])
  assert_rule(r, "__->___")


def test_transpose_follows_permutation():
  _, _, r = rule_of_fn(lambda x: jnp.transpose(x, (0, 2, 3, 1)), sds(2, 3, 4, 5))
  assert_rule(r, "abcd->acdb")


def test_broadcast_in_dim_new_and_expanded_dims_are_output_only():
  r = rule_of("broadcast_in_dim", {"shape": (2, 8, 16), "broadcast_dimensions": (1, 2)},
              [(8, 1)], [(2, 8, 16)])
  assert_rule(r, "s_->bsd")


def test_reduce_sum_partial_and_argmax_unsplit():
  _, _, r = rule_of_fn(lambda x: jnp.sum(x, axis=1), sds(4, 8, 16))
  assert_rule(r, "brd->bd", reduce="r")
  assert r.combine == "sum" and r.flops == 4 * 8 * 16
  _, _, r = rule_of_fn(lambda x: jnp.max(x, axis=(0, 2)), sds(4, 8, 16))
  assert_rule(r, "abc->b", reduce="ac")
  assert r.combine == "max"
  _, _, r = rule_of_fn(lambda x: jnp.argmax(x, axis=-1), sds(4, 8))
  assert_rule(r, "a_->a")


def test_gather_embedding_vocab_is_reduce():
  _, _, r = rule_of_fn(lambda e, i: jnp.take(e, i, axis=0), sds(256, 64),
                       sds(2, 8, dtype=jnp.int32), primitive="gather")
  assert_rule(r, "vd,bl_->bld", reduce="v", sizes=dict(v=256, d=64))


def test_gather_take_along_axis_passes_batch_and_reduces_classes():
  _, _, r = rule_of_fn(
      lambda x, i: jnp.take_along_axis(x, i[..., None], axis=-1),
      sds(2, 8, 100), sds(2, 8, dtype=jnp.int32), primitive="gather")
  assert_rule(r, "blv,bl__->bl_", reduce="v")


def test_scatter_add_embedding_gradient():
  g = trace(jax.grad(lambda e, i: jnp.take(e, i, axis=0).sum()), sds(256, 64),
            sds(2, 8, dtype=jnp.int32))
  r = rule_for(g, only(g, "scatter-add"))
  assert_rule(r, "vd,bl_,bld->vd", reduce="bl", sizes=dict(v=256, d=64, b=2, l=8))


def test_scatter_overwrite_never_reduces():
  _, _, r = rule_of_fn(lambda e, i, u: e.at[i].set(u), sds(256, 64),
                       sds(2, 8, dtype=jnp.int32), sds(2, 8, 64), primitive="scatter")
  assert_rule(r, "vd,___,__d->vd")


def test_conv_nhwc():
  def conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))

  _, _, r = rule_of_fn(conv, sds(2, 8, 8, 4), sds(3, 3, 4, 16))
  assert_rule(r, "n__c,__co->n__o", reduce="c")
  assert r.flops == 2 * (2 * 8 * 8 * 16) * 9 * 4


def test_grouped_and_batch_grouped_convs_are_conservative():
  dn = jax.lax.conv_dimension_numbers((2, 8, 8, 4), (3, 3, 1, 4),
                                      ("NHWC", "HWIO", "NHWC"))
  depthwise = dict(dimension_numbers=dn, feature_group_count=4, batch_group_count=1)
  r = rule_of("conv_general_dilated", depthwise, [(2, 8, 8, 4), (3, 3, 1, 4)],
              [(2, 8, 8, 4)])
  assert_rule(r, "n__c,___c->n__c")
  grouped = dict(dimension_numbers=dn, feature_group_count=2, batch_group_count=1)
  r = rule_of("conv_general_dilated", grouped, [(2, 8, 8, 4), (3, 3, 2, 4)],
              [(2, 8, 8, 4)])
  assert_rule(r, "n___,____->n___")
  batch_grouped = dict(dimension_numbers=dn, feature_group_count=1, batch_group_count=2)
  r = rule_of("conv_general_dilated", batch_grouped, [(4, 8, 8, 4), (3, 3, 4, 4)],
              [(2, 8, 8, 4)])
  assert_rule(r, "___c,__c_->____", reduce="c")


def test_slicing_ops_keep_touched_dims_whole():
  cases = [
      (lambda x: x[:, 1:5], "a_c->a_c"),
      (lambda x: jnp.pad(x, ((0, 0), (0, 0), (1, 2))), "ab_,->ab_"),
      (lambda x: jnp.flip(x, 1), "a_c->a_c"),
      (lambda x: jnp.concatenate([x, x], axis=2), "ab_,ab_->ab_"),
      (lambda x: jnp.cumsum(x, axis=1), "a_c->a_c"),
      (lambda x: jax.lax.top_k(x, 2)[0], "ab_->ab_,ab_"),
      (lambda x: jnp.sort(x, axis=0), "_bc->_bc"),
      (lambda x: jax.lax.dynamic_slice_in_dim(x, 2, 3, axis=1), "a_c,,,->a_c"),
      (lambda x: jax.lax.dynamic_update_slice_in_dim(x, x[:, :2] * 2, 3, axis=1),
       "a_c,a_c,,,->a_c"),
  ]
  for fn, spec in cases:
    g = trace(fn, sds(4, 8, 6))
    helpers = ("add", "lt", "select_n", "convert_element_type", "clamp")
    op = [op for op in g.ops if op.primitive not in helpers][-1]
    assert_rule(rule_for(g, op), spec)


def test_elementwise_broadcast_and_scalars():
  r = rule_of("add", {}, [(2, 8, 16), (1, 8, 16)], [(2, 8, 16)])
  assert_rule(r, "abc,_bc->abc")
  r = rule_of("select_n", {}, [(), (4, 8), (4, 8)], [(4, 8)])
  assert_rule(r, ",ab,ab->ab")
  _, _, r = rule_of_fn(jnp.tanh, sds(4, 8))
  assert_rule(r, "ab->ab")
  assert r.flops == 32


def _checkpoint_named(x):
  return checkpoint_name(x, "mlp_hidden")


def _polynomial(x):
  return jax.lax.polynomial(x, [1.0, 2.0, 3.0])


# Primitives the common library styles emit (tests/styles.py), pinned: fn, primitive,
# operand shape, einsum with sizes of its letters.
STYLE_PRIMITIVE_CASES = [
    (_checkpoint_named, "name", (4, 8, 6), "abc->abc", {}),
    (lambda x: jnp.stack([x, x * 2], axis=1), "stack", (4, 8, 6), "abc,abc->a_bc",
     {"a": 4, "b": 8, "c": 6}),
    (lambda x: jnp.stack([x, x * 2, x], axis=-1), "stack", (4, 8), "ab,ab,ab->ab_", {}),
    # `jnp.unstack`, and the transpose of stack.
    (jnp.unstack, "unstack", (3, 8, 6), "_bc->bc,bc,bc", {"b": 8}),
    (lambda x: jnp.tile(x, (2, 1, 3)), "tile", (4, 8, 6), "_b_->abc",
     {"a": 2 * 4, "b": 8, "c": 3 * 6}),
    # The class token of a ViT: a (1, 1, D) parameter tiled over the batch.
    (lambda x: jnp.tile(x, (4, 1, 1)), "tile", (1, 1, 6), "__a->b_a", {"a": 6, "b": 4}),
]
if hasattr(jax.lax, "polynomial"):  # jax >= 0.12
  STYLE_PRIMITIVE_CASES.append((_polynomial, "polynomial", (4, 8), "ab,,,->ab", {}))


@pytest.mark.parametrize("fn,primitive,shape,spec,sizes", STYLE_PRIMITIVE_CASES,
                         ids=[f"{c[1]}-{k}" for k, c in enumerate(STYLE_PRIMITIVE_CASES)])
def test_style_primitive_rules(fn, primitive, shape, spec, sizes):
  _, _, r = rule_of_fn(fn, sds(*shape), primitive=primitive)
  assert_rule(r, spec, sizes=sizes)
  assert r.flops == (2 * 3 * math.prod(shape) if primitive == "polynomial" else 0)


def test_fft_keeps_its_transformed_dims_whole():
  # An FNet-style mixing layer: fft over the sequence and features, batch split free.
  _, _, r = rule_of_fn(lambda x: jnp.fft.rfft(x, axis=-1), sds(4, 8, 6), primitive="fft")
  assert_rule(r, "ab_->ab_", sizes={"a": 4, "b": 8})
  _, _, r = rule_of_fn(lambda x: jnp.fft.fft2(x).real, sds(4, 8, 6), primitive="fft")
  assert_rule(r, "a__->a__")
  assert r.flops == 5 * 4 * 8 * 6 * 6  # 5 n log2 n, n = 48 (ceil(log2 48) = 6)


def test_reshard_passes_its_operand_through():
  assert_rule(rule_of("reshard", {}, [(4, 8)], [(4, 8)]), "ab->ab")


def test_tile_of_another_rank_is_an_error_not_a_guess():
  with rules.strict_rules(), pytest.raises(ValueError, match="differ in rank"):
    rule_of("tile", {"reps": (2, 1)}, [(8,)], [(2, 8)])


def test_iota_and_pooling():
  _, _, r = rule_of_fn(lambda: jax.lax.iota(jnp.int32, 8))
  assert_rule(r, "->a")
  def pool(x):
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                                 "SAME")

  _, _, r = rule_of_fn(pool, sds(2, 8, 8, 4), primitive="reduce_window_max")
  assert_rule(r, "n__c->n__c")


def test_op_rule_rejects_input_only_factors():
  with pytest.raises(ValueError, match="inputs only"):
    OpRule((4,), inputs=((0,),), outputs=((None,),))
  with pytest.raises(ValueError, match="index an output"):
    OpRule((4,), inputs=((0,),), outputs=((0,),), reduce=(0,))


def test_every_registered_rule_has_its_facts():
  assert set(rules.FACTS) == set(rules.RULES)
  assert all(isinstance(f, rules.Facts) for f in rules.FACTS.values())


def test_an_unknown_primitive_gets_the_conservative_default():
  # Written out to its own buffer, fused into nothing, no contraction: the memory
  # model counts all of it, folding takes no layer from it.
  assert rules.facts("no_such_primitive") is rules.DEFAULT_FACTS
  assert rules.DEFAULT_FACTS == rules.Facts(
      fusible=False, expensive=False, fusion_root=False, in_place=False, contracts=False,
      copies=False, offset_params=(), sums=False, moves=False)
  for loop in ("scan", "while", "cond", "pjit"):  # no rule: the solver handles bodies
    assert rules.facts(loop) is rules.DEFAULT_FACTS


FACT_CASES = [  # primitive, the fields that are set (every other is the default)
    ("add", dict(fusible=True, sums=True)),
    ("add_any", dict(fusible=True, sums=True)),
    ("sub", dict(fusible=True)),
    ("transpose", dict(fusible=True, moves=True)),
    ("reshape", dict(fusible=True, moves=True)),
    ("convert_element_type", dict(fusible=True)),
    ("exp", dict(fusible=True, expensive=True)),
    ("threefry2x32", dict(fusible=True, expensive=True)),
    ("reduce_precision", dict(fusible=True, copies=True)),
    ("optimization_barrier", dict(fusible=True, copies=True)),
    ("stop_gradient", dict(fusible=True)),
    ("broadcast_in_dim", dict(fusible=True)),
    ("dynamic_slice", dict(fusible=True, selects=True)),
    ("slice", dict(fusible=True, selects=True, offset_params=("start_indices", "limit_indices"))),
    ("squeeze", dict(fusible=True, selects=True)),
    ("pad", dict(fusible=True, offset_params=("padding_config",))),
    ("reduce_sum", dict(fusion_root=True)),
    ("argmax", dict(fusion_root=True)),
    ("reduce_xor", dict()),
    ("dot_general", dict(contracts=True)),
    ("conv_general_dilated", dict(contracts=True)),
    ("scatter-add", dict(in_place=True)),
    ("scatter", dict(in_place=True)),
    ("dynamic_update_slice", dict(in_place=True)),
    ("scatter-sub", dict()),
    ("gather", dict()),
    ("polynomial", dict()),
    ("split", dict()),
    ("cumsum", dict()),
]


@pytest.mark.parametrize("primitive, fields", FACT_CASES, ids=[c[0] for c in FACT_CASES])
def test_facts_pinned(primitive, fields):
  assert rules.facts(primitive) == rules.Facts(**fields)


# -- (3) JAX param objects parsed into plain ints ---------------------------------


def _conv(x, w):
  return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _last_op(fn, primitive, *args):
  g = trace(fn, *args)
  return g, [op for op in g.ops if op.primitive == primitive][-1]


I32 = jnp.int32
PARSED = [
    ("dot", lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k), "dot_general",
     (sds(2, 8, 4, 16), sds(2, 6, 4, 16)), jx.dot_dims,
     jx.DotDims(lhs_contracting=(3,), rhs_contracting=(3,), lhs_batch=(0, 2),
                rhs_batch=(0, 2))),
    ("gather_take", lambda e, i: jnp.take(e, i, axis=0), "gather",
     (sds(256, 64), sds(2, 8, dtype=I32)), jx.gather_dims,
     jx.GatherDims(offset_dims=(2,), collapsed_slice_dims=(0,), start_index_map=(0,),
                   operand_batching_dims=(), start_indices_batching_dims=(),
                   slice_sizes=(1, 64))),
    ("gather_take_along_axis",
     lambda x, i: jnp.take_along_axis(x, i[..., None], axis=-1), "gather",
     (sds(2, 8, 100), sds(2, 8, dtype=I32)), jx.gather_dims,
     jx.GatherDims(offset_dims=(), collapsed_slice_dims=(2,), start_index_map=(2,),
                   operand_batching_dims=(0, 1), start_indices_batching_dims=(0, 1),
                   slice_sizes=(1, 1, 1))),
    ("scatter_add_embedding_grad", jax.grad(lambda e, i: jnp.take(e, i, axis=0).sum()),
     "scatter-add", (sds(256, 64), sds(2, 8, dtype=I32)), jx.scatter_dims,
     jx.ScatterDims(update_window_dims=(2,), inserted_window_dims=(0,),
                    scatter_dims_to_operand_dims=(0,), operand_batching_dims=(),
                    scatter_indices_batching_dims=())),
    ("scatter_add_take_along_axis_grad",
     jax.grad(lambda x, i: jnp.take_along_axis(x, i[..., None], axis=-1).sum()),
     "scatter-add", (sds(2, 8, 100), sds(2, 8, dtype=I32)), jx.scatter_dims,
     jx.ScatterDims(update_window_dims=(), inserted_window_dims=(2,),
                    scatter_dims_to_operand_dims=(2,), operand_batching_dims=(0, 1),
                    scatter_indices_batching_dims=(0, 1))),
    ("conv_nhwc", _conv, "conv_general_dilated", (sds(2, 8, 8, 4), sds(3, 3, 4, 16)),
     functools.partial(jx.conv_dims, rank=4),
     jx.ConvDims(lhs_spec=(0, 3, 1, 2), rhs_spec=(3, 2, 0, 1), out_spec=(0, 3, 1, 2))),
    # The kernel gradient: the image batch sits in the lhs feature slot.
    ("conv_weight_grad", jax.grad(lambda w, x: _conv(x, w).sum()), "conv_general_dilated",
     (sds(3, 3, 4, 16), sds(2, 8, 8, 4)), functools.partial(jx.conv_dims, rank=4),
     jx.ConvDims(lhs_spec=(3, 0, 1, 2), rhs_spec=(3, 0, 1, 2), out_spec=(2, 3, 0, 1))),
]


@pytest.mark.parametrize("fn, primitive, args, parse, expected",
                         [case[1:] for case in PARSED], ids=[case[0] for case in PARSED])
def test_params_parse_into_plain_ints(fn, primitive, args, parse, expected):
  _, op = _last_op(fn, primitive, *args)
  got = parse(op.raw_params)
  assert got == expected
  for field in dataclasses.fields(got):  # nothing of JAX's left inside
    value = getattr(got, field.name)
    assert type(value) in (int, tuple), (field.name, type(value))
    assert all(type(v) is int for v in (value if isinstance(value, tuple) else (value,)))


def test_conv_dims_default_layout_and_groups():
  assert jx.conv_dims({}, 3) == jx.ConvDims((0, 1, 2), (0, 1, 2), (0, 1, 2))
  dn = jax.lax.conv_dimension_numbers((2, 8, 8, 4), (3, 3, 1, 4), ("NHWC", "HWIO", "NHWC"))
  got = jx.conv_dims(dict(dimension_numbers=dn, feature_group_count=4,
                          batch_group_count=1), 4)
  assert (got.feature_group_count, got.batch_group_count) == (4, 1)


def test_scan_counts_from_a_real_scan():
  _, op = _last_op(lambda c, xs, k: jax.lax.scan(lambda c, x: (c * k + x, c), c, xs),
                   "scan", sds(4), sds(3, 4), sds(4))
  # jax <= 0.10 names the counts; 0.11 dropped them, and its `ft_in` says them instead.
  assert jx.scan_counts(op.raw_params) == jx.ScanCounts(num_consts=1, num_carry=1)


@pytest.mark.parametrize("parse, params, match", [
    (jx.dot_dims, {}, "dot_general params carry no 'dimension_numbers'"),
    (jx.dot_dims, {"dimension_numbers": ((0,), (1,))}, "lhs_contracting"),
    (jx.dot_dims, {"dimension_numbers": (((0, 1), (0,)), ((), ()))}, "do not pair up"),
    (jx.gather_dims, {"slice_sizes": (1,)}, "gather params carry no"),
    (jx.scatter_dims, {}, "scatter params carry no"),
    (functools.partial(jx.conv_dims, rank=4),
     {"dimension_numbers": ((0, 1, 2), (0, 1, 2), (0, 1, 2))}, "rank 4"),
    (functools.partial(jx.conv_dims, rank=4),
     {"dimension_numbers": ("NHWC", "HWIO", "NHWC")}, "dim indices"),
])
def test_param_parsers_reject_malformed_params(parse, params, match):
  with pytest.raises(ValueError, match=match):
    parse(params)


# -- (4) the layouts a rule allows compute the right numbers ----------------------


@pytest.fixture(scope="module")
def mesh():
  return tapas_jax.make_mesh({"data": 2, "model": 4})


def _spec(layout) -> P:
  return P(*layout.to_partition_spec())


def check_sharded(fn, args, graph, op, assignment, mesh, local_fn=None):
  """Runs `fn` with inputs laid out as the search would lay out `op` of `graph` under
  `assignment` ({factor: mesh axes}; see `production_layouts`) and compares to the
  unsharded run.

  With `local_fn`, also runs it per device on the local shards (shard_map) and
  combines partial results over the reduce axes: that checks the rule's meaning,
  not only that the layouts are accepted.
  """
  rule = rule_for(graph, op)
  ins, outs = production_layouts(graph, op, assignment, dict(mesh.shape))
  expected = fn(*args)
  in_shardings = tuple(NamedSharding(mesh, _spec(layout)) for layout in ins)
  out_sharding = None if outs[0].partial else NamedSharding(mesh, _spec(outs[0]))
  placed = [jax.device_put(a, s) for a, s in zip(args, in_shardings)]
  got = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_sharding)(*placed)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  if local_fn is None:
    return
  combine = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}[rule.combine]

  def per_device(*local):
    out = local_fn(*local)
    return combine(out, outs[0].partial) if outs[0].partial else out

  sharded = jax.shard_map(per_device, mesh=mesh, in_specs=tuple(_spec(x) for x in ins),
                          out_specs=P(*outs[0].to_partition_spec()))
  np.testing.assert_allclose(jax.jit(sharded)(*args), expected, rtol=1e-5, atol=1e-5)


def _rand(key, *shape):
  return jax.random.normal(jax.random.key(key), shape, F32)


def _factor(rule, tensor, dim, outputs=False):
  return (rule.outputs if outputs else rule.inputs)[tensor][dim]


def test_numerics_matmul_batch_and_contracting_split(mesh):
  fn = lambda x, w: x @ w  # noqa: E731
  args = (_rand(0, 4, 8, 16), _rand(1, 16, 32))
  g, op, r = rule_of_fn(fn, *args)
  assign = {_factor(r, 0, 0): ("data",), _factor(r, 0, 2): ("model",)}
  check_sharded(fn, args, g, op, assign, mesh, local_fn=fn)
  assign = {_factor(r, 0, 1): ("data",), _factor(r, 1, 1): ("model",)}
  check_sharded(fn, args, g, op, assign, mesh, local_fn=fn)


def test_numerics_attention_scores_heads_split(mesh):
  fn = lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k)  # noqa: E731
  args = (_rand(0, 2, 8, 4, 16), _rand(1, 2, 8, 4, 16))
  g, op, r = rule_of_fn(fn, *args, primitive="dot_general")
  assign = {_factor(r, 0, 0): ("data",), _factor(r, 0, 2): ("model",)}
  check_sharded(fn, args, g, op, assign, mesh, local_fn=fn)


def test_numerics_ragged_dot_free_and_contracting_split(mesh):
  sizes = jnp.array([5, 0, 8, 3], jnp.int32)
  fn = jax.lax.ragged_dot
  args = (_rand(0, 16, 8), _rand(1, 4, 8, 32), sizes)
  g, op, r = rule_of_fn(fn, *args, primitive="ragged_dot_general")
  assign = {_factor(r, 0, 1): ("data",), _factor(r, 1, 2): ("model",)}
  check_sharded(fn, args, g, op, assign, mesh, local_fn=fn)
  # The weight gradient's two free dims, one per axis.
  numbers = jax.lax.RaggedDotDimensionNumbers((((0,), (0,)), ((), ())), [0], [])
  fn = functools.partial(jax.lax.ragged_dot_general, ragged_dot_dimension_numbers=numbers)
  args = (_rand(0, 16, 8), _rand(1, 16, 32), sizes)
  g, op, r = rule_of_fn(fn, *args, primitive="ragged_dot_general")
  assign = {_factor(r, 0, 1): ("data",), _factor(r, 1, 1): ("model",)}
  check_sharded(fn, args, g, op, assign, mesh, local_fn=fn)


def test_numerics_reshape_split_heads(mesh):
  fn = lambda x: x.reshape(x.shape[0], x.shape[1], -1, 16)  # noqa: E731
  args = (_rand(0, 2, 8, 64),)
  g, op, r = rule_of_fn(fn, *args)
  assign = {_factor(r, 0, 0): ("data",), _factor(r, 0, 2): ("model",)}
  check_sharded(fn, args, g, op, assign, mesh, local_fn=fn)
  # The merged direction, with the factor split over both axes at once.
  fn = lambda x: x.reshape(x.shape[0], -1)  # noqa: E731
  args = (_rand(1, 2, 8, 16),)
  g, op, r = rule_of_fn(fn, *args)
  check_sharded(fn, args, g, op, {_factor(r, 0, 1): ("data", "model")}, mesh, local_fn=fn)


def test_numerics_reduce_sum_and_max_partial(mesh):
  for fn in (lambda x: jnp.sum(x, axis=1), lambda x: jnp.max(x, axis=1)):
    args = (_rand(0, 4, 8, 6),)
    g, op, r = rule_of_fn(fn, *args)
    assign = {_factor(r, 0, 0): ("data",), _factor(r, 0, 1): ("model",)}
    check_sharded(fn, args, g, op, assign, mesh, local_fn=fn)


def test_numerics_conv_nhwc_batch_and_input_features(mesh):
  def fn(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))

  args = (_rand(0, 2, 6, 6, 8), _rand(1, 3, 3, 8, 4))
  g, op, r = rule_of_fn(fn, *args)
  assign = {_factor(r, 0, 0): ("data",), _factor(r, 0, 3): ("model",)}
  check_sharded(fn, args, g, op, assign, mesh, local_fn=fn)


def test_numerics_conv_weight_gradient_reduces_batch(mesh):
  def loss(w, x):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC")).sum()

  x, w = _rand(0, 8, 6, 6, 4), _rand(1, 3, 3, 4, 8)
  g = trace(jax.grad(loss), w, x)
  op = [op for op in g.ops if op.primitive == "conv_general_dilated"][-1]
  r = rule_for(g, op)
  (n,) = r.reduce
  fn = functools.partial(jax.lax.conv_general_dilated_p.bind, **op.raw_params)
  dy = jnp.ones((8, 6, 6, 8), F32)
  args = (x, dy)
  assert [g.types[v].shape for v in op.inputs] == [a.shape for a in args]
  check_sharded(fn, args, g, op, {n: ("data", "model")}, mesh, local_fn=fn)


def test_numerics_broadcast_and_elementwise(mesh):
  fn = lambda x, b: x * jnp.broadcast_to(b, x.shape)  # noqa: E731
  args = (_rand(0, 4, 8), _rand(1, 8))
  g = trace(fn, *args)
  op = only(g, "broadcast_in_dim")
  r = rule_for(g, op)
  assert r.inputs[0] == (r.outputs[0][1],)  # the new dim is output-only
  check_sharded(lambda b: jnp.broadcast_to(b, (4, 8)), args[1:], g, op,
                {r.outputs[0][0]: ("data",), r.outputs[0][1]: ("model",)}, mesh)
  op = only(g, "mul")
  r = rule_for(g, op)
  check_sharded(lambda x, b2: x * b2, (args[0], jnp.broadcast_to(args[1], (4, 8))), g, op,
                {r.outputs[0][0]: ("data",), r.outputs[0][1]: ("model",)}, mesh)


def test_numerics_embedding_gather_and_scatter_add(mesh):
  emb, ids = _rand(0, 64, 16), jax.random.randint(jax.random.key(1), (4, 8, 1), 0, 64)
  g = trace(lambda e, i: jnp.take(e, i[..., 0], axis=0), emb, ids)
  op = only(g, "gather")
  r = rule_for(g, op)
  (v,) = r.reduce
  fn = functools.partial(jax.lax.gather, **op.raw_params)
  assert [g.types[x].shape for x in op.inputs] == [emb.shape, ids.shape]
  check_sharded(fn, (emb, ids), g, op, {v: ("model",), r.inputs[1][0]: ("data",)}, mesh)

  g = trace(jax.grad(lambda e, i: jnp.take(e, i[..., 0], axis=0).sum()), emb, ids)
  op = only(g, "scatter-add")
  r = rule_for(g, op)
  params = {k: v for k, v in op.raw_params.items() if k != "update_consts"}
  fn = functools.partial(jax.lax.scatter_add, **params)
  args = (_rand(3, 64, 16), ids, _rand(2, 4, 8, 16))  # a non-zero operand counts once
  assert [g.types[x].shape for x in op.inputs] == [a.shape for a in args]
  batch, vocab = r.inputs[2][0], r.outputs[0][0]
  assert batch in r.reduce
  check_sharded(fn, args, g, op, {vocab: ("model",), batch: ("data",)}, mesh)


def test_numerics_style_primitives(mesh):
  """name, stack, unstack and tile under every split their rules allow on 2 x 4."""
  x = _rand(0, 4, 8, 16)
  cases = [
      (_checkpoint_named, (x,), "name"),
      (lambda a, b: jnp.stack([a, b], axis=1), (x[:, 0], x[:, 1] * 2), "stack"),
      (lambda a: jnp.unstack(a, axis=1), (x[:, :2],), "unstack"),
      (lambda a: jnp.tile(a, (2, 1, 1)), (x,), "tile"),
  ]
  for fn, args, primitive in cases:
    g, op, r = rule_of_fn(fn, *args, primitive=primitive)
    out = r.outputs[0]
    splits = [f for f in out if f is not None]
    assert len(splits) >= 2, (primitive, r.einsum())
    for a, b in ((0, 1), (1, 0), (0, -1)):
      assign = {splits[a]: ("data",), splits[b]: ("model",)}
      # A split tiled dim is no local computation: each device slices a whole tiling.
      local = None if primitive == "tile" and 0 in (a, b) else fn
      check_sharded(fn, args, g, op, assign, mesh, local_fn=local)


def test_numerics_fft_split_over_its_leading_dims(mesh):
  x = _rand(0, 4, 8, 16)
  fn = lambda a: jnp.fft.rfft(a, axis=-1).real  # noqa: E731
  g, op, r = rule_of_fn(fn, x, primitive="fft")
  a, b, _ = r.inputs[0]
  check_sharded(lambda a: jnp.fft.rfft(a, axis=-1), (x,), g, op,
                {a: ("data",), b: ("model",)}, mesh, local_fn=lambda a: jnp.fft.rfft(a, axis=-1))


# Styles whose programs run values through name, stack, unstack and tile.
PLANNED_STYLES = ["linen_remat_names", "nnx_remat", "pytree_vit"]


@pytest.mark.parametrize("style", PLANNED_STYLES)
def test_style_plans_compute_what_unsharded_does(style):
  """A plan that splits values (a tight budget makes it) runs the step as unsharded."""
  p, g = style_program(style)
  assert {"name", "stack", "unstack", "tile"} & {op.primitive for op in g.ops}
  styles.assert_plan_runs_like_unsharded(p, MESH_AXES)


# -- (5) unknown primitives, failing rules and loops -----------------------------


def test_unknown_primitive_warns_once_and_is_replicated(monkeypatch):
  monkeypatch.setattr(op_rule, "_WARNED", set())
  prim = jax.extend.core.Primitive("tapas_test_mystery")
  prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
  g = trace(lambda x: prim.bind(x), sds(4, 8))
  op = only(g, "tapas_test_mystery")
  with pytest.warns(UserWarning, match="tapas_test_mystery.*replicated"):
    r = rule_for(g, op)
  assert r.inputs == ((None, None),) and r.outputs == ((None, None),)
  assert r.factor_sizes == () and r.flops == 0
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert rule_for(g, op) == r


BROKEN_DOT = ("dot_general", {}, [(4, 8), (8, 2)], [(4, 2)])  # no dimension numbers


def test_failing_rule_falls_back_to_replicated_with_one_warning(monkeypatch):
  monkeypatch.setattr(op_rule, "_WARNED", set())
  with rules.strict_rules(False):
    with pytest.warns(UserWarning, match="rule failed.*'dot_general'") as record:
      r = rule_of(*BROKEN_DOT)
      assert rule_of(*BROKEN_DOT) == r
  assert len([w for w in record if "rule failed" in str(w.message)]) == 1
  assert r == rules.default_rule([(4, 8), (8, 2)], [(4, 2)])


def test_strict_mode_reraises_with_a_note(monkeypatch):
  monkeypatch.setattr(op_rule, "_WARNED", set())
  assert rules.is_strict()  # tests/conftest.py turns it on for the session
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with pytest.raises(ValueError, match="dimension_numbers") as info:
      rule_of(*BROKEN_DOT)
  assert any("'dot_general'" in note and "(4, 8)" in note
             for note in getattr(info.value, "__notes__", ()))


@pytest.mark.parametrize("env, block, strict", [
    ("1", None, True),
    ("0", None, False),
    ("", None, False),
    ("0", True, True),    # the innermost setting wins
    ("1", False, False),
])
def test_strict_mode_switches(monkeypatch, env, block, strict):
  monkeypatch.setenv(rules.STRICT_ENV, env)
  if block is None:
    assert rules.is_strict() == strict
  else:
    with rules.strict_rules(block):
      assert rules.is_strict() == strict
      with rules.strict_rules(not block):
        assert rules.is_strict() == (not strict)
      assert rules.is_strict() == strict
    assert rules.is_strict() == (env == "1")


def test_loop_ops_are_replicated_without_warning(monkeypatch):
  monkeypatch.setattr(op_rule, "_WARNED", set())
  g = trace(lambda c, xs: jax.lax.scan(lambda c, x: (c + x, c * x), c, xs),
            sds(4), sds(3, 4))
  op = only(g, "scan")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    r = rule_for(g, op)
  assert all(f is None for d in r.inputs + r.outputs for f in d)
  assert math.prod(r.factor_sizes) == 1


def test_a_shard_map_reads_and_makes_the_shards_its_specs_name():
  mesh = styles.auto_mesh((2, 2), ("data", "model"), jax.devices()[:4])
  f = jax.shard_map(lambda a, b: (a * 2, b + 1), mesh=mesh,
                    in_specs=(P("data", "model"), P(None, "model")),
                    out_specs=(P("data"), P(None, "model")), check_vma=False)
  g = trace(lambda a, b: f(a, b), jax.ShapeDtypeStruct((8, 4), jnp.float32),
            jax.ShapeDtypeStruct((4, 6), jnp.float32))
  op, = [op for op in g.ops if op.primitive == "shard_map"]
  rule = rule_for(g, op)
  assert rule.einsum() == "__,__->__,__"  # no factor: no plan splits its shards further
  # A spec shorter than the rank leaves the trailing dims whole.
  assert rule.fixed_inputs == ((("data",), ("model",)), ((), ("model",)))
  assert rule.fixed_outputs == ((("data",), ()), ((), ("model",)))
  assert rule.fixed_mesh == (("data", 2), ("model", 2))
  with pytest.raises(ValueError, match="fixed layouts .* every dim"):
    dataclasses.replace(rule, fixed_inputs=((("data",),), None))


def test_a_shard_maps_flops_are_its_bodys_on_one_device():
  mesh = styles.auto_mesh((2, 2), ("data", "model"), jax.devices()[:4])
  f = jax.shard_map(lambda a, b: a @ b, mesh=mesh, in_specs=(P("data", None), P(None, "model")),
                    out_specs=P("data", "model"))
  g = trace(f, jax.ShapeDtypeStruct((8, 16), jnp.float32),
            jax.ShapeDtypeStruct((16, 4), jnp.float32))
  op, = [op for op in g.ops if op.primitive == "shard_map"]
  assert rule_for(g, op).flops == 2 * 4 * 16 * 2  # one device's [4, 16] @ [16, 2]


def test_a_pallas_kernels_flops_are_its_authors_estimate():
  pl = pytest.importorskip("jax.experimental.pallas")

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2

  def double(x, cost):
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          cost_estimate=cost, interpret=True)(x)

  x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
  for estimate, flops in ((pl.CostEstimate(flops=1234, transcendentals=0,
                                            bytes_accessed=0), 1234), (None, 0)):
    g = trace(functools.partial(double, cost=estimate), x)
    op, = [op for op in g.ops if op.primitive == "pallas_call"]
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # a kernel is kept whole by its own rule, quietly
      rule = rule_for(g, op)
    assert (rule.einsum(), rule.flops) == ("__->__", flops)
