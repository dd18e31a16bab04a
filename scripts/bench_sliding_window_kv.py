"""Sliding-window KV freeing: the same long generations with the blocks a window has passed
given back to the pool (the default where every layer has the same window, as Mistral's and
Phi-3's) and with every token's KV kept (`disable_hybrid_kv_cache_manager=True`, vLLM's
switch), in a pool that holds a third of the requests' whole sequences.

The model is dummy-30m (random weights) as a Mistral with a 128-token window. Greedy outputs
must be the same both ways; the table shows throughput, steps (fewer: more requests ran at
once) and preemptions (a preempted request recomputes its KV when it resumes).

    python scripts/bench_sliding_window_kv.py [--requests 32] [--output-len 384] [--repeats 2]
"""

from __future__ import annotations

import argparse

from bench_common import (DUMMY_CONFIG_DIR, make_engine, make_workload, markdown_table,
                          run_engine, write_result)

WINDOW = 128
VOCAB = 8192
ENGINE_ARGS = dict(load_format="dummy", dtype="float32", max_model_len=1024, block_size=16,
                   max_num_batched_tokens=512, precompile=True,
                   hf_overrides={"architectures": ["MistralForCausalLM"],
                                 "sliding_window": WINDOW})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=384)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    blocks_per_sequence = -(-(args.prompt_len + args.output_len) // 16)
    num_kv_blocks = 1 + args.requests * blocks_per_sequence // 3
    workload = make_workload("w", args.requests, (args.prompt_len, args.prompt_len),
                             (args.output_len, args.output_len), VOCAB, seed=3)
    rows, tokens = [], {}
    for label, keep_all in (("freed as the window moves", False), ("every token kept", True)):
        engine = make_engine(DUMMY_CONFIG_DIR, **ENGINE_ARGS, num_kv_blocks=num_kv_blocks,
                             max_num_seqs=args.requests,
                             disable_hybrid_kv_cache_manager=keep_all)
        runs = [run_engine(engine, workload, prefix=f"r{i}-") for i in range(args.repeats)]
        best = min(runs, key=lambda r: r.elapsed_s)
        tokens[label] = sorted((o.request_id.split("-", 1)[1], o.outputs[0].token_ids)
                               for o in best.outputs)
        rows.append([label, f"{best.elapsed_s:.1f}", f"{best.output_throughput:.0f}",
                     best.num_preemptions, best.num_steps])
    same = len(set(map(str, tokens.values()))) == 1
    body = (f"dummy-30m as Mistral, window {WINDOW}; {args.requests} requests at once of "
            f"{args.prompt_len} prompt + {args.output_len} output tokens (greedy): their whole "
            f"sequences need {args.requests * blocks_per_sequence} blocks of 16, the pool has "
            f"{num_kv_blocks - 1}; best of {args.repeats} runs each. Same greedy tokens both "
            f"ways: {'yes' if same else 'NO'}.\n\n"
            + markdown_table(["KV of sliding-window layers", "seconds", "output tok/s",
                              "preemptions", "steps"], rows))
    write_result("bench_sliding_window_kv", "Sliding-window KV freeing vs keeping every token",
                 body)


if __name__ == "__main__":
    main()
