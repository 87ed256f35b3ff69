"""T5 encoder-decoder (`tapas_jax.models.t5`) for scripts/train.py.

Sizes: tiny, t5-base, t5-11b.
`tiny` trains in seconds on the 8-device CPU mesh; the others are published
shapes, to plan (`--plan_only`, any mesh) or to train on a pod:

  python scripts/train.py --config=configs/t5.py:tiny --config.model.num_encoder_layers=4
  python scripts/train.py --config=configs/t5.py:t5-11b --mesh=data:16,model:16 --plan_only
"""

from configs import base


def get_config(size: str = "tiny"):
  tiny = size == "tiny"
  return base.make("t5", size, batch_size=8 if tiny else 256,
                   learning_rate=3e-3 if tiny else 1e-4)
