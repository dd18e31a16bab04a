"""Request ids: a finished id may be reused at once; ids that would collide are refused."""

from __future__ import annotations

import asyncio

import pytest

from engine_helpers import assert_no_leaks, hf_greedy, random_prompts
from jaxserve import AsyncLLM, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _run(engine: LLMEngine, request_id: str) -> list[int]:
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out.outputs[0].token_ids


def _stopping_early(llama, prompts: list[list[int]]) -> tuple[list[SamplingParams], list]:
    """Params that stop each prompt on its third greedy token (a stop token: the step after it
    is already in flight), and the tokens expected."""
    params, expected = [], []
    for ref in hf_greedy(llama, prompts, 8):
        params.append(SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                     stop_token_ids=[ref[2]]))
        expected.append(ref[:ref.index(ref[2]) + 1])
    return params, expected


def test_a_finished_id_reused_at_once_gets_its_own_tokens(engine, llama):
    prompts = random_prompts(3, 10, 20, seed=51)
    params, expected = _stopping_early(llama, prompts)
    got = []
    for p, sp in zip(prompts, params):  # each re-add while the old one's next step is in flight
        engine.add_request("same", {"prompt_token_ids": p}, sp)
        got.append(_run(engine, "same"))
    while engine.has_unfinished_requests():
        engine.step()
    assert got == expected
    assert_no_leaks(engine)


def test_async_llm_reuses_a_finished_id(engine, llama):
    prompts = random_prompts(3, 10, 20, seed=52)
    params, expected = _stopping_early(llama, prompts)
    llm = AsyncLLM.from_engine(engine)

    async def run(prompt: list[int], sp: SamplingParams) -> list[int]:
        async for out in llm.generate({"prompt_token_ids": prompt}, sp, "same"):
            final = out  # cumulative (vLLM's default): the last output holds them all
        return final.outputs[0].token_ids

    try:
        assert [asyncio.run(run(p, sp)) for p, sp in zip(prompts, params)] == expected
    finally:
        llm.shutdown()


def test_an_id_equal_to_a_sample_of_another_request_is_refused(engine, llama):
    prompts = random_prompts(2, 10, 20, seed=53)
    engine.add_request("foo", {"prompt_token_ids": prompts[0]},
                       SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True))
    with pytest.raises(ValueError, match="'0_foo' is already in use: '0_foo' is a sample of 'foo'"):
        engine.add_request("0_foo", {"prompt_token_ids": prompts[1]}, GREEDY)
    engine.add_request("0_bar", {"prompt_token_ids": prompts[1]}, GREEDY)
    with pytest.raises(ValueError, match="already in use"):  # its samples would be 0_bar, 1_bar
        engine.add_request("bar", {"prompt_token_ids": prompts[1]},
                           SamplingParams(n=2, max_tokens=2))
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert set(done) == {"foo", "0_bar"}
    assert [c.token_ids for c in done["foo"].outputs] == hf_greedy(llama, prompts[:1], 6) * 2
    assert_no_leaks(engine)
