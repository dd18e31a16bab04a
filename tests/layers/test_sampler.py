import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers.sampler import (SamplingMetadata, apply_penalties, argmax, filter_threshold,
                                     sample)
from jaxserve.programs.input_batch import RowSpec, logprobs_width, make_sampling_metadata
from jaxserve.sampling_params import SamplingParams

_sample = jax.jit(sample)
_apply_penalties = jax.jit(apply_penalties)


def make_md(num_rows: int, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=0,
            steps=0, presence=0.0, frequency=0.0, repetition=1.0, output=None, prompt=None,
            blocked=None, all_greedy=False, num_logprobs=0, bitmask=None) -> SamplingMetadata:
    def rows(value, dtype) -> np.ndarray:
        return np.broadcast_to(np.asarray(value, dtype), (num_rows,)).copy()

    def ids(value) -> np.ndarray:
        return np.zeros((num_rows, 0), np.int32) if value is None else np.asarray(value, np.int32)

    return SamplingMetadata(
        rows(temperature, np.float32), rows(top_k, np.int32), rows(top_p, np.float32),
        rows(min_p, np.float32), rows(seeds, np.uint32), rows(steps, np.int32),
        rows(presence, np.float32), rows(frequency, np.float32), rows(repetition, np.float32),
        ids(output), ids(prompt), ids(blocked), ids(None), np.zeros((num_rows, 0), np.float32),
        ids(bitmask), all_greedy, num_logprobs)


def run(logits: np.ndarray, md: SamplingMetadata) -> tuple[np.ndarray, ...]:
    out = _sample(jnp.asarray(logits, jnp.float32), md)
    return tuple(np.asarray(x) for x in (out.sampled, out.logprob, out.topk_ids,
                                         out.topk_logprobs))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def reference_allowed(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                      min_p: float) -> tuple[np.ndarray, float]:
    """Final sampling distribution (float64, vLLM's order) and its distance to a filter edge."""
    probs = softmax(logits.astype(np.float64) / temperature)
    keep = probs >= min_p * probs.max()
    margin = np.min(np.abs(probs / probs.max() - min_p)) if min_p > 0 else 1.0
    order = np.argsort(-probs)
    if 0 < top_k < len(probs):
        keep[order[top_k:]] = False
    renorm = np.where(keep, probs, 0.0) / np.where(keep, probs, 0.0).sum()
    before = np.cumsum(renorm[order]) - renorm[order]
    if top_p < 1:
        keep[order[before >= top_p]] = False
        margin = min(margin, np.min(np.abs(before[1:] - top_p)))
    final = np.where(keep, probs, 0.0)
    return final / final.sum(), margin


def reference_penalties(logits: np.ndarray, output: list[list[int]], prompt: list[list[int]],
                        presence, frequency, repetition) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for r in range(len(out)):
        counts = np.bincount(np.asarray(output[r], int), minlength=out.shape[1])
        seen = (counts > 0) | np.isin(np.arange(out.shape[1]), prompt[r])
        for t in np.flatnonzero(seen):
            out[r, t] = out[r, t] / repetition[r] if out[r, t] > 0 else out[r, t] * repetition[r]
        out[r] -= frequency[r] * counts + presence[r] * (counts > 0)
    return out


def pad(lists: list[list[int]], width: int) -> np.ndarray:
    out = np.full((len(lists), width), -1, np.int32)
    for r, ids in enumerate(lists):
        out[r, :len(ids)] = ids
    return out


def test_greedy_rows_take_the_argmax() -> None:
    logits = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)
    sampled, *_ = run(logits, make_md(8, temperature=0.0, all_greedy=True))
    np.testing.assert_array_equal(sampled, logits.argmax(-1))
    mixed = make_md(8, temperature=np.where(np.arange(8) % 2, 0.0, 1.0), seeds=np.arange(8))
    sampled, *_ = run(logits, mixed)
    np.testing.assert_array_equal(sampled[1::2], logits[1::2].argmax(-1))


def primitives(logits: jax.Array, md: SamplingMetadata) -> set[str]:
    return set(re.findall(r"(\w+)\[", str(jax.make_jaxpr(sample)(logits, md))))


def test_argmax_is_jnp_argmax_with_ties_nan_and_infinities() -> None:
    x = np.random.default_rng(0).standard_normal((7, 300)).astype(np.float32)
    x[1, [5, 200]] = x[1].max() + 1  # a tie: the first
    x[2, [40, 9]] = np.nan  # NaN: the first NaN
    x[3] = -np.inf
    x[4, 17] = np.inf
    x[5, :3] = np.finfo(np.float32).max
    got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert got.dtype == np.int32 and got[1] == 5 and got[2] == 9 and got[3] == 0


