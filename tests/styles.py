"""Small train steps written the way common JAX libraries write them (a test helper).

Each style is a function `(num_layers) -> Program`: a pure `step(state, batch) ->
(state, loss)` and concrete tiny arguments, so a test can trace, fold, plan and run it.
The styles are what users bring, not the zoo's house style:

* linen with `nn.remat` and `checkpoint_name` under a names policy (MaxText style),
  with `dots_saveable`, offloading named values to host, on a submodule only, and
  inside `nn.scan`;
* nnx with `nnx.remat` (no name stacks: nnx modules push none);
* an equinox-style pytree model in plain JAX: dataclass modules registered as
  pytrees, a filter-like split of arrays from static fields, rotary embeddings with
  `jnp.stack` / unstack slicing, a `jnp.tile`d class token;
* Keras-3-style per-op names (`dense_3`, `layer_normalization_7`, ...);
* a CNN with batch-norm state and residual blocks;
* blocks over stacked parameters: a Python loop over slices of one stacked pytree,
  with `vmap` over per-head stacked weights inside each block;
* optax adamw, adam, sgd with momentum; jax.nn gelu (tanh and erf), silu, relu,
  softmax, logsumexp.

Besides the styles, `shard_mapped_attention`: attention run inside a `jax.shard_map` on
a given mesh, as TPU users run a Pallas kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
import collections
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import tapas_jax

VOCAB, SEQ, BATCH, D, HEADS, FF = 64, 8, 4, 32, 4, 64


@dataclasses.dataclass(frozen=True)
class Program:
  """One style's train step and its arguments.

  Attributes:
    name: the style.
    kind: "transformer" or "cnn" (the issue's fold targets differ).
    step: `step(state, batch) -> (state, loss)`.
    state: concrete state pytree.
    batch: concrete batch pytree.
  """

  name: str
  kind: str
  step: Callable[..., Any]
  state: Any
  batch: Any


def assert_plan_runs_like_unsharded(program: Program, mesh: dict) -> None:
  """Plans `program` under a tight budget (so the plan splits values), runs one step
  through `tapas_jax.apply` and compares loss and new state with the unsharded step."""
  p = program
  free = tapas_jax.search(p.step, p.state, p.batch, mesh=mesh, device="h100")
  plan = tapas_jax.search(p.step, p.state, p.batch, mesh=mesh, device="h100",
                          memory_budget=0.6 * free.stats.predicted_memory_bytes)
  specs = jax.tree.leaves(plan.in_specs, is_leaf=lambda x: isinstance(x, P))
  assert any(any(e is not None for e in spec) for spec in specs), "the plan splits nothing"
  step, ref = tapas_jax.apply(plan, p.step), jax.jit(p.step)
  placed = tapas_jax.place(plan, p.state, p.batch)
  state, loss = step(*placed)
  ref_state, ref_loss = ref(p.state, p.batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=5e-4)  # after one Adam step
  np.testing.assert_allclose(step(state, placed[1])[1], ref(ref_state, p.batch)[1], rtol=1e-4)


def _tokens(seed: int = 1) -> dict:
  t = jax.random.randint(jax.random.key(seed), (BATCH, SEQ + 1), 0, VOCAB)
  return {"inputs": t[:, :-1], "targets": t[:, 1:]}


def _xent(logits, targets):
  """Cross entropy through logsumexp (as hand-written losses do)."""
  logits = logits.astype(jnp.float32)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def _optax_step(loss_fn, opt):
  def step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss
  return step


def _with_opt(name, kind, loss_fn, params, opt, batch):
  return Program(name, kind, _optax_step(loss_fn, opt), (params, opt.init(params)), batch)


# -- flax linen with remat -----------------------------------------------------------


class _LinenBlock(nn.Module):
  """Pre-LN block; activations named for a remat policy, as MaxText names them."""

  @nn.compact
  def __call__(self, x, _=None):
    h = nn.LayerNorm(name="ln1")(x)
    q, k, v = (nn.DenseGeneral((HEADS, D // HEADS), name=n)(h) for n in ("query", "key",
                                                                          "value"))
    q, k = checkpoint_name(q, "query_proj"), checkpoint_name(k, "key_proj")
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D // HEADS)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    w = jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1)
    o = nn.DenseGeneral(D, axis=(-2, -1), name="out")(jnp.einsum("bhqk,bkhd->bqhd", w, v))
    x = x + checkpoint_name(o, "attention_out")
    h = nn.Dense(FF, name="fc1")(nn.LayerNorm(name="ln2")(x))
    h = checkpoint_name(jax.nn.gelu(h), "mlp_hidden")
    return x + nn.Dense(D, name="fc2")(h), None


class _LinenMlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(FF, name="fc1")(nn.LayerNorm(name="ln2")(x))
    return nn.Dense(D, name="fc2")(jax.nn.gelu(h))


class _LinenBlockInnerRemat(nn.Module):
  """Only the MLP rematerialised (an offloading-style policy on part of a block)."""

  @nn.compact
  def __call__(self, x, _=None):
    h = nn.LayerNorm(name="ln1")(x)
    q, k, v = (nn.DenseGeneral((HEADS, D // HEADS), name=n)(h) for n in ("query", "key",
                                                                          "value"))
    w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D // HEADS), axis=-1)
    x = x + nn.DenseGeneral(D, axis=(-2, -1), name="out")(
        jnp.einsum("bhqk,bkhd->bqhd", w, v))
    mlp = nn.remat(_LinenMlp, policy=jax.checkpoint_policies.dots_saveable)
    return x + mlp(name="MLP")(x), None


class _LinenLM(nn.Module):
  num_layers: int
  block: Any
  scan: bool = False

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(VOCAB, D, name="wte")
    x = embed(tokens)
    if self.scan:
      stack = nn.scan(self.block, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=self.num_layers)
      x, _ = stack(name="layers")(x, None)
    else:
      for i in range(self.num_layers):
        x, _ = self.block(name=f"Block_{i}")(x)
    return embed.attend(nn.LayerNorm(name="ln_f")(x))


def _linen(name: str, block: Any, scan: bool = False):
  def build(num_layers: int) -> Program:
    model = _LinenLM(num_layers, block, scan)
    batch = _tokens()
    params = model.init(jax.random.key(0), batch["inputs"])["params"]

    def loss_fn(p, b):
      return _xent(model.apply({"params": p}, b["inputs"]), b["targets"])

    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    return _with_opt(name, "transformer", loss_fn, params, opt, batch)
  return build


_NAMES_POLICY = jax.checkpoint_policies.save_only_these_names("attention_out", "mlp_hidden")
linen_remat = _linen("linen_remat", nn.remat(_LinenBlock))
linen_remat_names = _linen("linen_remat_names", nn.remat(_LinenBlock, policy=_NAMES_POLICY))
linen_remat_dots = _linen("linen_remat_dots", nn.remat(
    _LinenBlock, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable))
linen_remat_offload = _linen("linen_remat_offload", nn.remat(
    _LinenBlock, policy=jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=["attention_out"], names_which_can_be_offloaded=["mlp_hidden"],
        offload_src="device", offload_dst="pinned_host")))
linen_scan_remat = _linen("linen_scan_remat", nn.remat(_LinenBlock), scan=True)
linen_plain = _linen("linen_plain", _LinenBlock)  # no remat: the reference for the above
linen_inner_remat = _linen("linen_inner_remat", _LinenBlockInnerRemat)


# -- flax nnx with remat -------------------------------------------------------------


class _NnxBlock(nnx.Module):
  """LLaMA-ish: RMSNorm, SwiGLU (silu), no biases."""

  def __init__(self, rngs: nnx.Rngs):
    self.norm1, self.norm2 = nnx.RMSNorm(D, rngs=rngs), nnx.RMSNorm(D, rngs=rngs)
    self.qkv = nnx.Linear(D, 3 * D, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(D, D, use_bias=False, rngs=rngs)
    self.gate = nnx.Linear(D, FF, use_bias=False, rngs=rngs)
    self.up = nnx.Linear(D, FF, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(FF, D, use_bias=False, rngs=rngs)

  def __call__(self, x):
    b, s, _ = x.shape
    q, k, v = jnp.split(self.qkv(self.norm1(x)).reshape(b, s, 3, HEADS, D // HEADS), 3,
                        axis=2)
    q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
    q, k = _rotary(q), _rotary(k)
    x = x + self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, D))
    h = self.norm2(x)
    return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class _NnxLM(nnx.Module):
  def __init__(self, num_layers: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.blocks = nnx.List([_NnxBlock(rngs) for _ in range(num_layers)]) \
        if hasattr(nnx, "List") else [_NnxBlock(rngs) for _ in range(num_layers)]
    self.norm = nnx.RMSNorm(D, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = nnx.remat(lambda blk, y: blk(y))(block, x)
    return self.embed.attend(self.norm(x))


def nnx_remat(num_layers: int) -> Program:
  graphdef, params = nnx.split(_NnxLM(num_layers, nnx.Rngs(0)))

  def loss_fn(p, b):
    return _xent(nnx.merge(graphdef, p)(b["inputs"]), b["targets"])

  return _with_opt("nnx_remat", "transformer", loss_fn, params, optax.adam(1e-3), _tokens())


# -- equinox style: pytree dataclass modules, filtered params ------------------------


def _pytree_module(cls):
  """Registers a dataclass as a pytree: array fields are children, others static
  (what `equinox.Module` does)."""
  cls = dataclasses.dataclass(frozen=True)(cls)
  fields = [f.name for f in dataclasses.fields(cls)]
  static = {f.name for f in dataclasses.fields(cls) if f.metadata.get("static")}

  def flatten(m):
    kids = [(jax.tree_util.GetAttrKey(n), getattr(m, n)) for n in fields if n not in static]
    return kids, tuple(getattr(m, n) for n in fields if n in static)

  def unflatten(aux, kids):
    values = dict(zip([n for n in fields if n not in static], kids))
    values.update(zip([n for n in fields if n in static], aux))
    return cls(**values)

  jax.tree_util.register_pytree_with_keys(cls, flatten, unflatten)
  return cls


def _static(default=None):
  return dataclasses.field(default=default, metadata={"static": True})


def _is_array(x) -> bool:
  return isinstance(x, jax.Array)


def partition(tree, keep=_is_array):
  """`equinox.partition`: (the leaves `keep` selects, the rest), None elsewhere."""
  a = jax.tree.map(lambda x: x if keep(x) else None, tree)
  b = jax.tree.map(lambda x: None if keep(x) else x, tree)
  return a, b


def combine(a, b):
  """`equinox.combine`: the leaves of `a`, else of `b`."""
  return jax.tree.map(lambda x, y: y if x is None else x, a, b, is_leaf=lambda x: x is None)


def _rotary(x):
  """Rotary embedding on (batch, seq, heads, dim): even/odd halves unstacked by
  slicing, rotated, stacked back (`jnp.stack`), angles `jnp.tile`d over the pairs."""
  s, d = x.shape[1], x.shape[-1]
  freq = 1.0 / (10000 ** (jnp.arange(0, d, 2) / d))
  angle = jnp.arange(s)[:, None] * freq[None, :]
  cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
  x1, x2 = x[..., 0::2], x[..., 1::2]
  out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return out.reshape(x.shape)


@_pytree_module
class _Linear:
  weight: jax.Array
  bias: jax.Array

  @staticmethod
  def make(key, n_in, n_out):
    return _Linear(jax.random.normal(key, (n_in, n_out)) / jnp.sqrt(n_in), jnp.zeros(n_out))

  def __call__(self, x):
    return x @ self.weight + self.bias


@_pytree_module
class _LayerNorm:
  scale: jax.Array
  eps: float = _static(1e-5)

  def __call__(self, x):
    mu = x.mean(-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + self.eps) * self.scale


@_pytree_module
class _EqxBlock:
  ln1: _LayerNorm
  qkv: _Linear
  out: _Linear
  ln2: _LayerNorm
  fc1: _Linear
  fc2: _Linear
  heads: int = _static(HEADS)

  @staticmethod
  def make(key):
    k = jax.random.split(key, 4)
    return _EqxBlock(_LayerNorm(jnp.ones(D)), _Linear.make(k[0], D, 3 * D),
                     _Linear.make(k[1], D, D), _LayerNorm(jnp.ones(D)),
                     _Linear.make(k[2], D, FF), _Linear.make(k[3], FF, D))

  def __call__(self, x):
    b, s, _ = x.shape
    q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
    q, k, v = (t.reshape(b, s, self.heads, -1) for t in (q, k, v))
    q, k = _rotary(q), _rotary(k)
    w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]), -1)
    x = x + self.out(jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, -1))
    return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x)), approximate=False))


@_pytree_module
class _EqxViT:
  """Patch embedding, a `jnp.tile`d class token, blocks, a class head."""

  patch: _Linear
  cls_token: jax.Array
  blocks: tuple
  head: _Linear
  ln: _LayerNorm

  def __call__(self, images):
    b = images.shape[0]
    patches = images.reshape(b, SEQ, -1)
    x = self.patch(patches)
    x = jnp.concatenate([jnp.tile(self.cls_token, (b, 1, 1)), x], axis=1)
    for block in self.blocks:
      x = jax.checkpoint(type(block).__call__)(block, x)  # filter_checkpoint style
    return self.head(self.ln(x[:, 0]))


def pytree_vit(num_layers: int) -> Program:
  keys = jax.random.split(jax.random.key(0), num_layers + 2)
  model = _EqxViT(_Linear.make(keys[0], 16, D), jnp.zeros((1, 1, D)),
                  tuple(_EqxBlock.make(k) for k in keys[2:]), _Linear.make(keys[1], D, 10),
                  _LayerNorm(jnp.ones(D)))
  params, static = partition(model)
  batch = {"images": jax.random.normal(jax.random.key(1), (BATCH, SEQ * 16)),
           "labels": jax.random.randint(jax.random.key(2), (BATCH,), 0, 10)}

  def loss_fn(p, b):
    logits = combine(p, static)(b["images"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

  return _with_opt("pytree_vit", "transformer", loss_fn, params, optax.adam(1e-3), batch)


# -- Keras 3 style: every op its own uniquely numbered layer name --------------------


class _KerasNames:
  """Keras's global per-class layer counters: `dense`, `dense_1`, `dense_2`, ..."""

  def __init__(self):
    self.counts: collections.Counter[str] = collections.Counter()

  def __call__(self, kind: str) -> str:
    n = self.counts[kind]
    self.counts[kind] += 1
    return kind if n == 0 else f"{kind}_{n}"


def _keras_dense(names, p, x, activation=None):
  with jax.named_scope(names("dense")):
    y = x @ p["kernel"] + p["bias"]
  if activation is not None:
    with jax.named_scope(names("activation")):
      y = activation(y)
  return y


def _keras_ln(names, p, x):
  with jax.named_scope(names("layer_normalization")):
    mu = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + 1e-6) * p["gamma"] + p["beta"]


