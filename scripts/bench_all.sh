#!/usr/bin/env bash
# Run every benchmark (each writes results/<name>.md and prints it), then rewrite the README's
# results section from results/*.md. Usage: scripts/bench_all.sh [NAME_TO_SKIP ...]
# UPDATE_README=0 leaves the README alone. Takes ~45-60 minutes on a 2-core CPU (more when the
# machine is shared); each table records the load average it was made under.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
BENCHES=(bench_real_model bench_throughput_vs_hf bench_prefix_caching bench_chunked_prefill bench_mixed_batching
         bench_spec_decode bench_embeddings bench_health_under_load bench_host_overhead bench_decode_roofline bench_compile_check
         bench_startup bench_gguf_dequant bench_sliding_window_kv)
SKIP=" ${*:-} "
for bench in "${BENCHES[@]}"; do
  if [[ "$SKIP" == *" $bench "* ]]; then
    echo "== $bench: skipped"
    continue
  fi
  echo "== $bench"
  start=$(date +%s)
  "$PY" -u "scripts/$bench.py"
  if [[ "$bench" == bench_throughput_vs_hf ]]; then  # and its large-batch suite (issue 22's rows)
    "$PY" -u "scripts/$bench.py" --suite large-batch --skip-hf-cb
  fi
  echo "== $bench: $(( $(date +%s) - start )) s"
done
if [[ "${UPDATE_README:-1}" != 0 ]]; then
  "$PY" scripts/update_readme_results.py
fi
