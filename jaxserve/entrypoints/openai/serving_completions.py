"""`POST /v1/completions`: one or more prompts (text or token ids), streamed or not."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response

from jaxserve.entrypoints.openai.errors import APIError
from jaxserve.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs,
                                                  CompletionRequest, CompletionResponse,
                                                  LogprobEntry)
from jaxserve.entrypoints.openai.serving_common import OpenAIServing, SSEResponse, merge, usage
from jaxserve.outputs import PromptLogprobs, RequestOutput, SampleLogprobs


class _Choice:
    """One choice of a non-streamed response, assembled from deltas."""

    def __init__(self, text: str, want_logprobs: bool):
        self.text = text
        self.token_ids: list[int] = []
        self.logprobs = CompletionLogprobs() if want_logprobs else None
        self.offset = 0  # of the next token's text, for logprobs.text_offset
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.prompt_logprobs: PromptLogprobs | None = None


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest) -> Response:
        self.check_request(req)
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, f"best_of must equal n ({req.n}) here, got {req.best_of}",
                           "best_of", "unsupported")
        if req.logprobs is not None and req.logprobs < 0:  # OpenAI's; SamplingParams takes -1
            raise APIError(400, f"logprobs must be >= 0, got {req.logprobs}", "logprobs")
        scores_prompt = req.echo and req.logprobs is not None
        if scores_prompt and req.stream:
            raise APIError(400, "echo with logprobs is not supported when streaming", "echo",
                           "unsupported")
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "prompt_logprobs is not supported when streaming",
                           "prompt_logprobs", "unsupported")
        if scores_prompt and req.prompt_logprobs not in (None, req.logprobs):
            raise APIError(400, f"prompt_logprobs must equal logprobs ({req.logprobs}) with "
                           f"echo, got {req.prompt_logprobs}", "prompt_logprobs")
        # echo with max_tokens=0 (an evaluation harness's log-likelihood request): the prompt
        # alone; the engine samples one token, which is not returned.
        prompt_only = req.echo and req.max_tokens == 0
        params = await asyncio.to_thread(
            self.sampling_params, req, 1 if prompt_only else req.max_tokens, req.logprobs,
            req.logprobs if scores_prompt else req.prompt_logprobs)
        prompts, echoes = await asyncio.to_thread(self._prompts, req)
        request_id = f"cmpl-{req.request_id or uuid.uuid4().hex}"
        gens = await self.start(request_id, prompts, params, req)
        model = req.model or self.model_names[0]
        if req.stream:
            return SSEResponse(self._stream(request_id, model, gens, params.n, echoes, req))
        return JSONResponse((await self._collect(request_id, model, gens, params.n, echoes,
                                                 req)).model_dump())

    def _prompts(self, req: CompletionRequest) -> tuple[list[dict[str, Any]], list[str]]:
        """The prompts as the engine takes them, and the text each echoes."""
        prompts = self.tokenized_prompts(req.prompt, "prompt", req.add_special_tokens,
                                         lambda ids: self.fit(ids, req, "prompt",
                                                              req.max_tokens))
        return prompts, [self._prompt_text(p) if req.echo else "" for p in prompts]

    def _prompt_text(self, prompt: dict[str, Any]) -> str:
        if "prompt" in prompt:
            return prompt["prompt"]
        return "" if self.tokenizer is None else self.tokenizer.decode(prompt["prompt_token_ids"])

    def _logprobs(self, token_ids: list[int], entries: SampleLogprobs, offset: int,
                  ) -> tuple[CompletionLogprobs, int]:
        lp = CompletionLogprobs()
        for token_id, entry in zip(token_ids, entries):
            text = self.token_text(token_id)
            top = {self.token_text(t): v.logprob for t, v in entry.items()}
            lp.tokens.append(text)
            lp.token_logprobs.append(entry[token_id].logprob)
            lp.top_logprobs.append(top)
            lp.text_offset.append(offset)
            offset += len(text)
        return lp, offset

    def _prompt_logprobs(self, lp: CompletionLogprobs, prompt_ids: list[int],
                         entries: PromptLogprobs) -> int:
        """The echoed prompt's tokens in `lp` (the first has no logprob, as OpenAI's); returns
        the text offset after them."""
        offset = 0
        for token_id, entry in zip(prompt_ids, entries):
            text = self.token_text(token_id)
            lp.tokens.append(text)
            lp.token_logprobs.append(None if entry is None else entry[token_id].logprob)
            lp.top_logprobs.append(None if entry is None else {
                self.token_text(t): v.logprob for t, v in entry.items()})
            lp.text_offset.append(offset)
            offset += len(text)
        return offset

    def _stream(self, request_id: str, model: str, gens: list[AsyncIterator[RequestOutput]],
                n: int, echoes: list[str], req: CompletionRequest) -> AsyncIterator[str]:
        want_logprobs = req.logprobs is not None
        pending_echo = {i * n + j: echoes[i] for i in range(len(gens)) for j in range(n)
                        if echoes[i]}
        offsets: dict[int, int] = {}

        def choices(i: int, out: RequestOutput) -> list[CompletionChoice]:
            chosen = []
            for comp in out.outputs:
                index = i * n + comp.index
                text = pending_echo.pop(index, "") + comp.text
                logprobs = None
                if want_logprobs and comp.logprobs:
                    logprobs, offsets[index] = self._logprobs(
                        comp.token_ids, comp.logprobs, offsets.get(index, 0))
                if text or logprobs or comp.finish_reason or (
                        req.return_token_ids and comp.token_ids):
                    chosen.append(CompletionChoice(
                        index=index, text=text, logprobs=logprobs,
                        finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                        token_ids=comp.token_ids if req.return_token_ids else None))
            return chosen

        return self.stream(request_id, model, gens, n, req, CompletionResponse, choices)

    async def _collect(self, request_id: str, model: str,
                       gens: list[AsyncIterator[RequestOutput]], n: int, echoes: list[str],
                       req: CompletionRequest) -> CompletionResponse:
        choices = {i * n + j: _Choice(echoes[i], req.logprobs is not None)
                   for i in range(len(gens)) for j in range(n)}
        trackers = [self.metrics.tracker(n) for _ in gens]
        prompt_tokens = 0
        try:
            async for i, out in merge(gens):
                trackers[i].observe(out)
                if out.finished:
                    prompt_tokens += len(out.prompt_token_ids)
                for comp in out.outputs:
                    choice = choices[i * n + comp.index]
                    if req.prompt_logprobs is not None and out.prompt_logprobs is not None:
                        choice.prompt_logprobs = out.prompt_logprobs
                    if out.prompt_logprobs is not None and choice.logprobs is not None \
                            and not choice.logprobs.tokens:
                        choice.offset = self._prompt_logprobs(
                            choice.logprobs, out.prompt_token_ids, out.prompt_logprobs)
                    if req.echo and req.max_tokens == 0:
                        choice.finish_reason = "length"
                        continue
                    choice.text += comp.text
                    choice.token_ids.extend(comp.token_ids)
                    if choice.logprobs is not None and comp.logprobs:
                        lp, choice.offset = self._logprobs(comp.token_ids, comp.logprobs,
                                                           choice.offset)
                        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                            getattr(choice.logprobs, name).extend(getattr(lp, name))
                    if comp.finish_reason is not None:
                        choice.finish_reason, choice.stop_reason = (comp.finish_reason,
                                                                    comp.stop_reason)
        finally:
            for tracker in trackers:
                tracker.close()
        return CompletionResponse(
            id=request_id, model=model,
            choices=[CompletionChoice(index=k, text=c.text, logprobs=c.logprobs,
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                      token_ids=c.token_ids if req.return_token_ids else None,
                                      prompt_logprobs=_entries(c.prompt_logprobs))
                     for k, c in sorted(choices.items())],
            usage=usage(prompt_tokens, sum(len(c.token_ids) for c in choices.values())))


def _entries(prompt_logprobs: PromptLogprobs | None,
             ) -> list[dict[int, LogprobEntry] | None] | None:
    if prompt_logprobs is None:
        return None
    return [None if e is None else {t: LogprobEntry(logprob=lp.logprob, rank=lp.rank,
                                                    decoded_token=lp.decoded_token)
                                    for t, lp in e.items()} for e in prompt_logprobs]
