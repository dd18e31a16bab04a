"""LoRA does not exist in jaxserve: a request for an adapter is refused with a clear error at the
API (LLM.generate, LLMEngine.add_request, AsyncLLM.generate), never served by the base model;
vLLM's `lora_request=None` is accepted."""

from __future__ import annotations

import asyncio

import pytest

from engine_helpers import SMALL_ENGINE
from jaxserve import LLM, SamplingParams
from jaxserve.engine.async_llm import AsyncLLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
ADAPTER = ("sql-lora", 1, "/adapters/sql")  # vLLM's LoRARequest(name, id, path), as a tuple


def test_a_lora_request_is_refused_and_none_is_accepted(hf_checkpoint, compile_cache_dir):
    llm = LLM(str(hf_checkpoint("llama")), compilation_cache_dir=compile_cache_dir,
              **SMALL_ENGINE)
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=ADAPTER)
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        llm.engine.add_request("r0", [5, 6, 7], GREEDY, lora_request=ADAPTER)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=None)
    assert len(out[0].outputs[0].token_ids) == 2


def test_async_generate_refuses_a_lora_request_before_queueing():
    async def first_output() -> None:
        llm = object.__new__(AsyncLLM)  # refused before the engine is touched
        async for _ in AsyncLLM.generate(llm, [5, 6, 7], GREEDY, lora_request=ADAPTER):
            pass

    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        asyncio.run(first_output())
