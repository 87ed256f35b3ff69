"""ResNet (`tapas_jax.models.resnet`) for scripts/train.py.

Sizes: tiny, resnet-50.
`tiny` trains in seconds on the 8-device CPU mesh; the others are published
shapes, to plan (`--plan_only`, any mesh) or to train on a pod:

  python scripts/train.py --config=configs/resnet.py:tiny --config.model.num_filters=16
  python scripts/train.py --config=configs/resnet.py:resnet-50 --mesh=data:16,model:16 --plan_only
"""

from configs import base


def get_config(size: str = "tiny"):
  tiny = size == "tiny"
  return base.make("resnet", size, batch_size=8 if tiny else 256,
                   learning_rate=1e-2 if tiny else 1e-3)