def test_all_greedy_fast_path_has_no_filtering_and_no_noise() -> None:
    logits = jnp.zeros((4, 32))
    greedy = primitives(logits, make_md(4, temperature=0.0, all_greedy=True))
    sampled = primitives(logits, make_md(4, top_p=0.5))
    assert not {"cond", "scan", "random_bits"} & greedy
    assert {"cond", "scan", "random_bits"} <= sampled


def test_top_k_1_equals_greedy_at_any_temperature() -> None:
    logits = np.random.default_rng(1).normal(size=(64, 50)).astype(np.float32)
    sampled, *_ = run(logits, make_md(64, temperature=1.7, top_k=1, seeds=np.arange(64)))
    np.testing.assert_array_equal(sampled, logits.argmax(-1))


def test_seeded_row_is_the_same_whatever_the_batch_and_its_row_index() -> None:
    rng = np.random.default_rng(2)
    vocab, num_steps = 40, 32
    target = rng.normal(size=vocab).astype(np.float32)
    steps = np.arange(num_steps)
    alone = np.array([run(target[None], make_md(1, temperature=0.9, top_p=0.95, seeds=1234,
                                                 steps=s))[0][0] for s in steps])
    assert len(set(alone.tolist())) >= 5  # the steps really draw different tokens

    # The same (seed, step) rows scattered among unrelated rows of a bigger, busier batch.
    num_rows = 64
    positions = rng.permutation(num_rows)[:num_steps]
    logits = rng.normal(size=(num_rows, vocab)).astype(np.float32)
    logits[positions] = target
    temperature = rng.choice([0.0, 0.5, 1.3], size=num_rows)
    top_p, seeds, row_steps = rng.uniform(0.3, 1.0, num_rows), rng.integers(0, 2**32, num_rows), \
        rng.integers(0, 100, num_rows)
    presence = rng.uniform(-1, 1, num_rows)
    output = rng.integers(-1, vocab, size=(num_rows, 16))
    temperature[positions], top_p[positions], seeds[positions] = 0.9, 0.95, 1234
    row_steps[positions], presence[positions], output[positions] = steps, 0.0, -1
    busy, *_ = run(logits, make_md(num_rows, temperature=temperature, top_p=top_p, min_p=0.01,
                                   seeds=seeds, steps=row_steps, presence=presence,
                                   output=output))
    np.testing.assert_array_equal(busy[positions], alone)


def test_different_seeds_draw_different_tokens() -> None:
    logits = np.zeros((128, 64), np.float32)
    by_seed, *_ = run(logits, make_md(128, seeds=np.arange(128)))
    assert len(set(by_seed.tolist())) > 40  # 128 uniform draws over 64 tokens
    again, *_ = run(logits, make_md(128, seeds=np.arange(128)))
    np.testing.assert_array_equal(by_seed, again)
    by_step, *_ = run(logits, make_md(128, seeds=7, steps=np.arange(128)))
    other, *_ = run(logits, make_md(128, seeds=8, steps=np.arange(128)))
    assert np.mean(by_step == other) < 0.2


FILTER_CONFIGS = [  # temperature, top_k, top_p, min_p
    (1.0, 5, 1.0, 0.0),
    (0.7, 0, 0.6, 0.0),
    (1.5, 0, 1.0, 0.2),
    (1.2, 10, 0.8, 0.05),
    (2.0, 3, 0.5, 0.3),
    (1.0, 0, 1.0, 0.0),
]


