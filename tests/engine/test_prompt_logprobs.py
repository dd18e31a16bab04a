"""Prompt logprobs (SamplingParams.prompt_logprobs) against HF transformers' log-softmax of the
same prompt (fp32, 1e-4): whole prompts, prompts chunked over several steps, prefix-cache hits,
n > 1, and requests without them in the same batch (their tokens unchanged)."""

from __future__ import annotations

import pytest

from engine_helpers import (FEW_BUCKETS, SMALL_ENGINE, assert_no_leaks, check_against_hf,
                            random_prompts)
from jaxserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(hf_checkpoint, compile_cache_dir) -> LLM:
    return LLM(str(hf_checkpoint("llama")), compilation_cache_dir=compile_cache_dir,
               **SMALL_ENGINE)


def test_prompt_logprobs_equal_hf_log_softmax_whole_and_chunked(llm, hf_checkpoint):
    path = hf_checkpoint("llama")
    # 100 and 120 tokens with a 128-token step budget: batched together, the second is
    # split over two steps (chunked prefill); 1 token: no position to score.
    prompts = random_prompts(3, 90, 120, seed=3) + [[5]]
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        check_against_hf(path, prompt, out.prompt_logprobs, 3)
    assert outs[-1].prompt_logprobs == [None]
    assert_no_leaks(llm.llm_engine)


def test_prompt_logprobs_recompute_a_cached_prefix_and_leave_other_requests_alone(
        llm, hf_checkpoint):
    path = hf_checkpoint("llama")
    prompt = random_prompts(1, 70, 70, seed=11)[0]
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompt}, plain)[0]
    assert first.prompt_logprobs is None
    # The prompt's blocks are now cached: the prompt-logprobs request must still score them.
    asks = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, [asks, plain])
    check_against_hf(path, prompt, outs[0].prompt_logprobs, 0)
    assert outs[1].prompt_logprobs is None and outs[1].num_cached_tokens > 0
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids \
        == first.outputs[0].token_ids
    assert_no_leaks(llm.llm_engine)


def test_prompt_logprobs_with_n_and_sampling(llm, hf_checkpoint):
    path = hf_checkpoint("llama")
    prompt = random_prompts(1, 40, 40, seed=5)[0]
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=5,
                                      prompt_logprobs=2))[0]
    assert len(out.outputs) == 3
    check_against_hf(path, prompt, out.prompt_logprobs, 2)
    assert_no_leaks(llm.llm_engine)


def test_logprobs_over_max_logprobs_are_refused(llm):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate("hi", SamplingParams(prompt_logprobs=10_000))
    for name in ("logprobs", "prompt_logprobs"):  # -1, the vocabulary's 320, are over 20
        with pytest.raises(ValueError, match=rf"^{name} must be <= max_logprobs \(20\), got "
                                             r"-1 \(the whole vocabulary, 320\)"):
            llm.generate("hi", SamplingParams(**{name: -1}))
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: -2})
    assert_no_leaks(llm.llm_engine)


def test_logprobs_minus_one_are_the_whole_vocabulary_as_hf_log_softmax(hf_checkpoint,
                                                                       compile_cache_dir):
    """vLLM's -1, with max_logprobs=-1 (no cap): every token's logprob at each sampled and
    each prompt position."""
    path = hf_checkpoint("llama")
    llm = LLM(str(path), compilation_cache_dir=compile_cache_dir, max_logprobs=-1,
              **SMALL_ENGINE | FEW_BUCKETS)
    vocab = llm.llm_engine.input_processor.vocab_size
    prompt = random_prompts(1, 20, 20, seed=7)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0.0, max_tokens=3, logprobs=-1, prompt_logprobs=-1, ignore_eos=True))[0]
    check_against_hf(path, prompt, out.prompt_logprobs, vocab)
    sample = out.outputs[0]
    check_against_hf(path, prompt + sample.token_ids, [None] * len(prompt) + sample.logprobs,
                     vocab, first=len(prompt))
    assert {len(e) for e in out.prompt_logprobs[1:] + sample.logprobs} == {vocab}
    assert_no_leaks(llm.llm_engine)


def test_strict_compile_refuses_prompt_logprobs_instead_of_failing_the_step(
        hf_checkpoint, compile_cache_dir):
    """Their step programs are not built at warm-up: under strict_compile a request asking for
    them would raise in the step (and stop the engine), so it is refused up front."""
    llm = LLM(str(hf_checkpoint("llama")), compilation_cache_dir=compile_cache_dir,
              precompile=True, strict_compile=True, **SMALL_ENGINE)
    with pytest.raises(ValueError, match="prompt_logprobs is not supported with strict_compile"):
        llm.generate([[5, 6, 7]], SamplingParams(prompt_logprobs=2, max_tokens=2))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2  # the engine serves on
    assert_no_leaks(llm.llm_engine)
