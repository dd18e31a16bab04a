"""Engine test helpers: HF greedy references and small engine settings."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import numpy as np
import pytest

# Small buckets keep the number of compiled step shapes (and CI time) low.
SMALL_ENGINE = dict(max_model_len=128, num_kv_blocks=160, block_size=16, max_num_seqs=16,
                    max_num_batched_tokens=128, token_buckets=[16, 32, 64, 128],
                    request_buckets=[4, 16])
# For the costliest engines (interpreted TPU kernels, speculation's two programs a bucket, draft
# models): two token buckets and one request bucket.
FEW_BUCKETS = dict(token_buckets=[32, 128], request_buckets=[16])


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def backend_compiles() -> Iterator[list[str]]:
    """Every XLA backend compilation in the process while the block runs."""
    events: list[str] = []

    def listener(event: str, duration: float, **kwargs: object) -> None:
        if event == COMPILE_EVENT:
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def random_prompts(n: int, low: int, high: int, seed: int, vocab: int = 320) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, size=int(rng.integers(low, high + 1))).tolist()
            for _ in range(n)]


def hf_greedy(path, prompts: list[list[int]], max_new_tokens: int,
              **constraint: object) -> list[list[int]]:
    """HF `generate`, greedy, one prompt at a time (no padding), EOS ignored; `constraint`:
    arguments of its logits processors (bad_words_ids, sequence_bias, ...)."""
    import torch
    from hf_checkpoints import hf_model

    model = hf_model(path)
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, **constraint)
            outs.append(out[0, len(ids):].tolist())
    return outs


def assert_no_leaks(engine) -> None:  # noqa: ANN001 (LLMEngine)
    """Every block but the null block is free on every rank, and no request state is left."""
    for sched in engine.core.schedulers:
        assert not sched.running and not sched.waiting and not sched.requests
        assert sched.kv.num_free_blocks == sched.kv.num_blocks - 1
        assert not sched.kv.req_to_blocks
    router = engine.core.router  # None: one rank, nothing routed
    assert router is None or (not router.routes and not router.groups)
    assert not engine.output_processor.states and not engine.output_processor.parent_of


def hf_log_softmax(path, prompt: list[int]) -> np.ndarray:
    """f32[P, V]: HF's log-softmax at each prompt position."""
    import torch
    from hf_checkpoints import hf_model

    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1).numpy()


def check_against_hf(path, prompt: list[int], got, k: int, first: int = 1) -> None:
    """Each position's own token (logprob and rank) and top-k (by rank) from `first` on equal
    HF's log-softmax of `prompt` (vLLM's shape: position -> {token id: Logprob})."""
    from jaxserve.outputs import Logprob

    ref = hf_log_softmax(path, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for pos in range(first, len(prompt)):
        entry, row, token = got[pos], ref[pos - 1], prompt[pos]
        assert isinstance(entry[token], Logprob)
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        # The rank counts the tokens more likely; ties within fp32 noise may go either way.
        assert 1 + np.sum(row > row[token] + 1e-4) <= entry[token].rank \
            <= 1 + np.sum(row > row[token] - 1e-4)
        descending = np.sort(row)[::-1]
        tops = {lp.rank: lp for tid, lp in entry.items() if tid != token}
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(float(row[tid]), abs=1e-4)
            if tid != token or lp.rank <= k:
                assert lp.logprob == pytest.approx(float(descending[lp.rank - 1]), abs=1e-4)
        assert len(entry) in (k, k + 1) and all(r <= k for r in tops)


# Chunked prefill in steps of 32 tokens and async scheduling: what a family's tokens are checked
# under, with a prefix that a second wave of prompts finds cached.
CHUNKED_ASYNC = dict(max_num_batched_tokens=32, token_buckets=[16, 32], async_scheduling=True)


def greedy_with_a_cached_prefix(llm, sampling, seed: int,  # noqa: ANN001 (LLM, SamplingParams)
                                ) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of 8 random prompts and a 40-token prefix, then of 3 prompts extending that
    prefix, which start from its cached blocks (asserted): (the prompts, their tokens)."""
    prompts = random_prompts(8, 1, 60, seed=seed)
    prefix = random_prompts(1, 40, 41, seed=seed + 1)[0]
    sharing = [prefix + tail for tail in random_prompts(3, 5, 20, seed=seed + 2)]
    got = []
    for wave in (prompts + [prefix], sharing):
        outs = llm.generate([{"prompt_token_ids": p} for p in wave], sampling, use_tqdm=False)
        got += [o.outputs[0].token_ids for o in outs]
    assert llm.engine.core.scheduler.kv.total_stats.hits >= 3 * 32  # two blocks each
    assert_no_leaks(llm.engine)
    return prompts + [prefix] + sharing, got