def filter_cases(vocab: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """One logits row per FILTER_CONFIGS entry, every filter edge clear of float rounding."""
    rng = np.random.default_rng(3)
    logits, refs = [], []
    for temperature, top_k, top_p, min_p in FILTER_CONFIGS:
        while True:
            row = (rng.normal(size=vocab) * 2).astype(np.float32)
            ref, margin = reference_allowed(row, temperature, top_k, top_p, min_p)
            if margin > 1e-3:
                break
        logits.append(row)
        refs.append(ref)
    return np.stack(logits), refs


def test_filter_threshold_is_the_smallest_kept_value_exactly() -> None:
    logits, refs = filter_cases(48)
    params = np.array(FILTER_CONFIGS)
    scaled = logits / params[:, :1].astype(np.float32)
    got = np.asarray(jax.jit(filter_threshold)(
        jnp.asarray(scaled), jnp.asarray(params[:, 1], jnp.int32),
        jnp.asarray(params[:, 2], jnp.float32), jnp.asarray(params[:, 3], jnp.float32)))
    want = np.array([row[ref > 0].min() for row, ref in zip(scaled, refs)])
    np.testing.assert_array_equal(got, want)


def test_filters_never_emit_a_token_outside_the_allowed_set() -> None:
    samples_per_config = 256
    logits, refs = filter_cases(48)
    num_rows = len(FILTER_CONFIGS) * samples_per_config
    config = np.arange(num_rows) % len(FILTER_CONFIGS)  # every config in one batch
    params = np.array(FILTER_CONFIGS)[config]
    md = make_md(num_rows, temperature=params[:, 0], top_k=params[:, 1], top_p=params[:, 2],
                 min_p=params[:, 3], seeds=np.arange(num_rows))
    sampled, *_ = run(logits[config], md)
    for c, ref in enumerate(refs):
        drawn = sampled[config == c]
        assert np.all(ref[drawn] > 0), f"config {FILTER_CONFIGS[c]} drew a filtered token"
        likely = np.flatnonzero(ref >= 0.03)
        assert set(likely.tolist()) <= set(drawn.tolist()), f"config {FILTER_CONFIGS[c]}"


@pytest.mark.parametrize("temperature, top_k, vary", [
    (0.7, 0, "seed"), (1.0, 4, "seed"), (1.3, 0, "step")])
def test_empirical_distribution_matches_softmax(temperature: float, top_k: int,
                                                vary: str) -> None:
    logits = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -1.0, 1.5, 0.7], np.float32)
    num_draws = 4096
    counter = np.arange(num_draws)
    md = make_md(num_draws, temperature=temperature, top_k=top_k,
                 seeds=counter if vary == "seed" else 99, steps=counter if vary == "step" else 3)
    sampled, *_ = run(np.tile(logits, (num_draws, 1)), md)
    expected, _ = reference_allowed(logits, temperature, top_k, 1.0, 0.0)
    counts = np.bincount(sampled, minlength=len(logits))
    assert np.all(counts[expected == 0] == 0)
    allowed = expected > 0
    chi2 = np.sum((counts[allowed] - num_draws * expected[allowed]) ** 2
                  / (num_draws * expected[allowed]))
    assert chi2 < 30.0, (chi2, counts, expected * num_draws)  # 7 dof: p(chi2 > 30) ~ 1e-4


def test_penalties_match_numpy_reference() -> None:
    rng = np.random.default_rng(4)
    num_rows, vocab = 6, 40
    logits = (rng.normal(size=(num_rows, vocab)) * 3).astype(np.float32)
    output = [[1, 2, 2, 2, 30], [], [5, 5, 39], [0, 7, 7], [3], [10, 11, 12, 10]]
    prompt = [[4, 1, 39], [6, 6], [], [7, 8, 9, 20], [3, 21], []]
    presence = np.array([0.5, 1.0, -0.7, 0.0, 2.0, 0.0])
    frequency = np.array([0.3, 0.0, 1.1, -0.4, 0.0, 0.0])
    repetition = np.array([1.3, 0.8, 1.0, 2.0, 1.5, 1.0])
    md = make_md(num_rows, presence=presence, frequency=frequency, repetition=repetition,
                 output=pad(output, 8), prompt=pad(prompt, 8))
    got = np.asarray(_apply_penalties(jnp.asarray(logits), md))
    want = reference_penalties(logits, output, prompt, presence, frequency, repetition)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.array_equal(got[5], logits[5])


def test_builder_and_sampler_apply_penalties_before_greedy_argmax() -> None:
    rng = np.random.default_rng(5)
    vocab = 32
    logits = (rng.normal(size=(3, vocab)) * 2).astype(np.float32)
    histories = [[int(logits[0].argmax())] * 3, list(np.argsort(-logits[1])[:4]), []]
    prompts = [[1, 2], [int(logits[1].argmax())], [int(logits[2].argmax())]]
    params = [SamplingParams(temperature=0, frequency_penalty=2.0),
              SamplingParams(temperature=0, presence_penalty=1.5, repetition_penalty=1.4),
              SamplingParams(temperature=0, repetition_penalty=2.0)]
    rows = [RowSpec(p, 0, h, pr) for p, h, pr in zip(params, histories, prompts)]
    sampled, *_ = run(np.pad(logits, ((0, 1), (0, 0))), make_sampling_metadata(rows, 4))
    want = reference_penalties(logits, histories, prompts, [0, 1.5, 0], [2.0, 0, 0],
                               [1.0, 1.4, 2.0])
    np.testing.assert_array_equal(sampled[:3], want.argmax(-1))
    assert np.any(sampled[:3] != logits.argmax(-1))  # the penalties changed something


