"""jaxserve: a JAX-native LLM inference engine with vLLM V1's architecture."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Lazy, so that `import jaxserve.core...` (pure Python) does not pull in jax.
_EXPORTS = {
    "LLM": "jaxserve.entrypoints.llm",
    "AsyncLLM": "jaxserve.engine.async_llm",
    "AsyncLLMEngine": "jaxserve.engine.async_llm",
    "LLMEngine": "jaxserve.engine.llm_engine",
    "EngineConfig": "jaxserve.config",
    "EngineArgs": "jaxserve.engine.arg_utils",
    "AsyncEngineArgs": "jaxserve.engine.arg_utils",
    "SamplingParams": "jaxserve.sampling_params",
    "RequestOutputKind": "jaxserve.sampling_params",
    "TextPrompt": "jaxserve.inputs",
    "TokensPrompt": "jaxserve.inputs",
    "RequestOutput": "jaxserve.outputs",
    "CompletionOutput": "jaxserve.outputs",
    "PoolingParams": "jaxserve.pooling_params",
    "PoolingRequestOutput": "jaxserve.outputs",
    "EmbeddingRequestOutput": "jaxserve.outputs",
    "ScoringRequestOutput": "jaxserve.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
