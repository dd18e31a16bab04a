"""`jaxserve bench serve`: vLLM's serving benchmark against a running OpenAI-compatible server.
Random token prompts arrive as a Poisson process (gamma with `burstiness`), each streams its
completion, and the summary is vLLM's: TTFT, TPOT, ITL and end-to-end latency (mean, median,
percentiles), request and token throughput."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
           ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency"))


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft: float = 0.0  # seconds from sending the request to its first token
    e2e: float = 0.0  # seconds from sending the request to its last token
    itl: list[float] = field(default_factory=list)  # seconds between successive chunks
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


async def send_request(client: Any, url: str, body: dict[str, Any]) -> RequestResult:
    """One streamed completion (`client`: an httpx.AsyncClient); tokens are counted from the
    chunks' token_ids (`return_token_ids`)."""
    import httpx

    start = time.perf_counter()
    times: list[float] = []
    tokens = 0
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                return RequestResult(False, error=f"HTTP {resp.status_code}: "
                                     f"{(await resp.aread()).decode(errors='replace')}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(False, error=str(chunk["error"]))
                for choice in chunk.get("choices", []):
                    n = len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
                    if n:
                        tokens += n
                        times.append(time.perf_counter())
    except httpx.HTTPError as exc:
        return RequestResult(False, error=repr(exc))
    if not times:
        return RequestResult(False, error="no tokens")
    return RequestResult(True, times[0] - start, times[-1] - start, np.diff(times).tolist(),
                         len(body["prompt"]), tokens)


def arrival_gaps(num: int, request_rate: float, burstiness: float,
                 rng: np.random.Generator) -> np.ndarray:
    """Seconds before each request: gamma(burstiness) with mean 1 / request_rate (burstiness 1
    is a Poisson process), or all at once for an infinite rate."""
    if request_rate == float("inf"):
        return np.zeros(num)
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError(f"request_rate and burstiness must be > 0, got {request_rate} and "
                         f"{burstiness}")
    return rng.gamma(burstiness, 1.0 / (request_rate * burstiness), size=num)


async def run_benchmark(base_url: str, model: str, prompts: list[list[int]], output_len: int,
                        request_rate: float, *, burstiness: float = 1.0, seed: int = 0,
                        max_concurrency: int | None = None, api_key: str | None = None,
                        endpoint: str = "/v1/completions",
                        ) -> tuple[list[RequestResult], float]:
    """Every prompt as one greedy request of `output_len` tokens (ignore_eos); the results
    and the wall time from the first send to the last answer."""
    import httpx

    gaps = arrival_gaps(len(prompts), request_rate, burstiness, np.random.default_rng(seed))
    gate = asyncio.Semaphore(max_concurrency or len(prompts) or 1)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=(max_concurrency or len(prompts)) + 8)

    async with httpx.AsyncClient(timeout=None, limits=limits, headers=headers) as client:
        async def one(prompt: list[int]) -> RequestResult:
            body = {"model": model, "prompt": prompt, "max_tokens": output_len,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "return_token_ids": True}
            async with gate:
                return await send_request(client, f"{base_url}{endpoint}", body)

        tasks = []
        start = time.perf_counter()
        for prompt, gap in zip(prompts, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(prompt)))
        results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float,
              percentiles: tuple[float, ...] = (99,)) -> dict[str, float]:
    """vLLM's result fields: counts, throughputs, and mean/median/std/p{q} of each metric."""
    ok = [r for r in results if r.ok]
    samples = {"ttft": [r.ttft for r in ok],
               "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
                        if r.output_tokens > 1],
               "itl": [x for r in ok for x in r.itl], "e2el": [r.e2e for r in ok]}
    inputs, outputs = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    out: dict[str, float] = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": inputs, "total_output_tokens": outputs,
        "request_throughput": len(ok) / duration, "output_throughput": outputs / duration,
        "total_token_throughput": (inputs + outputs) / duration}
    for name, values in samples.items():
        ms = np.asarray(values or [np.nan]) * 1000
        out[f"mean_{name}_ms"], out[f"median_{name}_ms"] = float(ms.mean()), float(np.median(ms))
        out[f"std_{name}_ms"] = float(ms.std())
        for q in percentiles:
            out[f"p{q:g}_{name}_ms"] = float(np.percentile(ms, q))
    return out


