"""Host overhead per decode step at 64, 256 and 1024 running requests, as a share of the step.

A tiny model (stories260K's shape, random weights) keeps the device part small, so what is left
is the host: scheduler.schedule(), the runner's input prep (persistent batch update, ragged
arrays, sampling metadata), the jitted call's dispatch, update_from_output and output
processing. Read from the engine's own per-phase timings (`EngineStats.step_seconds`), with
synchronous steps so the parts add up; then the same batch's step time with async scheduling
(the default), which hides host work behind the device's.

    python scripts/bench_host_overhead.py [--running 64,256,1024] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from bench_common import (device_only_ms, fill_decoding, make_engine, markdown_table,
                          timed_steps_ms, write_result)

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 172, "num_hidden_layers": 5, "num_attention_heads": 8,
        "num_key_value_heads": 4, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--running", default="64,256,1024")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=8)
    args = p.parse_args()
    sizes = [int(n) for n in args.running.split(",")]
    largest = max(sizes)

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(TINY))
        # A prompt, the tokens the first requests decode while the last are admitted (the
        # step budget is shared with the decodes: ~50 steps to admit 1024), and the timed steps
        blocks_per_req = -(-(args.prompt_len + 64 + args.steps + 2) // 16)
        engines = {mode: make_engine(
            tmp, load_format="dummy", max_model_len=256, block_size=16,
            num_kv_blocks=largest * blocks_per_req + 64, max_num_seqs=largest,
            max_num_batched_tokens=largest, token_buckets=sorted(set(sizes)),
            request_buckets=sorted(set(sizes)), precompile=True, async_scheduling=mode)
            for mode in (False, True)}
        rows = []
        for n in sizes:
            engine = engines[False]
            ids = fill_decoding(engine, n, args.prompt_len, TINY["vocab_size"], prefix=f"n{n}-")
            timed_steps_ms(engine, 2)  # the first decode steps of a new batch size warm caches
            ms = timed_steps_ms(engine, args.steps)
            host = sum(ms[k] for k in ("schedule", "prep", "dispatch", "update", "output"))
            rows.append([n, ms["step"], ms["schedule"], ms["prep"], ms["dispatch"],
                         ms["update"], ms["output"], host, f"{100 * host / ms['step']:.0f}%",
                         ms["device"], device_only_ms(engine),
                         async_step_ms(engines[True], n, args)])
            engine.abort_request(ids)
            engine.step()  # let the scheduler drop them

    body = ("Decode steps only (every request past its prefill), "
            f"{args.steps} steps each; ms per step. Tiny model: stories260K's shape (dim 64, "
            "5 layers, vocab 512), random weights, the default attention backend (`cpu` here).\n\n"
            + markdown_table(["running", "step", "schedule", "input prep", "dispatch",
                              "update", "output proc.", "host total", "host share",
                              "wait (device)", "device only (replay)", "step, async"], rows)
            + "\n\nEvery phase is the engine's own timing (`EngineStats.step_seconds`, "
            "jaxserve/core/step_timing.py), step = the whole LLMEngine.step timed by the "
            "script. schedule = Scheduler.schedule; input prep = persistent-batch update, ragged "
            "arrays and sampling metadata; dispatch = copying the step inputs to the device and "
            "the model's and the sampler's jitted calls until they return (on CPU it can "
            "include some compute); "
            "update = update_from_output + recording the ids; output proc. = detokenising and "
            "RequestOutputs; host total = their sum, host share = host total / step. wait = "
            "fetching the sampled ids (the device finishing the step); device only = the same "
            "jitted step replayed on inputs already on the device, blocking (best of 5, "
            "ModelRunner.time_last_step). The "
            "columns up to here are synchronous steps (`async_scheduling=False`), so the parts "
            "add up. step, async = the same batch's step with async scheduling (the default), "
            "where the host prepares step N+1 while the device runs step N.")
    write_result("bench_host_overhead", "Host overhead per step", body)


def async_step_ms(engine: Any, n: int, args: argparse.Namespace) -> float:
    ids = fill_decoding(engine, n, args.prompt_len, TINY["vocab_size"], prefix=f"a{n}-")
    timed_steps_ms(engine, 2)
    ms = timed_steps_ms(engine, args.steps)["step"]
    engine.abort_request(ids)
    engine.step()
    return ms


if __name__ == "__main__":
    main()
