"""`jaxserve bench throughput` and `jaxserve bench latency`: vLLM's offline benchmarks, over
an engine in this process: the throughput of a batch of random prompts, and the latency of one
batch over repeated runs."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from jaxserve.entrypoints.bench_serve import random_token_prompts
from jaxserve.entrypoints.cli.args import add_config_arg, add_engine_args, engine_kwargs

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def _engine_and_prompts(args: argparse.Namespace, num: int) -> tuple:
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    llm = LLM(**engine_kwargs(args))  # the engine's --seed seeds the prompts too
    vocab = args.vocab_size or llm.engine.input_processor.vocab_size
    prompts = [{"prompt_token_ids": p}
               for p in random_token_prompts(num, args.input_len, vocab,
                                                   getattr(args, "seed", 0))]
    # As vLLM's: sampled at temperature 1, every output exactly output_len long.
    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True,
                            max_tokens=args.output_len)
    return llm, prompts, params


def _write_json(path: str | None, record: dict) -> None:
    if path is not None:
        with open(path, "w") as f:
            json.dump(record, f, indent=2)


def cmd_throughput(args: argparse.Namespace) -> int:
    llm, prompts, params = _engine_and_prompts(args, args.num_prompts)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    record = {"elapsed_time": elapsed, "num_requests": len(outputs),
              "total_num_tokens": prompt_tokens + output_tokens,
              "requests_per_second": len(outputs) / elapsed,
              "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
              "output_tokens_per_second": output_tokens / elapsed}
    print(f"Throughput: {record['requests_per_second']:.2f} requests/s, "
          f"{record['tokens_per_second']:.2f} total tokens/s, "
          f"{record['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    _write_json(args.output_json, record)
    return 0


def cmd_latency(args: argparse.Namespace) -> int:
    llm, prompts, params = _engine_and_prompts(args, args.batch_size)

    def run() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        run()
    latencies = np.array([run() for _ in range(args.num_iters)])
    percentiles = {q: float(np.percentile(latencies, q)) for q in LATENCY_PERCENTILES}
    print(f"Avg latency: {latencies.mean()} seconds")
    for q, value in percentiles.items():
        print(f"{q}% percentile latency: {value} seconds")
    _write_json(args.output_json, {"avg_latency": float(latencies.mean()),
                                   "latencies": latencies.tolist(),
                                   "percentiles": {str(q): v for q, v in percentiles.items()}})
    return 0


def add_offline_parsers(kinds: argparse._SubParsersAction) -> None:
    throughput = kinds.add_parser("throughput", help="offline throughput of random prompts")
    throughput.add_argument("--num-prompts", type=int, default=1000, help="prompts to run")
    latency = kinds.add_parser("latency", help="latency of one batch, over repeated runs")
    latency.add_argument("--batch-size", type=int, default=8, help="prompts in the batch")
    latency.add_argument("--num-iters-warmup", type=int, default=10,
                         help="runs before the measured ones")
    latency.add_argument("--num-iters", type=int, default=30, help="measured runs")
    for p, func in ((throughput, cmd_throughput), (latency, cmd_latency)):
        p.add_argument("--input-len", type=int, default=32, help="prompt tokens (random ids)")
        p.add_argument("--output-len", type=int, default=128,
                       help="output tokens per prompt (ignore_eos)")
        p.add_argument("--vocab-size", type=int, default=None,
                       help="prompt ids are drawn below this (default: the model's vocabulary)")
        p.add_argument("--output-json", default=None, help="also write the results as JSON")
        add_engine_args(p)
        add_config_arg(p)
        p.set_defaults(func=func)
