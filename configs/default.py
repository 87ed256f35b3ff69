"""The embedded default job: tiny GPT on an 8-device CPU mesh (a stand-in TPU slice)."""


def get_config():
  return {
      "model": "gpt",            # one of tapas_jax.models.FAMILIES
      "config": "tiny",          # a named config of that model
      "overrides": {"num_layers": 4},  # config fields to replace
      "mesh": {"data": 2, "model": 4},  # axis sizes; product = number of devices
      "batch_size": 8,
      "steps": 5,
      "learning_rate": 1e-3,
      "seed": 0,
  }
