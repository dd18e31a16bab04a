"""64 concurrent streaming clients, arriving over the run, get exactly the offline tokens."""

from __future__ import annotations

import asyncio

import numpy as np
import openai

from engine_helpers import assert_no_leaks, random_prompts
from jaxserve import SamplingParams
from server_helpers import API_KEY, MODEL_NAME, wait_engine_idle

NUM_CLIENTS = 64
ARRIVAL_GAP_S = 0.01  # clients keep arriving while earlier ones decode (a request lasts ~30-100 ms)


async def _client(client: openai.AsyncOpenAI, i: int, prompt: list[int], max_tokens: int,
                  ) -> list[int]:
    await asyncio.sleep(i * ARRIVAL_GAP_S)
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    ids: list[int] = []
    async for chunk in stream:
        for choice in chunk.choices:
            ids += choice.token_ids or []
    return ids


def test_64_streaming_clients_get_the_offline_tokens_while_requests_keep_arriving(served,
                                                                                   offline):
    prompts = random_prompts(NUM_CLIENTS, 4, 40, seed=77)
    max_tokens = np.random.default_rng(5).integers(6, 25, size=NUM_CLIENTS).tolist()
    refs = offline.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                             for m in max_tokens], use_tqdm=False)
    before = served.llm.stats()

    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=API_KEY,
                                      max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(_client(client, i, p, m) for i, (p, m) in
                                          enumerate(zip(prompts, max_tokens))))

    results = asyncio.run(run())
    for ids, ref in zip(results, refs):
        assert ids == ref.outputs[0].token_ids
    after = served.llm.stats()
    # Engine side: requests got their first token in steps where others were decoding.
    assert after.num_join_steps > before.num_join_steps
    assert after.num_joined_requests - before.num_joined_requests >= NUM_CLIENTS // 4
    wait_engine_idle(served.llm)
    served.llm.call_in_engine(assert_no_leaks).result()


async def _stream_events(client: openai.AsyncOpenAI, prompt: list[int], max_tokens: int,
                         events: list[str], name: str, started: asyncio.Event | None = None,
                         ) -> None:
    """Stream a completion, appending `name` + ":first" / ":end" to `events` as they happen."""
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text is not None and f"{name}:first" not in events:
            events.append(f"{name}:first")
            if started is not None:
                started.set()
    events.append(f"{name}:end")


def test_a_request_sent_mid_stream_streams_before_the_first_one_ends(served):
    """Client side, ordered by steps rather than by the clock: a request sent once another has
    its first token gets its own first token ~100 steps before that one's last."""
    prompts = random_prompts(2, 4, 5, seed=78)
    events: list[str] = []

    async def run() -> None:
        async with openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=API_KEY,
                                      max_retries=0, timeout=120) as client:
            started = asyncio.Event()
            long = asyncio.create_task(_stream_events(client, prompts[0], 100, events, "a",
                                                      started))
            await started.wait()
            await _stream_events(client, prompts[1], 4, events, "b")
            await long

    asyncio.run(run())
    assert events.index("a:first") < events.index("b:first") < events.index("a:end"), events
    wait_engine_idle(served.llm)
    served.llm.call_in_engine(assert_no_leaks).result()