def _keras_block(names, p, x):
  with jax.named_scope(names("multi_head_attention")):
    b, s, _ = x.shape
    h = _keras_ln(names, p["ln1"], x)
    q, k, v = (_keras_dense(names, p[n], h).reshape(b, s, HEADS, -1) for n in "qkv")
    w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D // HEADS), -1)
    a = _keras_dense(names, p["o"], jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, -1))
  with jax.named_scope(names("dropout")):  # a fixed seed: runs compare step for step
    keep = jax.random.bernoulli(jax.random.key(0), 0.9, a.shape)
    a = jnp.where(keep, a / 0.9, 0.0)
  with jax.named_scope(names("add")):
    x = x + a
  h = _keras_dense(names, p["fc1"], _keras_ln(names, p["ln2"], x), jax.nn.gelu)
  h = _keras_dense(names, p["fc2"], h)
  with jax.named_scope(names("add")):
    return x + h


def _dense_params(key, n_in, n_out):
  return {"kernel": jax.random.normal(key, (n_in, n_out)) / jnp.sqrt(n_in),
          "bias": jnp.zeros(n_out)}


def _ln_params():
  return {"gamma": jnp.ones(D), "beta": jnp.zeros(D)}


def keras_transformer(num_layers: int) -> Program:
  keys = iter(jax.random.split(jax.random.key(0), 6 * num_layers + 1))
  blocks = [{"ln1": _ln_params(), "ln2": _ln_params(),
             **{n: _dense_params(next(keys), D, D) for n in "qkvo"},
             "fc1": _dense_params(next(keys), D, FF), "fc2": _dense_params(next(keys), FF, D)}
            for _ in range(num_layers)]
  params = {"embedding": jax.random.normal(next(keys), (VOCAB, D)), "blocks": blocks}

  def loss_fn(p, b):
    names = _KerasNames()
    with jax.named_scope(names("embedding")):
      x = jnp.take(p["embedding"], b["inputs"], axis=0)
    for bp in p["blocks"]:
      x = _keras_block(names, bp, x)
    return _xent(x @ p["embedding"].T, b["targets"])

  # SGD: Adam would turn the key bias's gradient, zero but for rounding (softmax does
  # not see it), into full-size steps of either sign, sharded or not.
  return _with_opt("keras_transformer", "transformer", loss_fn, params,
                   optax.sgd(0.1, momentum=0.9), _tokens())


