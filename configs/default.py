"""The default job of scripts/train.py and scripts/demo.sh: a 4-layer tiny GPT-2 on
the 8-device CPU mesh (data 2, model 4), a stand-in for a TPU slice."""

from configs import gpt2


def get_config():
  config = gpt2.get_config("tiny")
  config.model.num_layers = 4
  config.steps = 40
  return config
