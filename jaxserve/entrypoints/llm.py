"""`LLM`: the offline batch API (`generate`, `chat`), as vLLM users know it."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from jaxserve.config import EngineConfig
from jaxserve.engine.core import EngineStats
from jaxserve.engine.input_processor import PromptType, refuse_lora
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.metrics_reader import Metric, engine_metrics
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args))
        self._ids = itertools.count()

    @property
    def llm_engine(self) -> LLMEngine:
        return self.engine

    def get_tokenizer(self):  # noqa: ANN201 (Tokenizer | None)
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """The engine's vLLM-named gauges and counters (`vllm:num_requests_running`, ...)."""
        return engine_metrics(self.engine.stats(),
                              {"model_name": str(self.engine.config.model.model), "engine": "0"})

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: object | None = None,
                 ) -> list[RequestOutput]:
        refuse_lora(lora_request)
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt: a text, a dict, or a bare token id list
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(request_id, prompt, p)
        except ValueError:
            self.engine.abort_request(ids)  # nothing of a rejected batch stays queued
            raise
        return self._run(ids, use_tqdm and len(ids) > 1)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("messages: this model has no tokenizer, so no chat template")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [{"prompt_token_ids": tokenizer.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        wanted = set(ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        generated = 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step(RequestOutputKind.FINAL_ONLY):
                if out.request_id in wanted:
                    finished[out.request_id] = out
                    generated += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                    bar.set_postfix_str(f"{generated / max(bar.format_dict['elapsed'], 1e-9):.1f} "
                                        "output tok/s", refresh=False)
        bar.close()
        return [finished[i] for i in ids]
