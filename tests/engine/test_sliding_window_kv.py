"""KV blocks a sliding window no longer sees go back to the pool (Phi-3: every layer attends over
the last 24 positions): a request holds a few blocks however long it runs, so a pool far too
small for the requests' whole sequences serves them all at once, tokens equal to HF's."""

from __future__ import annotations

import pytest

from engine_helpers import CHUNKED_ASYNC, SMALL_ENGINE, assert_no_leaks, hf_greedy, random_prompts
from jaxserve import LLMEngine, SamplingParams

PROMPTS = random_prompts(8, 40, 40, seed=51)
GREEDY = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
BLOCK = SMALL_ENGINE["block_size"]
WINDOW = 24  # tests/hf_checkpoints.py's Phi-3


def run(engine: LLMEngine) -> tuple[dict[str, list[int]], int]:
    """Every prompt at once: each request's tokens, and the most blocks one request held."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
    tokens, most_held = {}, 0
    kv = engine.core.scheduler.kv
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
        most_held = max([most_held] + [sum(not b.is_null for b in blocks)
                                       for blocks in kv.req_to_blocks.values()])
    return tokens, most_held


NGRAM = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                "prompt_lookup_max": 3}}


@pytest.mark.parametrize("engine_args, held", [
    # A query sees 24 positions: two blocks, three while it crosses into a new one; drafts a
    # verification may reject keep three positions more.
    pytest.param({}, 3, id="one-step-prompts"),
    pytest.param(CHUNKED_ASYNC, 3, id="chunked-async"),
    pytest.param(NGRAM, 4, id="ngram-drafts")])
def test_a_pool_too_small_for_whole_sequences_serves_them_all_at_once(
        hf_checkpoint, compile_cache_dir, engine_args, held):
    path = hf_checkpoint("phi3")
    whole = len(PROMPTS) * -(-(40 + GREEDY.max_tokens) // BLOCK)  # 64 blocks without freeing
    num_kv_blocks = 1 + len(PROMPTS) * held  # and the null block
    engine = LLMEngine.from_engine_args(
        model=str(path), compilation_cache_dir=compile_cache_dir,
        **(SMALL_ENGINE | engine_args | {"num_kv_blocks": num_kv_blocks}))
    assert engine.core.scheduler.kv.sliding_window == WINDOW
    tokens, most_held = run(engine)
    assert most_held <= held
    assert engine.core.scheduler.num_preemptions == 0
    assert whole / (num_kv_blocks - 1) >= 2  # concurrent sequences: 2-2.67x the pool's
    assert [tokens[str(i)] for i in range(len(PROMPTS))] == hf_greedy(
        path, PROMPTS, GREEDY.max_tokens)
    assert_no_leaks(engine)


def test_a_mixed_or_disaggregated_model_keeps_every_block(hf_checkpoint):
    import json

    from jaxserve.config import EngineConfig
    from jaxserve.engine.core import freed_window
    from jaxserve.models.registry import config_from_hf

    def model_config(kind: str):  # noqa: ANN202
        return config_from_hf(json.loads((hf_checkpoint(kind) / "config.json").read_text()))

    gemma, phi3 = model_config("gemma2"), model_config("phi3")  # gemma2: local and global
    config = EngineConfig.from_kwargs(model=str(hf_checkpoint("phi3")))
    assert freed_window(config, phi3) == WINDOW and freed_window(config, gemma) is None
    drafted = EngineConfig.from_kwargs(model=str(hf_checkpoint("phi3")), speculative_config={
        "method": "draft_model", "model": str(hf_checkpoint("phi3")),
        "num_speculative_tokens": 2})
    assert freed_window(drafted, phi3) is None
    kept = EngineConfig.from_kwargs(model=str(hf_checkpoint("phi3")),
                                    disable_hybrid_kv_cache_manager=True)
    assert freed_window(kept, phi3) is None
