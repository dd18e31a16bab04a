"""`jaxserve serve`: engine arguments and server arguments on one command line."""

from __future__ import annotations

import pytest

from jaxserve.entrypoints.cli.args import engine_kwargs
from jaxserve.entrypoints.cli.main import build_parser
from jaxserve.entrypoints.cli.serve import cmd_serve


def test_serve_parses_engine_and_server_arguments():
    args = build_parser().parse_args([
        "serve", "/models/tiny", "--max-num-seqs", "8", "--token-buckets", "16,64",
        "--port", "9001", "--api-key", "k", "--served-model-name", "a", "b",
        "--max-queued-requests", "5"])
    assert args.func is cmd_serve and args.model == "/models/tiny"
    assert (args.port, args.api_key, args.served_model_name, args.max_queued_requests) == (
        9001, "k", ["a", "b"], 5)
    assert engine_kwargs(args, skip=("model",)) == {"max_num_seqs": 8, "token_buckets": [16, 64]}


def test_serve_rejects_a_bad_queue_bound_before_loading_anything():
    args = build_parser().parse_args(["serve", "/no/such/model", "--max-queued-requests", "0"])
    with pytest.raises(ValueError, match="max_queued_requests must be a positive integer"):
        cmd_serve(args)


def test_serve_refuses_a_model_without_a_tokenizer(stories_dir, tmp_path, compile_cache_dir):
    import shutil

    shutil.copy(stories_dir / "stories260K.bin", tmp_path / "alone.bin")  # no tok512.bin beside
    args = build_parser().parse_args(["serve", str(tmp_path / "alone.bin"), "--num-kv-blocks",
                                      "64", "--compilation-cache-dir", compile_cache_dir])
    with pytest.raises(ValueError, match="alone.bin: this model has no tokenizer.*pass "
                                         "tokenizer="):
        cmd_serve(args)


def test_the_server_exits_non_zero_once_the_engine_is_dead(engine_args, monkeypatch):
    import asyncio
    import socket
    import threading

    import httpx

    from jaxserve import AsyncLLM, SamplingParams
    from jaxserve.engine.async_llm import EngineDeadError
    from jaxserve.entrypoints.openai.api_server import run_server
    from server_helpers import wait_until

    llm = AsyncLLM(**engine_args)
    runner = llm.engine.core.executor.worker.runner

    def collect(pending):  # noqa: ANN001, ANN202 (a device failure that loses the KV cache)
        runner.k_cache.delete()
        raise RuntimeError("device halted")

    monkeypatch.setattr(runner, "collect", collect)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(run_server(
        llm, ["m"], "127.0.0.1", port, log_level="warning")), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}/health"

    def healthy() -> bool:
        try:
            return httpx.get(url).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(healthy)

    async def generate() -> None:
        async for _ in llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2)):
            pass

    with pytest.raises(EngineDeadError):
        asyncio.run(generate())
    thread.join(30)
    assert codes == [1]


@pytest.mark.parametrize(("flags", "message"), [
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-keyfile", "/no/k.pem", "--ssl-certfile", "/no/c.pem"],
     "--ssl-keyfile: /no/k.pem is not a file"),
    (["--allowed-origins", "https://a.example"], "--allowed-origins must be a JSON list"),
    (["--allowed-origins", '{"a": 1}'], "--allowed-origins must be a JSON list"),
    (["--response-role", " "], "--response-role must not be blank"),
    (["--max-log-len", "-1"], "--max-log-len must be >= 0"),
])
def test_serve_checks_vllms_http_flags_before_loading_anything(flags, message):
    args = build_parser().parse_args(["serve", "/no/such/model", *flags])
    with pytest.raises(ValueError, match=message):
        cmd_serve(args)


