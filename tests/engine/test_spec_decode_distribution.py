"""Sampling with speculation draws from the target's distribution: a chi-square test of the
joint of the first three sampled tokens against HF's exact probabilities, on an 8-token
vocabulary, with the same test shown to fail when drafts are taken unverified. Proposers:
n-gram drafts (host), and a draft model (device): an unrelated random checkpoint of the same
vocabulary, another width, depth and head count, so its drafts are often rejected."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

PROMPT = [3, 1, 6, 0, 5, 2, 7, 4, 3, 1, 6]  # every token, some repeated: n-gram drafts for any
VOCAB = 8
NUM_TOKENS = 3
NUM_SAMPLES = 3000
TEMPERATURE = 1.0
ENGINE = dict(max_model_len=32, num_kv_blocks=512, block_size=16, max_num_seqs=64,
              max_num_batched_tokens=512, token_buckets=[64, 128, 256, 512],
              request_buckets=[16, 64], max_logprobs=4)


def exact_joint(path) -> dict[tuple[int, ...], float]:
    """P(x0, x1, x2 | PROMPT) from HF's logits at temperature 1: one forward per (x0, x1)."""
    import torch
    from hf_checkpoints import hf_model

    model = hf_model(path)
    joint = {}
    with torch.no_grad():
        for x0, x1 in itertools.product(range(VOCAB), repeat=2):
            logits = model(torch.tensor([PROMPT + [x0, x1]])).logits[0, -3:].double()
            p = torch.softmax(logits / TEMPERATURE, dim=-1).numpy()
            for x2 in range(VOCAB):
                joint[(x0, x1, x2)] = p[0, x0] * p[1, x1] * p[2, x2]
    return joint


def chi_square(counts: dict[tuple[int, ...], int], joint: dict[tuple[int, ...], float],
               ) -> tuple[float, int]:
    """Pearson's statistic over the cells expecting >= 5 samples (the rest pooled into one),
    and its degrees of freedom."""
    n = sum(counts.values())
    big = [c for c, p in joint.items() if p * n >= 5]
    small = [c for c in joint if c not in set(big)]
    observed = [counts.get(c, 0) for c in big] + [sum(counts.get(c, 0) for c in small)]
    expected = [joint[c] * n for c in big] + [sum(joint[c] for c in small) * n]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    return stat, len(observed) - 1


def critical_value(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 1e-3 (z: the normal's), by Wilson and Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def sample_joint(llm: LLM) -> dict[tuple[int, ...], int]:
    params = [SamplingParams(temperature=TEMPERATURE, max_tokens=NUM_TOKENS, ignore_eos=True,
                             seed=seed) for seed in range(NUM_SAMPLES)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * NUM_SAMPLES, params, use_tqdm=False)
    counts: dict[tuple[int, ...], int] = {}
    for out in outs:
        key = tuple(out.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.fixture(scope="module")
def small_vocab(hf_checkpoint):
    path = hf_checkpoint("llama", vocab_size=VOCAB)
    return path, exact_joint(path)


def proposer_args(proposer: str, hf_checkpoint) -> dict:  # noqa: ANN001 (the fixture)
    """Engine arguments of the proposer; the draft model's engine compiles 4 step programs."""
    if proposer == "ngram":
        return {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                       "prompt_lookup_min": 1, "prompt_lookup_max": 2,
                                       "adaptive": False}}
    draft = hf_checkpoint("llama", vocab_size=VOCAB, seed=3, num_layers=1, hidden_size=32,
                          num_heads=2, num_kv_heads=1)
    return {"speculative_config": {"method": "draft_model", "model": str(draft),
                                   "num_speculative_tokens": 2, "adaptive": False},
            "token_buckets": [128, 512], "request_buckets": [64]}


@pytest.mark.slow
# A draft model's drafts come with their own probabilities (the general rejection test);
# n-gram drafts (probability one) run with `pytest -m full`.
@pytest.mark.parametrize("proposer", [pytest.param("ngram", marks=pytest.mark.full),
                                      "draft_model"])
def test_sampled_joint_equals_the_targets_and_the_test_catches_unverified_drafts(
        small_vocab, compile_cache_dir, monkeypatch, hf_checkpoint, proposer):
    path, joint = small_vocab
    assert math.isclose(sum(joint.values()), 1.0, rel_tol=1e-9)
    llm = LLM(str(path), compilation_cache_dir=compile_cache_dir,
              **(ENGINE | proposer_args(proposer, hf_checkpoint)))
    stat, df = chi_square(sample_joint(llm), joint)
    spec = llm.stats().spec_decoding
    # Drafts were verified, some accepted and some not: both paths shaped the samples.
    assert spec.num_draft_tokens > spec.num_accepted_tokens > 0.05 * NUM_SAMPLES
    assert stat < critical_value(df), (stat, df)
    print(f"chi-square {stat:.1f} on {df} degrees of freedom (critical {critical_value(df):.1f})")

    import jaxserve.runtime.model_runner as model_runner

    def accept_every_draft(sampled: np.ndarray, sample_starts: np.ndarray,
                           drafts: list) -> list[list[int]]:
        return [list(map(int, d)) + [int(sampled[sample_starts[i + 1] - 1])]
                for i, d in enumerate(drafts)]

    monkeypatch.setattr(model_runner, "accepted_tokens", accept_every_draft)
    wrong, df_wrong = chi_square(sample_joint(llm), joint)
    assert wrong > critical_value(df_wrong), (wrong, df_wrong)
    print(f"unverified drafts: chi-square {wrong:.1f} on {df_wrong} degrees of freedom")
