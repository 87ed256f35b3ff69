# Sourced by the scripts: make .venv and install the package into it when missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
# VENV names a second environment (CI tests a second Python and jax line in .venv312).
VENV="${VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if ! KERAS_BACKEND=jax "$VENV/bin/python" -c "import tapas_jax, pytest, ml_collections, orbax.checkpoint, grain, libtpu, equinox, keras" 2>/dev/null || [ ! -x "$VENV/bin/ruff" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e '.[test]'
fi
