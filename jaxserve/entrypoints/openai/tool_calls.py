"""Tool calls out of a chat completion's text: a forced call's constrained JSON (named function
or `required`), or, with tool_choice "auto", what a tool-call parser finds: Hermes/Qwen
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks, or Llama-3's bare JSON
`{"name": ..., "parameters": ...}` (several separated by ";")."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from jaxserve.entrypoints.openai.protocol import (ChatCompletionRequest, DeltaToolCall,
                                                  FunctionCall, ToolCall)
from jaxserve.entrypoints.openai.structured import forced_function

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def _call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                    function=FunctionCall(name=name, arguments=text))


def _as_call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    return _call(obj["name"], {} if args is None else args)


def _calls_of(parts: list[str]) -> list[ToolCall] | None:
    """One call per JSON text, or None if any is not a call."""
    calls = []
    for part in parts:
        try:
            call = _as_call(json.loads(part))
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    return calls


def _hermes(text: str) -> tuple[str | None, list[ToolCall]] | None:
    blocks = _HERMES.findall(text)
    calls = _calls_of(blocks) if blocks else None
    if calls is None:
        return None
    content = text[:text.index("<tool_call>")].strip()
    return content or None, calls


def _llama3(text: str) -> tuple[str | None, list[ToolCall]] | None:
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    calls = _calls_of(body.split(";")) if body.startswith("{") else None
    return None if calls is None else (None, calls)


def parse_tool_calls(text: str, mode: str, req: ChatCompletionRequest,
                     parser: str | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of one finished choice; `mode` from structured.tool_mode;
    `parser` (vLLM's --tool-call-parser, one of TOOL_CALL_PARSERS) the only format an `auto`
    reply's calls are read in, or None: any of them."""
    if mode == "named":
        return None, [_call(forced_function(req), text)]
    if mode == "required":
        try:
            calls = [_as_call(c) for c in json.loads(text)]
        except (ValueError, TypeError):
            calls = []  # cut short by max_tokens: not valid JSON yet
        if calls and all(c is not None for c in calls):
            return None, calls
        return text, []
    if mode == "auto":
        for read in ([TOOL_CALL_PARSERS[parser]] if parser else TOOL_CALL_PARSERS.values()):
            found = read(text)
            if found is not None:
                return found
    return text, []


TOOL_CALL_PARSERS = {"hermes": _hermes, "llama3_json": _llama3}


def tool_call_deltas(calls: list[ToolCall]) -> list[DeltaToolCall]:
    """A streamed choice's tool calls, each whole in one delta."""
    return [DeltaToolCall(index=i, id=c.id, type="function", function=c.function)
            for i, c in enumerate(calls)]
