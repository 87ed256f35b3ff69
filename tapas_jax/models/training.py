"""Train state and train step shared by every model in the zoo.

A zoo model is a `Family` (how to build the module, make a batch and compute
the loss) plus a config. `ZooModel` turns that into the three things a user of
the planner has: an abstract or concrete `TrainState`, a batch, and a pure
`train_step(state, batch) -> (state, metrics)` built with optax adamw.

Example:
  >>> from tapas_jax import models
  >>> m = models.get_model("gpt", "tiny")
  >>> state = m.abstract_state()          # nothing allocated
  >>> batch = m.batch_spec(batch_size=2)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax import struct


class TrainState(struct.PyTreeNode):
  """Everything a train step reads and writes.

  Attributes:
    step: scalar int32 step counter.
    params: trainable parameters (a linen params dict or an nnx `State`).
    opt_state: the optax state for `params`.
    model_state: mutable non-trained collections (e.g. `batch_stats`); `{}` when none.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  model_state: Any


@dataclasses.dataclass(frozen=True)
class Family:
  """What the zoo knows about one model family.

  Attributes:
    name: registry name, e.g. "gpt".
    framework: "linen" or "nnx".
    configs: named configs, smallest first; "tiny" is the test size.
    make_module: config -> linen module, or (config, nnx.Rngs) -> nnx module.
    make_batch: (config, rng, batch_size) -> dict of arrays.
    loss: linen: (module, variables, batch) -> (loss, new_model_state);
      nnx: (module, batch) -> loss.
    inputs: batch -> positional arguments of the module's `__call__` (used by init).
  """

  name: str
  framework: Literal["linen", "nnx"]
  configs: Mapping[str, Any]
  make_module: Callable[..., Any]
  make_batch: Callable[[Any, jax.Array, int], dict]
  loss: Callable[..., Any]
  inputs: Callable[[dict], tuple] = lambda batch: (batch["inputs"],)


@dataclasses.dataclass(frozen=True)
class ZooModel:
  """One family at one config, ready to train or to plan.

  Attributes:
    family: the model family.
    config: its frozen config dataclass.
    learning_rate: adamw learning rate.
    weight_decay: adamw weight decay.
  """

  family: Family
  config: Any
  learning_rate: float = 1e-3
  weight_decay: float = 0.01

  @property
  def name(self) -> str:
    return self.family.name

  def optimizer(self) -> optax.GradientTransformation:
    return optax.adamw(self.learning_rate, weight_decay=self.weight_decay)

  def make_batch(self, rng: jax.Array, batch_size: int) -> dict:
    """A random but well-formed batch of `batch_size` examples."""
    return self.family.make_batch(self.config, rng, batch_size)

  def batch_spec(self, batch_size: int) -> dict:
    """The batch as `jax.ShapeDtypeStruct`s (nothing allocated)."""
    return jax.eval_shape(lambda r: self.make_batch(r, batch_size), jax.random.key(0))

  # -- state ---------------------------------------------------------------

  def _nnx_module(self, rng):
    return self.family.make_module(self.config, nnx.Rngs(rng))

  def _graphdef(self):
    abstract = nnx.eval_shape(lambda: self._nnx_module(jax.random.key(0)))
    graphdef, _, _ = nnx.split(abstract, nnx.Param, ...)
    return graphdef

  def init_variables(self, rng: jax.Array) -> tuple[Any, Any]:
    """Returns `(params, model_state)` for a fresh model."""
    if self.family.framework == "nnx":
      _, params, rest = nnx.split(self._nnx_module(rng), nnx.Param, ...)
      return params, rest
    batch = self.batch_spec(1)
    inputs = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.family.inputs(batch))
    variables = dict(self.family.make_module(self.config).init(rng, *inputs))
    params = variables.pop("params")
    return params, variables

  def init(self, rng: jax.Array) -> TrainState:
    """A concrete `TrainState` (allocates: use tiny configs)."""
    params, model_state = jax.jit(self.init_variables)(rng)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=self.optimizer().init(params),
        model_state=model_state,
    )

  def abstract_state(self) -> TrainState:
    """The `TrainState` as `jax.ShapeDtypeStruct`s; works for 175B shapes."""
    return jax.eval_shape(self.init, jax.random.key(0))

  def param_count(self) -> int:
    params = jax.eval_shape(lambda r: self.init_variables(r)[0], jax.random.key(0))
    return sum(int(x.size) for x in jax.tree.leaves(params))

  # -- step ----------------------------------------------------------------

  def loss_fn(self) -> Callable[[Any, Any, dict], tuple[jax.Array, Any]]:
    """`(params, model_state, batch) -> (loss, new_model_state)`."""
    family = self.family
    if family.framework == "nnx":
      graphdef = self._graphdef()

      def nnx_loss(params, model_state, batch):
        module = nnx.merge(graphdef, params, model_state)
        return family.loss(module, batch), model_state

      return nnx_loss
    module = family.make_module(self.config)

    def linen_loss(params, model_state, batch):
      return family.loss(module, {"params": params, **model_state}, batch)

    return linen_loss

  def train_step(self) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """A pure `train_step(state, batch) -> (state, {"loss": loss})`."""
    loss_fn = self.loss_fn()
    optimizer = self.optimizer()

    def train_step(state: TrainState, batch: dict):
      (loss, model_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
          state.params, state.model_state, batch)
      updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      new_state = TrainState(step=state.step + 1, params=params,
                             opt_state=opt_state, model_state=model_state)
      return new_state, {"loss": loss}

    return train_step

