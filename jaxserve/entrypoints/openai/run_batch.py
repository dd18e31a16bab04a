"""`jaxserve run-batch -i IN.jsonl -o OUT.jsonl`: OpenAI's batch-file format, as vLLM's
run-batch. Each input line, `{custom_id, method, url, body}`, is answered by the OpenAI server's
own handlers in this process (same validation, same 400s, same bodies) and becomes one output
line, `{id, custom_id, response: {status_code, request_id, body}, error}`, in input order."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterable
from typing import Any

import httpx

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.api_server import build_app

BATCH_URLS = ("/v1/completions", "/v1/chat/completions")


def parse_line(line: str, lineno: int) -> tuple[str | None, str, dict[str, Any]]:
    """(custom_id, url, body) of one input line; a ValueError names what is wrong."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {lineno}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"line {lineno}: must be a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str):
        raise ValueError(f"line {lineno}: custom_id must be a string, got {custom_id!r}")
    if obj.get("method", "POST") != "POST":
        raise ValueError(f"line {lineno}: method must be POST, got {obj['method']!r}")
    url, body = obj.get("url"), obj.get("body")
    if url not in BATCH_URLS:
        raise ValueError(f"line {lineno}: url must be one of {', '.join(BATCH_URLS)}, "
                         f"got {url!r}")
    if not isinstance(body, dict):
        raise ValueError(f"line {lineno}: body must be a JSON object")
    if body.get("stream"):
        raise ValueError(f"line {lineno}: body.stream is not supported in a batch file")
    return custom_id, url, body


def output_line(custom_id: str | None, status: int | None, body: Any,
                error: dict[str, Any] | None) -> dict[str, Any]:
    response = None if status is None else {
        "status_code": status, "request_id": f"jaxserve-batch-{uuid.uuid4().hex}", "body": body}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": response, "error": error}


def _custom_id_of(line: str) -> str | None:
    try:
        custom_id = json.loads(line).get("custom_id")
    except (json.JSONDecodeError, AttributeError):
        return None
    return custom_id if isinstance(custom_id, str) else None


async def run_batch_lines(llm: AsyncLLM, model_names: list[str], lines: Iterable[str],
                          max_concurrency: int = 256) -> list[dict[str, Any]]:
    """One output line per non-blank input line, in order; at most `max_concurrency` requests
    in the engine at once."""
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be a positive integer, got {max_concurrency}")
    app = build_app(llm, model_names)
    gate = asyncio.Semaphore(max_concurrency)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://run-batch", timeout=None) as client:

        async def answer(lineno: int, line: str) -> dict[str, Any]:
            try:
                custom_id, url, body = parse_line(line, lineno)
            except ValueError as exc:
                return output_line(_custom_id_of(line), None, None,
                                   {"code": "invalid_request", "message": str(exc)})
            async with gate:
                resp = await client.post(url, json=body)
            reply = resp.json()
            return output_line(custom_id, resp.status_code, reply,
                               None if resp.status_code == 200 else reply.get("error"))

        return await asyncio.gather(*(answer(i, line) for i, line in enumerate(lines, 1)
                                      if line.strip()))
