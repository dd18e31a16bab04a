"""vLLM's extra endpoints (/tokenize, /detokenize, /version, /ping) and `vllm:` metrics."""

from __future__ import annotations

import httpx

from jaxserve import __version__
from server_helpers import MODEL_NAME

MESSAGES = [{"role": "user", "content": "Hello robot"}]


def test_chat_template_options_are_honoured_on_tokenize_and_chat(served):
    tokenizer = served.llm.tokenizer
    open_reply = [*MESSAGES, {"role": "assistant", "content": "Hello"}]
    options = {"add_generation_prompt": False, "continue_final_message": True,
               "chat_template_kwargs": {"unused_variable": 1}}
    with httpx.Client(base_url=served.url, headers=served.headers, timeout=60) as http:
        got = http.post("/tokenize", json={"messages": open_reply, **options}).json()
        want = tokenizer.apply_chat_template(open_reply, add_generation_prompt=False,
                                             continue_final_message=True)
        assert got["tokens"] == want
        assert want != tokenizer.apply_chat_template(open_reply)  # the template closes it
        chat = http.post("/v1/chat/completions", json={
            "model": MODEL_NAME, "messages": open_reply, "max_tokens": 2, **options}).json()
        assert chat["usage"]["prompt_tokens"] == len(want)
        bad = http.post("/v1/chat/completions", json={
            "model": MODEL_NAME, "messages": MESSAGES, "chat_template_kwargs": {"tokenize": 0}})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "chat_template_kwargs"
        both = http.post("/tokenize", json={"messages": open_reply,
                                            "continue_final_message": True})
        assert both.status_code == 400 and "continue_final_message" in both.text


def test_the_servers_chat_template_replaces_the_models(served):
    from fastapi.testclient import TestClient

    from jaxserve.entrypoints.openai.api_server import build_app

    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    app = build_app(served.llm, [MODEL_NAME], chat_template=template)
    got = TestClient(app).post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert got == served.llm.tokenizer.encode("[Hello robot]", add_special_tokens=False)


def test_invocations_routes_chat_and_completion_bodies(served):
    with httpx.Client(base_url=served.url, headers=served.headers, timeout=60) as http:
        greedy = {"model": MODEL_NAME, "max_tokens": 3, "temperature": 0}
        for path, body in (("/v1/completions", {"prompt": "Once upon"}),
                           ("/v1/chat/completions", {"messages": MESSAGES})):
            want = http.post(path, json=greedy | body).json()
            got = http.post("/invocations", json=greedy | body).json()
            assert got["object"] == want["object"] and got["choices"] == want["choices"]
        bad = http.post("/invocations", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
        assert http.post("/invocations", json={"max_tokens": 2}).status_code == 400
        assert http.post("/invocations", json=[1]).status_code == 400
        refused = http.post("/invocations", json={"prompt": "x", "use_beam_search": True})
        assert refused.json()["error"]["param"] == "use_beam_search"


def test_ping_and_version(served):
    assert httpx.get(f"{served.url}/ping").status_code == 200  # no key, as /health
    assert httpx.post(f"{served.url}/ping").status_code == 200
    assert httpx.get(f"{served.url}/version").status_code == 401
    resp = httpx.get(f"{served.url}/version", headers=served.headers)
    assert resp.json() == {"version": __version__}


def test_tokenize_and_detokenize_round_trip(served):
    tokenizer = served.llm.tokenizer
    text = "Once upon a time"
    with httpx.Client(base_url=served.url, headers=served.headers, timeout=60) as http:
        got = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": text}).json()
        ids = tokenizer.encode(text)
        assert got == {"count": len(ids), "max_model_len": served.llm.max_model_len,
                       "tokens": ids, "token_strs": None}
        bare = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False,
                                            "return_token_strs": True}).json()
        assert bare["tokens"] == tokenizer.encode(text, False) != ids
        assert "".join(bare["token_strs"]) == text
        chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
        assert chat["tokens"] == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
        assert http.post("/detokenize", json={"tokens": bare["tokens"]}).json() == {
            "prompt": text}

        refused = http.post("/tokenize", json={"messages": MESSAGES, "chat_template": "x"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
        for body, field in (({"prompt": 5}, "prompt"), ({"messages": "hi"}, "messages")):
            error = http.post("/tokenize", json=body).json()["error"]  # one member's error
            assert error["param"] == field and "more problem" not in error["message"], error
        bad = http.post("/detokenize", json={"tokens": [10**6]})
        assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"][
            "message"]
        assert http.post("/tokenize", json={"model": "gpt-4", "prompt": "x"}).status_code == 404


def _scrape(served) -> dict[str, float]:
    """Each series' value, summed over its label sets (request_success has one per reason)."""
    text = httpx.get(f"{served.url}/metrics", headers=served.headers).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("vllm:", "jaxserve:")) and "_bucket" not in line:
            name = line.split("{")[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def test_vllm_named_metrics_are_served_beside_the_jaxserve_ones(served):
    before = _scrape(served)
    resp = httpx.post(f"{served.url}/v1/completions", headers=served.headers, timeout=60, json={
        "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert resp.status_code == 200
    after = _scrape(served)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total",
                 "num_preemptions_total", "prompt_tokens_total"):
        assert f"vllm:{name}" in after and f"jaxserve:{name}" in after
    for name, grew in (("generation_tokens_total", 5), ("time_to_first_token_seconds_count", 1),
                       ("inter_token_latency_seconds_count", 4),
                       ("e2e_request_latency_seconds_count", 1), ("request_success_total", 1)):
        for prefix in ("vllm", "jaxserve"):
            key = f"{prefix}:{name}"
            assert after[key] - before.get(key, 0) == grew, key


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(served):
    long_prompt = list(range(5, 5 + 300))  # longer than the context
    with httpx.Client(base_url=f"{served.url}/v1", headers=served.headers, timeout=60) as http:
        greedy = {"model": MODEL_NAME, "max_tokens": 3, "temperature": 0}
        cut = http.post("/completions", json=greedy | {"prompt": long_prompt[:40],
                                                       "truncate_prompt_tokens": 4}).json()
        tail = http.post("/completions", json=greedy | {"prompt": long_prompt[36:40]}).json()
        assert cut["choices"][0]["text"] == tail["choices"][0]["text"]
        assert cut["usage"]["prompt_tokens"] == 4
        assert http.post("/completions", json=greedy | {"prompt": long_prompt}).status_code \
            == 400
        fits = http.post("/completions", json=greedy | {"prompt": long_prompt,
                                                        "truncate_prompt_tokens": -1,
                                                        "max_tokens": 1}).json()
        assert fits["usage"]["prompt_tokens"] == served.llm.max_model_len - 1
        chat = http.post("/chat/completions", json=greedy | {
            "messages": MESSAGES, "truncate_prompt_tokens": 2}).json()
        assert chat["usage"]["prompt_tokens"] == 2
        bad = http.post("/completions", json=greedy | {"prompt": "x",
                                                       "truncate_prompt_tokens": 0})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "truncate_prompt_tokens"