def _keras_conv(names, w, x):
  with jax.named_scope(names("conv2d")):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _keras_bn(names, p, stats, x):
  """Batch norm in training mode; returns the moving statistics' next values."""
  with jax.named_scope(names("batch_normalization")):
    mean, var = x.mean((0, 1, 2)), x.var((0, 1, 2))
    y = (x - mean) * jax.lax.rsqrt(var + 1e-3) * p["gamma"] + p["beta"]
    new = {"moving_mean": 0.99 * stats["moving_mean"] + 0.01 * mean,
           "moving_var": 0.99 * stats["moving_var"] + 0.01 * var}
  return y, new


def _keras_relu(names, x):
  with jax.named_scope(names("activation")):
    return jax.nn.relu(x)


def _keras_res_block(names, p, stats, x):
  y, s1 = _keras_bn(names, p["bn1"], stats["bn1"], _keras_conv(names, p["conv1"], x))
  y, s2 = _keras_bn(names, p["bn2"], stats["bn2"],
                    _keras_conv(names, p["conv2"], _keras_relu(names, y)))
  with jax.named_scope(names("add")):
    y = x + y
  return _keras_relu(names, y), {"bn1": s1, "bn2": s2}


def keras_resnet(num_layers: int) -> Program:
  """A Keras-3-style ResNet: residual blocks whose every op is its own numbered layer."""
  c = 16
  keys = iter(jax.random.split(jax.random.key(0), 2 * num_layers + 2))

  def conv(n_in):
    return jax.random.normal(next(keys), (3, 3, n_in, c)) / jnp.sqrt(9 * n_in)

  def bn():
    return {"gamma": jnp.ones(c), "beta": jnp.zeros(c)}

  def bn_stats():
    return {"moving_mean": jnp.zeros(c), "moving_var": jnp.ones(c)}

  params = {"stem": conv(3), "stem_bn": bn(),
            "blocks": [{"conv1": conv(c), "bn1": bn(), "conv2": conv(c), "bn2": bn()}
                       for _ in range(num_layers)],
            "dense": _dense_params(next(keys), c, 10)}
  stats = {"stem_bn": bn_stats(),
           "blocks": [{"bn1": bn_stats(), "bn2": bn_stats()} for _ in range(num_layers)]}
  opt = optax.sgd(0.1, momentum=0.9)
  batch = {"images": jax.random.normal(jax.random.key(1), (BATCH, 8, 8, 3)),
           "labels": jax.random.randint(jax.random.key(2), (BATCH,), 0, 10)}

  def loss_fn(p, stats, b):
    names = _KerasNames()
    x, stem = _keras_bn(names, p["stem_bn"], stats["stem_bn"],
                        _keras_conv(names, p["stem"], b["images"]))
    x = _keras_relu(names, x)
    new = []
    for bp, bs in zip(p["blocks"], stats["blocks"]):
      x, s = _keras_res_block(names, bp, bs, x)
      new.append(s)
    logits = _keras_dense(names, p["dense"], x.mean(axis=(1, 2)))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()
    return loss, {"stem_bn": stem, "blocks": new}

  def step(state, b):
    params, stats, opt_state = state
    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, stats, b)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), stats, opt_state), loss

  return Program("keras_resnet", "cnn", step, (params, stats, opt.init(params)), batch)


