"""Server test helpers: the served handle and waiting for the engine to settle."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

API_KEY = "test-key"
MODEL_NAME = "tiny-llama"


@dataclass
class Served:
    llm: object  # AsyncLLM
    url: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def wait_engine_idle(llm) -> None:  # noqa: ANN001 (AsyncLLM)
    """Until every accepted request is gone and the engine has nothing left to run."""
    wait_until(lambda: llm.stats().num_unfinished == 0
               and not llm.call_in_engine(lambda e: e.has_unfinished_requests()).result())
