"""Prompt logprobs (SamplingParams.prompt_logprobs) against HF transformers' log-softmax of the
same prompt (fp32, 1e-4): whole prompts, prompts chunked over several steps, prefix-cache hits,
n > 1, and requests without them in the same batch (their tokens unchanged)."""

from __future__ import annotations

import pytest

from engine_helpers import SMALL_ENGINE, assert_no_leaks, check_against_hf, random_prompts
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


def test_prompt_logprobs_over_max_logprobs_is_refused(llm):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate("hi", SamplingParams(prompt_logprobs=10_000))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
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
