#!/usr/bin/env bash
# The demo on the embedded default (configs/default.py: a 4-layer tiny GPT-2): plan it
# for an 8-device CPU mesh (data 2, model 4, a stand-in for a TPU slice), print the plan
# next to data parallel, FSDP and Megatron (predicted, and what XLA compiles of each),
# then train it as a byte-level language model on this repository's own text (README and
# sources, made a token file by scripts/prepare_data.py), the end of it held out for the
# eval loss. Extra args go to scripts/train.py (a --config=FILE first, as absl wants it
# before overrides), e.g. scripts/demo.sh --config=configs/llama.py:tiny --steps=20;
# --config.data=learnable trains on the synthetic pattern (and image models need it).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
WORKDIR="${WORKDIR:-$(mktemp -d -t tapas_demo.XXXXXX)}"
mkdir -p "$WORKDIR"
echo "workdir $WORKDIR (corpus.bin, plan.json, plan.txt, metrics.jsonl, checkpoints/)"
"$VENV/bin/python" scripts/prepare_data.py README.md tapas_jax/*.py tapas_jax/*/*.py \
  scripts/*.py "$WORKDIR/corpus.bin"
CONFIG=(--config=configs/default.py)
REST=()
for arg in "$@"; do
  case "$arg" in
    --config=*) CONFIG=("$arg") ;;
    *) REST+=("$arg") ;;
  esac
done
exec "$VENV/bin/python" scripts/train.py "${CONFIG[@]}" --mesh=data:2,model:4 --compare \
  --config.data="tokens:$WORKDIR/corpus.bin" --batch_size=32 --steps=100 \
  --config.eval_every=25 --config.eval_steps=4 --workdir="$WORKDIR" ${REST[@]+"${REST[@]}"}
