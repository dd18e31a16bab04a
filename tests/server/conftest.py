"""Server test fixtures: one tiny-llama server (and one offline LLM for references) per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine_helpers import SMALL_ENGINE
from server_helpers import API_KEY, MODEL_NAME, Served

# One step shape: each compilation costs seconds on CI, and a server sees every batch size.
SERVER_ENGINE = SMALL_ENGINE | dict(token_buckets=[128], request_buckets=[16])


@pytest.fixture(scope="session")
def engine_args(hf_checkpoint, compile_cache_dir) -> dict:
    return dict(model=str(hf_checkpoint("llama")), compilation_cache_dir=compile_cache_dir,
                **SERVER_ENGINE)


@pytest.fixture(scope="session")
def offline(engine_args):
    """The offline `LLM` over the same checkpoint and settings: the reference outputs."""
    from jaxserve import LLM

    return LLM(**engine_args)


@pytest.fixture(scope="session")
def served(engine_args) -> Iterator[Served]:
    from jaxserve import AsyncLLM
    from jaxserve.entrypoints.openai.api_server import BackgroundServer, build_app

    llm = AsyncLLM(**engine_args)
    server = BackgroundServer(build_app(llm, [MODEL_NAME], api_key=API_KEY)).start()
    yield Served(llm, server.url)
    server.stop()
    llm.shutdown()
