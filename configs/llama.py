"""LLaMA 3 (GQA, RoPE, SwiGLU) (`tapas_jax.models.llama`) for scripts/train.py.

Sizes: tiny, llama3-8b, llama3-70b.
`tiny` trains in seconds on the 8-device CPU mesh; the others are published
shapes, to plan (`--plan_only`, any mesh) or to train on a pod:

  python scripts/train.py --config=configs/llama.py:tiny --config.model.num_layers=4
  python scripts/train.py --config=configs/llama.py:llama3-70b --mesh=data:16,model:16 --plan_only
"""

from configs import base


def get_config(size: str = "tiny"):
  tiny = size == "tiny"
  return base.make("llama", size, batch_size=8 if tiny else 256,
                   learning_rate=3e-3 if tiny else 3e-4)
