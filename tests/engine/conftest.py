"""Engine test fixtures: the tiny Llama checkpoint and a fresh small engine over it."""

from __future__ import annotations

import pytest

from engine_helpers import SMALL_ENGINE
from jaxserve import LLMEngine


@pytest.fixture(scope="module")
def llama(hf_checkpoint):
    return hf_checkpoint("llama")


@pytest.fixture
def engine(llama, compile_cache_dir) -> LLMEngine:
    return LLMEngine.from_engine_args(model=str(llama), compilation_cache_dir=compile_cache_dir,
                                      **SMALL_ENGINE)
