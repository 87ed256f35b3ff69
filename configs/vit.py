"""Vision Transformer (`tapas_jax.models.vit`) for scripts/train.py.

Sizes: tiny, vit-b16, vit-h14.
`tiny` trains in seconds on the 8-device CPU mesh; the others are published
shapes, to plan (`--plan_only`, any mesh) or to train on a pod:

  python scripts/train.py --config=configs/vit.py:tiny --config.model.num_layers=4
  python scripts/train.py --config=configs/vit.py:vit-h14 --mesh=data:16,model:16 --plan_only
"""

from configs import base


def get_config(size: str = "tiny"):
  tiny = size == "tiny"
  return base.make("vit", size, batch_size=8 if tiny else 256,
                   learning_rate=1e-3 if tiny else 1e-3)
