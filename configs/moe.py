"""Mixture-of-experts transformer (top-2 routing) (`tapas_jax.models.moe`) for scripts/train.py.

Sizes: tiny, moe-64e.
`tiny` trains in seconds on the 8-device CPU mesh; the others are published
shapes, to plan (`--plan_only`, any mesh) or to train on a pod:

  python scripts/train.py --config=configs/moe.py:tiny --config.model.num_layers=4
  python scripts/train.py --config=configs/moe.py:moe-64e --mesh=data:16,model:16 --plan_only
"""

from configs import base


def get_config(size: str = "tiny"):
  tiny = size == "tiny"
  return base.make("moe", size, batch_size=8 if tiny else 256,
                   learning_rate=3e-3 if tiny else 3e-4)
