#!/usr/bin/env bash
# The one check a lent GPU machine runs (the `device` tool; nothing in CI depends on it):
#   1. scripts/bench_attention.py: the Pallas GPU (Triton) kernel runs, matches the pure-JAX
#      reference within the kernel tests' tolerance, and is timed against the HBM peak;
#   2. scripts/device_check.py: the engine serves the shipped model on the GPU with the xla
#      backend's greedy tokens, and a compiled directory built there loads with no compilation;
#   3. the same with the directory built deviceless for a target description, if one is given.
# The machine's own Python 3.12 and jax 0.11.2 are used (its image has no jax 0.10.2 and no
# network); what it lacks travels as wheels in .whl/, git-ignored: flax 0.12.12 (0.12.8 fails
# on jax 0.11), gguf and llguidance 1.9.1, fetched here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_31_x86_64 -d .whl flax==0.12.12 gguf llguidance==1.9.1
# and a target description copied into a git-ignored folder beside it, e.g. .gpu_targets/.
# The whole check ran on jax 0.11.2 on CPU (JAX_PLATFORMS=cpu) before it was sent. Tables and
# logs go to $OUT when set (the device tool's folder), else to results/. Exit 1 if any failed.
#
#   bash scripts/device_gpu_check.sh [.gpu_targets/h100_sxm.txtpb]
set -u
out=${OUT:-results}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import jax, sys; print(sys.version.split()[0], jax.__version__, jax.devices())"

status=0
run() {  # run NAME CMD...: log to $out/NAME.log, remember a failure
  local name=$1; shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$out/$name.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "== $name FAILED"; status=1; }
}
run bench_attention python3 scripts/bench_attention.py --out "$out/bench_attention_gpu.md"
run device_check python3 scripts/device_check.py
if [ -n "${1:-}" ]; then
  run device_check_target python3 scripts/device_check.py --target "$1"
fi
exit $status
