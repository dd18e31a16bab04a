"""Seeded sampling is reproducible alone and inside a busy batch; logprobs come back."""

from __future__ import annotations

import pytest

from engine_helpers import SMALL_ENGINE, check_against_hf, random_prompts
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


def test_sample_logprobs_are_vllm_dicts_equal_to_hf_log_softmax(llm, llama):
    prompt = random_prompts(1, 12, 12, seed=43)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 6
    # Position P + j of prompt + output is output token j, scored by HF's row P + j - 1.
    check_against_hf(llama, prompt + out.token_ids, [None] * len(prompt) + out.logprobs, 3,
                     first=len(prompt))
    for token, entry in zip(out.token_ids, out.logprobs):
        assert next(iter(entry)) == token and entry[token].rank == 1  # greedy: the top one
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)), abs=1e-5)


def test_sample_logprobs_carry_each_token_text_as_hf_decodes_it(llm, llama):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(llama)
    out = llm.generate("Once upon a time", SamplingParams(
        temperature=1.0, seed=5, max_tokens=8, logprobs=2, ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    for token, entry in zip(out.token_ids, out.logprobs):
        assert list(entry)[0] == token and len(entry) in (2, 3)
        for tid, lp in entry.items():
            assert lp.decoded_token == hf.decode([tid])


@pytest.mark.parametrize("k", [0, 1])
def test_a_sampled_token_outside_the_top_k_has_its_rank_in_the_vocabulary(llm, llama, k):
    """Sampled at temperature 2 from random weights, most tokens are not the likeliest: their
    rank is still HF's (1 + the tokens likelier), with logprobs=0 (only the sampled token) too."""
    prompt = random_prompts(1, 10, 10, seed=44)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=2.0, seed=3, max_tokens=12, logprobs=k, ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    # The sampled token first, then the top k (it is one of them when its rank is <= k).
    assert all(list(entry)[0] == token and len(entry) == k + (entry[token].rank > k)
               for token, entry in zip(out.token_ids, out.logprobs))
    assert sum(e[t].rank > k for t, e in zip(out.token_ids, out.logprobs)) >= 3
    check_against_hf(llama, prompt + out.token_ids, [None] * len(prompt) + out.logprobs, k,
                     first=len(prompt))
