"""Train steps in idioms neither the zoo nor `tests/styles.py` writes, planned and run.

Each idiom is a loss (or a whole step) as a user might bring it: control flow (`cond`,
`fori_loop`, `associative_scan`), a `custom_vjp`, sorting and top-k routing, dropless
routing through one grouped matmul (`lax.ragged_dot`) and `segment_sum`, `log2` and
`jax.debug.print`, an FFT
mixing layer, pooling and resizing, a `shard_map` inside the step, mixed precision with
loss scaling, gradient accumulation over microbatches, flax nnx layers scanned with
`nnx.scan`, dropout drawing from a key in the batch. For each, the plan unbudgeted and
the plan under a tight budget (which splits values) run through `tapas.apply` and
compute the unsharded step's loss and new parameters; no primitive falls back to the
replicated default (no "no sharding rule" warning, rules strict).
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import styles  # tests/styles.py: the optax step they share
import tapas_jax as tapas
from tapas_jax import rules

B, S, D, V = 8, 16, 32, 64
MESH = {"data": 2, "model": 4}
TIGHT = 0.7  # of the unbudgeted plan's predicted memory
# Where remat alone fits TIGHT, a budget under which the plan must split something too
# (nnx_scan's 0.7 plan split the embedding's rows only while the lookup's partial sums,
# read by the scan alone, were priced nowhere: a free saving).
TIGHTER = {"nnx_scan": 0.35}


def _weights(n: int = 2) -> dict:
  keys = jax.random.split(jax.random.key(0), n)
  return {f"w{k + 1}": jax.random.normal(keys[k], (D, D)) * 0.1 for k in range(n)}


def _x():
  return jax.random.normal(jax.random.key(2), (B, S, D))


def _sgd_step(loss):
  def step(w, x):
    value, grads = jax.value_and_grad(loss)(w, x)
    return jax.tree.map(lambda a, g: a - 0.1 * g, w, grads), value
  return step


# -- losses over (weights, x) -----------------------------------------------------


@jax.custom_vjp
def _gelu(x):
  return jax.nn.gelu(x)


_gelu.defvjp(lambda x: (jax.nn.gelu(x), x),
             lambda x, g: (g * jax.grad(lambda t: jnp.sum(jax.nn.gelu(t)))(x),))


def custom_vjp(w, x):
  return jnp.mean(_gelu(x @ w["w1"]) @ w["w2"])


def cond(w, x):
  h = x @ w["w1"]
  h = jax.lax.cond(jnp.mean(h) > 0, jnp.tanh, jax.nn.relu, h)
  return jnp.mean((h @ w["w2"]) ** 2)


def fori_loop(w, x):
  h = jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w["w2"]), x @ w["w1"])
  return jnp.mean(h ** 2)


def associative_scan(w, x):  # a linear recurrence, as state-space layers write it
  def combine(left, right):
    return left[0] * right[0], right[0] * left[1] + right[1]
  _, h = jax.lax.associative_scan(combine, (jax.nn.sigmoid(x @ w["w1"]), x @ w["w2"]),
                                  axis=1)
  return jnp.mean(h ** 2)


def sort_top(w, x):
  h = x @ w["w1"]
  order = jnp.argsort(h, axis=-1)
  return (jnp.mean(jnp.sort(h, axis=-1)[..., -4:] ** 2)
          + jnp.mean(jnp.take_along_axis(h @ w["w2"], order[..., :2], -1)))


def top_k_routing(w, x):  # two of four experts per token, gates from a softmax
  experts = jnp.stack([w["w1"], w["w2"], w["w1"].T, -w["w2"]])
  gates, chosen = jax.lax.top_k(x @ w["w1"][:, :4], 2)
  weight = (jax.nn.one_hot(chosen, 4) * jax.nn.softmax(gates, -1)[..., None]).sum(-2)
  y = jnp.einsum("bsd,edf->bsef", x, experts)
  return jnp.mean(jnp.einsum("bsef,bse->bsf", jax.nn.silu(y), weight) ** 2)


def ragged_dot_experts(w, x):  # dropless routing: tokens sorted by expert, one grouped matmul
  experts = jnp.stack([w["w1"], w["w2"], w["w1"].T, -w["w2"]])
  tokens = x.reshape(B * S, D)
  logits = tokens @ w["w1"][:, :4]
  chosen = jnp.argmax(logits, -1)
  order = jnp.argsort(chosen)
  sizes = jnp.bincount(chosen, length=4).astype(jnp.int32)
  y = jax.lax.ragged_dot(jax.nn.silu(tokens[order]), experts, sizes)
  y = jnp.zeros_like(y).at[order].set(y) * jnp.max(jax.nn.softmax(logits, -1), -1)[:, None]
  per_expert = jax.ops.segment_sum(y, chosen, num_segments=4)
  return jnp.mean(y ** 2) + jnp.mean(per_expert ** 2)


def bits_printed(w, x):  # an entropy in bits (jnp.log2), watched with jax.debug.print
  p = jax.nn.softmax(x @ w["w1"], -1)
  bits = -jnp.sum(p * jnp.log2(p + 1e-9), -1)
  jax.debug.print("mean entropy {e} bits", e=jnp.mean(bits))
  return jnp.mean(bits) + jnp.mean((p @ w["w2"]) ** 2)


def causal_cumsum(w, x):
  h = x @ w["w1"]
  scores = jnp.where(jnp.tril(jnp.ones((S, S), bool)),
                     jnp.einsum("bsd,btd->bst", h, h) / np.sqrt(D), -1e9)
  y = jnp.einsum("bst,btd->bsd", jax.nn.softmax(scores, -1), h @ w["w2"])
  return jnp.mean(jnp.cumsum(y, axis=1) ** 2)


def fft_mixing(w, x):  # FNet
  h = x @ w["w1"]
  return jnp.mean(jnp.fft.fft2(h).real @ w["w2"])


def pool_and_resize(w, x):
  h = (x @ w["w1"]).reshape(B, 4, 4, D)
  pooled = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1),
                                 "VALID")
  up = jax.image.resize(pooled, (B, 4, 4, D), "bilinear")
  return jnp.mean((up.reshape(B, S, D) @ w["w2"]) ** 2)


def shard_map_inside(w, x):
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  h = jax.shard_map(lambda h: h * jax.lax.psum(jnp.mean(h), "d"), mesh=mesh,
                    in_specs=P("d"), out_specs=P("d"))(x @ w["w1"])
  return jnp.mean((h @ w["w2"]) ** 2)


def vmapped_ensemble(w, x):
  return jnp.mean(jax.vmap(lambda m: jnp.tanh(x @ m))(jnp.stack([w["w1"], w["w2"]])) ** 2)


def bf16_dots(w, x):
  h = jax.lax.dot_general(x.astype(jnp.bfloat16), w["w1"].astype(jnp.bfloat16),
                          (((2,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  h = jax.lax.reduce_precision(h, exponent_bits=8, mantissa_bits=7)
  return jnp.mean((h @ w["w2"]) ** 2)


LOSSES = [custom_vjp, cond, fori_loop, associative_scan, sort_top, top_k_routing,
          ragged_dot_experts, bits_printed, causal_cumsum, fft_mixing, pool_and_resize,
          shard_map_inside, vmapped_ensemble, bf16_dots]


# -- whole steps ------------------------------------------------------------------


def loss_scaling():
  """Mixed precision: bf16 compute, a scaled loss, the update skipped if not finite."""
  def loss(w, x):
    h = x.astype(jnp.bfloat16)
    for k in (1, 2):
      h = h + jax.nn.gelu(h @ w[f"w{k}"].astype(jnp.bfloat16))
    return jnp.mean(h.astype(jnp.float32) ** 2)

  def step(w, x):
    value, grads = jax.value_and_grad(lambda w, x: loss(w, x) * 1024.0)(w, x)
    grads = jax.tree.map(lambda g: g / 1024.0, grads)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    new = jax.tree.map(lambda a, g: a - 0.1 * g, w, grads)
    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, w), value / 1024.0
  return step, _weights(), _x()


def gradient_accumulation():
  """Two microbatches under `lax.scan`, strided so that the batch stays split."""
  def loss(w, x):
    return jnp.mean(jnp.tanh(x @ w["w1"]) @ w["w2"]) ** 2

  def step(w, x):
    micro = jnp.moveaxis(x.reshape(B // 2, 2, S, D), 1, 0)
    def body(acc, mb):
      value, grads = jax.value_and_grad(loss)(w, mb)
      return jax.tree.map(jnp.add, acc, (value, grads)), None
    zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, w))
    (value, grads), _ = jax.lax.scan(body, zero, micro)
    return jax.tree.map(lambda a, g: a - 0.05 * g, w, grads), value / 2
  return step, _weights(), _x()


class _Block(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(4, D, decode=False, rngs=rngs)
    self.up, self.down = nnx.Linear(D, 2 * D, rngs=rngs), nnx.Linear(2 * D, D, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.norm(x))
    return x + self.down(jax.nn.gelu(self.up(x)))


class _ScannedLM(nnx.Module):
  """The flax docs' "scan over layers": blocks made by `nnx.vmap`, run by `nnx.scan`."""

  def __init__(self, layers: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return _Block(rngs)
    self.blocks = blocks(rngs)
    self.head = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, tokens):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, block):
      return block(x)
    return self.head(run(self.embed(tokens), self.blocks))


