"""The FastAPI app (`build_app`), its uvicorn runners, and API-key checking."""

from __future__ import annotations

import hmac
import importlib.metadata
import ipaddress
import logging
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.body import ParsedBodyRoute, parse_body
from jaxserve.entrypoints.openai.errors import (APIError, document_errors_as_answered,
                                                error_responses, install_error_handlers)
from jaxserve.entrypoints.openai.limits import (DEFAULT_MAX_BODY_BYTES, DEFAULT_READ_TIMEOUT_S,
                                                RequestLimitsMiddleware, timed_h11)
from jaxserve.entrypoints.openai.metrics import ServerMetrics
from jaxserve.entrypoints.openai import API_KEY_ENV
from jaxserve.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                                  CompletionRequest, CompletionResponse,
                                                  DetokenizeRequest, DetokenizeResponse,
                                                  EmbeddingChatRequest, EmbeddingRequest,
                                                  EmbeddingResponse, ModelCard, ModelList,
                                                  TokenizeChatRequest,
                                                  TokenizeCompletionRequest, TokenizeResponse,
                                                  VersionResponse)
from jaxserve.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxserve.entrypoints.openai.serving_common import cancel_on_disconnect
from jaxserve.entrypoints.openai.serving_completions import OpenAIServingCompletion
from jaxserve.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from jaxserve.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from jaxserve.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on every route but `open_paths` (a plain ASGI middleware,
    so that streamed responses and client disconnects pass through untouched)."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "missing or invalid API key (send 'Authorization: "
                                 "Bearer <key>')", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(llm: AsyncLLM, served_model_names: list[str], api_key: str | None = None, *,
              open_metrics: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
              chat_template: str | None = None,
              allowed_origins: list[str] | None = None,
              response_role: str = "assistant",
              tool_call_parser: str | None = None, log_requests: bool = False,
              max_log_len: int | None = None) -> FastAPI:
    """With `api_key`, every route but /health and /ping needs it (/metrics too unless
    `open_metrics`). `chat_template` replaces the model's for every chat request;
    `allowed_origins`, the origins browsers may call from (CORS), none by default."""
    if not served_model_names:
        raise ValueError("served_model_names must name at least one model")
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) \
            or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
    if not read_timeout_s > 0:
        raise ValueError(f"read_timeout_s must be > 0, got {read_timeout_s!r}")
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_CALL_PARSERS)}, "
                         f"got {tool_call_parser!r}")
    app = FastAPI(title="jaxserve", summary="OpenAI-compatible API over jaxserve")
    app.router.route_class = ParsedBodyRoute
    metrics = ServerMetrics(llm, served_model_names[0])
    completions = OpenAIServingCompletion(llm, served_model_names, metrics)
    chat = OpenAIServingChat(llm, served_model_names, metrics, chat_template)
    chat.response_role, chat.tool_call_parser = response_role, tool_call_parser
    for serving in (completions, chat):
        serving.log_requests, serving.max_log_len = log_requests, max_log_len
    tokenization = OpenAIServingTokenization(llm, served_model_names, metrics, chat_template)
    embedding = OpenAIServingEmbedding(llm, served_model_names, metrics)
    install_error_handlers(app)
    app.add_middleware(RequestLimitsMiddleware, max_body_bytes=max_body_bytes,
                       read_timeout_s=read_timeout_s)
    if api_key:  # outside the limits: an unauthorised body is never read
        open_paths = frozenset({"/health", "/ping"} | ({"/metrics"} if open_metrics
                                                       else set()))
        app.add_middleware(APIKeyMiddleware, api_key=api_key, open_paths=open_paths)
    if allowed_origins:  # outermost of all: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.state.llm, app.state.metrics = llm, metrics

    keyed = (401,) if api_key else ()
    body_errors = error_responses(400, *keyed, 404, 405, 408, 413, 500, 503)

    health_doc = error_responses(405, 503) | {
        200: {"description": "The engine is running (empty body)", "content": {}}}

    @app.get("/health", response_class=Response, responses=health_doc)
    async def health() -> Response:
        if not llm.is_running:
            raise APIError(503, "the engine loop has stopped", code="engine_dead")
        return Response(status_code=200)

    # vLLM's /ping (SageMaker's health check): /health by another name; POST is accepted
    # too but left out of the document (a body-less POST has nothing to describe).
    app.add_api_route("/ping", health, methods=["GET"], name="ping",
                      response_class=Response, responses=health_doc)
    app.add_api_route("/ping", health, methods=["POST"], name="ping_post",
                      include_in_schema=False)

    @app.get("/version", responses=error_responses(*keyed, 405))
    async def version() -> VersionResponse:
        return VersionResponse(version=importlib.metadata.version("jaxserve"))

    @app.post("/tokenize", responses=error_responses(400, *keyed, 404, 405, 413))
    async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest,
                       ) -> TokenizeResponse:
        return await tokenization.tokenize(req)

    @app.post("/detokenize", responses=error_responses(400, *keyed, 404, 405, 413))
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        return await tokenization.detokenize(req)

    @app.get("/v1/models", responses=error_responses(*keyed, 405))
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, max_model_len=llm.max_model_len)
                               for name in served_model_names])

    @app.get("/metrics", response_class=Response, responses=error_responses(
        *(() if open_metrics else keyed), 405) | {200: {"description": "Prometheus metrics",
                                                      "content": {CONTENT_TYPE_LATEST: {}}}})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", response_class=Response,
              responses=body_errors | _generation_reply(CompletionResponse))
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        return await cancel_on_disconnect(raw, completions.create(req))

    @app.post("/v1/chat/completions", response_class=Response,
              responses=body_errors | _generation_reply(ChatCompletionResponse))
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        return await cancel_on_disconnect(raw, chat.create(req))

    @app.post("/v1/embeddings", responses=body_errors)
    async def create_embedding(req: EmbeddingRequest | EmbeddingChatRequest, raw: Request,
                               ) -> EmbeddingResponse:
        return await cancel_on_disconnect(raw, embedding.create(req))

    either = {"anyOf": [{"$ref": "#/components/schemas/CompletionRequest"},
                        {"$ref": "#/components/schemas/ChatCompletionRequest"}]}

    @app.post("/invocations", response_class=Response, openapi_extra={"requestBody": {
        "required": True, "content": {"application/json": {"schema": either}}}},
        responses=body_errors | _generation_reply(CompletionResponse | ChatCompletionResponse))
    async def invocations(raw: Request) -> Response:
        """vLLM's (SageMaker's) one route: a chat body (with messages) or a completion body."""
        req = await parse_body(await raw.body(), _chat_or_completion)
        serving = chat if isinstance(req, ChatCompletionRequest) else completions
        return await cancel_on_disconnect(raw, serving.create(req))

    document_errors_as_answered(app)
    return app


