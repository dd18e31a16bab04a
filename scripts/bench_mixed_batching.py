"""Mixed batching: V1 steps that mix prefill chunks and decodes, against V0-style steps that run
prefills only or decodes only (`enable_mixed_batching=False`), under continuous arrivals.

Two runs of each: offline (every request there at once: throughput), and Poisson arrivals at
`--load` x V1's offline request rate (latency: TTFT, ITL, end-to-end).

    python scripts/bench_mixed_batching.py [--requests 32] [--load 0.8]
"""

from __future__ import annotations

import argparse

import numpy as np

from bench_common import (DUMMY_CONFIG_DIR, make_engine, make_workload, markdown_table, pct_ms,
                          run_engine, write_result)

VOCAB = 8192


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--load", type=float, default=0.8, help="arrival rate / V1 offline capacity")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    # One engine per scheduler: the same step shapes, so the second compiles nothing.
    engines = {mixed: make_engine(
        DUMMY_CONFIG_DIR, load_format="dummy", max_model_len=1024, block_size=16,
        num_kv_blocks=1024, max_num_seqs=16, max_num_batched_tokens=512,
        token_buckets=[8, 16, 32, 64, 128, 256, 512], request_buckets=[8, 16],
        enable_prefix_caching=False, precompile=True, enable_mixed_batching=mixed)
        for mixed in (True, False)}
    w = make_workload("mixed", args.requests, (64, 512), (16, 96), VOCAB, args.seed)
    offline = {}
    for mixed, engine in engines.items():
        run_engine(engine, make_workload("warm", 4, (32, 300), (4, 4), VOCAB, 99),
                   prefix="warm-")
        offline[mixed] = run_engine(engine, w, prefix=f"off{mixed}-")
    rate = args.load * len(w.prompts) / offline[True].elapsed_s
    gaps = np.random.default_rng(args.seed + 1).exponential(1 / rate, len(w.prompts))
    arrivals = np.cumsum(gaps).tolist()

    rows = []
    for mixed, engine in engines.items():
        r = run_engine(engine, w, arrival_s=arrivals, prefix=f"m{mixed}-")
        o = offline[mixed]
        rows.append(["V1 mixed" if mixed else "V0-style prefill/decode", o.output_throughput,
                     o.num_steps, pct_ms(r.ttft_s, 50), pct_ms(r.ttft_s, 99),
                     pct_ms(r.itl_s, 50), pct_ms(r.itl_s, 99), pct_ms(r.e2e_s, 50),
                     pct_ms(r.e2e_s, 99)])
    ratio = offline[True].output_throughput / offline[False].output_throughput

    body = (f"dummy ~30M Llama (random weights), {len(w.prompts)} requests (prompts 64-512, "
            f"outputs 16-96 tokens), budget 512 tokens/step, 16 sequences. Offline = all "
            f"requests at once; online = Poisson arrivals at {rate:.2f} req/s ({args.load:.0%} "
            f"of V1's offline request rate). Offline throughput V1 / V0-style: "
            f"**{ratio:.2f}x**.\n\n"
            + markdown_table(["scheduler", "offline output tok/s", "offline steps",
                              "online TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                              "latency p50 ms", "latency p99 ms"], rows))
    write_result("bench_mixed_batching", "Mixed batching (V1) vs prefill-only/decode-only steps",
                 body)


if __name__ == "__main__":
    main()
