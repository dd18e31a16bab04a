"""Request bodies parsed and validated on a worker thread: a 10 MB body is seconds of JSON and
pydantic work, which on the event loop would stall every other request (and /health)."""

from __future__ import annotations

import asyncio
import email.message
import json
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.responses import Response

T = TypeVar("T")


def parse_json(body: bytes, validate: Callable[[Any], T]) -> T:
    """`validate(the body's JSON)`; a RequestValidationError (answered 400) for a body that is
    not JSON or does not validate."""
    try:
        return validate(json.loads(body, parse_int=_int, object_hook=_object))
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested too deeply
        error = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",),
                                       "msg": "JSON decode error", "ctx": {"error": error}}],
                                     ) from None


def _int(text: str) -> int:
    # A Python call per integer lets the event loop's thread take the GIL between two: the C
    # parser alone holds it through a whole body (0.5 s for 10 MB of token ids).
    return int(text)


def _object(value: dict[str, Any]) -> dict[str, Any]:
    # As `_int`, a Python call per object: a body of objects without integers (270k chat
    # messages, 8 MB) held the GIL for 0.2 s.
    return value


async def parse_body(body: bytes, validate: Callable[[Any], T]) -> T:
    return await asyncio.to_thread(parse_json, body, validate)


class ParsedBodyRoute(APIRoute):
    """FastAPI's route, but a JSON body is parsed and validated by `parse_json` on a worker
    thread (FastAPI does both on the event loop); the OpenAPI document and the endpoint's
    arguments stay as declared."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler
        validate = TypeAdapter(self.body_field.field_info.annotation).validate_python

        async def parsed(request: Request) -> Response:
            body = await request.body()
            if not body or not _is_json(request.headers.get("content-type")):
                return await handler(request)  # FastAPI refuses it as before
            value = await parse_body(body, validate)
            # FastAPI validates the model again: an instance passes through at once.
            return await handler(_ParsedRequest(request, body, value))

        return parsed


class _ParsedRequest(Request):
    def __init__(self, request: Request, body: bytes, value: Any):
        super().__init__(request.scope, request.receive)
        self._parsed_body, self._parsed = body, value

    async def body(self) -> bytes:
        return self._parsed_body

    async def json(self) -> Any:
        return self._parsed


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI reads the body as JSON (it does not without a content type)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json"))
