"""Prefix caching: TTFT and prefill time with caching on vs off when requests share 90% of a long
prompt, and the throughput cost of caching when nothing is ever hit (0% hit rate).

TTFT is measured one request at a time (each after the previous finished), so it is the
prefill of what the cache does not hold, not queueing. The 0%-hit cost alternates on/off runs
over fresh prompts (a repeat must not hit the previous one); the median of the paired on/off
ratios cancels the slow drifts of a shared machine's load.

    python scripts/bench_prefix_caching.py [--prompt-lens 512,1000] [--requests 8] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from bench_common import (DUMMY_CONFIG_DIR, Workload, make_engine, make_workload,
                          markdown_table, pct_ms, run_engine, write_result)

ENGINE_ARGS = dict(load_format="dummy", dtype="float32", max_model_len=1024, block_size=16,
                   num_kv_blocks=1024, max_num_seqs=16, max_num_batched_tokens=512,
                   token_buckets=[8, 16, 32, 64, 128, 256, 512], request_buckets=[8, 16],
                   precompile=True)
VOCAB = 8192


def sequential_ttft(engine, args: argparse.Namespace, prompt_len: int, seed: int) -> list[float]:
    """TTFT of each request sent alone, in turn; the first one (nothing cached yet) excluded."""
    w = make_workload(f"seq{seed}-", args.requests + 1, (prompt_len, prompt_len),
                      (args.output_len, args.output_len), VOCAB, seed, shared_prefix=args.shared)
    ttfts = []
    for i in range(len(w.prompts)):
        one = Workload("one", [w.prompts[i]], [w.output_lens[i]])
        ttfts += run_engine(engine, one, prefix=f"s{seed}-{i}-").ttft_s
    return ttfts[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-lens", default="512,1000")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--shared", type=float, default=0.9, help="shared share of each prompt")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--batch-requests", type=int, default=16, help="all-at-once run")
    p.add_argument("--cost-requests", type=int, default=16, help="0%% hit-rate throughput run")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    batch_len = prompt_lens[0]

    engines = {on: make_engine(DUMMY_CONFIG_DIR, enable_prefix_caching=on, **ENGINE_ARGS)
               for on in (True, False)}
    for engine in engines.values():  # the first runs pay for page faults and thread start-up
        run_engine(engine, make_workload("warm", 4, (32, 300), (4, 4), VOCAB, 99), prefix="w")

    rows, batch_rows, speedups = [], [], {}
    for n, prompt_len in enumerate(prompt_lens):
        ttft = {on: sequential_ttft(engines[on], args, prompt_len, seed=1 + n) for on in engines}
        for on in (False, True):
            rows.append([prompt_len, "on" if on else "off", len(ttft[on]), pct_ms(ttft[on], 50),
                         pct_ms(ttft[on], 90), float(np.mean(ttft[on]) * 1e3)])
        speedups[prompt_len] = np.median(ttft[False]) / np.median(ttft[True])

    batch = {}
    for on in (False, True):
        w = make_workload("batch", args.batch_requests, (batch_len, batch_len),
                          (args.output_len, args.output_len), VOCAB, seed=2,
                          shared_prefix=args.shared)
        r = run_engine(engines[on], w, prefix=f"b{on}-")
        batch[on] = r
        batch_rows.append(["on" if on else "off", len(w.prompts), r.elapsed_s,
                           pct_ms(r.ttft_s, 50), pct_ms(r.ttft_s, 99), f"{r.prefix_hit_rate:.0%}",
                           r.total_throughput])

    cost: dict[bool, list[float]] = {True: [], False: []}
    ratios, cpu_ratios, hit_rates = [], [], []
    for rep in range(args.repeats):
        w = make_workload("cost", args.cost_requests, (64, batch_len), (8, 32), VOCAB,
                          seed=100 + rep)
        cpu = {}
        for on in ((True, False) if rep % 2 else (False, True)):
            r = run_engine(engines[on], w, prefix=f"c{rep}{on}-")
            cost[on].append(r.output_throughput)
            cpu[on] = r.cpu_s
            if on:
                hit_rates.append(r.prefix_hit_rate)
        ratios.append(cost[True][-1] / cost[False][-1])
        cpu_ratios.append(cpu[False] / cpu[True])
    med = {on: statistics.median(v) for on, v in cost.items()}
    loss = 1 - statistics.median(ratios)
    cpu_loss = 1 - statistics.median(cpu_ratios)

    speedup_text = ", ".join(f"**{s:.1f}x** at {n} tokens" for n, s in speedups.items())
    body = (
        f"dummy ~30M Llama (random weights), prompts sharing {args.shared:.0%} of their tokens, "
        f"{args.output_len} output tokens, block 16, budget 512 tokens/step.\n\n"
        f"TTFT speedup from caching at {args.shared:.0%} shared prefix (median, one request at "
        f"a time): {speedup_text}. **Throughput cost of caching at a 0% hit rate: "
        f"{100 * loss:+.1f}%** in wall time, **{100 * cpu_loss:+.1f}%** in CPU time (median of "
        f"{args.repeats} paired on/off runs; positive = slower with caching; measured hit rate "
        f"{max(hit_rates):.1%}; CPU time is the steadier measure on a shared machine).\n\n"
        "One request at a time (TTFT = its prefill of what the cache lacks):\n\n"
        + markdown_table(["prompt tokens", "caching", "requests", "TTFT p50 ms", "TTFT p90 ms",
                          "TTFT mean ms"], rows)
        + f"\n\n{args.batch_requests} requests of {batch_len} tokens at once:\n\n"
        + markdown_table(["caching", "requests", "seconds", "TTFT p50 ms", "TTFT p99 ms",
                          "hit rate", "total tok/s"], batch_rows)
        + f"\n\n0% hit rate ({args.cost_requests} unique prompts of 64-{batch_len} tokens, "
        "8-32 output tokens), output tok/s:\n\n"
        + markdown_table(["caching", "runs", "median tok/s", "min", "max"],
                         [["on" if on else "off", len(v), med[on], min(v), max(v)]
                          for on, v in ((False, cost[False]), (True, cost[True]))])
        + "\n\npaired on/off throughput ratios, wall time: "
        + ", ".join(f"{r:.3f}" for r in ratios) + "; CPU time: "
        + ", ".join(f"{r:.3f}" for r in cpu_ratios))
    write_result("bench_prefix_caching", "Prefix caching", body)


if __name__ == "__main__":
    main()
