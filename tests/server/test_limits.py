"""What one request may cost: body size (413), prompt length before tokenising, read times,
and the event loop's time: /health answers while the largest bodies are parsed and served."""

from __future__ import annotations

import gc
import select
import socket
import threading
import time

import httpx
import pytest

from engine_helpers import assert_no_leaks
from server_helpers import API_KEY, MODEL_NAME, wait_engine_idle


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def test_a_body_over_the_limit_gets_413_before_it_is_read(served):
    url = f"{served.url}/v1/completions"
    big = b'{"prompt": "' + b"x" * (11 * 2**20) + b'"}'
    with httpx.Client(headers=served.headers, timeout=60) as http:
        error = _error(http.post(url, content=big, headers={"Content-Type": "application/json"}),
                       413)
        assert error["code"] == "request_too_large"

        def chunks():  # no Content-Length: counted as it arrives
            for i in range(0, len(big), 2**20):
                yield big[i:i + 2**20]

        assert _error(http.post(url, content=chunks()), 413)["code"] == "request_too_large"
        assert http.get(f"{served.url}/health").status_code == 200


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenising(served, monkeypatch):
    tokenizer = served.llm.tokenizer
    calls = []
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: calls.append(1) or [])
    with httpx.Client(headers=served.headers, timeout=60) as http:
        for path, body in (("completions", {"prompt": "robot " * 200_000}),
                           ("chat/completions",
                            {"messages": [{"role": "user", "content": "robot " * 200_000}]})):
            error = _error(http.post(f"{served.url}/v1/{path}", json=body), 400)
            assert error["code"] == "context_length_exceeded" and "characters" in error["message"]
    assert not calls


