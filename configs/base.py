"""What every model config of `scripts/train.py` holds; the family files fill it in.

A config is an `ml_collections.ConfigDict`, locked by the launcher, so a misspelt
override (`--config.model.num_layer=4`) is an error rather than a silent no-op:

- `family`, `size`: the zoo model (`tapas_jax.models.get_model(family, size)`).
- `model`: every field of that size's config dataclass; override any of them.
- `batch_size`, `steps`, `learning_rate`, `weight_decay`, `seed`: training.
- `mesh`: default `--mesh`, axis:size pairs.
- `data`: "learnable" (a pattern the loss visibly learns), "random" (the zoo's
  uniform batches: nothing to learn), "tokens:PATH" (a token file, see
  tapas_jax/models/data.py; scripts/prepare_data.py writes one from text) or
  "images:IMAGES.npy,LABELS.npy".
- `token_dtype`: uint16 or uint32, the ids of a raw token file (a .npy says its own).
- `eval_every`, `eval_steps`: every `eval_every` steps (0: never) and at the last, the
  mean loss of `eval_steps` held-out batches (the end of a data file, held out of
  training; fresh draws of synthetic data).
- `checkpoint_every`: steps between orbax checkpoints (the last step always saves).
"""

import dataclasses

import ml_collections

from tapas_jax import models


def make(family: str, size: str, *, batch_size: int, steps: int = 10,
         learning_rate: float = 1e-3, mesh: str = "data:2,model:4",
         **model_fields) -> ml_collections.ConfigDict:
  """The config of zoo model `family` at named config `size`.

  Raises:
    ValueError: unknown size; the message lists the sizes of the family.
  """
  configs = models.get_family(family).configs
  if size not in configs:
    raise ValueError(f"unknown size {size!r} for {family}; choose one of: "
                     f"{', '.join(configs)}")
  config = ml_collections.ConfigDict()
  config.family = family
  config.size = size
  config.model = dataclasses.asdict(models.override(configs[size], **model_fields))
  config.batch_size = batch_size
  config.steps = steps
  config.learning_rate = learning_rate
  config.weight_decay = 0.01
  config.seed = 0
  config.mesh = mesh
  config.data = "learnable"
  config.token_dtype = "uint16"
  config.eval_every = 0
  config.eval_steps = 1
  config.checkpoint_every = 100
  return config
