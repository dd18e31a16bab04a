"""A step that raises fails only the requests it carried; lost device state stops the engine."""

from __future__ import annotations

import asyncio

import pytest

from engine_helpers import assert_no_leaks, hf_greedy, random_prompts
from jaxserve import AsyncLLM, LLMEngine, SamplingParams
from jaxserve.engine.async_llm import EngineDeadError, EngineStepError
from jaxserve.engine.core import DeviceStateLostError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _poisoned() -> SamplingParams:
    """Params that passed validation and then went bad: the step that samples them raises."""
    params = SamplingParams(temperature=1.0, max_tokens=8)
    params.top_k = 2**31  # no longer representable as the device's int32
    return params


def _drain(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return done


def test_a_failing_step_fails_its_requests_frees_their_blocks_and_the_engine_goes_on(
        engine, llama):
    engine.add_request("bad", {"prompt_token_ids": [5, 6, 7]}, _poisoned())
    done = _drain(engine)
    assert done["bad"].outputs[0].finish_reason == "error"
    assert "OverflowError" in done["bad"].error
    assert_no_leaks(engine)
    good = random_prompts(2, 10, 30, seed=41)
    for i, p in enumerate(good):
        engine.add_request(f"good{i}", {"prompt_token_ids": p}, GREEDY)
    done = _drain(engine)
    assert [done[f"good{i}"].outputs[0].token_ids for i in range(2)] == hf_greedy(llama, good, 8)
    assert done["good0"].error is None
    assert_no_leaks(engine)


def test_async_llm_raises_for_the_failed_request_and_keeps_serving(engine):
    llm = AsyncLLM.from_engine(engine)

    async def run(params: SamplingParams) -> list:
        return [o async for o in llm.generate({"prompt_token_ids": [5, 6, 7]}, params)]

    try:
        with pytest.raises(EngineStepError, match="OverflowError"):
            asyncio.run(run(_poisoned()))
        assert llm.is_running
        outs = asyncio.run(run(GREEDY))
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8  # cumulative
        llm.call_in_engine(assert_no_leaks).result()
    finally:
        llm.shutdown()


def test_lost_device_state_stops_the_engine(engine, monkeypatch):
    runner = engine.core.executor.worker.runner

    def collect(pending):  # noqa: ANN001, ANN202
        runner.k_cache.delete()  # as a failed device computation leaves it
        raise RuntimeError("device halted")

    monkeypatch.setattr(runner, "collect", collect)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    with pytest.raises(DeviceStateLostError, match="device halted"):
        _drain(engine)
    # Its requests are stranded mid-step: the engine takes no more work.
    for call in (lambda: engine.step(),
                 lambda: engine.add_request("next", {"prompt_token_ids": [5]}, GREEDY)):
        with pytest.raises(EngineDeadError, match="stopped after DeviceStateLostError"):
            call()


def test_a_compile_that_strict_compile_forbids_stops_the_engine(engine, monkeypatch):
    from jaxserve.runtime.model_runner import UnexpectedCompilationError

    def dispatch(sched):  # noqa: ANN001, ANN202
        raise UnexpectedCompilationError("step shape (999,) was not compiled at warm-up")

    monkeypatch.setattr(engine.core.executor.worker.runner, "dispatch", dispatch)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    with pytest.raises(UnexpectedCompilationError):
        _drain(engine)
    with pytest.raises(EngineDeadError, match="stopped after UnexpectedCompilationError"):
        engine.add_request("next", {"prompt_token_ids": [5]}, GREEDY)


def test_async_llm_reports_dead_when_device_state_is_lost(engine, monkeypatch):
    runner = engine.core.executor.worker.runner

    def collect(pending):  # noqa: ANN001, ANN202
        runner.k_cache.delete()
        raise RuntimeError("device halted")

    monkeypatch.setattr(runner, "collect", collect)
    llm = AsyncLLM.from_engine(engine)

    async def run() -> list:
        return [o async for o in llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY)]

    with pytest.raises(EngineDeadError):
        asyncio.run(run())
    llm._thread.join(30)
    assert not llm.is_running


def test_the_queue_bound_counts_samples_not_requests(engine):
    import threading

    from jaxserve.engine.async_llm import EngineQueueFullError

    llm = AsyncLLM.from_engine(engine, max_queued_requests=4)
    gate = threading.Event()

    async def run() -> None:
        llm.call_in_engine(lambda e: gate.wait(30))  # nothing gets admitted meanwhile
        first = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(n=3, max_tokens=2))
        waiting = asyncio.ensure_future(anext(first))
        await asyncio.sleep(0.05)
        with pytest.raises(EngineQueueFullError, match="4"):
            await anext(llm.generate({"prompt_token_ids": [5, 6]},
                                     SamplingParams(n=2, max_tokens=2)))
        gate.set()
        await waiting
        await first.aclose()

    try:
        asyncio.run(run())
    finally:
        gate.set()
        llm.shutdown()
