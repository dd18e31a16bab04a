"""A server with speculative decoding: the same greedy completion as the plain server, and
vLLM's spec-decode series on /metrics."""

from __future__ import annotations

import httpx

from server_helpers import API_KEY, MODEL_NAME

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "adaptive": False}
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 4  # repeats: the n-gram proposer drafts from it


def test_spec_server_matches_plain_and_serves_spec_metrics(served, engine_args):
    from jaxserve import AsyncLLM
    from jaxserve.entrypoints.openai.api_server import BackgroundServer, build_app

    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    headers = served.headers
    plain = httpx.post(f"{served.url}/v1/completions", headers=headers, json=body, timeout=60)
    llm = AsyncLLM(**engine_args, speculative_config=NGRAM)
    server = BackgroundServer(build_app(llm, [MODEL_NAME], api_key=API_KEY)).start()
    try:
        spec = httpx.post(f"{server.url}/v1/completions", headers=headers, json=body, timeout=60)
        metrics = httpx.get(f"{server.url}/metrics", headers=headers).text
    finally:
        server.stop()
        llm.shutdown()
    assert plain.status_code == spec.status_code == 200
    assert spec.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    values = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
              if line.startswith("vllm:spec_decode")}
    drafted = values['vllm:spec_decode_num_draft_tokens_total{model_name="%s"}' % MODEL_NAME]
    accepted = values['vllm:spec_decode_num_accepted_tokens_total{model_name="%s"}' % MODEL_NAME]
    assert drafted >= accepted > 0
    per_pos = [v for k, v in values.items() if "per_pos" in k]
    assert len(per_pos) == 3 and sum(per_pos) == accepted
