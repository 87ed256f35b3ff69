"""The model zoo: named flax models at named configs, from tiny to published shapes.

Example:
  >>> from tapas_jax import models
  >>> sorted(models.FAMILIES)[:2]
  ['gpt', 'gpt_nnx']
  >>> m = models.get_model("gpt", "tiny", num_layers=4)
  >>> m.config.num_layers
  4
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from tapas_jax.models.training import Family, TrainState, ZooModel

# name -> module holding FAMILY. Imported lazily so `import tapas_jax` stays cheap.
_FAMILY_MODULES = {
    "gpt": "tapas_jax.models.gpt",
    "gpt_nnx": "tapas_jax.models.gpt_nnx",
    "llama": "tapas_jax.models.llama",
    "llama_nnx": "tapas_jax.models.llama_nnx",
    "t5": "tapas_jax.models.t5",
    "vit": "tapas_jax.models.vit",
    "moe": "tapas_jax.models.moe",
    "resnet": "tapas_jax.models.resnet",
}
FAMILIES = tuple(sorted(_FAMILY_MODULES))

__all__ = ["FAMILIES", "SMALL", "Family", "TrainState", "ZooModel", "get_family", "get_model",
           "override"]


# The zoo at its small configs: each family's real widths, two layers (a ResNet's
# stages one block each), short sequences: (named config, overrides). What the
# memory benchmarks compile where a real-size config would take too long.
SMALL = {
    "gpt": ("gpt2-small", {"num_layers": 2, "seq_len": 256}),
    "llama": ("llama3-8b", {"num_layers": 2, "seq_len": 256, "vocab_size": 32000,
                            "d_model": 768, "num_heads": 12, "num_kv_heads": 4,
                            "d_ff": 2048}),
    "t5": ("t5-base", {"num_encoder_layers": 2, "num_decoder_layers": 2, "enc_len": 256,
                       "dec_len": 64, "d_model": 512, "num_heads": 8, "d_kv": 64,
                       "d_ff": 2048}),
    "vit": ("vit-b16", {"num_layers": 2}),
    "moe": ("moe-64e", {"num_layers": 2, "seq_len": 256, "d_model": 768,
                        "num_heads": 12, "d_ff": 3072, "num_experts": 8}),
    "resnet": ("resnet-50", {"stage_sizes": (1, 1, 1, 1), "image_size": 64}),
}


def get_family(name: str) -> Family:
  """The `Family` registered under `name`.

  Raises:
    ValueError: unknown name; the message lists the valid ones.
  """
  if name not in _FAMILY_MODULES:
    raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(FAMILIES)}")
  return importlib.import_module(_FAMILY_MODULES[name]).FAMILY


def override(config: Any, **fields: Any) -> Any:
  """`dataclasses.replace` that names the valid fields when one is wrong."""
  valid = [f.name for f in dataclasses.fields(config)]
  unknown = sorted(set(fields) - set(valid))
  if unknown:
    raise ValueError(f"unknown field(s) {unknown} for {type(config).__name__}; "
                     f"valid fields: {', '.join(valid)}")
  return dataclasses.replace(config, **fields)


def get_model(name: str, config: str | Any = "tiny", **overrides: Any) -> ZooModel:
  """A zoo model by family name and named config (or a config object).

  Args:
    name: family, one of `FAMILIES`.
    config: a named config of that family (e.g. "tiny", "gpt2-small") or a config object.
    **overrides: config fields to replace, e.g. `num_layers=48`.

  Raises:
    ValueError: unknown family, config name or field; the message lists the choices.
  """
  family = get_family(name)
  if isinstance(config, str):
    if config not in family.configs:
      raise ValueError(f"unknown config {config!r} for model {name!r}; "
                       f"choose one of: {', '.join(family.configs)}")
    config = family.configs[config]
  return ZooModel(family=family, config=override(config, **overrides))
