#!/usr/bin/env bash
# Creates the venvs for deviceless compiles (`jaxserve compile-check`, `jaxserve compile`,
# scripts/check_tpu_compile.py), kept apart from .venv because of their size:
#   .venv-tpu: jaxserve with libtpu (~700 MB), for TPU topologies;
#   .venv-gpu: jaxserve with the CUDA compile-only plugin (~4.6 GB), for the GPU descriptions
#              in ../shared/gpu_targets.
# Where .venv exists (the README's install), each sees .venv's packages (jaxserve and its
# dependencies) through a .pth file and installs only what it adds: seconds, not minutes of
# reinstalling the same packages. Without .venv, each installs jaxserve in full.
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
  [tpu]='import jax, jaxserve, libtpu; print("jax", jax.__version__, "libtpu ok")'
  [gpu]='import jax, jaxserve, jax_plugins.xla_cuda13; print("jax", jax.__version__, "CUDA compile-only plugin ok")'
)
site_packages() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
base=""
[ -x .venv/bin/python ] && base=$(site_packages .venv/bin/python)
for kind in "${@:-tpu gpu}"; do
  for k in $kind; do
    venv=".venv-$k"
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
    if [ -n "$base" ]; then
      # addsitedir (not a bare path) so that .venv's own .pth files (the editable jaxserve) run
      echo "import site; site.addsitedir('$base')" > "$(site_packages "$venv/bin/python")/_jaxserve_base.pth"
      # shellcheck disable=SC2086  # the package list is meant to split
      "$venv/bin/pip" install --quiet ${PACKAGES[$k]}
    else
      # shellcheck disable=SC2086
      "$venv/bin/pip" install --quiet -e . ${PACKAGES[$k]}
    fi
    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 "$venv/bin/python" -c "${CHECK[$k]}"
  done
done
