#!/usr/bin/env bash
# Creates .venv-gpu: jaxserve with the CUDA compile-only plugin, for deviceless GPU compiles
# against the descriptions in ../shared/gpu_targets (`jaxserve compile-check`). ~4.6 GB, so it is
# made only when asked: `bash scripts/setup_gpu_venv.sh`, or JAXSERVE_GPU_CHECK=1 in .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv-gpu/bin/python ]; then
  "$PYTHON" -m venv .venv-gpu
fi
.venv-gpu/bin/pip install --quiet -e . "jax-cuda13-plugin[with-cuda]==0.10.2" \
  "jax-cuda13-pjrt==0.10.2"
JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 .venv-gpu/bin/python -c \
  "import jax, jax_plugins.xla_cuda13; print('jax', jax.__version__, 'cuda compile-only plugin ok')"
