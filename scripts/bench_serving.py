"""Serving benchmark sweep: `jaxserve bench serve`'s Poisson arrivals and summary
(jaxserve/entrypoints/bench_serve.py) at several request rates against the OpenAI-compatible
server; throughput and p50/p90/p99 of TTFT, inter-token latency (ITL) and end-to-end latency,
written as a markdown table, with the engine's busy share and its step split by phase.

    python scripts/bench_serving.py                      # starts `jaxserve serve` on stories260K
    python scripts/bench_serving.py --url http://host:8000 --model NAME   # an existing server

The client runs in this process and the server in another, on the same machine: on a 2-core CPU
box the client's own work is part of what is measured, so compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from jaxserve.entrypoints.bench_serve import run_benchmark, summarize

REPO = Path(__file__).resolve().parent.parent
STORIES = Path("/work/shared/models/stories260K/stories260K.bin")
DEFAULT_SERVER_ARGS = ("--max-model-len 512 --max-num-seqs 32 --max-num-batched-tokens 256 "
                       "--token-buckets 64,256 --request-buckets 32 --precompile "
                       "--compilation-cache-dir /tmp/jaxserve_bench_xla")


def scrape(base: str, name: str) -> float | None:
    try:
        text = httpx.get(f"{base}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


PERCENTILES = (50, 90, 99)


def summarize_rate(rate: float, results: list, duration: float, busy: float | None) -> dict:
    """`jaxserve bench serve`'s summary of one rate, with the engine's busy share."""
    return {"rate": "inf" if rate == float("inf") else f"{rate:g}",
            **summarize(results, duration, PERCENTILES), "busy": busy,
            "first_error": next((r.error for r in results if not r.ok), "")}


def default_model() -> str:
    if STORIES.exists():
        return str(STORIES)
    try:  # the packaged tiny model, where this install has one
        from jaxserve.default_model import default_model_path
        return default_model_path()
    except Exception:  # noqa: BLE001
        return "dummy"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_path: str, name: str, server_args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli.main", "serve", model_path,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name,
           "--uvicorn-log-level", "warning", *shlex.split(server_args)]
    print("starting:", " ".join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become healthy in 600 s")


def profile_host(model_path: str, server_args: str, num: int, input_len: int, output_len: int,
                 vocab: int, seed: int) -> str:
    """In-process, without HTTP: the engine thread's step split into the phases the engine
    times itself (EngineStats.step_seconds: schedule, prep, dispatch, device, update, and
    output = detokenise, stop strings, delta outputs)."""
    from jaxserve.engine.llm_engine import LLMEngine
    from jaxserve.entrypoints.cli.args import add_engine_args, engine_kwargs
    from jaxserve.sampling_params import RequestOutputKind, SamplingParams

    parser = argparse.ArgumentParser()
    add_engine_args(parser, skip=("model",))
    engine = LLMEngine.from_engine_args(model=model_path, **engine_kwargs(
        parser.parse_args(shlex.split(server_args)), skip=("model",)))
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(num):
        engine.add_request(f"p{i}", rng.integers(3, vocab, size=input_len).tolist(), params)
    before = engine.stats().step_seconds
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step(RequestOutputKind.DELTA)
        steps += 1
    total = time.perf_counter() - start
    spent = {k: v - before[k] for k, v in engine.stats().step_seconds.items()}
    return (f"- engine thread, in-process ({num} requests at once, {steps} steps, "
            f"{1000 * total / steps:.1f} ms/step), share of the step time by phase (the "
            "engine's own timings): " + ", ".join(f"{k} {v / total:.1%}" for k, v in spent.items()))


def write_table(rows: list[dict], out: Path, header: list[str]) -> str:
    cols = [("rate (req/s)", "rate", "{}"), ("ok", "completed", "{}"),
            ("failed", "failed", "{}"), ("req/s", "request_throughput", "{:.2f}"),
            ("out tok/s", "output_throughput", "{:.1f}"),
            ("total tok/s", "total_token_throughput", "{:.1f}")] + [
        (f"{label} p{q} (ms)", f"p{q}_{m}_ms", "{:.1f}")
        for m, label in (("ttft", "TTFT"), ("itl", "ITL"), ("e2el", "E2E")) for q in PERCENTILES
    ] + [("engine busy", "busy", "{:.0%}")]
    lines = header + ["", "| " + " | ".join(c[0] for c in cols) + " |",
                      "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join("n/a" if row[key] is None else fmt.format(row[key])
                                       for _, key, fmt in cols) + " |")
    errors = [f"- rate {r['rate']}: {r['first_error']}" for r in rows if r["first_error"]]
    text = "\n".join(lines + ([""] + ["First error per rate:"] + errors if errors else [])) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="an existing server; else one is started")
    ap.add_argument("--model", default=None, help="checkpoint to serve, or the served name")
    ap.add_argument("--server-args", default=DEFAULT_SERVER_ARGS)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--rates", default="4,16,64,inf", help="requests per second; inf = burst")
    ap.add_argument("--num-prompts", type=int, default=96, help="requests per rate")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=None, help="prompt token ids below this")
    ap.add_argument("--warmup-prompts", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-host-profile", action="store_true",
                    help="skip the in-process split of the engine step (started server only)")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_serving.md"))
    args = ap.parse_args()

    proc = None
    if args.url:
        base, name = args.url.rstrip("/"), args.model
    else:
        model_path = args.model or default_model()
        name = Path(model_path).stem
        proc, base = start_server(model_path, name, args.server_args)
    try:
        models = httpx.get(f"{base}/v1/models", timeout=10, headers=(
            {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {})).json()
        name = name or models["data"][0]["id"]
        vocab = args.vocab or (512 if "stories" in name else 256)
        rng = np.random.default_rng(args.seed)

        def prompts(n: int) -> list[list[int]]:
            return rng.integers(3, vocab, size=(n, args.input_len)).tolist()

        asyncio.run(run_benchmark(base, name, prompts(args.warmup_prompts), args.output_len,
                                  float("inf"), seed=args.seed, api_key=args.api_key))
        rows = []
        for i, rate in enumerate(float(r) for r in args.rates.split(",")):
            busy_before = scrape(base, "jaxserve:engine_step_seconds_total")
            results, duration = asyncio.run(run_benchmark(
                base, name, prompts(args.num_prompts), args.output_len, rate,
                seed=args.seed + i, api_key=args.api_key))
            busy_after = scrape(base, "jaxserve:engine_step_seconds_total")
            busy = (None if busy_before is None or busy_after is None
                    else (busy_after - busy_before) / duration)
            rows.append(summarize_rate(rate, results, duration, busy))
            print(json.dumps(rows[-1]), file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    server = f"external {base}" if args.url else f"`jaxserve serve MODEL {args.server_args}`"
    header = ["# Serving benchmark (`scripts/bench_serving.py`)", "",
              f"- model: `{name}`; server: {server}",
              f"- {args.num_prompts} requests per rate, Poisson arrivals; random prompts of "
              f"{args.input_len} tokens, {args.output_len} output tokens each (ignore_eos), "
              "greedy, streamed",
              f"- machine: {platform.machine()}, {os.cpu_count()} CPU cores, "
              f"{platform.python_version()}; client and server on the same machine; load "
              f"average at the end {os.getloadavg()[0]:.1f} (other work on the machine skews "
              "absolute numbers)",
              "- TTFT and E2E from sending the request; ITL between successive streamed chunks; "
              "'engine busy' = share of wall time the engine thread spent inside steps"]
    if not args.url and not args.no_host_profile:
        header.append(profile_host(model_path, args.server_args, args.num_prompts,
                                   args.input_len, args.output_len, vocab, args.seed))
    print(write_table(rows, Path(args.out), header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
