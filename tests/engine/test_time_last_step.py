"""ModelRunner.time_last_step, what the roofline and host-overhead benchmarks read instead of
patching the runner: it re-runs the last step's programs and leaves the engine's state as it
was, so a run timed between its steps gives the same tokens as one left alone."""

from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import SMALL_ENGINE, random_prompts
from jaxserve import LLMEngine, SamplingParams


def decode(engine: LLMEngine, prompts: list[list[int]], replay: bool) -> tuple[dict, list]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    tokens, times = {}, []
    runner = engine.core.executor.worker.runner
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        if replay and engine.has_unfinished_requests():
            times.append(runner.time_last_step(repeats=2))
    return tokens, times


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_replaying_the_last_step_changes_no_token(hf_checkpoint, compile_cache_dir,
                                                  async_scheduling):
    engine = LLMEngine.from_engine_args(
        model=str(hf_checkpoint("llama")), compilation_cache_dir=compile_cache_dir,
        async_scheduling=async_scheduling, **SMALL_ENGINE)
    runner = engine.core.executor.worker.runner
    with pytest.raises(RuntimeError, match="no step was launched"):
        runner.time_last_step()
    prompts = random_prompts(3, 5, 40, seed=31)
    plain, _ = decode(engine, prompts, replay=False)
    replayed, times = decode(engine, prompts, replay=True)
    assert replayed == plain
    assert times and all(np.isfinite(t) and t > 0 for t in times)


def test_no_replay_after_another_write_to_the_cache(hf_checkpoint, compile_cache_dir):
    engine = LLMEngine.from_engine_args(
        model=str(hf_checkpoint("llama")), compilation_cache_dir=compile_cache_dir,
        **SMALL_ENGINE)
    decode(engine, random_prompts(1, 5, 10, seed=32), replay=False)
    runner = engine.core.executor.worker.runner
    zeros = np.zeros((*runner.k_cache.shape[:2], 1, *runner.k_cache.shape[3:]),
                     runner.k_cache.dtype)
    runner.write_blocks([1], zeros, zeros)  # e.g. KV received from a prefill engine
    with pytest.raises(RuntimeError, match="no step was launched"):
        runner.time_last_step()
