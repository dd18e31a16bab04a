"""Embeddings (runner="pooling"): a Qwen3 decoder as an embedding model, as vLLM converts one
(Qwen3-Embedding): the last prompt token's final hidden state, L2-normalised, equal to HF's
base model's, under chunked prefill, async scheduling and prefix caching; the bad inputs
named."""

from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import CHUNKED_ASYNC, SMALL_ENGINE, assert_no_leaks, random_prompts
from hf_checkpoints import hf_model
from jaxserve import LLM, PoolingParams, SamplingParams

PROMPTS = random_prompts(5, 3, 90, seed=11)


@pytest.fixture(scope="module")
def qwen3(hf_checkpoint):
    return hf_checkpoint("qwen3")


@pytest.fixture(scope="module")
def llm(qwen3, compile_cache_dir) -> LLM:
    return LLM(str(qwen3), runner="pooling", compilation_cache_dir=compile_cache_dir,
               **(SMALL_ENGINE | CHUNKED_ASYNC))


def hf_last_hidden(path, prompt: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = hf_model(path).model(input_ids=torch.tensor([prompt]))
    return out.last_hidden_state[0, -1].numpy()


def test_embeddings_equal_hf_last_token_hidden_state(llm, qwen3):
    # Prompts longer than a step's 32 tokens are chunked; the second call's repeat the first
    # call's leading blocks, so they are served partly from the prefix cache.
    repeats = [PROMPTS[4][:32] + [7, 8, 9], PROMPTS[2] + [5]]
    outs = llm.embed(PROMPTS, use_tqdm=False)
    hits = llm.stats().prefix_cache_hits
    outs += llm.embed(repeats, use_tqdm=False)
    prompts = PROMPTS + repeats
    for prompt, out in zip(prompts, outs):
        want = hf_last_hidden(qwen3, prompt)
        want /= np.linalg.norm(want)
        got = np.asarray(out.outputs.embedding)
        assert out.prompt_token_ids == prompt and out.finished
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=2e-5)
    assert llm.stats().prefix_cache_hits > hits
    assert_no_leaks(llm.engine)


def test_encode_without_normalising_and_truncated(llm, qwen3):
    prompt = PROMPTS[2]
    raw, cut = llm.encode([prompt, prompt], [PoolingParams(normalize=False),
                                             PoolingParams(truncate_prompt_tokens=10)],
                          use_tqdm=False)
    np.testing.assert_allclose(raw.outputs.data, hf_last_hidden(qwen3, prompt), atol=2e-5)
    assert abs(np.linalg.norm(raw.outputs.data) - 1.0) > 0.1  # really not normalised
    want = hf_last_hidden(qwen3, prompt[-10:])
    np.testing.assert_allclose(cut.outputs.data, want / np.linalg.norm(want), atol=2e-5)
    assert cut.prompt_token_ids == prompt[-10:]


def test_score_is_the_cosine_of_the_embeddings(llm):
    a, b, c = PROMPTS[:3]
    scores = llm.score(a, [b, c, a], use_tqdm=False)
    ea, eb, ec = (np.asarray(o.outputs.embedding) for o in llm.embed([a, b, c], use_tqdm=False))
    np.testing.assert_allclose([s.outputs.score for s in scores], [ea @ eb, ea @ ec, 1.0],
                               atol=1e-5)
    assert scores[0].prompt_token_ids == a + b
    pairwise = llm.score([a, b], [c, c], use_tqdm=False)
    np.testing.assert_allclose([s.outputs.score for s in pairwise], [ea @ ec, eb @ ec],
                               atol=1e-5)


def test_bad_pooling_input_is_named_and_the_engine_goes_on(llm):
    cases = [
        (lambda: llm.generate(PROMPTS[0]), "runner='pooling'"),
        (lambda: llm.embed(PROMPTS[0], PoolingParams(dimensions=8)), "dimensions"),
        (lambda: llm.embed(PROMPTS[0], PoolingParams(use_activation=True)), "use_activation"),
        (lambda: llm.embed(PROMPTS[0], SamplingParams()), "pooling_params"),
        (lambda: llm.encode(PROMPTS[0], pooling_task="classify"), "classify"),
        (lambda: llm.classify(PROMPTS[0]), "classify"),
        (lambda: llm.score([PROMPTS[0]] * 2, [PROMPTS[1]] * 3), "data_1"),
        (lambda: llm.embed([PROMPTS[0], [10**6]]), "token"),
        (lambda: llm.engine.add_request("x", PROMPTS[0], SamplingParams()), "PoolingParams"),
        (lambda: PoolingParams(normalize="yes"), "normalize"),
        (lambda: PoolingParams(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        (lambda: PoolingParams(task="rerank"), "task"),
    ]
    for call, field in cases:
        with pytest.raises(ValueError, match=field):
            call()
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.embed(PROMPTS[:2], use_tqdm=False)) == 2
    assert_no_leaks(llm.engine)


def test_runner_and_convert_are_checked(qwen3):
    from jaxserve.config import EngineConfig

    assert EngineConfig.from_kwargs(model=str(qwen3), task="embed").model.pooling
    for kwargs, field in [({"runner": "draft"}, "runner"), ({"convert": "classify"}, "convert"),
                          ({"convert": "embed"}, "convert"), ({"task": "classify"}, "task"),
                          ({"runner": "pooling", "speculative_config": {
                              "method": "ngram", "num_speculative_tokens": 2}},
                           "speculative_config")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig.from_kwargs(model=str(qwen3), **kwargs)


def test_a_generating_engine_refuses_pooling(qwen3, compile_cache_dir):
    llm = LLM(str(qwen3), num_kv_blocks=16, max_model_len=64,
              compilation_cache_dir=compile_cache_dir)
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.engine.add_request("x", [1, 2, 3], PoolingParams())
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.embed([1, 2, 3])


def test_an_aborted_async_embedding_ends_with_a_pooling_output(llm):
    """Last: the engine's thread becomes its only user."""
    import asyncio

    from jaxserve import AsyncLLM
    from jaxserve.outputs import PoolingRequestOutput

    async_llm = AsyncLLM.from_engine(llm.engine)

    async def embed(i: int, prompt: list[int]):
        async for out in async_llm.encode(prompt, request_id=f"e{i}"):
            return out

    async def run() -> list:
        # Twenty 90-token prompts at 32 tokens a step: the last is far from done when aborted.
        tasks = [asyncio.create_task(embed(i, PROMPTS[4])) for i in range(20)]
        while "e19" not in llm.engine.output_processor.states:
            await asyncio.sleep(0.001)
        await async_llm.abort("e19")
        return await asyncio.gather(*tasks)

    try:
        outs = asyncio.run(run())
    finally:
        async_llm.shutdown()
    aborted = outs[-1]
    assert isinstance(aborted, PoolingRequestOutput) and aborted.finished
    assert aborted.outputs.data is None and aborted.prompt_token_ids == PROMPTS[4]
    assert all(out.outputs.data is not None for out in outs[:-1])
    assert_no_leaks(llm.engine)