def _chat_or_completion(body: Any) -> ChatCompletionRequest | CompletionRequest:
    if isinstance(body, dict) and "messages" in body:
        return ChatCompletionRequest.model_validate(body)
    return CompletionRequest.model_validate(body)


def _generation_reply(model: type) -> dict[int | str, dict[str, Any]]:
    """200: the response body as JSON, or (with stream) server-sent events of chunks."""
    return {200: {"model": model, "description": "The completion, or its stream of events",
                  "content": {"text/event-stream": {}}}}


class BackgroundServer:
    """uvicorn serving `app` from a daemon thread (tests, benchmarks); port 0 picks a free one."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", read_timeout_s: float = DEFAULT_READ_TIMEOUT_S):
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                                    log_level=log_level, lifespan="off",
                                                    http=timed_h11(read_timeout_s)))
        self.thread = threading.Thread(target=self.server.run, name="jaxserve-http",
                                       daemon=True)
        self.host = host
        self.port = port

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def run_server(llm: AsyncLLM, served_model_names: list[str], host: str, port: int,
               api_key: str | None = None, log_level: str = "info", *,
               open_metrics: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
               chat_template: str | None = None, root_path: str = "",
               ssl_keyfile: str | None = None, ssl_certfile: str | None = None,
               allowed_origins: list[str] | None = None,
               response_role: str = "assistant", tool_call_parser: str | None = None,
               log_requests: bool = False, max_log_len: int | None = None) -> int:
    """Serve until interrupted (SIGINT/SIGTERM: returns 0) or until the engine dies (returns 1,
    so that a supervisor restarts the process rather than keep one that only answers 503).
    `read_timeout_s` bounds how long a request's headers, and then its whole body, may take
    to arrive."""
    warn_if_exposed(host, api_key)
    app = build_app(llm, served_model_names, api_key, open_metrics=open_metrics,
                    max_body_bytes=max_body_bytes, read_timeout_s=read_timeout_s,
                    chat_template=chat_template, allowed_origins=allowed_origins,
                    response_role=response_role, tool_call_parser=tool_call_parser,
                    log_requests=log_requests, max_log_len=max_log_len)
    server = uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
        http=timed_h11(read_timeout_s), root_path=root_path, ssl_keyfile=ssl_keyfile,
        ssl_certfile=ssl_certfile))
    watcher = threading.Thread(target=_exit_when_dead, args=(llm, server), daemon=True,
                               name="jaxserve-engine-watch")
    watcher.start()
    try:
        server.run()
        died = not llm.is_running
    finally:
        llm.shutdown()
    if died:
        logger.error("the engine died; the server exits non-zero")
    return 1 if died else 0


def warn_if_exposed(host: str, api_key: str | None) -> None:
    if not api_key and not _is_loopback(host):
        logger.warning("serving on %s without an API key: anyone who can reach it can use "
                       "it (set %s or --api-key)", host, API_KEY_ENV)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _exit_when_dead(llm: AsyncLLM, server: uvicorn.Server, poll_s: float = 0.2) -> None:
    while not server.should_exit:
        if not llm.is_running:
            server.should_exit = True
            return
        time.sleep(poll_s)
