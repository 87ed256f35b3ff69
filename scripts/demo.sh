#!/usr/bin/env bash
# The demo on the embedded default (configs/default.py: a 4-layer tiny GPT-2): plan it
# for an 8-device CPU mesh (data 2, model 4, a stand-in for a TPU slice), print the plan
# next to data parallel, FSDP and Megatron (predicted, and what XLA compiles of each),
# then train on learnable synthetic data so the loss falls. Extra args go to
# scripts/train.py, e.g. scripts/demo.sh --config=configs/llama.py:tiny --steps=20
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
WORKDIR="${WORKDIR:-$(mktemp -d -t tapas_demo.XXXXXX)}"
echo "workdir $WORKDIR (plan.json, plan.txt, metrics.jsonl, checkpoints/)"
exec "$VENV/bin/python" scripts/train.py --mesh=data:2,model:4 --compare \
  --workdir="$WORKDIR" "$@"
