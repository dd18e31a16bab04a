"""Every TPU/GPU preset's model step, every bucket, compiled deviceless for its own target at its
own settings (`jaxserve compile-check`, run in .venv-tpu / .venv-gpu): memory, KV capacity,
cache and weight copies, compile seconds per bucket, the whole set's compile time, and the
step modelled from the compiled program beside its floor for each batch a bucket is judged on;
beside the same model's reading of the engine before this change where
results/compile_check/before/<preset>.json holds one (`--before DIR` writes it).

    python scripts/bench_compile_check.py [--presets tpu-v5e-llama3-8b ...] [--num-layers N]

Writes results/compile_check/<preset>.json and results/bench_compile_check.md (presets not
asked for keep the rows of their last run, with its wall seconds where it recorded them).
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
MODELS = REPO_ROOT / "configs" / "models"
# preset (configs/engine/<preset>.yaml) -> its target and model (public architecture numbers)
TARGETS = {
    "tpu-v5e-llama3-8b": ("v5e:2x2", "llama-3-8b"),
    "tpu-v6e-llama3-8b": ("v6e:2x2", "llama-3-8b"),
    "tpu-v5p-llama3-8b": ("v5p:2x2x1", "llama-3-8b"),
    "tpu-tpu7x-llama3-8b": ("tpu7x:2x2x1", "llama-3-8b"),
    "h100-llama3-8b": (str(SHARED_GPU / "h100_sxm.txtpb"), "llama-3-8b"),
    "h200-llama3-8b": (str(SHARED_GPU / "h200.txtpb"), "llama-3-8b"),
    "tpu-v6e-qwen3-30b-a3b": ("v6e:2x2", "qwen3-30b-a3b"),
    "h200-qwen3-30b-a3b": (str(SHARED_GPU / "h200.txtpb"), "qwen3-30b-a3b"),
    "tpu-v5p-mixtral-8x7b": ("v5p:2x2x1", "mixtral-8x7b"),
    "tpu-v6e-gemma3-27b": ("v6e:2x2", "gemma-3-27b"),
    "h200-gemma3-27b": (str(SHARED_GPU / "h200.txtpb"), "gemma-3-27b"),
}
GIB = 2**30


def run_preset(name: str, num_layers: int | None, out_dir: Path = RESULTS_DIR / "compile_check",
               ) -> tuple[dict | None, float, str]:
    platform = "tpu" if name.startswith("tpu") else "gpu"
    python = REPO_ROOT / f".venv-{platform}" / "bin" / "python"
    if not python.exists():
        return None, 0.0, (f"{python.parent.parent.name} absent "
                           f"(scripts/setup_compile_venvs.sh {platform})")
    target, model = TARGETS[name]
    if platform == "gpu" and not Path(target).exists():
        return None, 0.0, f"{target} absent"
    out = out_dir / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(python), "-m", "jaxserve.entrypoints.cli.main", "compile-check", str(MODELS / model),
           "--target", target, "--config",
           str(REPO_ROOT / "configs" / "engine" / f"{name}.yaml"), "--json", str(out)]
    if num_layers:
        cmd += ["--num-layers", str(num_layers)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",
               ALLOW_MULTIPLE_LIBTPU_LOAD="1")  # libtpu locks itself to one process
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    report = json.loads(out.read_text()) if out.exists() and proc.returncode in (0, 1) else None
    if report is not None:  # kept with the report: a later run that skips this preset shows it
        report["bench_wall_seconds"] = wall
        out.write_text(json.dumps(report, indent=2))
    return report, wall, proc.stdout[-2000:] + proc.stderr[-2000:]


def scenario_costs(path: Path) -> dict[tuple[int, int, str], dict]:
    """(T, R, batch label) -> the cost of a report at `path`; empty where there is none."""
    if not path.exists():
        return {}
    return {(b["num_tokens"], b["num_reqs"], c["label"]): c
            for b in json.loads(path.read_text())["buckets"] for c in b.get("costs", [])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=list(TARGETS))
    p.add_argument("--num-layers", type=int, default=None, help="default: the model's")
    p.add_argument("--before", action="store_true",
                   help="only write the reports to results/compile_check/before/ (run from a "
                        "checkout of the code before a change, with this cost model in it)")
    args = p.parse_args()
    if args.before:
        for name in args.presets:
            run_preset(name, args.num_layers, RESULTS_DIR / "compile_check" / "before")
        return 0
    summary, buckets, costs, notes = [], [], [], []
    for name in TARGETS:
        saved = RESULTS_DIR / "compile_check" / f"{name}.json"
        if name in args.presets:
            report, wall, log = run_preset(name, args.num_layers)
        elif saved.exists():  # not asked for: the table keeps its last run
            report, log = json.loads(saved.read_text()), ""
            wall = report.get("bench_wall_seconds", float("nan"))
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
        before = scenario_costs(RESULTS_DIR / "compile_check" / "before" / f"{name}.json")
        for b in report["buckets"]:
            buckets.append([
                name, b["num_tokens"], b["num_reqs"], "yes" if b["compiled"] else b["error"],
                f"{b['compile_seconds']:.1f}", f"{b['temp_bytes'] / GIB:.3f}",
                f"{b['total_bytes'] / GIB:.2f} / {report['hbm_bytes'] / GIB:.0f}",
                b["cache_copies"], "n/a" if b["weight_copies"] is None else b["weight_copies"]])
            for c in b["costs"]:
                was = before.get((b["num_tokens"], b["num_reqs"], c["label"]))
                costs.append([
                    name, b["num_tokens"], b["num_reqs"], c["label"],
                    *(f"{c[k] / 1e9:.2f}" for k in ("weights", "kv_read", "kv_write",
                                                      "activations", "in_kernels")),
                    f"{c['collectives']} ({c['collective_bytes'] / 1e9:.2f})",
                    f"{c['flops'] / 1e12:.2f}", f"{c['floor_seconds'] * 1e3:.2f}",
                    f"{c['sequential_floor_seconds'] * 1e3:.2f}",
                    f"{c['modelled_seconds'] * 1e3:.2f} ({c['collective_seconds'] * 1e3:.2f})",
                    f"{c['ratio']:.2f}",
                    "n/a" if was is None else
                    f"{was['modelled_seconds'] * 1e3:.2f} / {was['ratio']:.2f}"])
    body = (
        "Each preset's model at its public architecture numbers (configs/models: Llama-3-8B "
        "width, 4096 hidden, 14336 FFN, 32 q / 8 KV heads, vocab 128,256; Qwen3-30B-A3B, 48 "
        "layers of 128 experts, top 8; Mixtral-8x7B, 32 layers of 8 experts, top 2; "
        "Gemma-3-27B, 62 layers, five local (1,024-token windows) to one global, vocab "
        "262,208), bf16, "
        "abstract weights, each preset's own engine arguments (the mixtures' TPU presets split "
        "their experts whole over the devices: enable_expert_parallel); KV pool sized from the memory "
        "the engine plans into (TPU: HBM as libtpu reports it x gpu_memory_utilization; GPU: "
        "XLA:GPU's 80%) minus weights and the largest step's own bytes. Layers are scanned on "
        "TPU, unrolled on GPU (XLA:GPU copies a scanned layer's weights: modelled 2.0x the "
        "decode floor) and on tpu7x. Cache copies: copy/transpose ops of at least one KV "
        "layer's size; weight copies: of a stacked layer weight's dims, the whole stack or one "
        "layer's slice (a relayout read and written every step); n/a where layers are unrolled, "
        "whose weights share their dims with activations.\n\n"
        + markdown_table(["preset", "target", "layers", "TP", "weights GiB/dev", "KV GiB/dev",
                          "blocks x size", "max temporaries GiB (% HBM)", "compiled",
                          "cache copies", "weight copies", "compile s (sum)", "wall s", "gate"],
                         summary)
        + "\n\nPer bucket:\n\n"
        + markdown_table(["preset", "T", "R", "compiled", "seconds", "temporaries GiB",
                          "total GiB / HBM", "cache copies", "weight copies"], buckets)
        + "\n\nThe step per device, modelled from its compiled HLO (each op's device-memory "
        "bytes and flops at the chip's published peaks, loops times their trip counts, the "
        "Pallas kernels by their DMAs, collectives on the ICI links less what the ops scheduled "
        "beside them hide), beside its floor (the weights, each request's visible KV and the "
        "logits moved once, or the flops at peak, whichever takes longer) and its sequential "
        "floor (the dense matmuls and attention taking turns, each at its own bound, as a "
        "layer's data flow has them do unless the batch is split and its halves interleaved): "
        "GB and ms. Each "
        "bucket is judged on a decode batch (128 and a full bucket at 1,024 tokens of context) "
        "or, where it holds more tokens than requests, a mixed one: R - 1 such decodes and one "
        "prefill chunk at position 0 and deep into the prompt. 'before': the same model on the "
        "engine as it was (n/a: not measured).\n\n"
        + markdown_table(["preset", "T", "R", "batch", "weights", "KV read", "KV write",
                          "activations", "of which in kernels", "collectives (GB sent)",
                          "TFLOP", "floor ms", "sequential floor ms",
                          "modelled ms (collectives exposed)", "ratio",
                          "before: modelled ms / ratio"], costs)
        + ("\n\n" + "\n".join(notes) if notes else ""))
    write_result("bench_compile_check", "Deviceless compile of every TPU/GPU preset", body)
    return 0 if all(row[-1] == "PASS" for row in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
