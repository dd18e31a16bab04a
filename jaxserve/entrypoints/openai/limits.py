"""What one HTTP request may cost before the app sees it: body size (413) and the time its
headers and body may take to arrive (slow clients must not hold connections open forever)."""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxserve.entrypoints.openai.errors import APIError

DEFAULT_MAX_BODY_BYTES = 10 * 2**20
DEFAULT_READ_TIMEOUT_S = 30.0


class RequestLimitsMiddleware:
    """413 for a body over `max_body_bytes` (at once when Content-Length says so, else as soon
    as the count passes it), 408 for a body not all in within `read_timeout_s` of its headers
    (a deadline for the whole body: one per chunk lets a byte a second hold a connection)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_body_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        received, complete = 0, False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout_s

        async def limited_receive() -> Message:
            nonlocal received, complete
            if complete:  # the body is in: what follows is the disconnect, however late
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):  # what has arrived is read even late
                    message = await receive()
            except TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within "
                                         f"{self.read_timeout_s:g} s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise HTTPException(413, self._too_large().message)
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is over {self.max_body_bytes} bytes "
                        "(--max-request-body-bytes)", code="request_too_large")


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's headers: a client that sends
    them byte by byte (slowloris) is cut off instead of holding its connection forever."""

    header_timeout_s = DEFAULT_READ_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_header_deadline()  # the headers are in

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()  # the next request on this connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_late(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def timed_h11(header_timeout_s: float) -> type[TimedH11Protocol]:
    return type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout_s": header_timeout_s})
