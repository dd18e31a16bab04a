"""The OpenAI and vLLM ways of asking for structured output, as one StructuredOutputsParams:
`response_format` (json_object, json_schema), `structured_outputs`, the `guided_*` aliases,
and for chat the tools' schemas when `tool_choice` forces a call."""

from __future__ import annotations

from typing import Any

from jaxserve.entrypoints.openai.errors import APIError, bad_request
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, SamplingRequest
from jaxserve.sampling_params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def _response_format(value: dict[str, Any]) -> dict[str, Any] | None:
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise APIError(400, "response_format.json_schema must be an object with a "
                           "'schema' object", "response_format")
        # OpenAI's strict mode means the output must match the schema: it always does here.
        return {"json": spec.get("schema", {})}
    raise APIError(400, f"response_format.type must be 'text', 'json_object' or "
                   f"'json_schema', got {kind!r}", "response_format")


def structured_outputs_of(req: SamplingRequest) -> StructuredOutputsParams | None:
    """The one constraint the request asks for (400 when it asks for several, or a bad one)."""
    asked: list[tuple[str, dict[str, Any]]] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            asked.append(("response_format", spec))
    if req.structured_outputs is not None:
        asked.append(("structured_outputs", dict(req.structured_outputs)))
    for name, key in _GUIDED.items():
        if getattr(req, name) is not None:
            asked.append((name, {key: getattr(req, name)}))
    if isinstance(req, ChatCompletionRequest):
        tools = tool_schema(req)
        if tools is not None:
            asked.append(("tool_choice", {"json": tools}))
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError(400, f"{asked[1][0]}: only one of {', '.join(n for n, _ in asked)} may "
                       "be given", asked[1][0])
    name, spec = asked[0]
    try:
        return StructuredOutputsParams(**spec)
    except (TypeError, ValueError) as exc:
        raise bad_request(f"{name}: {exc}", name) from None


def _functions(req: ChatCompletionRequest) -> dict[str, dict[str, Any]]:
    out = {}
    for i, tool in enumerate(req.tools or []):
        fn = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, f"tools.{i} must be a function with a name", f"tools.{i}")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise APIError(400, f"tools.{i}.function.parameters must be a JSON schema object",
                           f"tools.{i}")
        out[fn["name"]] = params
    return out


def forced_function(req: ChatCompletionRequest) -> str | None:
    """The function a named tool_choice forces, or None."""
    choice = req.tool_choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                           "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        return name
    return None


def tool_mode(req: ChatCompletionRequest) -> str:
    """'none' (no tools), 'auto' (the model may call; parsed), 'required' or 'named'."""
    if not req.tools or req.tool_choice == "none":
        if isinstance(req.tool_choice, dict) or req.tool_choice == "required":
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return "none"
    if req.tool_choice in (None, "auto"):
        return "auto"
    if req.tool_choice == "required":
        return "required"
    if forced_function(req) is not None:
        return "named"
    raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or a named function, "
                   f"got {req.tool_choice!r}", "tool_choice")


def tool_schema(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema a forced call must match: the named function's parameters, or (required)
    a non-empty array of {"name", "parameters"} calls to any of the tools (one at most with
    parallel_tool_calls false)."""
    mode = tool_mode(req)
    functions = _functions(req) if req.tools else {}
    if mode == "named":
        name = forced_function(req)
        if name not in functions:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools",
                           "tool_choice")
        return functions[name]
    if mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, params in functions.items()]
    one = {"maxItems": 1} if req.parallel_tool_calls is False else {}
    return {"type": "array", "minItems": 1, **one, "items": {"anyOf": calls}}
