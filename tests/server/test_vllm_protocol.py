"""Every field of vLLM's completions and chat protocol is honoured or refused with a 400 naming
it; n > 1 streams finish each choice once; context overflow is a 400; unknown models are 404."""

from __future__ import annotations

import json

import httpx
import pytest

from jaxserve import RequestOutputKind, SamplingParams
from jaxserve.core.scheduler_output import EngineCoreOutput
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from server_helpers import MODEL_NAME

# The request fields of vLLM's CompletionRequest / ChatCompletionRequest (vLLM 0.10/0.11).
_SHARED = ["model", "frequency_penalty", "logit_bias", "n", "presence_penalty", "seed", "stop",
           "stream", "stream_options", "temperature", "top_p", "user", "use_beam_search",
           "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
           "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
           "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids",
           "prompt_logprobs", "bad_words", "add_special_tokens", "response_format",
           "structured_outputs", "guided_json", "guided_regex", "guided_choice",
           "guided_grammar", "structural_tag", "guided_decoding_backend",
           "guided_whitespace_pattern", "priority", "request_id", "logits_processors",
           "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
           "kv_transfer_params", "vllm_xargs", "max_tokens", "logprobs", "echo"]
COMPLETION_FIELDS = _SHARED + ["prompt", "best_of", "suffix", "prompt_embeds"]
CHAT_FIELDS = _SHARED + ["messages", "top_logprobs", "max_completion_tokens", "tools",
                         "tool_choice", "parallel_tool_calls", "reasoning_effort",
                         "include_reasoning", "add_generation_prompt",
                         "continue_final_message", "documents", "chat_template",
                         "chat_template_kwargs", "mm_processor_kwargs"]

# A value for each refused field that asks for something jaxserve does not do.
ASKING = {"use_beam_search": True, "length_penalty": 0.5, "prompt_logprobs": 1,
          "allowed_token_ids": [5, 6], "bad_words": ["robot"], "truncate_prompt_tokens": 4,
          "spaces_between_special_tokens": False, "return_tokens_as_token_ids": True,
          "logits_processors": ["x.y"], "response_format": {"type": "json_object"},
          "structured_outputs": {"regex": "a+"}, "guided_json": {"type": "object"},
          "guided_regex": "a+", "guided_choice": ["a", "b"], "guided_grammar": "root ::= 'a'",
          "structural_tag": "{}", "guided_decoding_backend": "xgrammar",
          "guided_whitespace_pattern": " ", "kv_transfer_params": {"x": 1},
          "vllm_xargs": {"x": 1}, "logit_bias": {"5": 1.0}, "suffix": "end",
          "prompt_embeds": "AAAA", "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": "auto", "reasoning_effort": "low", "echo": True,
          "continue_final_message": True, "add_special_tokens": True,
          "documents": [{"title": "a", "text": "b"}], "chat_template": "{{ messages }}",
          "chat_template_kwargs": {"x": 1}, "mm_processor_kwargs": {"x": 1}}
MESSAGES = [{"role": "user", "content": "Hello robot"}]


@pytest.mark.parametrize("model, fields", [(CompletionRequest, COMPLETION_FIELDS),
                                           (ChatCompletionRequest, CHAT_FIELDS)])
def test_every_vllm_field_is_declared_so_none_is_dropped_unread(model, fields):
    assert [f for f in fields if f not in model.model_fields] == []
    assert set(model.UNSUPPORTED) <= set(ASKING)


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("path, model", [("completions", CompletionRequest),
                                         ("chat/completions", ChatCompletionRequest)])
