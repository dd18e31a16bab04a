"""Every TPU/GPU preset's model step, every bucket, compiled deviceless for its own target at its
own settings (`jaxserve compile-check`, run in .venv-tpu / .venv-gpu): memory, KV capacity,
cache and weight copies, compile seconds and bytes accessed per bucket, and the whole set's
compile time.

    python scripts/bench_compile_check.py [--presets tpu-v5e-llama3-8b ...] [--num-layers N]

Writes results/compile_check/<preset>.json and results/bench_compile_check.md (presets not
asked for keep the rows of their last run, wall seconds n/a).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import REPO_ROOT, RESULTS_DIR, markdown_table, write_result  # noqa: E402

SHARED_GPU = REPO_ROOT.parent / "shared" / "gpu_targets"
LLAMA3_8B = REPO_ROOT / "configs" / "models" / "llama-3-8b"
TARGETS = {
    "tpu-v5e-llama3-8b": "v5e:2x2",
    "tpu-v6e-llama3-8b": "v6e:2x2",
    "tpu-v5p-llama3-8b": "v5p:2x2x1",
    "tpu-tpu7x-llama3-8b": "tpu7x:2x2x1",
    "h100-llama3-8b": str(SHARED_GPU / "h100_sxm.txtpb"),
    "h200-llama3-8b": str(SHARED_GPU / "h200.txtpb"),
}
GIB = 2**30


def run_preset(name: str, num_layers: int | None) -> tuple[dict | None, float, str]:
    platform = "tpu" if name.startswith("tpu") else "gpu"
    python = REPO_ROOT / f".venv-{platform}" / "bin" / "python"
    if not python.exists():
        return None, 0.0, (f"{python.parent.parent.name} absent "
                           f"(scripts/setup_compile_venvs.sh {platform})")
    if platform == "gpu" and not Path(TARGETS[name]).exists():
        return None, 0.0, f"{TARGETS[name]} absent"
    out = RESULTS_DIR / "compile_check" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(python), "-m", "jaxserve.entrypoints.cli", "compile-check", str(LLAMA3_8B),
           "--target", TARGETS[name], "--config",
           str(REPO_ROOT / "configs" / "engine" / f"{name}.yaml"), "--json", str(out)]
    if num_layers:
        cmd += ["--num-layers", str(num_layers)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",
               ALLOW_MULTIPLE_LIBTPU_LOAD="1")  # libtpu locks itself to one process
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    report = json.loads(out.read_text()) if out.exists() and proc.returncode in (0, 1) else None
    return report, wall, proc.stdout[-2000:] + proc.stderr[-2000:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=list(TARGETS))
    p.add_argument("--num-layers", type=int, default=None, help="default: the model's 32")
    args = p.parse_args()
    summary, buckets, notes = [], [], []
    for name in TARGETS:
        saved = RESULTS_DIR / "compile_check" / f"{name}.json"
        if name in args.presets:
            report, wall, log = run_preset(name, args.num_layers)
        elif saved.exists():  # not asked for: the table keeps its last run
            report, wall, log = json.loads(saved.read_text()), float("nan"), ""
        else:
            continue
        if report is None:
            notes.append(f"- {name}: not run: {log.strip().splitlines()[-1] if log else ''}")
            continue
        compiled = [b for b in report["buckets"] if b["compiled"]]
        worst_temp = max((b["temp_bytes"] for b in compiled), default=0)
        summary.append([
            name, report["target"], report["num_layers"], report["tensor_parallel_size"],
            f"{report['weight_bytes'] / GIB:.2f}", f"{report['kv_bytes'] / GIB:.2f}",
            f"{report['num_blocks']} x {report['block_size']}",
            f"{worst_temp / GIB:.3f} ({worst_temp / report['hbm_bytes']:.2%})",
            f"{len(compiled)}/{len(report['buckets'])}",
            sum(b["cache_copies"] for b in compiled),
            "n/a" if any(b["weight_copies"] is None for b in compiled)
            else sum(b["weight_copies"] for b in compiled),
            f"{sum(b['compile_seconds'] for b in compiled):.0f}",
            "n/a" if wall != wall else f"{wall:.0f}",
            "PASS" if not report["failures"] else "FAIL: " + "; ".join(report["failures"][:3])])
        for b in report["buckets"]:
            accessed = b["bytes_accessed"]
            buckets.append([
                name, b["num_tokens"], b["num_reqs"], "yes" if b["compiled"] else b["error"],
                f"{b['compile_seconds']:.1f}", f"{b['temp_bytes'] / GIB:.3f}",
                f"{b['total_bytes'] / GIB:.2f} / {report['hbm_bytes'] / GIB:.0f}",
                b["cache_copies"], "n/a" if b["weight_copies"] is None else b["weight_copies"],
                "n/a" if accessed is None else f"{accessed / 1e9:.2f}",
                "n/a" if accessed is None else f"{accessed / report['weight_bytes']:.2f}"])
    body = (
        "Llama-3-8B width (4096 hidden, 14336 FFN, 32 q / 8 KV heads, vocab 128,256), bf16, "
        "abstract weights, each preset's own engine arguments; KV pool sized from the device's "
        "HBM x gpu_memory_utilization minus weights and the largest step's temporaries. Layers "
        "are scanned (the TPU/GPU default), so XLA's cost analysis counts the loop body once: "
        "'GB accessed' is one layer's traffic plus the embedding, LM head and sampler inputs, "
        "outside the Pallas kernels. GPU: no cost analysis without a device. Cache copies: "
        "copy/transpose ops of at least one KV layer's size; weight copies: of a stacked "
        "layer weight's dims, the whole stack or one layer's slice (a relayout read and written "
        "every step); n/a where layers are unrolled (tpu7x), whose weights share their dims "
        "with activations.\n\n"
        + markdown_table(["preset", "target", "layers", "TP", "weights GiB/dev", "KV GiB/dev",
                          "blocks x size", "max temporaries GiB (% HBM)", "compiled",
                          "cache copies", "weight copies", "compile s (sum)", "wall s", "gate"],
                         summary)
        + "\n\nPer bucket:\n\n"
        + markdown_table(["preset", "T", "R", "compiled", "seconds", "temporaries GiB",
                          "total GiB / HBM", "cache copies", "weight copies", "GB accessed",
                          "/ weight bytes"],
                         buckets)
        + ("\n\n" + "\n".join(notes) if notes else ""))
    write_result("bench_compile_check", "Deviceless compile of every TPU/GPU preset", body)
    return 0 if all(row[-1] == "PASS" for row in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
