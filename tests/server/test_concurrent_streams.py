"""64 concurrent streaming clients, arriving over the run, get exactly the offline tokens."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import openai

from engine_helpers import assert_no_leaks, random_prompts
from jaxserve import SamplingParams
from server_helpers import API_KEY, MODEL_NAME, wait_engine_idle

NUM_CLIENTS = 64
ARRIVAL_GAP_S = 0.01  # clients keep arriving while earlier ones decode (a request lasts ~30-100 ms)


async def _client(client: openai.AsyncOpenAI, i: int, prompt: list[int], max_tokens: int,
                  ) -> tuple[list[int], float, float, float]:
    await asyncio.sleep(i * ARRIVAL_GAP_S)
    start = time.monotonic()
    stream = await client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True})
    ids: list[int] = []
    first = None
    async for chunk in stream:
        for choice in chunk.choices:
            ids += choice.token_ids or []
            if first is None and ids:
                first = time.monotonic()
    return ids, start, first, time.monotonic()


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
    for (ids, *_), ref in zip(results, refs):
        assert ids == ref.outputs[0].token_ids
    after = served.llm.stats()
    # Engine side: requests got their first token in steps where others were decoding.
    assert after.num_join_steps > before.num_join_steps
    assert after.num_joined_requests - before.num_joined_requests >= NUM_CLIENTS // 4
    # Client side: a request sent after another one had started streaming got its first token
    # before that one ended (no waiting for the batch to drain).
    assert any(start_b > first_a and first_b < end_a
               for _, _, first_a, end_a in results for _, start_b, first_b, _ in results)
    wait_engine_idle(served.llm)
    served.llm.call_in_engine(assert_no_leaks).result()