def format_summary(s: dict[str, float], percentiles: tuple[float, ...] = (99,)) -> str:
    """vLLM's printed summary."""
    lines = ["{:=^50}".format(" Serving Benchmark Result ")]
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Benchmark duration (s):", f"{s['duration']:.2f}"),
            ("Total input tokens:", s["total_input_tokens"]),
            ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    lines += [f"{k:<40} {v:<10}" for k, v in rows]
    for name, title in METRICS:
        short = name.upper()
        lines.append("{:-^50}".format(title))
        lines += [f"{f'Mean {short} (ms):':<40} {s[f'mean_{name}_ms']:<10.2f}",
                  f"{f'Median {short} (ms):':<40} {s[f'median_{name}_ms']:<10.2f}"]
        lines += [f"{f'P{q:g} {short} (ms):':<40} {s[f'p{q:g}_{name}_ms']:<10.2f}"
                  for q in percentiles]
    lines.append("=" * 50)
    return "\n".join(lines)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import httpx

    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model
    if model is None:
        resp = httpx.get(f"{base}/v1/models", headers=headers, timeout=30)
        if resp.status_code != 200:
            raise ValueError(f"GET {base}/v1/models: HTTP {resp.status_code}: {resp.text}")
        model = resp.json()["data"][0]["id"]
    prompts = random_token_prompts(args.num_prompts, args.random_input_len,
                                   args.random_vocab_size, args.seed)
    percentiles = tuple(float(q) for q in args.metric_percentiles.split(","))
    # As vLLM: one request first, so that a misconfigured run fails at once and clearly.
    test, _ = asyncio.run(run_benchmark(base, model, prompts[:1], args.random_output_len,
                                        float("inf"), api_key=args.api_key,
                                        endpoint=args.endpoint))
    if not test[0].ok:
        raise ValueError(f"the test request failed: {test[0].error}")
    results, duration = asyncio.run(run_benchmark(
        base, model, prompts, args.random_output_len, args.request_rate,
        burstiness=args.burstiness, seed=args.seed, max_concurrency=args.max_concurrency,
        api_key=args.api_key, endpoint=args.endpoint))
    summary = summarize(results, duration, percentiles)
    print(format_summary(summary, percentiles))
    if args.save_result:
        record = {"model_id": model, "request_rate": args.request_rate,
                  "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
                  "num_prompts": args.num_prompts, **summary,
                  "errors": [r.error for r in results if not r.ok][:10]}
        path = args.result_filename or f"jaxserve-bench-{int(time.time())}.json"
        with open(path, "w") as f:
            json.dump(record, f, indent=2)
        print(f"results: {path}", file=sys.stderr)
    return 0 if summary["failed"] == 0 else 1


def random_token_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` random token ids in [3, vocab_size) (clear of the usual
    specials), the same for a given seed."""
    return np.random.default_rng(seed).integers(3, vocab_size, size=(num, length)).tolist()


def add_serve_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("serve", help="drive a running server: Poisson arrivals, vLLM's "
                         "latency and throughput summary")
    p.add_argument("--base-url", default=None, help="the server (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="served model name (default: the first "
                   "of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as a bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=1000, help="requests to send")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="mean requests per second (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrivals: 1 is Poisson, lower is burstier")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (default: no limit)")
    p.add_argument("--random-input-len", type=int, default=32,
                   help="prompt tokens per request (random ids)")
    p.add_argument("--random-output-len", type=int, default=64,
                   help="output tokens per request (ignore_eos)")
    p.add_argument("--random-vocab-size", type=int, default=256,
                   help="prompt token ids are drawn below this (at most the model's vocabulary)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metric-percentiles", default="99",
                   help="comma-separated percentiles to report, e.g. 50,90,99")
    p.add_argument("--save-result", action="store_true", help="write the results as JSON")
    p.add_argument("--result-filename", default=None)
    p.set_defaults(func=cmd_bench_serve)