# -- a CNN with batch-norm state -----------------------------------------------------


class _ResBlock(nn.Module):
  channels: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
    y = nn.relu(norm()(nn.Conv(self.channels, (3, 3), use_bias=False)(x)))
    y = norm()(nn.Conv(self.channels, (3, 3), use_bias=False)(y))
    return nn.relu(x + y)


class _CNN(nn.Module):
  num_blocks: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(16, (3, 3))(x)))
    for _ in range(self.num_blocks):
      x = _ResBlock(16)(x, train)
    x = nn.avg_pool(x, (2, 2), (2, 2))
    return nn.Dense(10)(x.mean(axis=(1, 2)))


def cnn_batchnorm(num_layers: int) -> Program:
  model = _CNN(num_layers)
  images = jax.random.normal(jax.random.key(1), (BATCH, 8, 8, 3))
  batch = {"images": images, "labels": jax.random.randint(jax.random.key(2), (BATCH,), 0, 10)}
  variables = model.init(jax.random.key(0), images)
  opt = optax.sgd(0.1, momentum=0.9)

  def step(state, b):
    params, stats, opt_state = state

    def loss_fn(p):
      logits, updates = model.apply({"params": p, "batch_stats": stats}, b["images"],
                                    mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()
      return loss, updates["batch_stats"]

    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), stats, opt_state), loss

  state = (variables["params"], variables["batch_stats"], opt.init(variables["params"]))
  return Program("cnn_batchnorm", "cnn", step, state, batch)


