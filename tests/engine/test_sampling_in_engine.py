"""Seeded sampling is reproducible alone and inside a busy batch; logprobs come back."""

from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import SMALL_ENGINE, random_prompts
from jaxserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(hf_checkpoint, compile_cache_dir):
    return LLM(str(hf_checkpoint("llama")), compilation_cache_dir=compile_cache_dir,
               **SMALL_ENGINE)


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_busy_batch(llm):
    prompt = {"prompt_token_ids": random_prompts(1, 30, 30, seed=41)[0]}
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16,
                            ignore_eos=True)
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in random_prompts(9, 5, 80, seed=42)]
    batch = others[:4] + [prompt] + others[4:]
    params = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 4 + [seeded] + [
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)] * 5
    busy = llm.generate(batch, params, use_tqdm=False)[4].outputs[0].token_ids
    assert alone == busy
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=4321, max_tokens=16,
                                ignore_eos=True)
    assert llm.generate(prompt, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_logprobs_are_the_model_log_softmax_of_each_sampled_token(llm):
    prompt = {"prompt_token_ids": random_prompts(1, 12, 12, seed=43)[0]}
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, logprobs=3,
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token
        assert len(lp.top) == 3 and lp.top[0][0] == token  # greedy: the sampled one is the top
        assert lp.logprob == pytest.approx(lp.top[0][1], abs=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
        assert lp.logprob <= 0.0
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))
    assert np.isfinite(out.cumulative_logprob)
