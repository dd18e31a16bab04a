"""OpenAI-style error bodies `{"error": {"message", "type", "param", "code"}}` for all failures."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from jaxserve.engine.async_llm import EngineDeadError, EngineQueueFullError, EngineStepError
from jaxserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)
# An absolute path of two or more parts (not the tail of a relative one, nor a URL's path).
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/-])/(?:[\w.+@~-]+/)+([\w.+@~-]*)")


def redact_paths(text: str) -> str:
    """Client-facing text names files by their last part only: no install paths."""
    return _ABSOLUTE_PATH.sub(lambda m: f".../{m.group(1)}", text)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error", 500: "internal_server_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        message = redact_paths(message)
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message,
                                             type=_TYPES.get(self.status, "api_error"),
                                             param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)


def bad_request(exc: ValueError | str, param: str | None = None,
                code: str | None = "invalid_value", fields: tuple[str, ...] = ()) -> APIError:
    """A 400 for a ValueError; `param` defaults to the field the message starts with."""
    message = str(exc)
    if param is None and fields:
        first = message.split(" ", 1)[0].rstrip(":")
        param = first if first in fields else None
    return APIError(400, message, param, code)


def _describe(errors: list[Any]) -> tuple[str, str | None, str]:
    err = errors[0]
    if err.get("type") == "json_invalid":
        return f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}", None, \
            "invalid_json"
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    text = err["msg"]
    if err.get("type") == "value_error":  # our own validator's message, which names its field
        text = str(err.get("ctx", {}).get("error", text))
        head, colon, _ = text.partition(": ")
        param = param or (head if colon and " " not in head else None)
    message = text if param is None or text.startswith(f"{param}:") else f"{param}: {text}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return message, param, "missing_field" if err.get("type") == "missing" else "invalid_value"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _describe(list(exc.errors()))
        return APIError(400, message, param, code).response()

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        code = {408: "request_timeout", 413: "request_too_large"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(EngineQueueFullError)
    async def _queue_full(_: Request, exc: EngineQueueFullError) -> JSONResponse:
        return APIError(503, f"the server is busy: {exc}", code="queue_full").response()

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return APIError(503, str(exc), code="engine_dead").response()

    @app.exception_handler(EngineStepError)
    async def _step_failed(_: Request, exc: EngineStepError) -> JSONResponse:
        return APIError(500, str(exc), code="engine_step_failed").response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error in a request", exc_info=exc)
        return APIError(500, f"internal error: {type(exc).__name__}").response()


_DESCRIPTIONS = {400: "Invalid request", 401: "Missing or wrong API key",
                 404: "The model is not served here", 405: "Method not allowed",
                 408: "The body arrived too slowly", 413: "The body is too large",
                 500: "The step carrying the request failed", 503: "Busy, or the engine is dead"}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these error statuses (all have the OpenAI error body)."""
    return {s: {"model": ErrorResponse, "description": _DESCRIPTIONS[s]} for s in statuses}


def document_errors_as_answered(app: FastAPI) -> None:
    """The OpenAPI document says what the server answers: FastAPI documents body validation
    errors as 422, which this server answers as 400."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for methods in schema.get("paths", {}).values():
                for operation in methods.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
