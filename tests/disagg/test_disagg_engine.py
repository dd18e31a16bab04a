"""The disaggregated engine (prefill TP 4 on 4 devices, decode TP 2 x DP 2 on the other 4, KV
moved device to device) gives the unified engine's tokens and HF's greedy tokens, with async
scheduling on both sides (and off), prefix hits on both sides, back-pressure from a full
decode side, and aborts in flight."""

from __future__ import annotations

import asyncio

import jax
import pytest
from disagg_helpers import (ENGINE, GREEDY, SPLIT, assert_no_disagg_leaks, drain, prefix_prompt,
                            tokens, workload)

from jaxserve import LLM, LLMEngine, SamplingParams
from jaxserve.config import EngineConfig
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.disagg.connector import InProcessConnector

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (forced) CPU devices")


def _engine(path: str, cache_dir: str, **extra: object) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(model=path, compilation_cache_dir=cache_dir,
                                              disaggregation=SPLIT, **ENGINE, **extra))


@pytest.mark.slow
def test_tokens_equal_the_unified_engine_with_prefix_hits_backpressure_and_aborts(
        gqa8, compile_cache_dir, reference):
    engine = _engine(gqa8, compile_cache_dir)
    core, connector = engine.core, engine.core.connector
    assert isinstance(connector, InProcessConnector)
    assert core.config.scheduler.async_scheduling  # the default, on both sides
    assert connector.prefill.core.config.scheduler.async_scheduling
    engine.add_request("warm", {"prompt_token_ids": prefix_prompt()}, GREEDY)
    finished: dict = {}
    drain(engine, finished)  # the shared prefix is now cached on the prefill side

    prompts, params = workload()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    engine.add_request("late", {"prompt_token_ids": prompts[0]}, GREEDY)
    max_parked, aborted = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        max_parked = max(max_parked, engine.stats().kv_transfer.num_parked)
        assert all(len(s.running) <= 4 for s in core.schedulers)
        if not aborted and len(connector.parked) >= 2:
            parents = sorted(r for r in connector.parked if "_" not in r)  # not n > 1 children
            aborted["parked"] = parents[-1]  # first token out, KV not moved yet
            aborted["decoding"] = next(r.request_id for s in core.schedulers
                                       for r in s.running if "_" not in r.request_id)
            aborted["prefilling"] = "late"
            assert "late" in connector.prefilling
            engine.abort_request(list(aborted.values()))
    assert max_parked >= 2  # the decode side was full: requests waited, none failed
    assert set(aborted.values()).isdisjoint(finished)  # LLMEngine drops aborted requests
    for i, want in enumerate(reference):
        if f"r{i}" not in aborted.values():
            assert tokens(finished[f"r{i}"]) == want, f"request r{i}"
    assert_no_disagg_leaks(engine)

    stats = engine.stats()
    kv = stats.kv_transfer
    transferred = [len(prefix_prompt())] + [  # prompt lengths, one per sample moved
        len(p) for i, (p, sp) in enumerate(zip(prompts, params))
        for _ in range(sp.n) if sp.max_tokens > 1 and f"r{i}" != aborted["parked"]]
    assert kv.prefill.prefix_cache_hits >= 3 * 32  # the family hit the cached prefix there
    # ... and here: the warm-up prompt's moved blocks are cached on the decode side too, so
    # (on its rank) the family's prefix is not moved again. Each sample is looked up once, with
    # its prompt and first token (queries count tokens).
    assert stats.prefix_cache_hits >= 32
    assert stats.prefix_cache_queries == sum(n + 1 for n in transferred)
    bytes_per_block = 2 * 2 * 2 * 16 * 8 * 4  # K and V x layers x decode KV heads x BS x D x f32
    assert kv.num_transfers == len(transferred)
    assert kv.num_blocks_moved == (sum(-(-n // 16) for n in transferred)
                                   - stats.prefix_cache_hits // 16)
    assert kv.transfer_bytes == bytes_per_block * kv.num_blocks_moved
    split = kv.mean_ttft_split
    assert split is not None and min(split.prefill, split.transfer, split.first_decode) >= 0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_llm_and_async_llm_work_unchanged_over_the_disaggregated_core(
        gqa8, compile_cache_dir, reference, async_scheduling):
    prompts, params = workload()
    llm = LLM(gqa8, compilation_cache_dir=compile_cache_dir, disaggregation=SPLIT,
              async_scheduling=async_scheduling, **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [tokens(o) for o in outs] == reference
    if not async_scheduling:
        return

    async def stream(llm: AsyncLLM, prompt: list[int]) -> list[int]:
        async for out in llm.generate({"prompt_token_ids": prompt}, GREEDY):
            final = out  # cumulative (vLLM's default): the last output holds them all
        return final.outputs[0].token_ids

    async def run() -> list[list[int]]:
        async_llm = AsyncLLM.from_engine(LLMEngine(llm.engine.config))
        try:
            return await asyncio.gather(*(stream(async_llm, p) for p in prompts[3:6]))
        finally:
            async_llm.shutdown()

    assert asyncio.run(run()) == [r[0] for r in reference[3:6]]


def test_a_decode_side_too_small_for_one_sequence_or_missing_devices_fail_at_start_up(gqa8):
    small = {**SPLIT, "decode": {**SPLIT["decode"], "num_kv_blocks": 8}}
    with pytest.raises(ValueError, match=r"disaggregation.decode: num_kv_blocks \(8\) must hold"):
        LLM(gqa8, disaggregation=small, **ENGINE)
    far = {"prefill": {"num_devices": 4}, "decode": {"devices": [8, 9]}}
    with pytest.raises(ValueError, match="only 8 are present"):
        LLM(gqa8, disaggregation=far, **ENGINE)


def test_first_token_stop_and_sampling_params_reach_the_prefill_side(gqa8, compile_cache_dir):
    engine = _engine(gqa8, compile_cache_dir)
    prompt = prefix_prompt()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request("one", {"prompt_token_ids": prompt}, params)
    finished: dict = {}
    drain(engine, finished)
    assert len(finished["one"].outputs[0].token_ids) == 1
    assert finished["one"].outputs[0].finish_reason == "length"
    assert engine.stats().kv_transfer.num_transfers == 0  # nothing to decode: nothing moved
    assert_no_disagg_leaks(engine)


def test_after_warm_up_nothing_compiles_not_even_block_transfers(gqa8, compile_cache_dir,
                                                                 reference):
    llm = LLM(gqa8, compilation_cache_dir=compile_cache_dir, disaggregation=SPLIT,
              precompile=True, strict_compile=True, **ENGINE)  # strict: raises on a compile
    before = llm.stats().num_compilations
    prompts, params = workload()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [tokens(o) for o in outs] == reference
    assert llm.stats().num_compilations == before


def test_structured_outputs_are_refused_not_ignored(gqa8, compile_cache_dir):
    from jaxserve.sampling_params import StructuredOutputsParams

    engine = _engine(gqa8, compile_cache_dir)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError, match="not supported with disaggregated"):
        engine.add_request("so", {"prompt_token_ids": prefix_prompt()}, params)
    assert not engine.has_unfinished_requests()