def test_min_tokens_blocks_eos_and_stop_token_ids() -> None:
    vocab, eos, stop = 16, 2, 5
    logits = np.zeros((4, vocab), np.float32)
    logits[:, eos], logits[:, stop], logits[:, 9] = 5.0, 4.0, 3.0
    rows = [
        RowSpec(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop]), 0, [1]),
        RowSpec(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop]), 0, [1, 1, 1]),
        RowSpec(SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[stop],
                               ignore_eos=True), 0, [1]),
        RowSpec(SamplingParams(temperature=0, min_tokens=2), 0, [1]),
    ]
    md = make_sampling_metadata(rows, 4, eos_token_ids=[eos])
    sampled, *_ = run(logits, md)
    assert sampled.tolist() == [9, eos, eos, stop]

    spread = np.tile(np.linspace(0, 1, vocab, dtype=np.float32), (256, 1))
    spread[:, eos] = spread[:, stop] = 3.0
    row = RowSpec(SamplingParams(temperature=1.0, min_tokens=8, stop_token_ids=[stop]), 0, [])
    md = make_sampling_metadata([row] * 256, 256, eos_token_ids=[eos])
    md = SamplingMetadata(**{**vars(md), "seeds": np.arange(256, dtype=np.uint32)})
    sampled, *_ = run(spread, md)
    assert not np.isin(sampled, [eos, stop]).any()


def test_logprobs_are_the_raw_log_softmax() -> None:
    rng = np.random.default_rng(6)
    num_rows, vocab, n = 8, 64, 5
    logits = (rng.normal(size=(num_rows, vocab)) * 2).astype(np.float32)
    md = make_md(num_rows, temperature=0.6, top_k=20, seeds=np.arange(num_rows), presence=1.0,
                 repetition=1.5, output=rng.integers(0, vocab, (num_rows, 16)),
                 num_logprobs=n)
    sampled, logprob, topk_ids, topk_logprobs = run(logits, md)
    log_softmax = np.log(softmax(logits.astype(np.float64)))
    np.testing.assert_allclose(logprob, log_softmax[np.arange(num_rows), sampled], atol=1e-5)
    np.testing.assert_array_equal(topk_ids, np.argsort(-logits, axis=-1)[:, :n])
    np.testing.assert_allclose(topk_logprobs, np.sort(log_softmax, axis=-1)[:, ::-1][:, :n],
                               atol=1e-5)
    _, _, none_ids, none_logprobs = run(logits, make_md(num_rows, temperature=0.0))
    assert none_ids.shape == none_logprobs.shape == (num_rows, 0)


def test_sampler_runs_jitted_with_host_transfers_disallowed() -> None:
    logits = jax.device_put(jnp.ones((4, 32)))
    md = jax.device_put(make_md(4, top_p=0.9, presence=0.5, output=np.full((4, 16), 3),
                                num_logprobs=2))
    with jax.transfer_guard("disallow"):
        out = _sample(logits, md)
        out.sampled.block_until_ready()
    assert out.sampled.shape == (4,) and out.topk_ids.shape == (4, 2)


def test_builder_pads_rows_and_histories_to_few_shapes() -> None:
    plain = SamplingParams(temperature=0.8, top_p=0.9)
    penalised = SamplingParams(temperature=0.8, presence_penalty=0.5)
    md = make_sampling_metadata([RowSpec(plain, 1, [4, 5]), None], 4)
    assert md.output_token_ids.shape == md.prompt_token_ids.shape == (4, 0)
    assert md.blocked_token_ids.shape == (4, 0)
    assert md.temperature.tolist() == pytest.approx([0.8, 0, 0, 0])
    assert md.steps.tolist() == [2, 0, 0, 0] and not md.all_greedy

    short = make_sampling_metadata([RowSpec(penalised, 1, [1] * 3)], 2)
    long = make_sampling_metadata([RowSpec(penalised, 1, [1] * 16), RowSpec(plain, 2, [])], 2)
    assert jax.tree.structure(short) == jax.tree.structure(long)
    assert [x.shape for x in jax.tree.leaves(short)] == [x.shape for x in jax.tree.leaves(long)]
    assert short.output_token_ids.shape == (2, 16)
    longer = make_sampling_metadata([RowSpec(penalised, 1, [1] * 17)], 2)
    assert longer.output_token_ids.shape == (2, 32)
    rep = make_sampling_metadata(
        [RowSpec(SamplingParams(repetition_penalty=1.2), 1, [], list(range(40)))], 2)
    assert rep.prompt_token_ids.shape == (2, 64)
    assert rep.prompt_token_ids[0, :40].tolist() == list(range(40))


