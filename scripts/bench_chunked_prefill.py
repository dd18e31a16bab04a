"""Chunked prefill: inter-token latency of running decodes while long prompts arrive, with
`long_prefill_token_threshold` off and on, against the steady ITL with no long prompt at all.

16 requests decode (32-token prompts, long outputs); long prompts arrive one after another while
they run. With the threshold off, a long prompt takes the whole remaining token budget of a step
(512), so the decodes in that step wait for a ~500-token prefill; with it on, each step carries
at most `threshold` prompt tokens. ITL is measured on the decoding requests only.

A run is `threshold` or `threshold:cap`, the cap being `max_num_partial_prefills` (how many
prompts get prefill tokens in one step; 0 = any number). Each run is its own engine built with
that setting.

    python scripts/bench_chunked_prefill.py [--runs 0,64,32,32:1,16:1] [--long-len 960]
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import numpy as np

from bench_common import (DUMMY_CONFIG_DIR, Workload, make_engine, make_workload, markdown_table,
                          pct_ms, run_engine, write_result)

if TYPE_CHECKING:
    from jaxserve.engine.llm_engine import LLMEngine

VOCAB = 8192


def index_of(output) -> int:  # request ids are f"{prefix}{index into the workload}"
    return int(output.request_id.rsplit("-", 1)[1])


def decode_itl(result, num_decodes: int) -> list[float]:
    """Gaps between consecutive tokens of the decoding requests (the first `num_decodes`)."""
    return [g for o in result.outputs if index_of(o) < num_decodes
            for g in np.diff(o.metrics.token_times).tolist()]


def warm_engine(threshold: int, cap: int) -> LLMEngine:
    """An engine with this chunking setting, warmed up. Every engine has the same step shapes,
    so after the first they reuse the process's compiled programs: none compiles again."""
    engine = make_engine(DUMMY_CONFIG_DIR, load_format="dummy", max_model_len=1024,
                         block_size=16, num_kv_blocks=512, max_num_seqs=32,
                         max_num_batched_tokens=512,
                         token_buckets=[16, 32, 48, 64, 96, 128, 192, 256, 384, 512],
                         request_buckets=[8, 16, 32], enable_prefix_caching=False,
                         precompile=True, long_prefill_token_threshold=threshold,
                         max_num_partial_prefills=cap)
    run_engine(engine, make_workload("warm", 4, (32, 600), (4, 4), VOCAB, 99), prefix="warm-")
    return engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="0,64,32,32:1,16:1",
                   help="threshold[:max_num_partial_prefills] per run; threshold 0 = off")
    p.add_argument("--decodes", type=int, default=16)
    p.add_argument("--decode-len", type=int, default=96, help="output tokens of each decode")
    p.add_argument("--long-prompts", type=int, default=3)
    p.add_argument("--long-len", type=int, default=960)
    args = p.parse_args()
    runs = [tuple(int(x) for x in (r + ":0").split(":")[:2]) for r in args.runs.split(",")]

    decodes = make_workload("d", args.decodes, (32, 32), (args.decode_len, args.decode_len),
                            VOCAB, seed=1)
    engine = warm_engine(0, 0)
    steady = run_engine(engine, decodes, prefix="steady-")
    steady_itl = decode_itl(steady, args.decodes)
    step_s = float(np.median(steady_itl))
    longs = make_workload("L", args.long_prompts, (args.long_len, args.long_len), (4, 4), VOCAB,
                          seed=2)
    # Long prompts arrive spread over the decodes' run: at 20%, 45%, 70%, ... of it.
    span = args.decode_len * step_s
    arrivals = [0.0] * args.decodes + [span * (0.2 + 0.25 * i) for i in range(args.long_prompts)]
    mixed = Workload("mix", decodes.prompts + longs.prompts,
                     decodes.output_lens + longs.output_lens)

    rows = [["steady (no long prompt)", "-", "-", pct_ms(steady_itl, 50), pct_ms(steady_itl, 99),
             pct_ms(steady_itl, 100), "-", "1.0x", steady.num_compilations]]
    steady_p99 = pct_ms(steady_itl, 99)
    for t, cap in runs:
        del engine  # one engine at a time (each holds its KV cache)
        engine = warm_engine(t, cap)
        r = run_engine(engine, mixed, arrival_s=arrivals, prefix=f"t{t}c{cap}-")
        itl = decode_itl(r, args.decodes)
        long_ttft = [o.metrics.time_to_first_token for o in r.outputs
                     if index_of(o) >= args.decodes]
        name = ((f"threshold {t}" if t else "threshold off")
                + (f", {cap} prefill/step" if cap else ""))
        rows.append([name, t or "-", cap or "-", pct_ms(itl, 50),
                     pct_ms(itl, 99), pct_ms(itl, 100), pct_ms(long_ttft, 50),
                     f"{pct_ms(itl, 99) / steady_p99:.1f}x", r.num_compilations])

    body = (f"dummy ~30M Llama (random weights), token budget 512/step, {args.decodes} decoding "
            f"requests (32-token prompts, {args.decode_len} output tokens), "
            f"{args.long_prompts} prompts of {args.long_len} tokens arriving while they run. "
            "ITL over the decoding requests only.\n\n"
            + markdown_table(["run", "threshold", "max_num_partial_prefills", "ITL p50 ms",
                              "ITL p99 ms", "ITL max ms",
                              "long prompt TTFT p50 ms", "p99 / steady p99",
                              "compilations in the run"], rows))
    write_result("bench_chunked_prefill", "Chunked prefill: ITL while long prompts arrive", body)


if __name__ == "__main__":
    main()
