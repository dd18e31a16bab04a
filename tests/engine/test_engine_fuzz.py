"""A bounded engine fuzz: random arrivals, aborts, n > 1, shared prefixes, a tiny KV pool and
reused ids, for at least 5,000 steps. Nothing leaks, nothing is lost, and every request that
ran to the end has the tokens it gets when run alone."""

from __future__ import annotations

import dataclasses

import numpy as np

from engine_helpers import assert_no_leaks
from jaxserve import LLMEngine, SamplingParams

NUM_STEPS = 5000
# Tiny shapes keep a step at a few ms; 5 blocks hold one 64-token sequence (4 + the null
# block), so 10 blocks hold two: admission waits and preemption happen all the time.
FUZZ_ENGINE = dict(max_model_len=64, num_kv_blocks=10, block_size=16, max_num_seqs=6,
                   max_num_batched_tokens=32, token_buckets=[8, 16, 32], request_buckets=[2, 6])
MAX_TOKENS = 8
STOP_IDS = list(range(2, 320, 5))  # a fifth of the vocabulary: many requests stop early, so
# their next step is already in flight when they finish (what an id reused at once must survive)
PARAMS = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=STOP_IDS),
          SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True),
          SamplingParams(n=2, temperature=0.8, top_k=20, seed=11, max_tokens=MAX_TOKENS,
                         stop_token_ids=STOP_IDS)]


def _prompts(rng: np.random.Generator) -> list[list[int]]:
    """Three families that share a 16- or 32-token prefix (whole blocks: prefix-cache hits)."""
    prompts = []
    for _ in range(3):
        prefix = rng.integers(2, 320, int(rng.choice([16, 32]))).tolist()
        prompts += [prefix + rng.integers(2, 320, int(rng.integers(1, 20))).tolist()
                    for _ in range(6)]
    return prompts


def _run_alone(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    engine.add_request("alone", {"prompt_token_ids": prompt}, params)
    while True:
        for out in engine.step():
            if out.finished:
                return [c.token_ids for c in out.outputs]


def test_engine_fuzz(llama, compile_cache_dir):
    rng = np.random.default_rng(2100)
    prompts = _prompts(rng)
    args = dict(model=str(llama), compilation_cache_dir=compile_cache_dir, **FUZZ_ENGINE)
    engine = LLMEngine.from_engine_args(**args)
    alone = LLMEngine.from_engine_args(**(args | {"num_kv_blocks": 64}))
    reference: dict[tuple[int, int], list[list[int]]] = {}

    added: dict[str, tuple[int, int, int]] = {}  # active id -> prompt, params, max_tokens
    aborted = finished = steps = 0
    while steps < NUM_STEPS or engine.has_unfinished_requests():
        if steps < NUM_STEPS and rng.random() < 0.35:
            free = [f"r{i}" for i in range(12) if f"r{i}" not in added]  # ids come back
            if free:
                rid = str(rng.choice(free))
                key = (int(rng.integers(len(prompts))), int(rng.integers(len(PARAMS))))
                max_tokens = int(rng.integers(1, MAX_TOKENS + 1))
                engine.add_request(rid, {"prompt_token_ids": prompts[key[0]]},
                                   dataclasses.replace(PARAMS[key[1]], max_tokens=max_tokens))
                added[rid] = (*key, max_tokens)
        if added and rng.random() < 0.03:
            victim = str(rng.choice(sorted(added)))
            engine.abort_request(victim)
            del added[victim]
            aborted += 1
        for out in engine.step():
            if not out.finished:
                continue
            prompt_i, params_i, max_tokens = added.pop(out.request_id)
            if (prompt_i, params_i) not in reference:
                reference[prompt_i, params_i] = _run_alone(alone, prompts[prompt_i],
                                                           PARAMS[params_i])
            want = [t[:max_tokens] for t in reference[prompt_i, params_i]]
            assert [c.token_ids for c in out.outputs] == want, out.request_id
            finished += 1
        steps += 1
    assert not added  # every request that was not aborted finished: none lost
    assert finished > 500 and aborted > 20, (finished, aborted)
    assert engine.stats().num_preemptions > 10
    assert engine.stats().prefix_cache_hits > 0
    assert_no_leaks(engine)
    assert_no_leaks(alone)
