"""vLLM's token constraints: `bad_words` are never generated, `allowed_token_ids` are the only
tokens sampled, `logit_bias` moves tokens' logits; greedy tokens equal HF `generate` under the
same constraint (`bad_words_ids`, `prefix_allowed_tokens_fn`, `sequence_bias`)."""

from __future__ import annotations

import pytest

from engine_helpers import SMALL_ENGINE, assert_no_leaks, hf_greedy, random_prompts
from jaxserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(hf_checkpoint, compile_cache_dir) -> LLM:
    """One engine for the module: async scheduling, so constrained requests must not run
    ahead of their host history."""
    return LLM(str(hf_checkpoint("llama")), compilation_cache_dir=compile_cache_dir,
               async_scheduling=True, **SMALL_ENGINE)


def contains(tokens: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i:i + len(word)]) == word for i in range(len(tokens)))


def test_bad_words_are_never_generated_and_tokens_equal_hf(hf_checkpoint, llm):
    path = hf_checkpoint("llama")
    tokenizer = llm.get_tokenizer()
    prompts = random_prompts(6, 5, 30, seed=41)
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    unbanned = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], free, use_tqdm=False)]
    # words the unconstrained outputs hold: a one-token word, and a two-token one
    encode = lambda w: tokenizer.encode(w, add_special_tokens=False)  # noqa: E731
    texts = [tokenizer.decode(out[i:i + n]).strip() for n in (1, 2) for out in unbanned
             for i in range(len(out) - n + 1)]
    words = [next(t for t in texts if t.isalpha() and len(encode(t)) == n) for n in (1, 2)]
    banned = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, bad_words=words)
    ids = banned.with_bad_words_token_ids(encode).bad_words_token_ids
    assert any(contains(out, w) for out in unbanned for w in ids)  # the ban has work to do
    got = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], banned, use_tqdm=False)]
    assert not any(contains(out, w) for out in got for w in ids)
    assert_no_leaks(llm.engine)

    # HF checks the prompt too; vLLM the output only: equal where no prompt ends in a word's
    # first tokens
    assert not any(len(w) > 1 and tuple(p[-len(w) + 1:]) == w[:-1] for p in prompts for w in ids)
    assert got == hf_greedy(path, prompts, 20, bad_words_ids=[list(w) for w in ids])


def test_allowed_token_ids_are_the_only_tokens_sampled(hf_checkpoint, llm):
    """Beside unconstrained requests in the same steps (with a grammar, the mask is both's:
    tests/core/test_structured_output.py)."""
    path = hf_checkpoint("llama")
    prompts = random_prompts(4, 5, 30, seed=42)
    allowed = list(range(40, 200, 3))
    masked = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            allowed_token_ids=allowed)
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts + prompts],
                        [masked] * 4 + [free] * 4, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert all(set(out) <= set(allowed) for out in got[:4])
    assert any(not set(out) <= set(allowed) for out in got[4:])  # the mask had work to do
    assert_no_leaks(llm.engine)
    assert got[:4] == hf_greedy(path, prompts, 12,
                                prefix_allowed_tokens_fn=lambda batch, ids: allowed)


def test_allowed_token_ids_outside_the_vocabulary_are_an_error_naming_the_field(llm):
    with pytest.raises(ValueError, match=r"allowed_token_ids: 320 is outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [5, 6]}],
                     SamplingParams(max_tokens=2, allowed_token_ids=[5, 320]), use_tqdm=False)
    assert_no_leaks(llm.engine)


def test_logit_bias_moves_the_greedy_tokens_as_hfs_sequence_bias(hf_checkpoint, llm):
    """Beside unbiased requests in the same steps; the logprobs stay the model's own."""
    path = hf_checkpoint("llama")
    prompts = random_prompts(4, 5, 30, seed=43)
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    unbiased = llm.generate([{"prompt_token_ids": p} for p in prompts], free, use_tqdm=False)
    # push the first token each request picked far down, and one other token up a little
    bias = {out.outputs[0].token_ids[0]: -100.0 for out in unbiased} | {77: 2.5}
    biased = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1,
                            logit_bias=bias)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts + prompts],
                        [biased] * 4 + [free] * 4, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got[4:] == [o.outputs[0].token_ids for o in unbiased]
    assert all(g[0] != u.outputs[0].token_ids[0] for g, u in zip(got, unbiased))
    # the logprob of a token both runs sampled at their first step is the model's, unbiased
    first = unbiased[0].outputs[0]
    assert outs[4].outputs[0].logprobs[0][first.token_ids[0]].logprob == \
        first.logprobs[0][first.token_ids[0]].logprob
    assert_no_leaks(llm.engine)
    assert got[:4] == hf_greedy(path, prompts, 12,
                                sequence_bias={(t,): b for t, b in bias.items()})
