#!/usr/bin/env bash
# The main job on the embedded default (configs/default.py): an 8-device CPU mesh
# stands in for a TPU slice. Extra args go to scripts/train.py.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
exec .venv/bin/python scripts/train.py "$@"
