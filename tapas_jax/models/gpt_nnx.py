"""GPT-2 style decoder in flax nnx: the same model as `gpt.py`, written as an
`nnx.Module`.

Attribute names mirror the linen module names (`wte`, `wpe`, `ln_f`; per block
`ln1`, `Attention`, `ln2`, `MLP`), and the blocks live in `blocks` (an
`nnx.List`, one entry per linen `Block_{i}`) or, with `scan_layers`, in
`layers` (one vmapped block with a leading layer axis, like linen's
`nn.scan`). So a linen params tree maps onto the nnx `Param`s one to one, and
`from_linen` loads the same weights into both.

Example:
  >>> import jax
  >>> from flax import nnx
  >>> from tapas_jax.models import gpt, gpt_nnx
  >>> module = gpt_nnx.GPT(gpt.CONFIGS["tiny"], rngs=nnx.Rngs(0))
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from tapas_jax.models import gpt
from tapas_jax.models import training

GPTConfig = gpt.GPTConfig
CONFIGS = gpt.CONFIGS
make_batch = gpt.make_batch
lm_loss = gpt.lm_loss

_ACTIVATIONS = {"gelu": jax.nn.gelu, "relu": jax.nn.relu}

# Linen names each unscanned block `Block_{i}`; nnx keeps them in a list.
_LINEN_BLOCK_PREFIX = "Block_"
_NNX_BLOCKS = "blocks"


class Attention(nnx.Module):

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    cfg = config
    head_dim = cfg.d_model // cfg.num_heads
    dtype = jnp.dtype(cfg.dtype)
    def dense():
      return nnx.LinearGeneral(cfg.d_model, (cfg.num_heads, head_dim), dtype=dtype,
                               param_dtype=dtype, rngs=rngs)
    self.head_dim = head_dim
    self.query, self.key, self.value = dense(), dense(), dense()
    self.out = nnx.LinearGeneral((cfg.num_heads, head_dim), cfg.d_model, axis=(-2, -1),
                                 dtype=dtype, param_dtype=dtype, rngs=rngs)

  def __call__(self, x):
    q, k, v = self.query(x), self.key(x), self.value(x)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(self.head_dim).astype(q.dtype)
    length = x.shape[1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    return self.out(jnp.einsum("bhqk,bkhd->bqhd", weights, v))


class MLP(nnx.Module):

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(config.dtype)
    self.activation = config.activation
    self.fc1 = nnx.Linear(config.d_model, config.hidden, dtype=dtype, param_dtype=dtype,
                          rngs=rngs)
    self.fc2 = nnx.Linear(config.hidden, config.d_model, dtype=dtype, param_dtype=dtype,
                          rngs=rngs)

  def __call__(self, x):
    return self.fc2(_ACTIVATIONS[self.activation](self.fc1(x)))


class Block(nnx.Module):

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    dtype = jnp.dtype(config.dtype)
    def ln():
      return nnx.LayerNorm(config.d_model, dtype=dtype, param_dtype=dtype, rngs=rngs)
    self.ln1 = ln()
    self.Attention = Attention(config, rngs=rngs)
    self.ln2 = ln()
    self.MLP = MLP(config, rngs=rngs)

  def __call__(self, x):
    x = x + self.Attention(self.ln1(x))
    return x + self.MLP(self.ln2(x))


def make_blocks(block: Callable[..., nnx.Module], config: Any, rngs: nnx.Rngs):
  """The blocks of a decoder: an `nnx.List`, or one stacked block if `scan_layers`.

  Args:
    block: `(config, rngs=...) -> nnx.Module`.
    config: model config with `num_layers` and `scan_layers`.
    rngs: initialization rngs.
  """
  if not config.scan_layers:
    # Each block is built inside its own (cached) `nnx.jit`. Built inline under an
    # outer trace, every `rngs` draw costs time proportional to the whole jaxpr so
    # far (flax checks the tracer's sharding, which walks the jaxpr): quadratic in
    # depth, ~30 s for `gpt3-175b`'s abstract state instead of ~1 s.
    @nnx.jit
    def one_block(rngs):
      return block(config, rngs=rngs)

    return nnx.List([one_block(rngs) for _ in range(config.num_layers)])

  @nnx.split_rngs(splits=config.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def stacked(rngs):
    return block(config, rngs=rngs)

  return stacked(rngs)


def run_blocks(blocks: Any, x: jax.Array, scan_layers: bool) -> jax.Array:
  """Applies `make_blocks`' output to `x`, scanning over the stacked ones."""
  if not scan_layers:
    for layer in blocks:
      x = layer(x)
    return x

  @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
  def step(layer, carry):
    return layer(carry)

  return step(blocks, x)