def test_builder_makes_greedy_rows_neutral_and_tracks_all_greedy() -> None:
    rows = [RowSpec(SamplingParams(temperature=0.9, top_k=1, top_p=0.5, min_p=0.2), 3, []),
            RowSpec(SamplingParams(temperature=0.0, top_k=7), 4, [])]
    md = make_sampling_metadata(rows, 4)
    assert md.all_greedy
    assert md.temperature.tolist() == [0] * 4 and md.top_k.tolist() == [0] * 4
    assert md.top_p.tolist() == [1] * 4 and md.min_p.tolist() == [0] * 4
    assert md.seeds.tolist() == [3, 4, 0, 0]


def test_builder_rejects_bad_input() -> None:
    row = RowSpec(SamplingParams(logprobs=4), 0, [])
    with pytest.raises(ValueError, match="num_rows_padded"):
        make_sampling_metadata([row, row], 1)
    with pytest.raises(ValueError, match="seed"):
        make_sampling_metadata([RowSpec(SamplingParams(), 2**32, [])], 1)
    with pytest.raises(ValueError, match="num_logprobs"):
        make_sampling_metadata([row], 1, num_logprobs=2)
    assert make_sampling_metadata([row], 1).num_logprobs == 4
    assert make_sampling_metadata([row], 1, num_logprobs=8).num_logprobs == 8


def test_a_logprobs_0_row_gets_the_sampled_tokens_rank_even_with_max_logprobs_0() -> None:
    """logprobs=0 asks for the sampled token's logprob and rank only; an engine whose
    max_logprobs is 0 still steps at the width that computes the rank."""
    row = RowSpec(SamplingParams(temperature=0.0, logprobs=0), 0, [])
    md = make_sampling_metadata([row, None], 2, num_logprobs=logprobs_width(0))
    assert md.num_logprobs == 1 and make_sampling_metadata([row], 1).num_logprobs == 1
    logits = np.array([[0.5, 3.0, 1.0, 2.0], [1.0, 0.0, 0.0, 0.0]], np.float32)
    # A greedy row samples its argmax, rank 1; force another token by masking it out.
    md = dataclasses.replace(md, blocked_token_ids=np.array([[1], [-1]], np.int32))
    out = _sample(jnp.asarray(logits), md)
    assert int(out.sampled[0]) == 3 and int(out.rank[0]) == 2  # only logit 3.0 is above 2.0


def test_token_bitmask_allows_exactly_its_set_bits_before_sampling() -> None:
    rng = np.random.default_rng(3)
    num_rows, vocab = 4, 70  # 3 words, the last one partly past the vocabulary
    allowed = rng.random((num_rows, vocab)) < 0.1
    allowed[:, 5] = True
    allowed[3] = True  # a free row: all ones
    bits = np.zeros((num_rows, 96), bool)
    bits[:, :vocab] = allowed
    words = np.packbits(bits.reshape(num_rows, 3, 4, 8)[..., ::-1], axis=-1,
                        bitorder="big").reshape(num_rows, 3, 4)
    bitmask = words.view("<u4").reshape(num_rows, 3).view(np.int32)  # bit t%32 of word t//32
    logits = rng.normal(size=(num_rows, vocab)).astype(np.float32) * 5
    for greedy in (True, False):
        md = make_md(num_rows, temperature=0.0 if greedy else 1.0, seeds=np.arange(num_rows),
                     all_greedy=greedy, bitmask=bitmask)
        for step in range(20):
            md = SamplingMetadata(**{**vars(md), "steps": np.full(num_rows, step, np.int32)})
            sampled = run(logits, md)[0]
            assert all(allowed[i, t] for i, t in enumerate(sampled))
    free = run(logits, make_md(num_rows, temperature=0.0, all_greedy=True))[0]
    assert free[3] == run(logits, make_md(num_rows, temperature=0.0, all_greedy=True,
                                          bitmask=bitmask))[0][3]
