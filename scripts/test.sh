#!/usr/bin/env bash
# Runs the whole test suite on 8 fake CPU devices. Extra args go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
exec "$VENV/bin/python" -m pytest -q "$@"