def _tokens():
  t = jax.random.randint(jax.random.key(1), (B, S + 1), 0, V)
  return {"inputs": t[:, :-1], "targets": t[:, 1:]}


def _xent(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def nnx_scan():
  graphdef, params = nnx.split(_ScannedLM(3, nnx.Rngs(0)), nnx.Param)

  def loss(p, b):
    return _xent(nnx.merge(graphdef, p)(b["inputs"]), b["targets"])
  # SGD: Adam's first step turns a zero gradient's rounding noise (an attention key's
  # bias: softmax does not see it) into a full step of either sign.
  opt = optax.sgd(0.1)
  return styles._optax_step(loss, opt), (params, opt.init(params)), _tokens()


class _DropoutMlp(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(V, D)(tokens)
    for _ in range(2):
      h = nn.Dropout(0.1, deterministic=False)(jax.nn.relu(nn.Dense(2 * D)(nn.LayerNorm()(x))))
      x = x + nn.Dense(D)(h)
    return nn.Dense(V)(x)


def linen_dropout():
  """Dropout drawing from a key the batch carries (as raw key data)."""
  model, batch = _DropoutMlp(), _tokens()
  params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)},
                      batch["inputs"])["params"]
  batch["rng"] = jax.random.key_data(jax.random.key(3))

  def loss(p, b):
    rngs = {"dropout": jax.random.wrap_key_data(b["rng"])}
    return _xent(model.apply({"params": p}, b["inputs"], rngs=rngs), b["targets"])
  opt = optax.adam(1e-3)
  return styles._optax_step(loss, opt), (params, opt.init(params)), batch