def test_tokenising_does_not_block_the_event_loop(served, monkeypatch):
    tokenizer = served.llm.tokenizer
    encode, gate = tokenizer.encode, threading.Event()

    def slow_encode(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        gate.wait(30)
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    results: list[httpx.Response] = []
    post = threading.Thread(target=lambda: results.append(httpx.post(
        f"{served.url}/v1/completions", headers=served.headers, timeout=60,
        json={"prompt": "Once", "max_tokens": 2, "temperature": 0})))
    post.start()
    try:
        # While a prompt is being tokenised, the loop answers others (it hung here before).
        assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200
        assert not results
    finally:
        gate.set()
        post.join(60)
    assert results[0].status_code == 200
    wait_engine_idle(served.llm)
    served.llm.call_in_engine(assert_no_leaks).result()


def test_parsing_a_large_body_does_not_block_the_event_loop(served, monkeypatch):
    from jaxserve.entrypoints.openai import body as body_module

    parse, gate, parsing = body_module.parse_json, threading.Event(), threading.Event()

    def slow_parse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        parsing.set()
        gate.wait(30)
        return parse(*args, **kwargs)

    monkeypatch.setattr(body_module, "parse_json", slow_parse)
    # A 10 MB token id prompt: its JSON and pydantic work on the event loop kept /health
    # waiting 2-3.8 s (issue 53). Off it, on the loaded 2-core dev host, /health took 0.10 s
    # (p50; 0.18 s at most) while such a body was parsed, 0.06 s (0.11 s) with nothing to do:
    # timings, not asserted.
    big = b'{"max_tokens": 1, "prompt": [' + b"5," * (5 * 2**20 - 20) + b'5]}'
    results: list[httpx.Response] = []
    post = threading.Thread(target=lambda: results.append(httpx.post(
        f"{served.url}/v1/completions", content=big, timeout=60,
        headers=served.headers | {"Content-Type": "application/json"})))
    post.start()
    try:
        assert parsing.wait(30)
        assert httpx.get(f"{served.url}/health", timeout=10).status_code == 200
        assert not results  # /health answered while the body was still being parsed
    finally:
        gate.set()
        post.join(60)
    assert _error(results[0], 400)["code"] == "context_length_exceeded"  # parsed in full


def _health_while(served, path: str, body: bytes) -> tuple[httpx.Response, float, float]:
    """POST `body` to /v1/`path`, asking /health again and again until it is answered: its
    response, how long it took, and the longest any /health took meanwhile. The garbage
    collector is off meanwhile: its pauses (0.2 s for a full collection of this test process's
    heap) are CPython's, not work done on the event loop."""
    results: list[httpx.Response] = []
    post = threading.Thread(target=lambda: results.append(httpx.post(
        f"{served.url}/v1/{path}", content=body, timeout=120,
        headers=served.headers | {"Content-Type": "application/json"})))
    collecting, worst = gc.isenabled(), 0.0
    gc.disable()
    try:
        start = time.monotonic()
        post.start()
        with httpx.Client(timeout=120) as http:
            while post.is_alive():
                asked = time.monotonic()
                assert http.get(f"{served.url}/health").status_code == 200
                worst = max(worst, time.monotonic() - asked)
                time.sleep(0.005)
        took = time.monotonic() - start
    finally:
        post.join(120)
        if collecting:
            gc.enable()
    return results[0], took, worst


# Large bodies whose handling stalled /health (issue 53). On the loaded 2-core dev host the
# longest /health took 3.3-3.9 s of the request's 6.1-6.3 s (stop ids), 0.33-0.37 s of 1.1-1.2 s
# (chat) and 26-52 s of 48-77 s (prompts) before their work left the event loop; after, 0.06 to
# 0.15 s: 1-8% of the request's.
@pytest.mark.slow
def test_health_answers_while_a_request_with_millions_of_stop_token_ids_is_served(served):
    ids = b"5," * (3_500_000 - 1) + b"5"
    resp, took, worst = _health_while(served, "completions", b'{"prompt": "Once", '
                                      b'"max_tokens": 2, "temperature": 0, '
                                      b'"stop_token_ids": [' + ids + b"]}")
    assert worst < took / 6, (worst, took)
    same = httpx.post(f"{served.url}/v1/completions", headers=served.headers, timeout=60,
                      json={"prompt": "Once", "max_tokens": 2, "temperature": 0,
                            "stop_token_ids": [5]})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == same.json()["choices"][0]["text"]


@pytest.mark.slow
def test_health_answers_while_a_chat_of_270k_messages_is_refused(served):
    message = b'{"role": "user", "content": "a"}'
    resp, took, worst = _health_while(served, "chat/completions", b'{"max_tokens": 2, '
                                      b'"messages": [' + b", ".join([message] * 270_000) + b"]}")
    assert worst < took / 6, (worst, took)
    error = _error(resp, 400)
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"


@pytest.mark.slow
def test_health_answers_while_2m_prompts_are_refused(served):
    resp, took, worst = _health_while(served, "completions", b'{"max_tokens": 2, "prompt": ['
                                      + b"[5]," * (2_000_000 - 1) + b"[5]]}")
    assert worst < took / 6, (worst, took)
    error = _error(resp, 400)
    assert error["param"] == "prompt" and "max_queued_requests=1024" in error["message"]


@pytest.fixture(scope="module")
def impatient(served):
    """A second server on the same engine that waits 0.5 s for a request's headers, and
    0.5 s for its whole body."""
    from jaxserve.entrypoints.openai.api_server import BackgroundServer, build_app

    server = BackgroundServer(build_app(served.llm, [MODEL_NAME], API_KEY, read_timeout_s=0.5),
                              read_timeout_s=0.5).start()
    yield server
    server.stop()


def _raw(server, data: bytes) -> bytes:
    with socket.create_connection((server.host, server.port), timeout=20) as sock:
        sock.sendall(data)
        reply = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            reply += chunk
        return reply


def test_slow_headers_are_cut_off(impatient):
    assert _raw(impatient, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") == b""


def test_a_slow_body_gets_408(impatient):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n")
    reply = _raw(impatient, head + b'{"prompt":')
    assert reply.startswith(b"HTTP/1.1 408")


def test_a_body_sent_byte_by_byte_gets_408_before_it_ends(impatient):
    body = b'{"prompt": "' + b"x" * 80 + b'", "max_tokens": 1}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n")
    with socket.create_connection((impatient.host, impatient.port), timeout=20) as sock:
        sock.sendall(head)
        sent = 0
        # Each byte comes well within the 0.5 s that a per-chunk timeout would allow.
        while sent < len(body) and not select.select([sock], [], [], 0.1)[0]:
            sock.sendall(body[sent:sent + 1])
            sent += 1
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert sent < len(body)  # cut off while the body was still coming