class GPT(nnx.Module):
  """GPT-2 decoder; `__call__(tokens) -> logits`."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    cfg = config
    dtype = jnp.dtype(cfg.dtype)
    self.config = cfg
    self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=dtype,
                         rngs=rngs)
    self.wpe = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(),
                                                       (cfg.seq_len, cfg.d_model), dtype))
    blocks = make_blocks(Block, cfg, rngs)
    if cfg.scan_layers:
      self.layers = blocks
    else:
      self.blocks = blocks
    self.ln_f = nnx.LayerNorm(cfg.d_model, dtype=dtype, param_dtype=dtype, rngs=rngs)

  def __call__(self, tokens):
    cfg = self.config
    x = self.wte(tokens) + self.wpe[: tokens.shape[1]]
    blocks = self.layers if cfg.scan_layers else self.blocks
    x = run_blocks(blocks, x, cfg.scan_layers)
    return self.wte.attend(self.ln_f(x))


def linen_to_nnx_tree(linen_params: Any) -> dict:
  """Renames a linen params tree into the pure-dict layout of these nnx modules.

  Unscanned linen blocks `Block_{i}` become `blocks[i]`; everything else (including
  a scanned `layers` subtree) keeps its name. Accepts `{"params": ...}` too.
  """
  source = _plain_dicts(linen_params)
  if set(source) == {"params"}:
    source = source["params"]
  blocks = {}
  for name in list(source):
    if name.startswith(_LINEN_BLOCK_PREFIX) and name[len(_LINEN_BLOCK_PREFIX):].isdigit():
      blocks[int(name[len(_LINEN_BLOCK_PREFIX):])] = source.pop(name)
  if blocks:
    source[_NNX_BLOCKS] = blocks
  return source


def _plain_dicts(tree: Any) -> Any:
  """`tree` with every mapping (e.g. a `FrozenDict`) turned into a plain dict."""
  if isinstance(tree, Mapping):
    return {k: _plain_dicts(v) for k, v in tree.items()}
  return tree


def load_linen_params(module: nnx.Module, linen_params: Any) -> nnx.Module:
  """Copies linen params into `module`'s `nnx.Param`s in place.

  Args:
    module: an nnx module of this zoo, built with the config the params came from.
    linen_params: the linen `params` collection (or `{"params": ...}`).

  Returns:
    `module`, now holding the linen weights.

  Raises:
    ValueError: the trees differ in names or shapes; the message lists the differences.
  """
  state = nnx.state(module, nnx.Param)
  target = nnx.to_pure_dict(state)
  source = linen_to_nnx_tree(linen_params)
  flat_target = {path: x for path, x in jax.tree_util.tree_flatten_with_path(target)[0]}
  flat_source = {path: x for path, x in jax.tree_util.tree_flatten_with_path(source)[0]}
  problems = [f"missing in linen params: {jax.tree_util.keystr(p)}"
              for p in flat_target if p not in flat_source]
  problems += [f"not in nnx module: {jax.tree_util.keystr(p)}"
               for p in flat_source if p not in flat_target]
  problems += [f"shape of {jax.tree_util.keystr(p)}: linen {flat_source[p].shape}, "
               f"nnx {x.shape}" for p, x in flat_target.items()
               if p in flat_source and flat_source[p].shape != x.shape]
  if problems:
    raise ValueError("linen params do not match the nnx module:\n  " + "\n  ".join(problems))
  nnx.replace_by_pure_dict(state, source)
  nnx.update(module, state)
  return module


def from_linen(linen_params: Any, config: GPTConfig, rngs: nnx.Rngs | None = None) -> GPT:
  """An nnx `GPT` holding the weights of a linen `gpt.GPT` with the same config.

  Args:
    linen_params: the linen `params` collection (or `{"params": ...}`).
    config: the config both models were built with.
    rngs: rngs for the (overwritten) initial weights; defaults to `nnx.Rngs(0)`.
  """
  return load_linen_params(make_module(config, rngs or nnx.Rngs(0)), linen_params)


def make_module(config: GPTConfig, rngs: nnx.Rngs) -> GPT:
  return GPT(config, rngs=rngs)


def loss(module: GPT, batch: dict) -> jax.Array:
  return lm_loss(module(batch["inputs"]), batch["targets"])


FAMILY = training.Family(name="gpt_nnx", framework="nnx", configs=CONFIGS,
                         make_module=make_module, make_batch=make_batch, loss=loss)
