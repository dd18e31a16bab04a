"""Bad requests get 400/401/503 with OpenAI error bodies; disconnects abort; the rest goes on."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from engine_helpers import assert_no_leaks
from jaxserve import SamplingParams
from server_helpers import MODEL_NAME, wait_engine_idle, wait_until

LONG = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=100, temperature=0,
            ignore_eos=True, stream=True)


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _text_of(lines: list[str]) -> str:
    return "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines
                   if line.startswith("data: {") and json.loads(line[6:])["choices"])


def test_bad_requests_get_400_while_requests_in_flight_are_unaffected(served, offline):
    url = f"{served.url}/v1/completions"
    too_long = list(range(2, 2 + served.llm.max_model_len))
    cases = [  # (body, expected param, words the message must hold)
        (b'{"model": "tiny-llama", "prompt": "x"', None, "malformed JSON"),
        ({"prompt": "x", "temperature": -1}, "temperature", "temperature must be"),
        ({"prompt": "x", "top_p": 1.5}, "top_p", "top_p must be in (0, 1]"),
        ({"prompt": "x", "n": "three"}, "n", "valid integer"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be in [1, 2147483647]"),
        ({"prompt": "x", "logprobs": 1000}, "logprobs", "max_logprobs"),
        ({"prompt": "x", "logprobs": -1}, "logprobs", "logprobs must be >= 0"),  # OpenAI's
        ({"prompt": "x", "n": 97500}, "n", "n must be <= max_n (64)"),  # not a 503 queue_full
        ({"prompt": "x", "top_k": 2**31}, "top_k", "top_k must be in [-1, 2147483647]"),
        ({"prompt": "x", "seed": 2**70}, "seed", "seed must be in"),
        ({"max_tokens": 3}, "prompt", "Field required"),
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": [10**6]}, "prompt_token_ids", "outside the vocabulary"),
        ({"prompt": too_long}, "prompt", "context length is 128"),
        # The prompt's shape is checked in Python (pydantic's union check of a long token list
        # held the GIL for seconds); a bool is no token id.
        ({"prompt": 5}, "prompt", "prompt: must be a string, a list of strings, a list of "
                                  "token ids (integers) or a list of token id lists, got int"),
        ({"prompt": [5, "x"]}, "prompt", "got a list of int and str"),
        ({"prompt": [True, 5]}, "prompt", "got a list of bool and int"),
        ({"prompt": [[5, 6], 7]}, "prompt", "got a list of int and list"),
        ({"prompt": "x", "ignore_eos": "maybe"}, "ignore_eos", "valid boolean"),
        ({"prompt": "x", "skip_special_tokens": 2}, "skip_special_tokens", "valid boolean"),
        ({"prompt": "x", "logit_bias": {"the": 1.0}}, "logit_bias", "keys must be token ids"),
        ({"prompt": "x", "logit_bias": {"5": 500}}, "logit_bias", "biases in [-100, 100]"),
        ({"prompt": "x", "logit_bias": {"5000": 1}}, "logit_bias", "outside the vocabulary"),
        ({"prompt": "x", "stop_token_ids": [5, 5000]}, "stop_token_ids",
         "stop_token_ids: 5000 is outside the vocabulary"),
        ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids", "non-empty list"),
        ({"prompt": "x", "bad_words": [""]}, "bad_words", "non-blank strings"),
    ]
    with httpx.Client(headers=served.headers, timeout=60) as http:
        with http.stream("POST", url, json=LONG | {"max_tokens": 40}) as inflight:
            assert inflight.status_code == 200
            lines = inflight.iter_lines()
            head = [next(lines) for _ in range(2)]
            for body, param, words in cases:
                resp = (http.post(url, content=body, headers={"Content-Type": "application/json"})
                        if isinstance(body, bytes) else http.post(url, json=body))
                error = _error(resp, 400)
                assert words in error["message"] and error["param"] == param
                assert error["type"] == "invalid_request_error"
            chat = http.post(f"{served.url}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "robot " * 200}]})
            assert _error(chat, 400)["code"] == "context_length_exceeded"
            text = _text_of(head + list(lines))
    want = offline.generate("Once upon a time", SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    assert text == want
    wait_engine_idle(served.llm)
    served.llm.call_in_engine(assert_no_leaks).result()


def test_the_api_key_is_required_on_every_route_but_health(served):
    body = {"prompt": "x", "max_tokens": 2, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key"}):
        error = _error(httpx.post(f"{served.url}/v1/completions", json=body, headers=headers),
                       401)
        assert error["code"] == "invalid_api_key"
    for path in ("/v1/models", "/metrics", "/openapi.json", "/docs", "/redoc"):
        assert _error(httpx.get(f"{served.url}{path}"), 401)["type"] == "authentication_error"
        assert httpx.get(f"{served.url}{path}", headers=served.headers).status_code == 200
    assert httpx.get(f"{served.url}/health").status_code == 200
    ok = httpx.post(f"{served.url}/v1/completions", json=body, headers=served.headers,
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def _aborted_count(served) -> float:
    text = httpx.get(f"{served.url}/metrics", headers=served.headers).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("jaxserve:request_success_total{")
               and 'finished_reason="abort"' in line)


def test_a_client_that_disconnects_has_its_request_aborted_and_blocks_freed(served):
    llm = served.llm
    before = llm.stats().num_generation_tokens
    aborted = _aborted_count(served)
    gate = threading.Event()
    with httpx.Client(headers=served.headers, timeout=60) as http:
        with http.stream("POST", f"{served.url}/v1/completions", json=LONG) as resp:
            lines = resp.iter_lines()
            assert [next(lines) for _ in range(6)]  # a few tokens in, then hang up
        wait_until(lambda: llm.stats().num_unfinished == 0)  # the server saw it go
        # A non-streamed request whose client gives up while it waits is dropped too.
        try:
            llm.call_in_engine(lambda e: gate.wait(30))
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{served.url}/v1/completions", json=LONG | {"stream": False},
                          timeout=0.5)
            wait_until(lambda: llm.stats().num_unfinished == 0)
        finally:
            gate.set()
    wait_engine_idle(llm)
    llm.call_in_engine(assert_no_leaks).result()
    assert llm.stats().num_generation_tokens - before < LONG["max_tokens"]
    assert _aborted_count(served) == aborted + 2  # both disconnects count as aborted
    ok = httpx.post(f"{served.url}/v1/completions", headers=served.headers, timeout=60,
                    json={"prompt": "Once", "max_tokens": 3, "ignore_eos": True,
                          "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_a_full_queue_answers_503_and_recovers(served):
    llm = served.llm
    gate = threading.Event()
    saved, llm.max_queued_requests = llm.max_queued_requests, 2
    results: list[httpx.Response] = []

    def post() -> None:
        results.append(httpx.post(f"{served.url}/v1/completions", headers=served.headers,
                                  json={"prompt": "Once", "max_tokens": 3, "temperature": 0},
                                  timeout=60))

    try:
        llm.call_in_engine(lambda e: gate.wait(30))  # the engine admits nobody for now
        waiting = [threading.Thread(target=post) for _ in range(2)]
        for t in waiting:
            t.start()
        wait_until(lambda: llm.stats().num_unfinished == 2)
        full = httpx.post(f"{served.url}/v1/completions", headers=served.headers, timeout=60,
                          json={"prompt": "Once", "max_tokens": 3, "temperature": 0})
        error = _error(full, 503)
        assert error["code"] == "queue_full" and "max_queued_requests=2" in error["message"]
        gate.set()
        for t in waiting:
            t.join(60)
    finally:
        gate.set()
        llm.max_queued_requests = saved
    assert [r.status_code for r in results] == [200, 200]
    wait_engine_idle(llm)
    llm.call_in_engine(assert_no_leaks).result()


def test_a_failing_step_answers_500_for_its_request_and_the_server_goes_on(served, monkeypatch):
    executor = served.llm.engine.core.executor
    dispatch = executor.dispatch
    calls = []

    def fail_once(scheds):  # noqa: ANN001, ANN202
        if not calls and any(s.num_scheduled_tokens for s in scheds):
            calls.append(1)
            raise RuntimeError("kernel failed in /opt/secret/site-packages/x.py")
        return dispatch(scheds)

    monkeypatch.setattr(executor, "dispatch", fail_once)
    body = {"prompt": "Once", "max_tokens": 3, "temperature": 0}
    with httpx.Client(headers=served.headers, timeout=60) as http:
        error = _error(http.post(f"{served.url}/v1/completions", json=body), 500)
        assert error["code"] == "engine_step_failed" and "kernel failed" in error["message"]
        assert "/opt/secret" not in error["message"]
        assert http.get(f"{served.url}/health").status_code == 200
        ok = http.post(f"{served.url}/v1/completions", json=body)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    wait_engine_idle(served.llm)
    served.llm.call_in_engine(assert_no_leaks).result()


def test_metrics_can_be_opened_and_a_public_bind_without_a_key_warns(served, caplog):
    from starlette.testclient import TestClient

    from jaxserve.entrypoints.openai.api_server import build_app, warn_if_exposed

    with TestClient(build_app(served.llm, [MODEL_NAME], api_key="k", open_metrics=True)) as http:
        assert http.get("/metrics").status_code == 200
        assert http.get("/v1/models").status_code == 401
    for host, key in (("127.0.0.1", None), ("::1", None), ("localhost", None), ("0.0.0.0", "k")):
        warn_if_exposed(host, key)
    assert not caplog.records
    warn_if_exposed("0.0.0.0", None)
    assert "without an API key" in caplog.text and "JAXSERVE_API_KEY" in caplog.text


def test_odd_bodies_get_400_with_a_json_error(served):
    url = f"{served.url}/v1/completions"
    with httpx.Client(headers=served.headers | {"Content-Type": "application/json"},
                      timeout=60) as http:
        for body, param in ((b'{"prompt": "hi \\ud800 there"}', "prompt"),
                            (b'{"prompt": "x", "stop": ["\\udfff"]}', "stop.0"),
                            (b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
                             "messages.0.content")):
            path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
            error = _error(http.post(f"{served.url}{path}", content=body), 400)
            assert error["message"].startswith(f"{param}: text holds a lone surrogate")
            assert error["param"] == param
        assert http.post(url, json={"prompt": "x", "priority": "high"}).status_code == 400


def test_the_openapi_document_lists_the_errors_the_server_answers(served):
    doc = httpx.get(f"{served.url}/openapi.json", headers=served.headers).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert "422" not in responses  # FastAPI's default; the server answers 400
        assert {"400", "401", "404", "405", "413", "500", "503"} <= set(responses)
    assert "503" in doc["paths"]["/health"]["get"]["responses"]
    # What the document says is 400 is 400 (it said 422).
    resp = httpx.post(f"{served.url}/v1/completions", headers=served.headers, json={"n": "x"})
    assert resp.status_code == 400 and str(resp.status_code) in doc["paths"]["/v1/completions"][
        "post"]["responses"]
    assert httpx.put(f"{served.url}/v1/completions", headers=served.headers).status_code == 405


def test_token_constraints_reach_the_sampler_from_the_server(served):
    """logit_bias with OpenAI's string keys and allowed_token_ids, as vLLM takes them."""
    body = dict(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=4, temperature=0,
                ignore_eos=True, return_token_ids=True)
    with httpx.Client(headers=served.headers, timeout=60) as http:
        def tokens(**extra: object) -> list[int]:
            resp = http.post(f"{served.url}/v1/completions", json=body | extra)
            assert resp.status_code == 200, resp.text
            return resp.json()["choices"][0]["token_ids"]

        assert tokens(logit_bias={"77": 100}) == [77] * 4
        assert set(tokens(allowed_token_ids=[40, 41])) <= {40, 41}
        assert tokens() != [77] * 4
    wait_engine_idle(served.llm)
