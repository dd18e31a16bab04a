"""Unified vs disaggregated prefill/decode on a long-prompt-heavy and a short-prompt workload:
TTFT and inter-token latency (ITL) percentiles, throughput, and the disaggregated engine's
transfer numbers. Writes results/bench_disagg.md and prints it.

    python scripts/bench_disagg.py [--devices 8] [--num-requests 24] [--rate-long 1.0] ...

Every engine gets the same 8 (forced) CPU devices: unified TP 2 x DP 4; disaggregated with
decode TP 2 x DP 2 on 4 devices and prefill on the other 4, as TP 4 or as TP 2 x DP 2, in this
process (KV copied device to device) or in a child process (KV bytes over loopback), with
async scheduling on both sides (the default) and, once, off. Requests arrive as a Poisson
process; every run follows a warm-up run of the same shapes with other prompts (all shapes
compiled before, and no prompt of the measured run is in a prefix cache).
On a CPU host the "devices" share the same cores, so the two sides of the disaggregated engine
do not really run in parallel here: read the rows as a comparison within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODEL_CONFIG = dict(  # a ~5M-parameter Llama with random weights (load_format "dummy")
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=2048, hidden_size=256,
    intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
ENGINE = dict(max_model_len=1024, block_size=16, num_kv_blocks=320, max_num_seqs=16,
              max_num_batched_tokens=256, token_buckets=[32, 128, 256], request_buckets=[16],
              precompile=True)


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]  # seconds after the start


def make_workload(name: str, n: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                  rate: float, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, MODEL_CONFIG["vocab_size"],
                            int(rng.integers(prompt_len[0], prompt_len[1] + 1))).tolist()
               for _ in range(n)]
    outs = [int(x) for x in rng.integers(output_len[0], output_len[1] + 1, n)]
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n)).tolist()
    return Workload(name, prompts, outs, arrivals)


@dataclass
class Run:
    elapsed: float
    ttft: list[float]
    itl: list[float]
    prompt_tokens: int
    output_tokens: int
    extra: dict


def run(engine, workload: Workload, tag: str) -> Run:
    from jaxserve import SamplingParams

    start = time.time()
    todo = list(range(len(workload.prompts)))
    done = {}
    while todo or engine.has_unfinished_requests():
        now = time.time() - start
        while todo and workload.arrivals[todo[0]] <= now:
            i = todo.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=workload.output_lens[i],
                                    ignore_eos=True)
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": workload.prompts[i]}, params,
                               arrival_time=start + workload.arrivals[i])
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        elif todo:
            time.sleep(max(0.0, workload.arrivals[todo[0]] - (time.time() - start)))
    elapsed = time.time() - start
    ttft, itl = [], []
    for out in done.values():
        m = out.metrics
        ttft.append(m.first_token_time - m.arrival_time)
        itl += np.diff(m.token_times).tolist()
    return Run(elapsed, ttft, itl, sum(len(p) for p in workload.prompts),
               sum(len(o.outputs[0].token_ids) for o in done.values()), {})


def measure(engine, workloads: list[Workload], warm_ups: list[Workload],  # noqa: ANN001
            label: str) -> dict[str, Run]:
    results = {}
    for w, warm in zip(workloads, warm_ups):
        run(engine, warm, f"warm-{w.name}")  # compiles nothing new; other prompts: no hits
        before = engine.stats()
        result = run(engine, w, w.name)
        after = engine.stats()
        if after.kv_transfer is not None:
            kv, kv0 = after.kv_transfer, before.kv_transfer
            n = kv.num_transfers - kv0.num_transfers
            recent = list(engine.core.connector.ttft_splits)[-n:] if n else []
            result.extra = {
                "transfers": n,
                "MiB moved": (kv.transfer_bytes - kv0.transfer_bytes) / 2**20,
                "decode-side prefix hits (tokens)": (after.prefix_cache_hits
                                                     - before.prefix_cache_hits),
                "ms per transfer": 1e3 * (kv.transfer_seconds - kv0.transfer_seconds)
                / max(n, 1),
                "prefill / transfer / first decode (ms, mean)": " / ".join(
                    f"{1e3 * np.mean([getattr(s, f) for s in recent]):.0f}"
                    for f in ("prefill", "transfer", "first_decode")) if recent else "-"}
        result.extra["compilations after warm-up"] = (after.num_compilations
                                                      - before.num_compilations)
        results[w.name] = result
        print(f"{label:>14} {w.name:>6}: {result.elapsed:.1f} s, "
              f"{result.output_tokens / result.elapsed:.1f} out tok/s", flush=True)
    return results


def pct(values: list[float], q: float) -> str:
    return f"{1e3 * float(np.percentile(values, q)):.0f}" if values else "-"


def table(all_results: dict[str, dict[str, Run]], workloads: list[Workload]) -> str:
    lines = ["| workload | engine | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) | "
             "output tok/s | total tok/s | wall (s) |", "|---|---|---|---|---|---|---|"]
    for w in workloads:
        for label, results in all_results.items():
            r = results[w.name]
            lines.append(
                f"| {w.name} | {label} | {pct(r.ttft, 50)} / {pct(r.ttft, 90)} / "
                f"{pct(r.ttft, 99)} | {pct(r.itl, 50)} / {pct(r.itl, 90)} / {pct(r.itl, 99)} | "
                f"{r.output_tokens / r.elapsed:.1f} | "
                f"{(r.prompt_tokens + r.output_tokens) / r.elapsed:.1f} | {r.elapsed:.1f} |")
    return "\n".join(lines)


DECODE = {"num_devices": 4, "tensor_parallel_size": 2, "data_parallel_size_local": 2}
ENGINES = {  # label -> engine arguments on top of ENGINE
    "unified TP2xDP4": dict(tensor_parallel_size=2, data_parallel_size_local=4,
                            long_prefill_token_threshold=128),
    "disagg P TP4 / D TP2xDP2": dict(disaggregation={
        "prefill": {"num_devices": 4}, "decode": DECODE}),
    "disagg P TP4 / D TP2xDP2, async off": dict(async_scheduling=False, disaggregation={
        "prefill": {"num_devices": 4}, "decode": DECODE}),
    "disagg P TP2xDP2 / D TP2xDP2": dict(disaggregation={
        "prefill": {"num_devices": 4, "tensor_parallel_size": 2, "data_parallel_size_local": 2},
        "decode": DECODE}),
    # The prefill side in a child process with its own 4 devices; decode on devices 4-7 here.
    "disagg P TP4 / D TP2xDP2, 2 processes, JAX transfer": dict(disaggregation={
        "connector": "socket", "kv_transport": "jax_transfer", "prefill": {"num_devices": 4},
        "decode": {**DECODE, "devices": [4, 5, 6, 7]}}),
    "disagg P TP4 / D TP2xDP2, 2 processes, bytes": dict(disaggregation={
        "connector": "socket", "kv_transport": "bytes", "prefill": {"num_devices": 4},
        "decode": {**DECODE, "devices": [4, 5, 6, 7]}}),
}


def transfer_table(all_results: dict[str, dict[str, Run]], workloads: list[Workload]) -> str:
    rows = [(label, w.name, results[w.name].extra) for label, results in all_results.items()
            for w in workloads if "transfers" in results[w.name].extra]
    head = ["engine", "workload", *rows[0][2]]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for label, name, extra in rows:
        lines.append(f"| {label} | {name} | " + " | ".join(
            f"{v:.2f}" if isinstance(v, float) else str(v) for v in extra.values()) + " |")
    return "\n".join(lines)


def report(all_results: dict[str, dict[str, Run]], workloads: list[Workload],
           args: argparse.Namespace) -> str:
    desc = [f"- **{w.name}**: {len(w.prompts)} requests, prompts {min(map(len, w.prompts))}-"
            f"{max(map(len, w.prompts))} tokens, outputs {min(w.output_lens)}-"
            f"{max(w.output_lens)} tokens, Poisson arrivals at "
            f"{len(w.prompts) / w.arrivals[-1]:.1f} req/s" for w in workloads]
    return "\n".join([
        "# Unified vs disaggregated prefill/decode", "",
        f"`python scripts/bench_disagg.py --num-requests {args.num_requests} --rate-long "
        f"{args.rate_long} --rate-short {args.rate_short}` on "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
        f"{args.devices} forced CPU devices, Python {sys.version.split()[0]}; load average "
        f"{os.getloadavg()[1]:.1f} over the last 5 minutes of the run (other jobs included).",
        "",
        "Model: a 4-layer Llama (hidden 256, 8 query heads over 2 KV heads, vocab 2048) with "
        f"random weights, float32; greedy, EOS ignored. Engines: {json.dumps(ENGINE)}; the "
        "unified engine chunks prefills at 128 tokens (long_prefill_token_threshold) so "
        "decodes keep running.", "", *desc, "",
        table(all_results, workloads), "",
        "Disaggregated engines, per measured run. The TTFT split is of the time to the second "
        "token: arrival -> first token on the prefill side (the TTFT above) -> KV moved and "
        "request admitted on the decode side -> second token. Blocks whose prompt prefix the "
        "decode side already holds (its prefix cache) are not moved.", "",
        transfer_table(all_results, workloads), "",
        "Caveat: the 8 devices are virtual CPU devices sharing this machine's cores, so the "
        "prefill and decode sides compete for the same CPUs instead of running side by side, "
        "and a KV transfer is a memory copy. On real accelerators the two sides run in "
        "parallel and transfers cross an interconnect; only the shape of these numbers "
        "carries over.", ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--rate-long", type=float, default=1.0, help="requests/s")
    parser.add_argument("--rate-short", type=float, default=4.0, help="requests/s")
    parser.add_argument("--out", default=str(ROOT / "results" / "bench_disagg.md"))
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}")
    from jaxserve import LLMEngine
    from jaxserve.config import EngineConfig

    model_dir = Path(tempfile.mkdtemp(prefix="bench-disagg-"))
    (model_dir / "config.json").write_text(json.dumps(MODEL_CONFIG))
    n = args.num_requests
    specs = [("long", (400, 900), (16, 32), args.rate_long),
             ("short", (16, 64), (48, 96), args.rate_short)]
    workloads = [make_workload(name, n, p, o, rate, seed=i + 1)
                 for i, (name, p, o, rate) in enumerate(specs)]
    warm_ups = [make_workload(name, n, p, o, rate, seed=i + 101)
                for i, (name, p, o, rate) in enumerate(specs)]
    base = dict(model=str(model_dir), load_format="dummy", compilation_cache_dir="", **ENGINE)
    all_results = {}
    for label, extra in ENGINES.items():
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig.from_kwargs(**base, **extra))
        print(f"{label}: built and warmed up in {time.perf_counter() - t0:.1f} s", flush=True)
        all_results[label] = measure(engine, workloads, warm_ups, label)
        engine.core.close()
        del engine
    text = report(all_results, workloads, args)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
