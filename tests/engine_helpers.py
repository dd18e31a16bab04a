"""Engine test helpers: HF greedy references and small engine settings."""

from __future__ import annotations

import numpy as np

# Small buckets keep the number of compiled step shapes (and CI time) low.
SMALL_ENGINE = dict(max_model_len=128, num_kv_blocks=160, block_size=16, max_num_seqs=16,
                    max_num_batched_tokens=128, token_buckets=[16, 32, 64, 128],
                    request_buckets=[4, 16])


def random_prompts(n: int, low: int, high: int, seed: int, vocab: int = 320) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, size=int(rng.integers(low, high + 1))).tolist()
            for _ in range(n)]


def hf_greedy(path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF `generate`, greedy, one prompt at a time (no padding), EOS ignored."""
    import torch
    from hf_checkpoints import hf_model

    model = hf_model(path)
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            outs.append(out[0, len(ids):].tolist())
    return outs


def assert_no_leaks(engine) -> None:  # noqa: ANN001 (LLMEngine)
    """Every block but the null block is free on every rank, and no request state is left."""
    for sched in engine.core.schedulers:
        assert not sched.running and not sched.waiting and not sched.requests
        assert sched.kv.num_free_blocks == sched.kv.num_blocks - 1
        assert not sched.kv.req_to_blocks
    assert not engine.core.router.routes and not engine.core.router.groups
    assert not engine.output_processor.states and not engine.output_processor.parent_of
