"""Request bodies parsed and validated on a worker thread: a 10 MB body is seconds of JSON and
pydantic work, which on the event loop would stall every other request (and /health)."""

from __future__ import annotations

import asyncio
import email.message
import json
import types
import typing
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.background import BackgroundTask, BackgroundTasks
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
        validate = _validator(self.body_field.field_info.annotation)

        async def parsed(request: Request) -> Response:
            body = await request.body()
            if not body or not _is_json(request.headers.get("content-type")):
                return await handler(request)  # FastAPI refuses it as before
            value = await parse_body(body, validate)
            long_lists = _long_lists(value)
            try:
                # FastAPI validates the model again: an instance passes through at once.
                response = await handler(_ParsedRequest(request, body, value))
            except BaseException:
                if long_lists:
                    asyncio.get_running_loop().run_in_executor(None, _free, long_lists)
                raise
            if long_lists:  # once the response is sent: a stream may still read the body
                response.background = _then(response.background, BackgroundTask(_free,
                                                                                long_lists))
            return response

        return parsed


# Freeing the objects of a list goes as one C call: 2M token id lists hold the GIL for 0.12 s,
# stalling the event loop even from a worker thread. A body's long lists are cleared a slice at
# a time instead, on a worker thread, once nothing reads them (8k chat messages: ~5 ms).
_SLICE = 1 << 13


def _long_lists(value: Any) -> list[list[Any]]:
    fields = value.__dict__.values() if hasattr(value, "__dict__") else ()
    return [field for field in fields if isinstance(field, list) and len(field) > _SLICE]


def _free(lists: list[list[Any]]) -> None:
    for items in lists:
        while items:
            del items[-_SLICE:]


def _then(first: BackgroundTask | None, second: BackgroundTask) -> BackgroundTask:
    if first is None:
        return second
    tasks = BackgroundTasks()
    tasks.tasks.extend([first, second])
    return tasks


def _validator(annotation: Any) -> Callable[[Any], Any]:
    """The body's validation. A union of a prompt body and a messages body (/tokenize,
    /v1/embeddings) is validated as the member the body's "messages" key picks: as a plain
    union, pydantic reports every member's errors, each under its class name."""
    members = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else ()
    chats = [m for m in members if "messages" in getattr(m, "model_fields", {})]
    if len(members) != 2 or len(chats) != 1:
        return TypeAdapter(annotation).validate_python
    chat = TypeAdapter(chats[0]).validate_python
    prompt = TypeAdapter(next(m for m in members if m is not chats[0])).validate_python
    return lambda value: (chat if isinstance(value, dict) and "messages" in value
                          else prompt)(value)


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