def test_each_unsupported_field_is_a_400_naming_it_and_its_no_op_value_is_served(
        served, path, model):
    base = {"model": MODEL_NAME, "max_tokens": 2} | (
        {"prompt": "Once upon"} if path == "completions" else {"messages": MESSAGES})
    with httpx.Client(base_url=f"{served.url}/v1", headers=served.headers, timeout=60) as http:
        for name in model.UNSUPPORTED:
            error = _error(http.post(path, json=base | {name: ASKING[name]}), 400)
            assert (error["param"], error["code"]) == (name, "unsupported"), name
            assert name in error["message"]
        error = _error(http.post(path, json=base | {
            "stream": True, "stream_options": {"continuous_usage_stats": True}}), 400)
        assert error["param"] == "stream_options.continuous_usage_stats"
        error = _error(http.post(path, json=base | {"stream_options": {"include_usage": True}}),
                       400)
        assert error["param"] == "stream_options"
        no_ops = {name: values[-1] for name, values in model.UNSUPPORTED.items()}
        resp = http.post(path, json=base | no_ops | {"request_id": "mine"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["id"].endswith("-mine")


def test_an_unknown_model_is_a_404_with_the_error_body(served):
    resp = httpx.post(f"{served.url}/v1/completions", headers=served.headers,
                      json={"model": "gpt-4", "prompt": "x"})
    error = _error(resp, 404)
    assert (error["param"], error["code"], error["type"]) == ("model", "model_not_found",
                                                              "not_found_error")


def test_prompt_plus_max_tokens_over_the_context_is_a_400(served):
    room = served.llm.max_model_len - 6
    with httpx.Client(base_url=f"{served.url}/v1", headers=served.headers, timeout=60) as http:
        ok = http.post("completions", json={"prompt": [5, 6, 7, 8, 9, 10], "max_tokens": room,
                                            "ignore_eos": True, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == room
        error = _error(http.post("completions", json={"prompt": [5, 6, 7, 8, 9, 10],
                                                      "max_tokens": room + 1}), 400)
        assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
        assert f"{room + 7} were asked for" in error["message"]
        error = _error(http.post("chat/completions", json={"messages": MESSAGES,
                                                           "max_tokens": 10**6}), 400)
        assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")


def test_add_special_tokens_is_honoured_on_completions(served):
    tokenizer = served.llm.tokenizer
    text = "Once upon a time"
    for add in (True, False):
        resp = httpx.post(f"{served.url}/v1/completions", headers=served.headers, json={
            "prompt": text, "max_tokens": 1, "add_special_tokens": add})
        assert resp.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(text, add))
    assert len(tokenizer.encode(text, True)) != len(tokenizer.encode(text, False))


def _finish_chunks(lines: list[str]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for line in lines:
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                if choice.get("finish_reason"):
                    counts[choice["index"]] = counts.get(choice["index"], 0) + 1
    return counts


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_n_streams_send_one_finish_chunk_per_choice(served, offline, path):
    params = dict(n=3, temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    sampled = offline.generate("Once upon a time", SamplingParams(**params), use_tqdm=False)
    stop = sampled[0].outputs[1].text[3:6]  # ends sample 1 early, the others later or never
    ends = offline.generate("Once upon a time", SamplingParams(**params, stop=[stop]),
                            use_tqdm=False)[0].outputs
    assert len({len(c.token_ids) for c in ends}) > 1  # the choices finish at different steps
    body = params | {"stop": [stop], "stream": True} | (
        {"prompt": "Once upon a time"} if path == "completions" else
        {"messages": MESSAGES})
    with httpx.stream("POST", f"{served.url}/v1/{path}", headers=served.headers, json=body,
                      timeout=60) as resp:
        assert resp.status_code == 200
        assert _finish_chunks(list(resp.iter_lines())) == {0: 1, 1: 1, 2: 1}


def test_delta_outputs_carry_each_samples_finish_once():
    proc = OutputProcessor(None)
    proc.add_request("r", None, [1, 2], SamplingParams(n=2), 0.0, ["0_r", "1_r"])
    steps = [[EngineCoreOutput("0_r", [3], finish_reason="length"), EngineCoreOutput("1_r", [4])],
             [EngineCoreOutput("1_r", [5])], [EngineCoreOutput("1_r", [6], finish_reason="stop")]]
    seen = []
    for step in steps:
        outs, _ = proc.process_outputs(step, RequestOutputKind.DELTA)
        seen.append([(c.index, c.token_ids, c.finish_reason) for c in outs[0].outputs])
    assert seen == [[(0, [3], "length"), (1, [4], None)], [(1, [5], None)],
                    [(1, [6], "stop")]]
