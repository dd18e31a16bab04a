#!/usr/bin/env bash
# Creates the venvs for deviceless compiles (`jaxserve compile-check`, `jaxserve compile`,
# scripts/check_tpu_compile.py), kept apart from .venv because of their size:
#   .venv-tpu: jaxserve with libtpu (~700 MB), for TPU topologies;
#   .venv-gpu: jaxserve with the CUDA compile-only plugin (~4.6 GB), for the GPU descriptions
#              in ../shared/gpu_targets.
# Usage: scripts/setup_compile_venvs.sh [tpu] [gpu]   (default: both)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
declare -A PACKAGES=(
  [tpu]='jax[tpu]==0.10.2'
  [gpu]='jax-cuda13-plugin[with-cuda]==0.10.2 jax-cuda13-pjrt==0.10.2'
)
declare -A CHECK=(
  [tpu]='import jax, libtpu; print("jax", jax.__version__, "libtpu ok")'
  [gpu]='import jax, jax_plugins.xla_cuda13; print("jax", jax.__version__, "CUDA compile-only plugin ok")'
)
for kind in "${@:-tpu gpu}"; do
  for k in $kind; do
    venv=".venv-$k"
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
    # shellcheck disable=SC2086  # the package list is meant to split
    "$venv/bin/pip" install --quiet -e . ${PACKAGES[$k]}
    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 "$venv/bin/python" -c "${CHECK[$k]}"
  done
done
