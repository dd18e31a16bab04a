"""AsyncLLM: streamed deltas, cancellation, aborts, bad input, the queue bound, shutdown."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine_helpers import assert_no_leaks, random_prompts
from jaxserve import AsyncLLM, RequestOutput, RequestOutputKind, SamplingParams
from jaxserve.engine.async_llm import EngineDeadError, EngineQueueFullError
from jaxserve.engine.input_processor import PromptType
from server_helpers import wait_engine_idle

DELTA = RequestOutputKind.DELTA
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, output_kind=DELTA)
LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, output_kind=DELTA)


@pytest.fixture(scope="module")
def llm(engine_args):
    llm = AsyncLLM(**engine_args)
    yield llm
    llm.shutdown()


async def _collect(llm: AsyncLLM, prompt: PromptType, params: SamplingParams,
                   request_id: str) -> list[RequestOutput]:
    return [out async for out in llm.generate(prompt, params, request_id)]


def test_streamed_deltas_concatenate_to_the_offline_output(llm, offline):
    prompts = ["Once upon a time", "The robot liked", {"prompt_token_ids": [5, 6, 7, 8, 9]}]
    sampled = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True,
                             output_kind=DELTA)
    stop_text = offline.generate("Every morning", GREEDY, use_tqdm=False)[0].outputs[0].text
    stopped = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                             stop=[stop_text[4:7]], output_kind=DELTA)
    cases = [(p, GREEDY) for p in prompts] + [("Once upon", sampled), ("Every morning", stopped)]

    async def run():
        return await asyncio.gather(*(_collect(llm, p, params, f"delta-{i}")
                                      for i, (p, params) in enumerate(cases)))

    streams = asyncio.run(run())
    for (prompt, params), outs in zip(cases, streams):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert len(outs) > 2  # really streamed, not one final blob
        expected = offline.generate(prompt, params, use_tqdm=False)[0]
        for want in expected.outputs:
            got = [c for o in outs for c in o.outputs if c.index == want.index]
            assert "".join(c.text for c in got) == want.text
            assert [t for c in got for t in c.token_ids] == want.token_ids
            assert (got[-1].finish_reason, got[-1].stop_reason) == (want.finish_reason,
                                                                     want.stop_reason)
        assert outs[-1].metrics.first_token_time <= outs[-1].metrics.finished_time
    assert streams[-1][-1].outputs[0].finish_reason == "stop"
    wait_engine_idle(llm)
    llm.call_in_engine(assert_no_leaks).result()


def test_cancelling_the_consumer_aborts_the_request_and_frees_its_blocks(llm):
    before = llm.stats().num_generation_tokens
    seen = []

    async def consume(request_id: str) -> None:
        async for out in llm.generate("Once upon a time there was", LONG, request_id):
            seen.append(out)

    async def run() -> None:
        task = asyncio.create_task(consume("cancel-me"))
        while len(seen) < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Breaking out of the loop (the generator is closed) aborts just the same.
        gen = llm.generate("Once upon a time there was", LONG, "break-me")
        async for _ in gen:
            break
        await gen.aclose()

    asyncio.run(run())
    wait_engine_idle(llm)
    llm.call_in_engine(assert_no_leaks).result()
    assert llm.stats().num_generation_tokens - before < 2 * LONG.max_tokens
    assert not any(o.finished for o in seen)


def test_bad_input_raises_in_generate_before_any_output_and_changes_nothing(llm):
    too_long = {"prompt_token_ids": list(range(2, 2 + llm.max_model_len))}

    async def run() -> list:
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in llm.generate(too_long, GREEDY, "bad-1"):
                raise AssertionError("no output may come before the error")
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await anext(llm.generate({"prompt_token_ids": [10**6]}, GREEDY, "bad-2"))
        with pytest.raises(ValueError, match="prompt_token_ids: must be a list of ints, got int"):
            await anext(llm.generate({"prompt_token_ids": 5}, GREEDY, "bad-3"))
        with pytest.raises(ValueError, match="request_id"):
            await anext(llm.generate("Once", GREEDY, ""))
        good = llm.generate("Once upon a time", GREEDY, "dup")
        first = await anext(good)
        with pytest.raises(ValueError, match="already in use"):
            await anext(llm.generate("Once", GREEDY, "dup"))
        return [first] + [o async for o in good]

    outs = asyncio.run(run())
    assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 12
    wait_engine_idle(llm)
    llm.call_in_engine(assert_no_leaks).result()


def test_vllms_engine_client_methods(llm):
    from jaxserve import AsyncLLMEngine

    assert AsyncLLMEngine is AsyncLLM  # vLLM's name for it
    prompt = {"prompt_token_ids": list(range(5, 45))}  # two full blocks to cache

    async def run() -> list[int]:
        assert not llm.errored
        await llm.check_health()
        assert await llm.get_tokenizer() is llm.tokenizer is not None
        with pytest.raises(ValueError, match="lora_request"):
            await llm.get_tokenizer(lora_request=object())
        assert (await llm.get_model_config()).max_model_len == llm.max_model_len
        hits = []
        for i, reset in enumerate((False, True, False)):
            if reset:
                assert await llm.reset_prefix_cache() is True
            outs = await _collect(llm, prompt, GREEDY, f"cached-{i}")
            assert outs[-1].kv_transfer_params is None  # no KV connector set it
            hits.append(llm.stats().engine.prefix_cache_hits)
        return hits

    after_first, after_reset, after_again = asyncio.run(run())
    assert after_reset == after_first < after_again  # the reset emptied the cache


def test_abort_ends_the_stream_with_finish_reason_abort(llm):
    async def run() -> list:
        outs = []
        async for out in llm.generate("Once upon a time", LONG, "to-abort"):
            outs.append(out)
            if len(outs) == 2:
                await llm.abort("to-abort")
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in outs) < LONG.max_tokens
    wait_engine_idle(llm)
    llm.call_in_engine(assert_no_leaks).result()


def test_a_new_request_joins_the_running_batch(llm):
    before = llm.stats()

    async def run() -> tuple[list, list]:
        early = llm.generate("Once upon a time", LONG, "early")
        early_outs = [await anext(early), await anext(early)]
        late_outs = [o async for o in llm.generate("The robot", GREEDY, "late")]
        early_outs += [o async for o in early]
        return early_outs, late_outs

    early, late = asyncio.run(run())
    # The late request finished while the early one was still decoding.
    assert late[-1].metrics.finished_time < early[-1].metrics.finished_time
    after = llm.stats()
    assert after.num_join_steps > before.num_join_steps
    assert after.num_joined_requests > before.num_joined_requests


def test_a_full_queue_raises_engine_queue_full_error(llm):
    gate = threading.Event()
    llm.call_in_engine(lambda e: gate.wait(30))  # hold the engine thread between steps
    saved, llm.max_queued_requests = llm.max_queued_requests, 2
    try:
        async def run() -> list:
            waiting = [asyncio.create_task(_collect(llm, "Once", GREEDY, f"q{i}"))
                       for i in range(2)]
            while llm.stats().num_unfinished < 2:
                await asyncio.sleep(0.005)
            with pytest.raises(EngineQueueFullError, match="max_queued_requests=2"):
                await anext(llm.generate("Once", GREEDY, "q-overflow"))
            gate.set()
            return await asyncio.gather(*waiting)

        results = asyncio.run(run())
    finally:
        gate.set()
        llm.max_queued_requests = saved
    assert all(outs[-1].finished for outs in results)
    wait_engine_idle(llm)
    llm.call_in_engine(assert_no_leaks).result()


def test_shutdown_fails_open_streams_and_refuses_new_requests(engine_args):
    llm = AsyncLLM(**engine_args)

    async def run() -> None:
        gen = llm.generate({"prompt_token_ids": random_prompts(1, 10, 10, seed=3)[0]}, LONG)
        await anext(gen)
        llm.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await anext(llm.generate("Once", GREEDY))

    asyncio.run(run())
    assert not llm.is_running and llm.errored
    with pytest.raises(EngineDeadError):
        asyncio.run(llm.check_health())
    with pytest.raises(EngineDeadError):
        llm.call_in_engine(lambda e: None).result()