# -- blocks over stacked parameters, vmap over stacked heads -------------------------


def _head(w, x):
  """One attention head from its own (D, 3, D // HEADS) weights."""
  q, k, v = jnp.einsum("bsd,dtk->tbsk", x, w)
  p = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / jnp.sqrt(q.shape[-1]), axis=-1)
  return p @ v


def _layer_norm(x, scale, bias):
  mu = x.mean(-1, keepdims=True)
  return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * scale + bias


def _stacked_block(p, x):
  """A GPT-2-style pre-LN block whose heads are a `vmap` over per-head weights."""
  h = _layer_norm(x, p["ln1"]["scale"], p["ln1"]["bias"])
  heads = jax.vmap(_head, in_axes=(0, None), out_axes=2)(p["heads"], h)  # (b, s, h, k)
  x = x + heads.reshape(x.shape) @ p["out"]
  h = jax.nn.relu(_layer_norm(x, p["ln2"]["scale"], p["ln2"]["bias"]) @ p["fc1"])
  return x + h @ p["fc2"]


def stacked_vmap(num_layers: int) -> Program:
  k = jax.random.split(jax.random.key(0), 5)
  n = (num_layers,)
  params = {"embed": jax.random.normal(k[0], (VOCAB, D)),
            "blocks": {"heads": jax.random.normal(k[1], n + (HEADS, D, 3, D // HEADS)) * 0.1,
                       "out": jax.random.normal(k[2], n + (D, D)) * 0.1,
                       "fc1": jax.random.normal(k[3], n + (D, FF)) * 0.1,
                       "fc2": jax.random.normal(k[4], n + (FF, D)) * 0.1,
                       **{ln: {"scale": jnp.ones(n + (D,)), "bias": jnp.zeros(n + (D,))}
                          for ln in ("ln1", "ln2")}}}

  def loss_fn(p, b):
    x = p["embed"][b["inputs"]]
    for i in range(num_layers):
      x = _stacked_block(jax.tree.map(lambda a, i=i: a[i], p["blocks"]), x)
    return _xent(x @ p["embed"].T, b["targets"])

  return _with_opt("stacked_vmap", "transformer", loss_fn, params,
                   optax.sgd(1e-2, momentum=0.9), _tokens())


STYLES: dict[str, Callable[[int], Program]] = {
    "linen_remat": linen_remat,
    "linen_remat_names": linen_remat_names,
    "linen_remat_dots": linen_remat_dots,
    "linen_remat_offload": linen_remat_offload,
    "linen_scan_remat": linen_scan_remat,
    "linen_inner_remat": linen_inner_remat,
    "nnx_remat": nnx_remat,
    "pytree_vit": pytree_vit,
    "keras_transformer": keras_transformer,
    "keras_resnet": keras_resnet,
    "cnn_batchnorm": cnn_batchnorm,
    "stacked_vmap": stacked_vmap,
}


def plain_block(x, p, heads: int = 4):
  """One pre-norm-free transformer block in plain JAX: attention, then a ReLU MLP."""
  b, s, d = x.shape
  q, k, v = ((x @ p[w]).reshape(b, s, heads, d // heads) for w in ("wq", "wk", "wv"))
  a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads), axis=-1)
  x = x + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, s, d) @ p["wo"]
  return x + jnp.maximum(x @ p["w1"], 0) @ p["w2"]


def plain_scan_step(params, x):
  """A plain-JAX transformer, its layers under one `lax.scan`, one SGD step (the
  stacked-parameter style budget_test and remat_test plan)."""
  def loss(params, x):
    return jnp.mean(jax.lax.scan(lambda h, p: (plain_block(h, p), None), x, params)[0] ** 2)
  value, grads = jax.value_and_grad(loss)(params, x)
  return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value


def _search_s(name: str, layers: int, clock: str) -> float:
  """`plan.stats.search_s` of one search, in a fresh process: a process that has traced
  other programs first is slower (more live objects for the garbage collector, warm and
  cold caches), which made a program's time look as if it grew with the depth."""
  import subprocess  # noqa: PLC0415 - command line only

  out = subprocess.run([sys.executable, __file__, "--one", name, str(layers), clock],
                       check=True, capture_output=True, text=True).stdout
  return float(out.strip().splitlines()[-1])


def _one(name: str, layers: int, clock: str) -> None:
  if clock == "cpu":  # the stages read `time.perf_counter`: CPU seconds instead
    time.perf_counter = time.process_time
  p = STYLES[name](layers)
  print(tapas_jax.search(p.step, p.state, p.batch, mesh={"data": 2, "model": 4},
                         device="h100").stats.search_s)


# -- a kernel on shards the program fixes: not a STYLES entry (its mesh is given) ---


def shard_mapped_attention(mesh, attention=None, batch=8, seq=512, heads=4, head_dim=128,
                           width=512):
  """(step, state, x) of an attention layer whose attention runs inside a
  `jax.shard_map` over `mesh` (None: the one `jax.set_mesh` sets; batch on data, heads
  on model), as TPU users run a Pallas kernel (flash attention), which XLA cannot
  partition; `attention(q, k, v)` ([batch, heads, seq, head_dim] each) runs per device,
  causal softmax attention by default. SGD (Adam's first step turns the rounding noise
  of a near-zero gradient into a full step of either sign); the state as arrays."""

  def causal(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    s = jnp.where(jnp.tril(jnp.ones((q.shape[2], k.shape[2]), bool)), s, -1e9)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1), v)

  spec = P("data", "model", None, None)
  run = jax.shard_map(attention or causal, mesh=mesh, in_specs=(spec,) * 3,
                      out_specs=spec, check_vma=False)

  def loss(p, x):
    def heads_of(w):
      return (x @ w).reshape(batch, seq, heads, head_dim).transpose(0, 2, 1, 3)
    o = run(heads_of(p["wq"]), heads_of(p["wk"]), heads_of(p["wv"]))
    return jnp.mean((o.transpose(0, 2, 1, 3).reshape(batch, seq, -1) @ p["wo"]) ** 2)

  opt = optax.sgd(0.1)

  def step(state, x):
    p, opt_state = state
    value, grads = jax.value_and_grad(loss)(p, x)
    updates, opt_state = opt.update(grads, opt_state, p)
    return (optax.apply_updates(p, updates), opt_state), value

  keys = jax.random.split(jax.random.key(0), 5)
  shapes = {"wq": (width, heads * head_dim), "wk": (width, heads * head_dim),
            "wv": (width, heads * head_dim), "wo": (heads * head_dim, width)}
  params = {n: 0.1 * jax.random.normal(k, s) for (n, s), k in zip(sorted(shapes.items()),
                                                                  keys)}
  return step, (params, opt.init(params)), jax.random.normal(keys[4], (batch, seq, width))


