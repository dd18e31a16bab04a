"""LLMEngine: the step-by-step API (add_request, step, abort_request) over EngineCore."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.request import RequestStatus
from jaxserve.engine.arg_utils import EngineArgs
from jaxserve.engine.core import EngineCore
from jaxserve.engine.input_processor import InputProcessor, PromptType
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.stats import EngineStats
from jaxserve.models.loaded_model import LoadedModel
from jaxserve.models.loader import load_tokenizer
from jaxserve.models.tokenizer import Tokenizer, as_tokenizer
from jaxserve.outputs import PoolingRequestOutput, RequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import RequestOutputKind, SamplingParams, sampling_defaults

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        self.pooling = config.model.pooling  # its requests embed their prompts (runner="pooling")
        self.core = make_engine_core(config, loaded)
        context = self.core.model_config.max_position_embeddings
        if self.core.max_model_len > context:
            raise ValueError(f"max_model_len ({self.core.max_model_len}) is more than the "
                             f"model's context (max_position_embeddings = {context})")
        self.tokenizer = _tokenizer(config, self.core.tokenizer, self.core.model_config)
        self.sampling_defaults = _sampling_defaults(config, self.core.generation_config)
        self.input_processor = InputProcessor(
            self.tokenizer, self.core.model_config.vocab_size, self.core.max_model_len,
            config.cache.block_size, self.core.root_hash, config.model,
            self.core.model_config.eos_token_ids,
            # Its requests cross to the decode side (maybe another process) without a matcher.
            structured_outputs=config.parallel.disaggregation is None,
            prompt_logprobs=_no_prompt_logprobs(config),
            default_params=SamplingParams(**self.sampling_defaults))
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs | None = None,
                         **kwargs: Any) -> LLMEngine:
        """As vLLM: `LLMEngine.from_engine_args(EngineArgs(model=...))`; or the arguments
        themselves (`from_engine_args(model=...)`)."""
        return cls(EngineArgs.of(engine_args, kwargs).create_engine_config())

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, lora_request: object | None = None) -> None:
        """`params`: SamplingParams, or with a pooling engine (runner="pooling") PoolingParams."""
        if self.core.is_sleeping():
            raise ValueError("the engine is asleep: call wake_up() before adding requests")
        if request_id in self.output_processor.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        pooling = self._pooling_params(params)
        if pooling is not None:  # a pooling request prefills its prompt and ends
            params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                    truncate_prompt_tokens=pooling.truncate_prompt_tokens,
                                    output_kind=RequestOutputKind.FINAL_ONLY)
        text, requests = self.input_processor.process(request_id, prompt, params, arrival_time,
                                                      priority, cache_salt, lora_request)
        for child in (r.request_id for r in requests):
            owner = self.output_processor.parent_of.get(child)
            if owner is not None:  # n > 1 samples are "{i}_{id}": they share one namespace
                raise ValueError(f"request_id {request_id!r} is already in use: "
                                 f"{child!r} is a sample of {owner!r}")
        first = requests[0]
        self.output_processor.add_request(request_id, text, first.prompt_token_ids,
                                          first.sampling_params, first.arrival_time,
                                          [r.request_id for r in requests], pooling)
        for request in requests:
            self.core.add_request(request)

    def _pooling_params(self, params: SamplingParams | PoolingParams | None,
                        ) -> PoolingParams | None:
        """A pooling engine's request's params, verified; None for a generating engine's."""
        if not self.pooling:
            if isinstance(params, PoolingParams):
                raise ValueError("params: PoolingParams need an engine started with "
                                 "runner='pooling'")
            return None
        if params is None:
            params = PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(f"params: a pooling engine (runner='pooling') takes PoolingParams, "
                             f"got {type(params).__name__}; it generates no text")
        params.verify(params.task or "embed")
        return params

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        children = [c for r in ids for c in self.output_processor.abort(r)]
        self.core.abort_requests(children)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        """Requests added and not yet finished or aborted (n samples count as one)."""
        return len(self.output_processor.states)

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (its checkpoint carries none); pass "
                             "tokenizer=")
        return self.tokenizer

    def set_tokenizer(self, tokenizer: object) -> None:
        """vLLM's: the requests that follow are tokenised and their outputs detokenised with
        `tokenizer` (ours, or an HF fast tokenizer, wrapped as a checkpoint's is)."""
        self.tokenizer = as_tokenizer(tokenizer)
        self.input_processor.set_tokenizer(self.tokenizer)
        self.output_processor.tokenizer = self.tokenizer

    def get_model_config(self) -> ModelConfig:
        """The model's settings, max_model_len resolved (vLLM's ModelConfig has it so)."""
        return dataclasses.replace(self.config.model, max_model_len=self.core.max_model_len)

    def step(self, output_kind: RequestOutputKind | None = None,
             ) -> list[RequestOutput | PoolingRequestOutput]:
        """One engine step: each request's output as its `SamplingParams.output_kind` asks
        (as vLLM's), or all of `output_kind`."""
        core_outputs = self.core.step()
        with self.core.timings.phase("output"):
            outputs, stopped = self.output_processor.process_outputs(core_outputs, output_kind)
        if stopped:
            self.core.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def stats(self) -> EngineStats:
        return self.core.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing reset) while a request holds blocks."""
        return self.core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        self.core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.core.is_sleeping()

    def update_weights(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        self.core.update_weights(weights)

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                       ) -> list[Any]:
        return self.core.collective_rpc(method, timeout, args, kwargs)


def _no_prompt_logprobs(config: EngineConfig) -> str | None:
    """Why prompt logprobs are refused, if they are: their step programs are not built at
    warm-up (so strict_compile would fail the step), and they are untested across the two sides
    of a disaggregated engine."""
    if config.runner.strict_compile:
        return "with strict_compile (their step programs are not built at warm-up)"
    if config.parallel.disaggregation is not None:
        return "with disaggregated prefill/decode"
    return None


def _sampling_defaults(config: EngineConfig, generation_config: dict[str, Any],
                       ) -> dict[str, Any]:
    """vLLM's generation_config: "auto" takes the checkpoint's sampling defaults, "vllm" none."""
    if config.model.generation_config == "vllm":
        return {}
    defaults = sampling_defaults(generation_config)
    if defaults:
        logger.info("sampling defaults from the checkpoint's generation config: %s (for "
                    "requests that do not set them; generation_config='vllm' ignores them)",
                    defaults)
    return defaults


def _tokenizer(config: EngineConfig, own: Tokenizer | None, model: Any) -> Tokenizer | None:
    """The checkpoint's tokenizer, or the one `tokenizer=` names."""
    path = config.model.tokenizer
    return own if path is None else load_tokenizer(path, model)


def make_engine_core(config: EngineConfig, loaded: LoadedModel | None = None) -> EngineCore:
    """The EngineCore; with `disaggregation`, the decode side's, connected to a prefill side."""
    if config.parallel.disaggregation is not None:
        from jaxserve.engine.disagg.decode_core import make_decode_core

        return make_decode_core(config, loaded)
    return EngineCore(config, loaded)
