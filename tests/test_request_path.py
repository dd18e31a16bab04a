"""The host files one plain greedy request runs through, from `LLM.generate` to the jitted step
and back, after warm-up: every jaxserve file with a Python frame during the call (profiled on
every thread). Issue 48 wants at most 20, and no new file may join the path unnoticed."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import jaxserve
from engine_helpers import SMALL_ENGINE
from jaxserve import LLM, SamplingParams

PACKAGE = Path(jaxserve.__file__).resolve().parent
MAX_FILES = 20


def files_run(call: Any) -> list[str]:
    """The jaxserve files (relative to the package) with a frame while `call()` runs."""
    seen: set[str] = set()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(str(PACKAGE)):
            seen.add(frame.f_code.co_filename)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return sorted(str(Path(f).relative_to(PACKAGE)) for f in seen)


def test_a_greedy_request_crosses_at_most_max_files_host_files(compile_cache_dir):
    llm = LLM(compilation_cache_dir=compile_cache_dir, **SMALL_ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    warm = llm.generate([[1, 2, 3, 4, 5]], params, use_tqdm=False)
    outputs: list[Any] = []
    files = files_run(lambda: outputs.extend(
        llm.generate([[1, 2, 3, 4, 5]], params, use_tqdm=False)))
    print(f"\n{len(files)} host files on the greedy path (at most {MAX_FILES}):\n  " +
          "\n  ".join(files))
    # The trace saw the request: its entry point and the runner that launches the step.
    assert outputs[0].outputs[0].token_ids == warm[0].outputs[0].token_ids
    assert {"entrypoints/llm.py", "core/scheduler.py"} <= set(files)
    assert any(f.endswith("model_runner.py") for f in files)
    assert len(files) <= MAX_FILES, "\n".join(files)
