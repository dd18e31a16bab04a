"""The official `openai` client against the server gets what the offline `LLM` gives."""

from __future__ import annotations

import httpx
import openai
import pytest

from engine_helpers import assert_no_leaks
from jaxserve import SamplingParams
from server_helpers import API_KEY, MODEL_NAME, wait_engine_idle

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
EXTRA = {"ignore_eos": True, "return_token_ids": True}
MESSAGES = [{"role": "system", "content": "You are a robot."},
            {"role": "user", "content": "Hello robot"}]


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=API_KEY, max_retries=0)


def _streamed(chunks: list, index: int = 0) -> tuple[str, list[int], str | None]:
    text, ids, reason = "", [], None
    for chunk in chunks:
        for c in chunk.choices:
            if c.index == index:
                text += c.text if hasattr(c, "text") else (c.delta.content or "")
                ids += c.token_ids or []
                reason = c.finish_reason or reason
    return text, ids, reason


@pytest.mark.parametrize("prompt", ["Once upon a time", [5, 6, 7, 8, 9, 10]])
def test_completions_match_offline_greedy_streamed_and_not(client, offline, prompt):
    ref = offline.generate(prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt},
                           GREEDY, use_tqdm=False)[0]
    want = ref.outputs[0]
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body=EXTRA)
    full = client.completions.create(**kwargs)
    assert full.choices[0].text == want.text
    assert full.choices[0].token_ids == want.token_ids
    assert full.choices[0].finish_reason == "length"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (
        len(ref.prompt_token_ids), 12)
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    assert len(chunks) > 3
    assert _streamed(chunks) == (want.text, want.token_ids, "length")
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_chat_matches_offline_chat_streamed_and_not(client, offline):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = offline.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0]
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0,
                  extra_body=EXTRA)
    full = client.chat.completions.create(**kwargs)
    msg = full.choices[0].message
    assert (msg.role, msg.content, full.choices[0].token_ids) == ("assistant", want.text,
                                                                  want.token_ids)
    assert full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert _streamed(chunks) == (want.text, want.token_ids, "length")
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stop_strings_n_and_batched_prompts(client, offline):
    free = offline.generate("The robot liked", GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = free[3:6]
    out = client.completions.create(model=MODEL_NAME, prompt=["The robot liked", "Once upon"],
                                    n=2, max_tokens=12, temperature=0, stop=stop,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text == free[:free.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    once = offline.generate("Once upon", SamplingParams(temperature=0.0, max_tokens=12,
                                                        ignore_eos=True, stop=[stop]),
                            use_tqdm=False)[0].outputs[0]
    assert out.choices[2].text == out.choices[3].text == once.text
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="The robot liked",
                                            max_tokens=12, temperature=0, stop=[stop],
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == free[:free.index(stop)]


def test_logprobs_name_the_sampled_tokens(client, offline):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    want = offline.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
    out = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=6,
                                    temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(
        [e[t].logprob for t, e in zip(want.token_ids, want.logprobs)], abs=1e-5)
    assert all(max(top.values()) <= lp_ + 1e-5 for top, lp_ in zip(lp.top_logprobs,
                                                                    lp.token_logprobs))
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    # Greedy: the sampled token is the likeliest; the top two come by rank.
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6)
               and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)


def test_models_health_and_metrics(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{served.url}/health").status_code == 200

    def scrape() -> dict[str, float]:
        text = httpx.get(f"{served.url}/metrics", headers=served.headers).text
        return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("jaxserve:") and "_bucket" not in line}

    before = scrape()
    client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=7,
                              temperature=0, extra_body={"ignore_eos": True})
    after = scrape()
    assert after["jaxserve:generation_tokens_total"] - before[
        "jaxserve:generation_tokens_total"] == 7
    assert after["jaxserve:time_to_first_token_seconds_count"] == before.get(
        "jaxserve:time_to_first_token_seconds_count", 0) + 1
    assert after["jaxserve:inter_token_latency_seconds_count"] - before.get(
        "jaxserve:inter_token_latency_seconds_count", 0) == 6
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_hit_rate", "num_preemptions_total", "prompt_tokens_total"):
        assert f"jaxserve:{name}" in after
    wait_engine_idle(served.llm)
    served.llm.call_in_engine(assert_no_leaks).result()