STEPS = [loss_scaling, gradient_accumulation, nnx_scan, linen_dropout]

CASES = ([(f.__name__, lambda f=f: (_sgd_step(f), _weights(), _x())) for f in LOSSES]
         + [(f.__name__, f) for f in STEPS])
# The absolute tolerance on the new parameters: bf16 gradients summed in another order
# differ in their 8th bit (0.1 x 2^-8 of a gradient near 1), not in their sign.
ATOL = {"loss_scaling": 1e-3}


def _splits(plan) -> bool:
  """Whether the plan splits an input or pins a split layout anywhere inside."""
  specs = jax.tree.leaves(plan.in_specs, is_leaf=lambda s: isinstance(s, P))
  specs += [c.spec for c in plan.constraints] + [spec for _, spec in plan.use_specs]
  return any(any(axis is not None for axis in spec) for spec in specs)


@pytest.mark.parametrize("name,make", CASES, ids=[c[0] for c in CASES])
def test_an_idiom_plans_and_runs_as_unsharded(name, make):
  step, state, batch = make()
  with rules.strict_rules(), warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    free = tapas.search(step, state, batch, mesh=MESH, device="h100")
    tight = tapas.search(step, state, batch, mesh=MESH, device="h100",
                         memory_budget=TIGHTER.get(name, TIGHT)
                         * free.stats.predicted_memory_bytes)
  fallbacks = [str(w.message) for w in seen if "no sharding rule" in str(w.message)]
  assert not fallbacks, fallbacks
  assert _splits(tight), "the tight plan splits nothing: it tests no sharding"
  want_state, want_loss = jax.jit(step)(state, batch)
  for plan in (free, tight):
    got_state, got_loss = tapas.apply(plan, step)(*tapas.place(plan, state, batch))
    np.testing.assert_allclose(got_loss, want_loss, rtol=2e-5)
    for got, want in zip(jax.tree.leaves(got_state), jax.tree.leaves(want_state)):
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=ATOL.get(name, 1e-6))
