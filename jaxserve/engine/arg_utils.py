"""vLLM's `EngineArgs` / `AsyncEngineArgs`: engine arguments held until an engine is made."""

from __future__ import annotations

from typing import Any

from jaxserve.config import EngineConfig

DEFAULT_MAX_QUEUED_REQUESTS = 1024


class EngineArgs:
    """`EngineArgs(model=..., max_num_seqs=8)`; bad arguments fail here, naming the argument.
    Every engine argument reads as an attribute (its default when not given)."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        self._kwargs = {"model": model, **kwargs}
        self._resolved = self.create_engine_config().to_kwargs()

    @classmethod
    def of(cls, engine_args: EngineArgs | None, kwargs: dict[str, Any]) -> EngineArgs:
        """`engine_args`, or one made of `kwargs` (not both)."""
        if engine_args is None:
            return cls(**kwargs)
        if kwargs:
            raise ValueError(f"pass engine arguments in {cls.__name__} or as keywords, not "
                             f"both (got {sorted(kwargs)} too)")
        if not isinstance(engine_args, cls):
            raise ValueError(f"engine_args must be a {cls.__name__}, got "
                             f"{type(engine_args).__name__}")
        return engine_args

    def create_engine_config(self) -> EngineConfig:
        return EngineConfig.from_kwargs(**self._kwargs)

    def __getattr__(self, name: str) -> Any:
        resolved = self.__dict__.get("_resolved", {})
        if name not in resolved:
            raise AttributeError(f"{type(self).__name__} has no engine argument {name!r}")
        return resolved[name]


class AsyncEngineArgs(EngineArgs):
    """EngineArgs and the AsyncLLM's own bound on waiting samples."""

    def __init__(self, model: str | None = None,
                 max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS, **kwargs: Any):
        super().__init__(model, **kwargs)
        self.max_queued_requests = max_queued_requests
