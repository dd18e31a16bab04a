"""The shapes a step is compiled for: token and request buckets, each bucket's variants with
speculative decoding (sample rows; the drafting program, for drafts proposed on the device),
and the padding-only steps that warm-up runs through every one of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxserve.config import EngineConfig, power_of_two_buckets
from jaxserve.core.structured_output import mask_words
from jaxserve.layers.sampler import SamplingMetadata
from jaxserve.programs.input_batch import StepArrays, logprobs_width, make_sampling_metadata


def step_buckets(config: EngineConfig) -> tuple[list[int], list[int]]:
    """The token and request buckets the model step is compiled for."""
    sched = config.scheduler
    # From 1 token: a decode step of a few requests pays for its bucket's rows in every matmul
    # and sampled row, and (the request bucket being min(R, T) below 8) for its padding
    # requests in the decodes' attention: one decode of the dummy model took 24 ms padded to 8
    # tokens and 8 requests, 9 ms unpadded (CPU).
    # With speculation, 1 + k too: one request's verify step is not padded to the next power
    # of two (5 rows to 8 at k = 4: ~1.25x the matmul time of 5 with the native CPU matmul).
    verify = 1 + num_speculative_tokens(config)
    token_buckets = sorted(config.runner.token_buckets or {
        *power_of_two_buckets(1, sched.max_num_batched_tokens),
        *([verify] if 1 < verify < sched.max_num_batched_tokens else [])})
    request_buckets = sorted(config.runner.request_buckets or power_of_two_buckets(
        min(8, sched.max_num_seqs), sched.max_num_seqs))
    if token_buckets[-1] < sched.max_num_batched_tokens:
        raise ValueError(f"token_buckets must reach max_num_batched_tokens "
                         f"({sched.max_num_batched_tokens}), got {token_buckets}")
    if request_buckets[-1] < sched.max_num_seqs:
        raise ValueError(f"request_buckets must reach max_num_seqs ({sched.max_num_seqs}), "
                         f"got {request_buckets}")
    return token_buckets, request_buckets


def bucket_pairs(token_buckets: Sequence[int], request_buckets: Sequence[int],
                 ) -> list[tuple[int, int]]:
    """Every (T, R) shape a step can take: a step never has more requests than tokens."""
    return [(T, R) for T in token_buckets for R in sorted({min(r, T) for r in request_buckets})]


def num_speculative_tokens(config: EngineConfig) -> int:
    spec = config.scheduler.speculative_config
    return 0 if spec is None else spec.num_speculative_tokens


def ngram_lookup(config: EngineConfig) -> tuple[int, int] | None:
    """(prompt_lookup_min, _max) with n-gram speculation, whose steps keep a token cache; else
    None."""
    spec = config.scheduler.speculative_config
    if spec is None or spec.method != "ngram":
        return None
    return spec.prompt_lookup_min, spec.prompt_lookup_max


def step_variants(T: int, R: int, num_drafts: int) -> list[tuple[int, bool]]:
    """The (sample rows S, drafting) variants a (T, R) step is compiled for: S = R without
    drafts, and with speculation the drafting program (a separate one, so steps without drafts
    do not carry it) with the most rows a step can sample (every request drafting, bounded by
    the tokens), where a draft fits (T > 1)."""
    drafting = num_drafts and T > 1
    return [(R, False)] + ([(min(T, R * (1 + num_drafts)), True)] if drafting else [])


def max_sample_rows(pairs: list[tuple[int, int]], num_drafts: int) -> int:
    """The length of `prev_sampled`: the most rows any step of these (T, R) shapes samples."""
    return max(min(T, R * (1 + num_drafts)) for T, R in pairs)


def warm_up_programs(token_buckets: Sequence[int], request_buckets: Sequence[int],
                     max_blocks_per_seq: int, eos_token_ids: tuple[int, ...],
                     max_logprobs: int, vocab_size: int = 0, num_drafts: int = 0,
                     ) -> list[tuple[StepArrays, SamplingMetadata]]:
    """The steps warm-up runs: the model for every (token bucket, request bucket) and each of
    its `step_variants`, and the sampler for every sample-row count: greedy and sampled,
    without and with logprobs, without and (given `vocab_size`) with a grammar bitmask.
    Penalties compile the sampler (only) for each new history width on first use."""
    logprobs_widths = [0, logprobs_width(max_logprobs)]
    mask_widths = sorted({0, mask_words(vocab_size)})
    sampler_done: set[int] = set()
    out = []
    for T, R in bucket_pairs(token_buckets, request_buckets):
        for S, drafting in step_variants(T, R, num_drafts):
            # The sampler's shapes depend on S only: all of its variants with the first T.
            variants = [(True, 0, 0)] if S in sampler_done else [
                (greedy, n, w) for greedy in (True, False) for n in logprobs_widths
                for w in mask_widths]
            sampler_done.add(S)
            for greedy, num_logprobs, words in variants:
                sampling = make_sampling_metadata(
                    [], S, eos_token_ids=eos_token_ids, num_logprobs=num_logprobs,
                    token_bitmask=np.full((S, words), -1, np.int32) if words else None)
                if not greedy:
                    sampling = dataclasses.replace(sampling, all_greedy=False)
                out.append((StepArrays.empty(T, R, max_blocks_per_seq, S, drafting), sampling))
    return out
