"""Output processing: detokenise incrementally, apply stop strings, build `RequestOutput`s."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from jaxserve.core.scheduler_output import EngineCoreOutput
from jaxserve.engine.logprobs import prompt_logprobs_of, sample_logprobs
from jaxserve.models.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxserve.outputs import (CompletionOutput, PoolingOutput, PoolingRequestOutput,
                              PromptLogprobs, RequestMetrics, RequestOutput)
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _Sample:
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer | None
    sent_tokens: int = 0  # for delta outputs: what the consumer has already received
    sent_text: int = 0
    sent_finish: bool = False  # a delta output carried its finish_reason: it is done


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    samples: list[_Sample]
    num_cached_tokens: int = 0
    child_index: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    sent_prompt_logprobs: bool = False  # delta outputs carry them once
    pooling: PoolingParams | None = None  # a pooling request: its output is its embedding
    pooled: Any = None  # np.ndarray f32[D]: its last token's hidden state, once computed

    @property
    def finished(self) -> bool:
        return all(s.completion.finished() for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.parent_of: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float, child_ids: list[str],
                    pooling: PoolingParams | None = None) -> None:
        if request_id in self.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        samples = [_Sample(CompletionOutput(i, "", [], 0.0 if params.logprobs is not None else None,
                                            [] if params.logprobs is not None else None),
                           self._detokenizer(prompt_token_ids, params))
                   for i in range(len(child_ids))]
        self.states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, RequestMetrics(arrival_time), samples,
            child_index={c: i for i, c in enumerate(child_ids)}, pooling=pooling)
        self.parent_of.update((c, request_id) for c in child_ids)

    def _detokenizer(self, prompt_token_ids: list[int],
                     params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None or not params.detokenize:
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                      skip_special_tokens=params.skip_special_tokens)

    def child_ids(self, request_id: str) -> list[str]:
        state = self.states.get(request_id)
        return [] if state is None else list(state.child_index)

    def process_outputs(self, outputs: list[EngineCoreOutput],
                        output_kind: RequestOutputKind | None = None,
                        ) -> tuple[list[RequestOutput | PoolingRequestOutput], list[str]]:
        """Returns the updated requests' outputs, of `output_kind` (None: each request's own),
        and the child ids that a stop string ended (the caller must stop them in the
        scheduler). FINAL_ONLY requests have an output only once they are finished."""
        now = time.time()
        touched: dict[str, RequestState] = {}
        stopped: list[str] = []
        for out in outputs:
            parent = self.parent_of.get(out.request_id)
            if parent is None:
                continue
            state = self.states[parent]
            sample = state.samples[state.child_index[out.request_id]]
            comp = sample.completion
            if comp.finished():
                continue
            state.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = prompt_logprobs_of(
                    out.prompt_logprobs, state.prompt_token_ids, state.params.prompt_logprobs,
                    self.tokenizer)
            if out.pooled is not None:
                state.pooled = out.pooled
            metrics = state.metrics
            if out.new_token_ids and metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            if self._add_tokens(state, sample, out, now):
                stopped.append(out.request_id)
            if out.finish_reason is not None and not comp.finished():
                comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason
                state.error = state.error or out.error
            touched[parent] = state
        results = []
        for parent, state in touched.items():
            if state.finished:
                state.metrics.finished_time = now
                del self.states[parent]
                for child in state.child_index:
                    self.parent_of.pop(child, None)
            kind = state.params.output_kind if output_kind is None else output_kind
            if kind != RequestOutputKind.FINAL_ONLY or state.finished:
                results.append(self._make_output(state, kind == RequestOutputKind.DELTA))
        return results, stopped

    def _add_tokens(self, state: RequestState, sample: _Sample, out: EngineCoreOutput,
                    now: float) -> bool:
        """Add the output's tokens one at a time (several come from one speculative step), so a
        stop string ends the text, the ids and the logprobs at the token that completed it.
        True when a stop string did."""
        comp = sample.completion
        tokenizer = self.tokenizer if state.params.detokenize else None
        for i, token in enumerate(out.new_token_ids):
            state.metrics.token_times.append(now)
            comp.token_ids.append(token)
            if comp.logprobs is not None:
                lp = out.new_logprobs[i]
                comp.logprobs.append(sample_logprobs(lp, tokenizer))
                comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + lp.logprob
            if sample.detokenizer is None:
                continue
            before = len(comp.text)
            comp.text += sample.detokenizer.push([token])
            if out.finish_reason is not None and i == len(out.new_token_ids) - 1:
                comp.text += sample.detokenizer.flush()
            # As vLLM: stop strings count only once min_tokens tokens are out.
            if len(comp.token_ids) > state.params.min_tokens and self._apply_stop_strings(
                    comp, state.params, before):
                return True
        return False

    @staticmethod
    def _apply_stop_strings(comp: CompletionOutput, params: SamplingParams, before: int) -> bool:
        for stop in params.stop:
            idx = comp.text.find(stop, max(0, before - len(stop) + 1))
            if idx >= 0:
                comp.text = comp.text[:idx + len(stop) if params.include_stop_str_in_output
                                      else idx]
                comp.finish_reason, comp.stop_reason = "stop", stop
                return True
        return False

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns its child ids (to abort in the scheduler)."""
        state = self.states.pop(request_id, None)
        if state is None:
            return []
        for child in state.child_index:
            self.parent_of.pop(child, None)
        return list(state.child_index)

    def _make_output(self, state: RequestState, delta: bool,
                     ) -> RequestOutput | PoolingRequestOutput:
        if state.pooling is not None:
            return PoolingRequestOutput(
                state.request_id,
                PoolingOutput(None if state.pooled is None else state.pooling.pool(state.pooled)),
                state.prompt_token_ids, state.finished, state.prompt, state.num_cached_tokens,
                state.error)
        completions = []
        holdback = max((len(stop) for stop in state.params.stop), default=1) - 1
        for sample in state.samples:
            comp = sample.completion
            if delta:
                if sample.sent_finish:
                    continue  # a finished sample has nothing new: it is sent once
                # Hold back a possible stop-string prefix: it may still be cut from the text.
                text_end = len(comp.text) if comp.finished() else max(
                    sample.sent_text, len(comp.text) - holdback)
                d = CompletionOutput(comp.index, comp.text[sample.sent_text:text_end],
                                     comp.token_ids[sample.sent_tokens:], comp.cumulative_logprob,
                                     None if comp.logprobs is None
                                     else comp.logprobs[sample.sent_tokens:],
                                     comp.finish_reason, comp.stop_reason)
                sample.sent_text, sample.sent_tokens = text_end, len(comp.token_ids)
                sample.sent_finish = comp.finished()
                comp = d
            completions.append(comp)
        prompt_logprobs = state.prompt_logprobs
        if delta:
            prompt_logprobs = None if state.sent_prompt_logprobs else prompt_logprobs
            state.sent_prompt_logprobs = state.sent_prompt_logprobs or prompt_logprobs is not None
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, completions,
                             state.finished, state.metrics, state.num_cached_tokens, state.error,
                             prompt_logprobs)
