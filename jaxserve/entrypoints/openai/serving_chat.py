"""`POST /v1/chat/completions`: messages through the tokenizer's chat template, streamed or not."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response

from jaxserve.engine.logprobs import top_logprobs
from jaxserve.entrypoints.openai.errors import APIError
from jaxserve.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk,
                                                  ChatCompletionRequest, ChatCompletionResponse,
                                                  ChatLogprobs, ChatMessageOut,
                                                  ChatStreamChoice, DeltaMessage, TokenLogprob,
                                                  TopLogprob)
from jaxserve.entrypoints.openai.serving_common import OpenAIServing, SSEResponse, merge, usage
from jaxserve.entrypoints.openai.structured import tool_mode
from jaxserve.entrypoints.openai.tool_calls import parse_tool_calls, tool_call_deltas
from jaxserve.outputs import CompletionOutput, RequestOutput

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


class OpenAIServingChat(OpenAIServing):
    # vLLM's --response-role: the role of a reply to a generation prompt
    response_role: str = "assistant"
    # vLLM's --tool-call-parser: the one format `auto` tool calls are read in (None: any)
    tool_call_parser: str | None = None

    def role(self, req: ChatCompletionRequest) -> str:
        """The reply's role: the server's response role, or, continuing the conversation
        without a generation prompt, the last message's (as vLLM does)."""
        if req.add_generation_prompt or not req.messages:
            return self.response_role
        return req.messages[-1].role

    async def create(self, req: ChatCompletionRequest) -> Response:
        self.check_request(req)
        top = req.top_logprobs
        if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}",
                           "top_logprobs")
        if top is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        params = await asyncio.to_thread(self.sampling_params, req, max_tokens,
                                         (top or 0) if req.logprobs else None)
        prompt_ids = await asyncio.to_thread(self._prompt, req, max_tokens)
        request_id = f"chatcmpl-{req.request_id or uuid.uuid4().hex}"
        gens = await self.start(request_id, [{"prompt_token_ids": prompt_ids}], params, req)
        model = req.model or self.model_names[0]
        if req.stream:
            return SSEResponse(self._stream(request_id, model, gens[0], params.n, req))
        return JSONResponse((await self._collect(request_id, model, gens[0], params.n,
                                                 req)).model_dump())

    def _prompt(self, req: ChatCompletionRequest, max_tokens: int | None) -> list[int]:
        return self.fit(self.render_chat(req, req.tools), req, "messages", max_tokens)

    def _logprobs(self, comp: CompletionOutput, num_top: int) -> ChatLogprobs:
        def entry(token_id: int, logprob: float) -> TopLogprob:
            text = self.token_text(token_id)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

        content = []
        for token_id, e in zip(comp.token_ids, comp.logprobs or []):
            head = entry(token_id, e[token_id].logprob)
            content.append(TokenLogprob(**head.model_dump(), top_logprobs=[
                entry(t, v) for t, v in top_logprobs(e, num_top)]))
        return ChatLogprobs(content=content)

    def _stream(self, request_id: str, model: str, gen: AsyncIterator[RequestOutput], n: int,
                req: ChatCompletionRequest) -> AsyncIterator[str]:
        # With tools, a choice's text is held back until it ends: only then is it known to be
        # content or tool calls (each sent whole in one delta).
        mode = tool_mode(req)
        held = [""] * n

        def choices(_: int, out: RequestOutput) -> list[ChatStreamChoice]:
            chosen = []
            for comp in out.outputs:
                logprobs = (self._logprobs(comp, req.top_logprobs or 0)
                            if req.logprobs and comp.logprobs else None)
                delta, finish = DeltaMessage(content=comp.text or None), comp.finish_reason
                if mode != "none":
                    held[comp.index] += comp.text
                    delta = DeltaMessage()
                    if finish is not None:
                        content, calls = parse_tool_calls(held[comp.index], mode, req,
                                                          self.tool_call_parser)
                        delta = DeltaMessage(content=content,
                                             tool_calls=tool_call_deltas(calls) or None)
                        finish = "tool_calls" if calls and finish == "stop" else finish
                if delta.content or delta.tool_calls or logprobs or finish or (
                        req.return_token_ids and comp.token_ids):
                    chosen.append(ChatStreamChoice(
                        index=comp.index, delta=delta,
                        logprobs=logprobs, finish_reason=finish,
                        stop_reason=comp.stop_reason,
                        token_ids=comp.token_ids if req.return_token_ids else None))
            return chosen

        head = [ChatStreamChoice(index=i, delta=DeltaMessage(role=self.role(req), content=""))
                for i in range(n)]
        return self.stream(request_id, model, [gen], n, req, ChatCompletionChunk, choices, head)

    async def _collect(self, request_id: str, model: str, gen: AsyncIterator[RequestOutput],
                       n: int, req: ChatCompletionRequest) -> ChatCompletionResponse:
        tracker = self.metrics.tracker(n)
        texts, token_ids = [""] * n, [[] for _ in range(n)]
        logprobs = [ChatLogprobs(content=[]) if req.logprobs else None for _ in range(n)]
        reasons: list[tuple[str | None, int | str | None]] = [(None, None)] * n
        prompt_tokens = 0
        try:
            async for _, out in merge([gen]):
                tracker.observe(out)
                prompt_tokens = len(out.prompt_token_ids)
                for comp in out.outputs:
                    i = comp.index
                    texts[i] += comp.text
                    token_ids[i].extend(comp.token_ids)
                    if logprobs[i] is not None and comp.logprobs:
                        logprobs[i].content.extend(
                            self._logprobs(comp, req.top_logprobs or 0).content)
                    if comp.finish_reason is not None:
                        reasons[i] = (comp.finish_reason, comp.stop_reason)
        finally:
            tracker.close()
        role = self.role(req)
        messages = [ChatMessageOut(role=role, content=text) for text in texts]
        mode = tool_mode(req)
        if mode != "none":
            for i, text in enumerate(texts):
                content, calls = parse_tool_calls(text, mode, req, self.tool_call_parser)
                messages[i] = ChatMessageOut(role=role, content=content, tool_calls=calls or None)
                if calls and reasons[i][0] == "stop":
                    reasons[i] = ("tool_calls", reasons[i][1])
        return ChatCompletionResponse(
            id=request_id, model=model,
            choices=[ChatChoice(index=i, message=messages[i],
                                logprobs=logprobs[i], finish_reason=reasons[i][0],
                                stop_reason=reasons[i][1],
                                token_ids=token_ids[i] if req.return_token_ids else None)
                     for i in range(n)],
            usage=usage(prompt_tokens, sum(len(t) for t in token_ids)))
