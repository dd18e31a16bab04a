"""What completions and chat share: model check, sampling params, submitting prompts, streaming."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from jaxserve.engine.async_llm import AsyncLLM, EngineDeadError
from jaxserve.engine.input_processor import truncated
from jaxserve.entrypoints.openai.errors import APIError, bad_request
from jaxserve.entrypoints.openai.metrics import ServerMetrics
from jaxserve.entrypoints.openai.protocol import (APIRequest, ChatCompletionRequest,
                                                  ChatTemplateRequest, ChoicesResponse,
                                                  EmbeddingFields, Prompts, SamplingRequest,
                                                  UsageInfo)
from jaxserve.entrypoints.openai.structured import structured_outputs_of
from jaxserve.models.chat_template import template_variables, text_content
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

LOGGED_ITEMS = 100  # of a list or dict parameter in the request log without --max-log-len
logger = logging.getLogger(__name__)

_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                      "frequency_penalty", "repetition_penalty")
_PASSED_SAMPLING = ("n", "seed", "stop", "min_tokens", "ignore_eos", "stop_token_ids",
                    "skip_special_tokens", "include_stop_str_in_output",
                    "truncate_prompt_tokens", "bad_words", "allowed_token_ids")
SAMPLING_FIELDS = _OPTIONAL_SAMPLING + _PASSED_SAMPLING + ("max_tokens", "logprobs",
                                                          "prompt_logprobs",
                                                          "structured_outputs", "logit_bias")
_PROMPT_FIELDS = ("prompt", "prompt_token_ids", "request_id", "cache_salt")
DONE = "data: [DONE]\n\n"
# (prompt index, output) -> the choices of the chunk it streams; none: no chunk.
ChoicesOf = Callable[[int, RequestOutput], Sequence[BaseModel]]


def sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # However the response ended (done, disconnect, send error), end the generation.
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class OpenAIServing:
    """What the endpoints share. Its methods that take time in proportion to a request's size
    (sampling params, tokenising, chat templates) are called on a worker thread: on the event
    loop a large request would stall every other one (and /health) for seconds."""
    # vLLM's --enable-log-requests: each request's prompt and parameters logged at INFO, the
    # prompt cut to --max-log-len characters / token ids (None: whole)
    log_requests: bool = False
    max_log_len: int | None = None

    def __init__(self, llm: AsyncLLM, model_names: list[str], metrics: ServerMetrics,
                 chat_template: str | None = None):
        self.llm = llm
        self.chat_template = chat_template  # the server's --chat-template, over the model's
        self.model_names = model_names
        self.metrics = metrics
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        # The checkpoint's sampling defaults, for the fields a request leaves unset.
        self.sampling_defaults = llm.engine.sampling_defaults

    def check_request(self, req: APIRequest) -> None:
        """The served model (404 otherwise, as vLLM), and no field that would be ignored."""
        if req.model is not None and req.model not in self.model_names:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves "
                           f"{', '.join(repr(n) for n in self.model_names)}", "model",
                           "model_not_found")
        name = req.unsupported_field()
        if name is not None:
            value = req.stream_options if name.startswith("stream_options") else \
                getattr(req, name)
            raise APIError(400, f"{name} is not supported by jaxserve (got {value!r})", name,
                           "unsupported")
        if isinstance(req, SamplingRequest) and req.stream_options is not None \
                and not req.stream:
            raise APIError(400, "stream_options can only be given with stream=true",
                           "stream_options")

    def check_chars(self, text: str, param: str) -> None:
        try:
            self.llm.engine.input_processor.check_prompt_chars(text, param)
        except ValueError as exc:
            raise APIError(400, str(exc), param, "context_length_exceeded") from None

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        self.check_chars(text, param)
        return self.tokenizer.encode(text, add_special_tokens)

    def render_chat(self, req: ChatCompletionRequest | ChatTemplateRequest,
                          tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The request's messages' token ids through the tokenizer's chat template, with its
        add_generation_prompt, continue_final_message and chat_template_kwargs."""
        if not req.messages:
            raise APIError(400, "messages must not be empty", "messages")
        if self.tokenizer is None:
            raise APIError(400, "messages: this model has no tokenizer, so no chat template",
                           "messages")
        conversation: list[dict[str, Any]] = []
        for i, m in enumerate(req.messages):
            content = m.content if not isinstance(m.content, list) else [
                p.model_dump(exclude_none=True) for p in m.content]
            try:
                conversation.append({"role": m.role, "content": text_content(
                    content, f"messages.{i}.content")})
            except ValueError as exc:
                raise APIError(400, str(exc), f"messages.{i}.content", "unsupported") from None
        self.check_chars("".join(m["content"] for m in conversation), "messages")
        try:
            variables = template_variables(req.chat_template_kwargs)
        except ValueError as exc:
            raise APIError(400, str(exc), "chat_template_kwargs") from None
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tools, chat_template=self.chat_template,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, tokenize=False,
                **variables)
        except Exception as exc:  # noqa: BLE001 (a template error is the request's fault)
            raise APIError(400, f"messages: the chat template failed: {exc}", "messages") \
                from None
        # Checked again as rendered: many empty messages make a long text. The template
        # writes the BOS itself.
        return self.encode(text, "messages", add_special_tokens=False)

    def tokenized_prompts(self, prompt: Prompts, param: str, add_special_tokens: bool,
                          fit: Callable[[list[int]], list[int]]) -> list[dict[str, Any]]:
        """Each prompt of `prompt` (one or a list, text or token ids) as the engine takes it,
        its token ids through `fit` (truncation and the context check)."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            items: list[Any] = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise APIError(400, f"{param} must not be empty", param)
        if len(items) > self.llm.max_queued_requests:  # refused before any is tokenised
            raise APIError(400, f"{param}: {len(items)} prompts are more than this server "
                           f"queues at once (max_queued_requests="
                           f"{self.llm.max_queued_requests})", param)
        prompts = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise APIError(400, f"{param} must not be empty", param)
                if self.tokenizer is None:
                    raise APIError(400, f"{param}: this model has no tokenizer; send token "
                                   "ids", param)
                ids = self.encode(item, param, add_special_tokens)
                prompts.append({"prompt": item, "prompt_token_ids": fit(ids)})
            else:
                prompts.append({"prompt_token_ids": fit(list(item))})
        return prompts

    def fit(self, token_ids: list[int], req: SamplingRequest | EmbeddingFields, param: str,
            max_tokens: int | None) -> list[int]:
        """The prompt as the engine will see it (truncate_prompt_tokens applied), checked to
        fit the context with `max_tokens`."""
        token_ids = truncated(token_ids, req.truncate_prompt_tokens, self.max_model_len)
        self.check_length(token_ids, param, max_tokens)
        return token_ids

    def check_length(self, token_ids: list[int], param: str, max_tokens: int | None) -> None:
        """The prompt and `max_tokens` must fit the context (vLLM answers 400, not a clipped
        output); `max_tokens=None` asks for whatever room is left."""
        if len(token_ids) >= self.max_model_len:
            raise APIError(400, f"{param}: the prompt has {len(token_ids)} tokens, but this "
                           f"model's context length is {self.max_model_len} (the prompt must "
                           "leave room for at least one generated token)", param,
                           "context_length_exceeded")
        if max_tokens is not None and len(token_ids) + max_tokens > self.max_model_len:
            raise APIError(400, f"max_tokens: this model's context length is "
                           f"{self.max_model_len} tokens, but {len(token_ids) + max_tokens} were "
                           f"asked for ({len(token_ids)} in the {param}, {max_tokens} in the "
                           "completion); reduce the prompt or max_tokens", "max_tokens",
                           "context_length_exceeded")

    def sampling_params(self, req: SamplingRequest, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        ) -> SamplingParams:
        kwargs: dict[str, Any] = {name: getattr(req, name) for name in _PASSED_SAMPLING}
        for name in _OPTIONAL_SAMPLING:
            value = getattr(req, name)
            value = self.sampling_defaults.get(name) if value is None else value
            if value is not None:
                kwargs[name] = value
        if max_tokens is None:  # the default, cut to the room the prompt leaves by the engine
            max_tokens = self.sampling_defaults.get("max_tokens")
        kwargs["structured_outputs"] = structured_outputs_of(req)
        if req.logit_bias:  # JSON keys are strings: OpenAI's token ids
            try:
                kwargs["logit_bias"] = {int(t): b for t, b in req.logit_bias.items()}
            except ValueError:
                raise bad_request(ValueError(f"logit_bias: keys must be token ids, got "
                                             f"{sorted(req.logit_bias)[:3]!r}"),
                                  fields=SAMPLING_FIELDS) from None
        try:
            return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                                  prompt_logprobs=prompt_logprobs,
                                  output_kind=RequestOutputKind.DELTA, **kwargs)
        except ValueError as exc:
            raise bad_request(exc, fields=SAMPLING_FIELDS) from None

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def start(self, request_id: str, prompts: list[dict[str, Any]], params: SamplingParams,
                    req: SamplingRequest) -> list[AsyncIterator[RequestOutput]]:
        """Submit every prompt and wait for each one's first output, so that a bad prompt
        fails the whole request before any byte of the response is sent."""
        if self.log_requests:
            cut = self.max_log_len
            for i, p in enumerate(prompts):
                logger.info("request %s-%d: prompt %r, prompt_token_ids %s, params %s",
                            request_id, i, (p.get("prompt") or "")[:cut],
                            (p.get("prompt_token_ids") or [])[:cut], logged_params(params, cut))
        gens = [self.llm.generate(p, params, f"{request_id}-{i}", priority=req.priority,
                                  cache_salt=req.cache_salt) for i, p in enumerate(prompts)]
        try:
            firsts = await asyncio.gather(*(anext(g) for g in gens), return_exceptions=True)
        except asyncio.CancelledError:  # the client went away before the first token
            self.metrics.count_finished("abort", params.n * len(gens))
            raise
        errors = [f for f in firsts if isinstance(f, BaseException)]
        if errors:
            await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
            if isinstance(errors[0], ValueError):
                raise bad_request(errors[0], fields=SAMPLING_FIELDS + _PROMPT_FIELDS) from None
            raise errors[0]
        return [_prepend(first, gen) for first, gen in zip(firsts, gens)]

    async def stream(self, request_id: str, model: str,
                     gens: list[AsyncIterator[RequestOutput]], n: int, req: SamplingRequest,
                     chunk: type[ChoicesResponse], choices_of: ChoicesOf,
                     head: Sequence[BaseModel] = ()) -> AsyncIterator[str]:
        """A streamed response's events: `head` (choices sent before any output), a `chunk`
        of `choices_of` each output, the usage chunk when stream_options asks for it, and
        [DONE]; a failure after the 200 went out is the event before [DONE]."""
        trackers = [self.metrics.tracker(n) for _ in gens]
        prompt_tokens = completion_tokens = 0
        seen: set[int] = set()
        try:
            if head:
                yield sse(chunk(id=request_id, model=model, choices=head))
            async for i, out in merge(gens):
                trackers[i].observe(out)
                if i not in seen:
                    seen.add(i)
                    prompt_tokens += len(out.prompt_token_ids)
                completion_tokens += sum(len(comp.token_ids) for comp in out.outputs)
                choices = choices_of(i, out)
                if choices:
                    yield sse(chunk(id=request_id, model=model, choices=choices))
            if req.stream_options and req.stream_options.include_usage:
                yield sse(chunk(id=request_id, model=model, choices=[],
                                usage=usage(prompt_tokens, completion_tokens)))
        except Exception as exc:  # noqa: BLE001 (the status line has gone out already)
            yield stream_error(exc)
        finally:
            for tracker in trackers:
                tracker.close()
        yield DONE


async def _prepend(first: RequestOutput, gen: AsyncIterator[RequestOutput],
                   ) -> AsyncIterator[RequestOutput]:
    try:
        yield first
        if not first.finished:
            async for out in gen:
                yield out
    finally:
        await gen.aclose()  # type: ignore[attr-defined]


async def merge(gens: list[AsyncIterator[RequestOutput]],
                ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several prompts as they come, tagged with the prompt's index."""
    if len(gens) == 1:
        try:
            async for out in gens[0]:
                yield 0, out
        finally:
            await gens[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 (re-raised by the consumer)
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def logged_params(params: SamplingParams, cut: int | None) -> str:
    """`params` as the request log shows them: a list or dict field cut to `cut` items (to
    LOGGED_ITEMS without --max-log-len). A request may carry millions of stop ids: its whole
    repr took seconds on the event loop."""
    limit = LOGGED_ITEMS if cut is None else cut
    shown = []
    for field in dataclasses.fields(params):
        value = getattr(params, field.name)
        if isinstance(value, (list, tuple, dict)) and len(value) > limit:
            head = itertools.islice(value.items() if isinstance(value, dict) else value, limit)
            text = f"[{', '.join(map(repr, head))}, ...] ({len(value)} in all)"
        else:
            text = repr(value)
        shown.append(f"{field.name}={text}")
    return f"SamplingParams({', '.join(shown)})"


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def stream_error(exc: Exception) -> str:
    """The last event of a stream that failed after its 200 was sent."""
    error = exc if isinstance(exc, APIError) else APIError(
        503 if isinstance(exc, EngineDeadError) else 500, f"{type(exc).__name__}: {exc}")
    return f"data: {error.body().model_dump_json()}\n\n"


async def cancel_on_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run the handler's work, cancelling it if the client goes away first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait((task,))  # let the generations it started abort
    return Response(status_code=499)  # "client closed request": nobody reads this
