#!/usr/bin/env bash
# Creates .venv-tpu: jaxserve with libtpu, for deviceless TPU compiles (`jaxserve compile-check`,
# scripts/check_tpu_compile.py). Kept apart from .venv because libtpu adds ~700 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv-tpu/bin/python ]; then
  "$PYTHON" -m venv .venv-tpu
fi
# The project itself (for `jaxserve compile-check`), with libtpu beside its jax.
.venv-tpu/bin/pip install --quiet -e . "jax[tpu]==0.10.2"
.venv-tpu/bin/python -c "import jax, libtpu; print('jax', jax.__version__, 'libtpu ok')"