def llama_with_shard_mapped_attention(patch, mesh, attention=None, spec=None, config="tiny",
                                      scan_layers=True, **fields):
  """The zoo's LLaMA (bf16 compute, f32 weights; a `models.Model`) whose attention runs
  inside a `jax.shard_map` over `mesh`, as MaxText runs Pallas' flash attention
  (`scripts/bench_flash.py` at real scale): `attention(q, k, v)` per device on
  [batch, heads, seq, head_dim] (default causal softmax attention in XLA ops), `spec`
  its operands' and result's PartitionSpec (default batch on data, heads on model), k
  and v repeated to the query heads. `patch(module, name, value)` swaps the zoo's
  attention (`monkeypatch.setattr` in a test, `setattr` in a script); `fields`
  override the config's."""
  from tapas_jax import models  # noqa: PLC0415 - only the tests that ask load the zoo
  from tapas_jax.models import llama  # noqa: PLC0415
  spec = spec or jax.sharding.PartitionSpec("data", "model", None, None)
  plain, devices = llama.attend, mesh.size

  def causal(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(q.shape[-1]).astype(q.dtype)
    s = jnp.where(jnp.tril(jnp.ones((q.shape[2], k.shape[2]), bool)), s, -1e9)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, -1).astype(q.dtype), v)

  def kernel_attend(config, q, k, v):
    n, length, heads, head_dim = q.shape
    if n % devices:  # the model's init traces one example
      return plain(config, q, k, v)
    k, v = (jnp.repeat(t, heads // k.shape[2], axis=2) for t in (k, v))
    run = jax.shard_map(attention or causal, mesh=mesh, in_specs=(spec,) * 3,
                        out_specs=spec, check_vma=False)
    out = run(*(t.transpose(0, 2, 1, 3) for t in (q, k, v)))
    return out.transpose(0, 2, 1, 3).reshape(n, length, heads * head_dim)

  patch(llama, "attend", kernel_attend)
  return models.get_model("llama", config, dtype="bfloat16", param_dtype="float32",
                          scan_layers=scan_layers, **fields)


# The small scanned LLaMA of the kernel tests: width 512, seq 512, 8 heads over 2 kv heads.
SMALL_KERNEL_LLAMA = dict(seq_len=512, d_model=512, num_heads=8, num_kv_heads=2, d_ff=1024,
                          vocab_size=1024)


def auto_mesh(shape, names, devices):
  """A mesh of Auto axes over these devices (as users build one for shard_map)."""
  return jax.sharding.Mesh(np.array(devices).reshape(shape), names,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def main(argv: list[str]) -> None:
  """Prints, per style and depth, how the train step folds (and with --search, how long
  the search takes, the least of --repeat=N runs, each in a fresh process: the machine
  may be shared; --clock=cpu: the process's CPU seconds, steadier on a loaded machine):
  `PYTHONPATH=$PWD python tests/styles.py 4,12,48 [--search] [--repeat=3] [--clock=cpu]
  [style ...]`.
  """
  from tapas_jax.fold import fold  # noqa: PLC0415 - only the command line needs it
  from tapas_jax.trace import trace  # noqa: PLC0415

  if argv[0] == "--one":
    return _one(argv[1], int(argv[2]), argv[3])
  depths = [int(d) for d in argv[0].split(",")]
  search = "--search" in argv
  repeat = max([int(a.split("=")[1]) for a in argv if a.startswith("--repeat=")] or [1])
  clock = "cpu" if "--clock=cpu" in argv else "wall"
  names = [a for a in argv[1:] if not a.startswith("--")] or list(STYLES)
  print("style                 layers     ops  in layers  unique  instances  method"
        + ("     search s" if search else ""))
  for name in names:
    for layers in depths:
      p = STYLES[name](layers)
      f = fold(trace(p.step, p.state, p.batch))
      share = sum(len(i.ops) for i in f.instances) / f.num_ops
      line = (f"{name:20s} {layers:7d} {f.num_ops:7d} {100 * share:9.1f}% "
              f"{len(f.unique_layers):7d} {len(f.instances):10d}  {f.method:9s}")
      if search:
        times = [_search_s(name, layers, clock) for _ in range(repeat)]
        line += f" {min(times):8.2f}"
      print(line, flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
