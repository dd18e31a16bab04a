"""Completions with echo + logprobs (+ max_tokens=0): an evaluation harness's log-likelihood
request. The prompt's per-token logprobs equal HF's log-softmax of the same prompt (1e-4)."""

from __future__ import annotations

import httpx
import pytest

from server_helpers import MODEL_NAME

PROMPT = [3, 17, 250, 81, 9, 120, 44, 300, 7, 61, 15, 200]


def test_echo_logprobs_max_tokens_0_scores_the_prompt_as_hf(served, hf_checkpoint):
    import torch
    from hf_checkpoints import hf_model

    body = dict(model=MODEL_NAME, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0,
                temperature=0.0)
    resp = httpx.post(f"{served.url}/v1/completions", json=body, headers=served.headers,
                      timeout=60)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(PROMPT) and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and resp.json()["usage"]["completion_tokens"] == 0
    with torch.no_grad():
        logits = hf_model(hf_checkpoint("llama"))(torch.tensor([PROMPT])).logits[0]
    ref = torch.log_softmax(logits.float(), dim=-1).numpy()
    for pos in range(1, len(PROMPT)):
        assert lp["token_logprobs"][pos] == pytest.approx(float(ref[pos - 1, PROMPT[pos]]),
                                                          abs=1e-4)
        # Keyed by text: byte tokens that decode alike ("\ufffd") share one key.
        assert 1 <= len(lp["top_logprobs"][pos]) <= 3
    assert lp["text_offset"] == sorted(lp["text_offset"])


def test_echo_logprobs_with_tokens_puts_the_prompt_first(served):
    body = dict(model=MODEL_NAME, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3,
                temperature=0.0, ignore_eos=True)
    resp = httpx.post(f"{served.url}/v1/completions", json=body, headers=served.headers,
                      timeout=60)
    assert resp.status_code == 200, resp.text
    lp = resp.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT) + 3
    assert all(x is not None for x in lp["token_logprobs"][1:])


def test_echo_logprobs_streaming_is_a_400_naming_echo(served):
    body = dict(model=MODEL_NAME, prompt=PROMPT, echo=True, logprobs=1, stream=True)
    resp = httpx.post(f"{served.url}/v1/completions", json=body, headers=served.headers,
                      timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "echo"


def test_prompt_logprobs_field_gives_vllms_entries_equal_to_hf(served, hf_checkpoint):
    from engine_helpers import check_against_hf
    from jaxserve.outputs import Logprob

    body = dict(model=MODEL_NAME, prompt=PROMPT, prompt_logprobs=3, max_tokens=2,
                temperature=0.0)
    with httpx.Client(base_url=f"{served.url}/v1", headers=served.headers, timeout=60) as http:
        resp = http.post("/completions", json=body)
        assert resp.status_code == 200, resp.text
        got = resp.json()["choices"][0]["prompt_logprobs"]
        entries = [None if e is None else {int(t): Logprob(**v) for t, v in e.items()}
                   for e in got]
        check_against_hf(hf_checkpoint("llama"), PROMPT, entries, 3)
        plain = http.post("/completions", json={**body, "prompt_logprobs": None}).json()
        assert plain["choices"][0]["prompt_logprobs"] is None  # costs nothing unless asked
        for bad, param in [({"stream": True}, "prompt_logprobs"),
                           ({"prompt_logprobs": -1}, "prompt_logprobs"),
                           ({"prompt_logprobs": 1000}, "prompt_logprobs"),
                           ({"echo": True, "logprobs": 2}, "prompt_logprobs")]:
            resp = http.post("/completions", json={**body, **bad})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == param, bad
        chat = http.post("/chat/completions", json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
            "prompt_logprobs": 1})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "prompt_logprobs"
