"""Async scheduling (step N+1 launched before step N's tokens reach the host) changes nothing
a user sees: the same tokens, finish reasons and logprobs as synchronous steps, for every kind
of request, and nothing leaks when requests stop or are aborted with a step in flight."""

from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import SMALL_ENGINE, assert_no_leaks, random_prompts
from jaxserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def engines(hf_checkpoint, compile_cache_dir):
    path = str(hf_checkpoint("llama"))
    return {mode: LLM(path, compilation_cache_dir=compile_cache_dir,
                      async_scheduling=mode == "async", **SMALL_ENGINE)
            for mode in ("async", "sync")}


def count_device_inputs(llm: LLM) -> list[int]:
    """Wrap the runner's input prep: counts the inputs read from the previous step's ids."""
    batch = llm.engine.core.executor.worker.runner.batch
    counts = [0]
    prepare = batch.prepare

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        arrays = prepare(*args, **kwargs)
        counts[0] += int((arrays.prev_rows >= 0).sum())
        return arrays

    batch.prepare = counting
    return counts


def workload(stop_token: int) -> tuple[list[dict], list[SamplingParams]]:
    prompts = [{"prompt_token_ids": p} for p in random_prompts(12, 1, 60, seed=71)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),  # engine-seeded
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_token], min_tokens=6),
        SamplingParams(temperature=0.7, n=2, seed=9, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=15, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30),  # EOS may stop it
        SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=14, ignore_eos=True,
                       presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    ]
    return prompts, params


def test_async_steps_give_the_same_outputs_as_synchronous_ones(engines):
    prompts, _ = workload(0)
    # A stop token that the greedy requests really produce, a few tokens in. Both engines
    # run the probe, so their request counters (which seed unseeded requests) stay equal.
    probe_params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    probes = [llm.generate(prompts[5], probe_params, use_tqdm=False)[0].outputs[0].token_ids
              for llm in engines.values()]
    assert probes[0] == probes[1]
    probe = probes[0]
    prompts, params = workload(probe[3])
    device_inputs = count_device_inputs(engines["async"])
    results = {mode: llm.generate(prompts, params, use_tqdm=False)
               for mode, llm in engines.items()}
    for i, (ours, ref) in enumerate(zip(results["async"], results["sync"])):
        assert len(ours.outputs) == len(ref.outputs)
        for a, b in zip(ours.outputs, ref.outputs):
            assert (i, a.token_ids, a.finish_reason) == (i, b.token_ids, b.finish_reason)
            assert a.stop_reason == b.stop_reason
            if b.logprobs is not None:
                assert [list(e) for e in a.logprobs] == [list(e) for e in b.logprobs]
                np.testing.assert_allclose(
                    [lp.logprob for e in a.logprobs for lp in e.values()],
                    [lp.logprob for e in b.logprobs for lp in e.values()], atol=1e-5)
    stopped = results["sync"][5].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == probe[3]
    assert len(results["sync"][6].outputs[0].token_ids) >= 6  # min_tokens held the stop back
    assert device_inputs[0] > 0, "no step ran ahead of its inputs: async scheduling was off"
    for llm in engines.values():
        assert_no_leaks(llm.engine)


def test_abort_with_a_step_in_flight_leaves_the_others_unchanged(engines):
    prompts = random_prompts(4, 10, 40, seed=72)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in engines["sync"].generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    engine = engines["async"].engine
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", {"prompt_token_ids": p}, params)
    tokens: dict[str, list[int]] = {f"a{i}": [] for i in range(4)}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 5:
            assert engine.core._in_flight is not None  # the abort lands mid-flight
            engine.abort_request("a1")
    assert 0 < len(tokens["a1"]) < 16
    assert tokens["a1"] == reference[1][:len(tokens["a1"])]
    assert [tokens[f"a{i}"] for i in (0, 2, 3)] == [reference[i] for i in (0, 2, 3)]
    assert_no_leaks(engine)
