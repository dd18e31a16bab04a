#!/usr/bin/env bash
# Creates .venv-tpu: jax with libtpu for the deviceless TPU compile check (scripts/check_tpu_compile.py).
# Kept apart from .venv because libtpu adds ~700 MB. pallas_kernels is imported from the repo via
# PYTHONPATH, never installed here.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv-tpu/bin/python ]; then
  "$PYTHON" -m venv .venv-tpu
fi
.venv-tpu/bin/pip install --quiet "jax[tpu]==0.10.2" flatbuffers numpy
.venv-tpu/bin/python -c "import jax, libtpu; print('jax', jax.__version__, 'libtpu ok')"
