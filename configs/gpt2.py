"""GPT-2 and GPT-3 shapes (`tapas_jax.models.gpt`) for scripts/train.py.

Sizes: tiny, gpt2-small, gpt2-medium, gpt2-xl, gpt3-6.7b, gpt3-175b.
`tiny` trains in seconds on the 8-device CPU mesh; the others are published
shapes, to plan (`--plan_only`, any mesh) or to train on a pod:

  python scripts/train.py --config=configs/gpt2.py:tiny --config.model.num_layers=4
  python scripts/train.py --config=configs/gpt2.py:gpt3-175b --mesh=data:16,model:16 --plan_only
"""

from configs import base


def get_config(size: str = "tiny"):
  tiny = size == "tiny"
  return base.make("gpt", size, batch_size=8 if tiny else 256,
                   learning_rate=3e-3 if tiny else 3e-4)
