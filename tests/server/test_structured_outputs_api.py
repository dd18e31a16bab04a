"""The `openai` client gets schema-valid JSON for response_format json_schema and valid tool
calls for tool_choice "required" and a named function, streamed and not; the vLLM spellings
(structured_outputs, guided_*) work; a bad schema is a 400 naming it; the tool-call parsers
read Hermes/Qwen and Llama-3 calls."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from engine_helpers import assert_no_leaks
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest
from jaxserve.entrypoints.openai.tool_calls import parse_tool_calls
from server_helpers import API_KEY, MODEL_NAME, wait_engine_idle

MESSAGES = [{"role": "user", "content": "Give me a record"}]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3}},
    "required": ["name", "age", "pets"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=API_KEY, max_retries=0)


def _chat(client: openai.OpenAI, stream: bool, **kwargs: object) -> tuple[str, list, str]:
    """(content, [(name, arguments JSON)], finish reason), streamed deltas assembled."""
    base = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 90, "temperature": 1.0,
            "seed": 3} | kwargs
    if not stream:
        choice = client.chat.completions.create(**base).choices[0]
        calls = [(c.function.name, c.function.arguments)
                 for c in choice.message.tool_calls or []]
        return choice.message.content or "", calls, choice.finish_reason
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(**base, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for call in c.delta.tool_calls or []:
                name, args = calls.get(call.index, ("", ""))
                calls[call.index] = (name + (call.function.name or ""),
                                     args + (call.function.arguments or ""))
            reason = c.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_gives_valid_objects(client, served, stream):
    for seed in range(3):
        text, calls, reason = _chat(client, stream, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA,
                                                   "strict": True}})
        assert reason == "stop" and calls == []
        jsonschema.validate(json.loads(text), SCHEMA)
    wait_engine_idle(served.llm)
    served.llm.call_in_engine(assert_no_leaks).result()


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_and_named_give_valid_tool_calls(client, stream):
    for seed in range(3):
        # One call each (random weights would otherwise go on appending calls).
        content, calls, reason = _chat(client, stream, seed=seed, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False)
        assert reason == "tool_calls" and not content and len(calls) == 1
        for name, args in calls:
            jsonschema.validate(json.loads(args), SCHEMAS[name])
    content, calls, reason = _chat(client, stream, tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_time"}})
    assert reason == "tool_calls" and len(calls) == 1 and calls[0][0] == "get_time"
    jsonschema.validate(json.loads(calls[0][1]), CLOCK)


def test_vllm_spellings_and_completions_are_constrained(client, served):
    out = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=30,
                                    seed=1, extra_body={"guided_regex": r"[a-z]{2,6}-[0-9]{2}"})
    assert re.fullmatch(r"[a-z]{2,6}-[0-9]{2}", out.choices[0].text)
    out = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=30,
                                    seed=2, extra_body={"structured_outputs": {
                                        "choice": ["left", "right"]}})
    assert out.choices[0].text in ("left", "right")
    text, _, _ = _chat(client, False, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(text), SCHEMA)
    text, _, _ = _chat(client, False, tools=TOOLS, tool_choice="none",
                       extra_body={"guided_choice": ["yes", "no"]})
    assert text in ("yes", "no")


def test_bad_constraints_are_400s_naming_them(served):
    base = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 5}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
         "structured_outputs.json"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "only one of"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "not among the tools"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
    ]
    with httpx.Client(base_url=f"{served.url}/v1", headers=served.headers, timeout=60) as http:
        for extra, message in cases:
            resp = http.post("chat/completions", json=base | extra)
            assert resp.status_code == 400, (extra, resp.text)
            assert message in resp.json()["error"]["message"], resp.text
        ok = http.post("chat/completions", json=base)  # the server goes on serving
        assert ok.status_code == 200


def test_tool_call_parsers_read_hermes_and_llama3_calls():
    req = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS)
    content, calls = parse_tool_calls(
        'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"days": 2}}</tool_call>', "auto", req)
    assert content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "days": 2})]
    content, calls = parse_tool_calls(
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', "auto", req)
    assert content is None and calls[0].function.name == "get_time"
    assert parse_tool_calls("plain words {not json", "auto", req) == (
        "plain words {not json", [])


def test_a_tool_call_parser_reads_its_own_format_only():
    """vLLM's --tool-call-parser: hermes reads <tool_call> tags, llama3_json Llama-3's JSON."""
    req = ChatCompletionRequest(messages=MESSAGES, tools=TOOLS)
    hermes = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    llama3 = '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}'
    assert parse_tool_calls(hermes, "auto", req, "hermes")[1][0].function.name == "get_time"
    assert parse_tool_calls(llama3, "auto", req, "hermes") == (llama3, [])
    assert parse_tool_calls(llama3, "auto", req, "llama3_json")[1][0].function.name == \
        "get_time"
    assert parse_tool_calls(hermes, "auto", req, "llama3_json") == (hermes, [])
