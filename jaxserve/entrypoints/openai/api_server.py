"""The FastAPI app (`build_app`), its uvicorn runners, and API-key checking."""

from __future__ import annotations

import hmac
import logging
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.errors import APIError, install_error_handlers
from jaxserve.entrypoints.openai.metrics import ServerMetrics
from jaxserve.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                  ModelCard, ModelList)
from jaxserve.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxserve.entrypoints.openai.serving_common import cancel_on_disconnect
from jaxserve.entrypoints.openai.serving_completions import OpenAIServingCompletion

logger = logging.getLogger(__name__)


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on every `/v1` route (a plain ASGI middleware, so that
    streamed responses and client disconnects pass through untouched)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "missing or invalid API key (send 'Authorization: "
                                 "Bearer <key>')", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(llm: AsyncLLM, served_model_names: list[str], api_key: str | None = None,
              ) -> FastAPI:
    if not served_model_names:
        raise ValueError("served_model_names must name at least one model")
    app = FastAPI(title="jaxserve", summary="OpenAI-compatible API over jaxserve")
    metrics = ServerMetrics(llm, served_model_names[0])
    completions = OpenAIServingCompletion(llm, served_model_names, metrics)
    chat = OpenAIServingChat(llm, served_model_names, metrics)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.state.llm, app.state.metrics = llm, metrics

    @app.get("/health")
    async def health() -> Response:
        if not llm.is_running:
            raise APIError(503, "the engine loop has stopped", code="engine_dead")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, max_model_len=llm.max_model_len)
                               for name in served_model_names])

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        return await cancel_on_disconnect(raw, completions.create(req))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        return await cancel_on_disconnect(raw, chat.create(req))

    return app


class BackgroundServer:
    """uvicorn serving `app` from a daemon thread (tests, benchmarks); port 0 picks a free one."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning"):
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                                    log_level=log_level, lifespan="off"))
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
               api_key: str | None = None, log_level: str = "info") -> int:
    """Serve until interrupted (SIGINT/SIGTERM: returns 0) or until the engine dies (returns 1,
    so that a supervisor restarts the process rather than keep one that only answers 503)."""
    server = uvicorn.Server(uvicorn.Config(
        build_app(llm, served_model_names, api_key), host=host, port=port,
        log_level=log_level, timeout_graceful_shutdown=5))
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


def _exit_when_dead(llm: AsyncLLM, server: uvicorn.Server, poll_s: float = 0.2) -> None:
    while not server.should_exit:
        if not llm.is_running:
            server.should_exit = True
            return
        time.sleep(poll_s)
