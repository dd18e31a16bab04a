"""`LLM`: the offline batch API (`generate`, `chat`; `embed`, `encode`, `score` with
`runner="pooling"`), as vLLM users know it."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Sequence

import numpy as np
from tqdm.auto import tqdm

from jaxserve.config import EngineConfig
from jaxserve.engine.stats import EngineStats
from jaxserve.engine.input_processor import PromptType, check_unicode, refuse_lora
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.metrics_reader import Metric, engine_metrics
from jaxserve.entrypoints.beam_search import BeamSearchOutput, beam_search
from jaxserve.models.chat_template import (CONTENT_FORMATS, load_chat_template,
                                           template_variables, text_content)
from jaxserve.outputs import (EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput,
                              ScoringOutput, ScoringRequestOutput)
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args))
        self._ids = itertools.count()

    @property
    def llm_engine(self) -> LLMEngine:
        return self.engine

    def get_tokenizer(self):  # noqa: ANN201 (Tokenizer | None)
        return self.engine.tokenizer

    def set_tokenizer(self, tokenizer: object) -> None:
        """vLLM's: later requests are tokenised, and their outputs detokenised, with
        `tokenizer` (a jaxserve Tokenizer, or an HF fast tokenizer)."""
        self.engine.set_tokenizer(tokenizer)

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams gets: vLLM's defaults with the checkpoint's
        (generation_config="auto")."""
        return SamplingParams(**self.engine.sampling_defaults)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """The engine's vLLM-named gauges and counters (`vllm:num_requests_running`, ...)."""
        return engine_metrics(self.engine.stats(),
                              {"model_name": str(self.engine.config.model.model), "engine": "0"})

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode, with no request unfinished: the KV cache (and the prefix cache)
        freed, and the weights moved to the host (level 1) or dropped (level 2: `wake_up`
        reads them again from the checkpoint)."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Put back "weights", "kv_cache" or both (None) as they were before `sleep`."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping()

    def update_weights(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        """Write weights named as the HF checkpoint names them (a mapping or (name, array)
        pairs, numpy or jax arrays, any part of the model's) over the model's, as an RL
        trainer syncs them into vLLM (`model.load_weights`); with no request unfinished."""
        self.engine.update_weights(weights)

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                       ) -> list[Any]:
        """vLLM's: `method` run on every worker (one per data-parallel rank), a Worker method
        by name or a function called as `method(worker, *args, **kwargs)` (the RL pattern: a
        trainer's function that reaches `worker.runner`); the results in rank order."""
        return self.engine.collective_rpc(method, timeout, args, kwargs)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: object | None = None,
                 ) -> list[RequestOutput]:
        refuse_lora(lora_request)
        if self.engine.pooling:
            raise ValueError("LLM.generate needs a generative model: this engine was started "
                             "with runner='pooling' (use LLM.embed)")
        return self._run(self._submit(prompts, sampling_params, "sampling_params"), use_tqdm)

    def _submit(self, prompts: PromptType | Sequence[PromptType],
                params: SamplingParams | PoolingParams | Sequence[Any] | None,
                params_name: str) -> list[str]:
        """Add each prompt as a request with its params (one for all, or one each); a batch
        with a bad request adds none. Returns their ids."""
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt: a text, a dict, or a bare token id list
        if not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts must be a prompt (a str, a dict or a token id list) or a "
                             f"list of prompts, got {type(prompts).__name__}")
        each = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(each) != len(prompts):
            raise ValueError(f"{params_name}: got {len(each)} for {len(prompts)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, p in zip(ids, prompts, each):
                self.engine.add_request(request_id, prompt, p)
        except ValueError:
            self.engine.abort_request(ids)  # nothing of a rejected batch stays queued
            raise
        return ids

    # ---- pooling (runner="pooling") -------------------------------------------------------
    def encode(self, prompts: PromptType | Sequence[PromptType],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               lora_request: object | None = None, pooling_task: str = "embed",
               ) -> list[PoolingRequestOutput]:
        """vLLM's `encode`: each prompt's pooled hidden state (`outputs.data`, an np.ndarray)."""
        refuse_lora(lora_request)
        if not self.engine.pooling:
            raise ValueError("LLM.encode needs a pooling model: start the engine with "
                             "runner='pooling'")
        given = isinstance(pooling_params, (list, tuple))
        params = []
        for p in (pooling_params if given else [pooling_params]):
            if p is not None and not isinstance(p, PoolingParams):
                raise ValueError(f"pooling_params must be PoolingParams, got {type(p).__name__}")
            p = dataclasses.replace(p or PoolingParams())  # the caller's stays as it was
            if truncate_prompt_tokens is not None:
                p = dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
            p.verify(pooling_task)
            params.append(p)
        outputs = self._run(self._submit(prompts, params if given else params[0],
                                         "pooling_params"), use_tqdm)
        for out in outputs:
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id}: {out.error}")
        return outputs

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              lora_request: object | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's `embed`: each prompt's embedding (`outputs.embedding`, a list of floats)."""
        return [EmbeddingRequestOutput.from_base(out) for out in self.encode(
            prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request, "embed")]

    def score(self, data_1: PromptType | Sequence[PromptType],
              data_2: PromptType | Sequence[PromptType], truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None,
              lora_request: object | None = None) -> list[ScoringRequestOutput]:
        """vLLM's `score` with an embedding model: the cosine similarity of each pair's
        embeddings (one `data_1` against every `data_2`, or pairwise)."""
        first, second = (list(d) if isinstance(d, (list, tuple)) and d
                         and not isinstance(d[0], int) else [d] for d in (data_1, data_2))
        if len(first) != 1 and len(first) != len(second):
            raise ValueError(f"data_1: {len(first)} prompts for {len(second)} in data_2 (give "
                             "one, or as many)")
        embedded = self.encode(first + second, pooling_params, truncate_prompt_tokens, use_tqdm,
                               lora_request, "embed")
        left, right = embedded[:len(first)] * (len(second) // len(first)), embedded[len(first):]
        return [ScoringRequestOutput(
            f"{a.request_id}_{b.request_id}",
            ScoringOutput(_cosine_similarity(a.outputs.data, b.outputs.data)),
            a.prompt_token_ids + b.prompt_token_ids, True) for a, b in zip(left, right)]

    def classify(self, prompts: PromptType | Sequence[PromptType], *args: Any,
                 **kwargs: Any) -> list[Any]:
        raise ValueError("LLM.classify needs a sequence-classification checkpoint (a score "
                         "head): not supported; jaxserve's pooling engines embed")

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request: object | None = None,
             chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's `chat`: each conversation through the chat template (the tokenizer's, or
        `chat_template`: a template or a file), then `generate`."""
        refuse_lora(lora_request)
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("messages: this model has no tokenizer, so no chat template")
        if mm_processor_kwargs is not None:
            raise ValueError("mm_processor_kwargs is not supported: there are no multimodal "
                             "models in jaxserve")
        if chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {CONTENT_FORMATS}, "
                             f"got {chat_template_content_format!r}")
        template = None if chat_template is None else load_chat_template(chat_template)
        variables = template_variables(chat_template_kwargs)
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for c, conversation in enumerate(conversations):
            if chat_template_content_format != "openai":
                conversation = [{**m, "content": text_content(
                    m.get("content"), f"messages[{c}][{i}].content")}
                    for i, m in enumerate(conversation)]
            text = tokenizer.apply_chat_template(
                conversation, tools, chat_template=template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False, **variables)
            check_unicode(text, f"messages[{c}]")
            # The template writes the BOS itself; the output reports the rendered text.
            prompts.append({"prompt": text,
                            "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: Sequence[PromptType], params: BeamSearchParams,
                    lora_request: object | None = None, use_tqdm: bool = False,
                    ) -> list[BeamSearchOutput]:
        """vLLM's beam search over `generate` (jaxserve/entrypoints/beam_search.py)."""
        refuse_lora(lora_request)
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        processor = self.engine.input_processor
        if 2 * params.beam_width > processor.max_logprobs:
            raise ValueError(f"beam_width must be <= max_logprobs / 2 "
                             f"({processor.max_logprobs // 2}), got {params.beam_width}")
        token_prompts = [processor.tokenize(p)[1] for p in prompts]
        for i, ids in enumerate(token_prompts):
            processor.validate_token_ids(ids)
            if len(ids) + params.max_tokens > processor.max_model_len:
                raise ValueError(f"max_tokens: prompt {i} has {len(ids)} tokens; with "
                                 f"{params.max_tokens} more it exceeds max_model_len "
                                 f"({processor.max_model_len})")
        tokenizer = self.engine.tokenizer
        return beam_search(lambda batch, step: self.generate(batch, step, use_tqdm=False),
                           token_prompts, params, frozenset(processor.eos_token_ids),
                           None if tokenizer is None else tokenizer.decode)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[Any]:
        """The requests' final outputs (RequestOutput, or PoolingRequestOutput), in order."""
        wanted = set(ids)
        finished: dict[str, Any] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2)
        generated = 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step(RequestOutputKind.FINAL_ONLY):
                if out.request_id in wanted:
                    finished[out.request_id] = out
                    if isinstance(out, RequestOutput):
                        generated += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                    bar.set_postfix_str(f"{generated / max(bar.format_dict['elapsed'], 1e-9):.1f} "
                                        "output tok/s", refresh=False)
        bar.close()
        return [finished[i] for i in ids]


def _cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))
