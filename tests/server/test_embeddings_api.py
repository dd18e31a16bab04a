"""`POST /v1/embeddings` through the openai client: a pooling server's embeddings equal HF's
last-token hidden states (normalised), in floats and in base64; bad bodies are 400s naming
the field; a generating server refuses embeddings and a pooling one text."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from engine_helpers import SMALL_ENGINE, random_prompts
from hf_checkpoints import hf_model
from server_helpers import API_KEY, MODEL_NAME, Served

PROMPTS = random_prompts(3, 3, 40, seed=5)


@pytest.fixture(scope="module")
def qwen3(hf_checkpoint):
    return hf_checkpoint("qwen3")


@pytest.fixture(scope="module")
def pooling_server(qwen3, compile_cache_dir) -> Iterator[Served]:
    from jaxserve import AsyncLLM
    from jaxserve.entrypoints.openai.api_server import BackgroundServer, build_app

    llm = AsyncLLM(model=str(qwen3), runner="pooling", compilation_cache_dir=compile_cache_dir,
                   **(SMALL_ENGINE | dict(token_buckets=[128], request_buckets=[16])))
    server = BackgroundServer(build_app(llm, [MODEL_NAME], api_key=API_KEY)).start()
    yield Served(llm, server.url)
    server.stop()
    llm.shutdown()


def hf_embedding(path, prompt: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        hidden = hf_model(path).model(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1]
    return (hidden / hidden.norm()).numpy()


def test_embeddings_through_the_openai_client(pooling_server, qwen3):
    client = openai.OpenAI(base_url=f"{pooling_server.url}/v1", api_key=API_KEY, max_retries=0)
    got = client.embeddings.create(model=MODEL_NAME, input=PROMPTS)
    assert [d.index for d in got.data] == [0, 1, 2]
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, PROMPTS))
    for prompt, data in zip(PROMPTS, got.data):
        np.testing.assert_allclose(data.embedding, hf_embedding(qwen3, prompt), atol=2e-5)
    encoded = httpx.post(f"{pooling_server.url}/v1/embeddings", headers=pooling_server.headers,
                         json={"input": PROMPTS[0], "encoding_format": "base64"}).json()
    floats = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(floats, got.data[0].embedding, atol=1e-6)


def test_a_conversation_is_embedded_through_the_chat_template(pooling_server, qwen3):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Once upon a time"}]
    tokenizer = AutoTokenizer.from_pretrained(str(qwen3))
    for ask_reply in (False, True):  # vLLM's default: no generation prompt
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=ask_reply,
                                                 tokenize=True)["input_ids"])
        got = httpx.post(f"{pooling_server.url}/v1/embeddings", headers=pooling_server.headers,
                         json={"messages": messages, "add_generation_prompt": ask_reply,
                               **({} if ask_reply else {"encoding_format": "float"})}).json()
        assert got["usage"]["prompt_tokens"] == len(ids)
        np.testing.assert_allclose(got["data"][0]["embedding"], hf_embedding(qwen3, ids),
                                   atol=2e-5)


@pytest.mark.parametrize("body, field", [
    ({"input": []}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [[10**6]]}, "input"),
    ({"input": [1, 2], "dimensions": 8}, "dimensions"),
    ({"input": [1, 2], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": [1] * 200}, "input"),
    ({"input": [1, 2], "model": "other"}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template": "{{ x }}"},
     "chat_template"),
    ({"messages": [{"role": "user", "content": "a " * 300}]}, "messages"),
])
def test_bad_embedding_bodies_name_the_field(pooling_server, body, field):
    r = httpx.post(f"{pooling_server.url}/v1/embeddings", headers=pooling_server.headers,
                   json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == field, r.text


def test_each_server_refuses_the_other_kind(pooling_server, served):
    r = httpx.post(f"{served.url}/v1/embeddings", headers=served.headers,
                   json={"input": [1, 2, 3]})
    assert r.status_code == 400 and "pooling" in r.json()["error"]["message"]
    r = httpx.post(f"{pooling_server.url}/v1/completions", headers=pooling_server.headers,
                   json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 400 and "runner='pooling'" in r.json()["error"]["message"]
    assert httpx.get(f"{pooling_server.url}/health").status_code == 200