def test_serve_reads_vllms_http_flags(tmp_path):
    from jaxserve.entrypoints.cli.serve import server_options

    (tmp_path / "k.pem").write_text("key")
    (tmp_path / "c.pem").write_text("cert")
    args = build_parser().parse_args([
        "serve", "/models/tiny", "--root-path", "/llm", "--ssl-keyfile", str(tmp_path / "k.pem"),
        "--ssl-certfile", str(tmp_path / "c.pem"), "--allowed-origins", '["https://a.example"]',
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-log-requests",
        "--max-log-len", "8"])
    assert server_options(args) == {
        "root_path": "/llm", "ssl_keyfile": str(tmp_path / "k.pem"),
        "ssl_certfile": str(tmp_path / "c.pem"), "allowed_origins": ["https://a.example"],
        "response_role": "assistant", "tool_call_parser": "hermes", "log_requests": True,
        "max_log_len": 8}


def test_allowed_origins_answer_a_browsers_preflight_before_the_api_key(served):
    from fastapi.testclient import TestClient

    from jaxserve.entrypoints.openai.api_server import build_app

    app = build_app(served.llm, ["m"], api_key="secret", allowed_origins=["https://a.example"])
    client = TestClient(app)
    preflight = client.options("/v1/completions", headers={
        "Origin": "https://a.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://a.example"
    denied = client.get("/v1/models", headers={"Origin": "https://a.example"})
    assert denied.status_code == 401  # the key is still required, the answer readable
    assert denied.headers["access-control-allow-origin"] == "https://a.example"
    other = client.get("/health", headers={"Origin": "https://b.example"})
    assert "access-control-allow-origin" not in other.headers


def test_the_response_role_names_replies_to_a_generation_prompt(served):
    """vLLM's rule: --response-role for a reply to a generation prompt; continuing the
    conversation without one, the last message's role."""
    from fastapi.testclient import TestClient

    from jaxserve.entrypoints.openai.api_server import build_app

    client = TestClient(build_app(served.llm, ["m"], response_role="bot"))
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    reply = client.post("/v1/chat/completions", json=body).json()
    assert reply["choices"][0]["message"]["role"] == "bot"
    cont = client.post("/v1/chat/completions", json=body | {"add_generation_prompt": False})
    assert cont.json()["choices"][0]["message"]["role"] == "user"
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as stream:
        first = next(line for line in stream.iter_lines() if line.startswith("data: {"))
    assert '"role":"bot"' in first.replace(" ", "")


def test_logged_requests_show_their_prompt_cut_to_max_log_len(served, caplog):
    import logging

    from fastapi.testclient import TestClient

    from jaxserve.entrypoints.openai.api_server import build_app

    client = TestClient(build_app(served.llm, ["m"], log_requests=True, max_log_len=6))
    with caplog.at_level(logging.INFO, logger="jaxserve.entrypoints.openai.serving_common"):
        resp = client.post("/v1/completions", json={"model": "m", "prompt": "Once upon a time",
                                                    "max_tokens": 2})
    assert resp.status_code == 200
    (line,) = [r.getMessage() for r in caplog.records if "prompt " in r.getMessage()]
    assert "prompt 'Once u'," in line and "max_tokens=2" in line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxserve.entrypoints.openai.serving_common"):
        resp = client.post("/v1/completions", json={"model": "m", "prompt": "Once",
                                                    "max_tokens": 2,
                                                    "stop_token_ids": [7] * 100_000})
    assert resp.status_code == 200
    (line,) = [r.getMessage() for r in caplog.records if "prompt " in r.getMessage()]
    assert "stop_token_ids=[7, 7, 7, 7, 7, 7, ...] (100000 in all)" in line and len(line) < 2000


def test_logged_params_show_every_field_and_cut_long_ones():
    from jaxserve.entrypoints.openai.serving_common import LOGGED_ITEMS, logged_params
    from jaxserve.sampling_params import SamplingParams

    params = SamplingParams(stop_token_ids=list(range(500)), logit_bias={5: 1.0}, seed=3)
    assert logged_params(params, None) == repr(params).replace(
        repr(list(range(500))), f"{list(range(LOGGED_ITEMS))}"[:-1] + ", ...] (500 in all)")
    assert repr(params) == logged_params(params, 500)
