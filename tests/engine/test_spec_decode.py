"""Speculative decoding: greedy tokens equal HF's with each proposer under the schedule matrix,
stops and logprobs inside accepted runs, no compilation after warm-up, and bad configs."""

from __future__ import annotations

import pytest

from engine_helpers import SMALL_ENGINE, assert_no_leaks, hf_greedy, random_prompts
from jaxserve import LLM, SamplingParams

MAX_TOKENS = 24
# Drafting always on (no adaptive switch): every test verifies drafts wherever it can.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}
LAYER_SKIP = {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 1,
              "adaptive": False}


def spec_workload() -> list[list[int]]:
    """Random prompts, prompts that repeat a span (n-gram drafts hit), and a shared prefix."""
    prompts = random_prompts(6, 1, 60, seed=21)
    prompts += [span * 3 for span in random_prompts(4, 4, 12, seed=22)]
    shared = random_prompts(1, 40, 40, seed=23)[0]
    prompts += [shared + tail for tail in random_prompts(3, 1, 10, seed=24)]
    return prompts


@pytest.fixture(scope="module")
def expected(llama):
    return hf_greedy(llama, spec_workload(), MAX_TOKENS)


SETTINGS = {
    "ngram": {"speculative_config": NGRAM},
    "ngram_adaptive_default": {"speculative_config": NGRAM | {"adaptive": True}},
    "ngram_chunks_every_prompt": {"speculative_config": NGRAM, "max_num_batched_tokens": 16},
    "ngram_one_seq": {"speculative_config": NGRAM, "max_num_seqs": 1},
    "ngram_no_prefix_caching_v0_steps": {"speculative_config": NGRAM,
                                         "enable_prefix_caching": False,
                                         "enable_mixed_batching": False},
    "ngram_k1_priority_tiny_pool": {
        "speculative_config": NGRAM | {"num_speculative_tokens": 1}, "num_kv_blocks": 14,
        "scheduling_policy": "priority"},
    "layer_skip": {"speculative_config": LAYER_SKIP},
    "layer_skip_scan_tiny_pool_preempts": {"speculative_config": LAYER_SKIP, "scan_layers": True,
                                           "num_kv_blocks": 14},
    "layer_skip_threshold_small": {"speculative_config": LAYER_SKIP,
                                   "long_prefill_token_threshold": 8},
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_tokens_equal_hf_with_speculation(llama, expected, compile_cache_dir, name):
    llm = LLM(str(llama), compilation_cache_dir=compile_cache_dir,
              **(SMALL_ENGINE | SETTINGS[name]))
    outs = generate(llm, spec_workload(), temperature=0.0, max_tokens=MAX_TOKENS,
                    ignore_eos=True)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.stats()
    spec = stats.spec_decoding
    assert spec.num_accepted_tokens > 0
    if "adaptive" not in name:  # the switch may stop drafting before any is rejected
        assert spec.num_draft_tokens > spec.num_accepted_tokens
    assert spec.num_accepted_tokens == sum(spec.num_accepted_tokens_per_pos)
    if "preempts" in name:
        assert stats.num_preemptions > 0
    assert_no_leaks(llm.engine)


def count_corrected_requests(llm: LLM) -> list[int]:
    """Wrap the runner: counts requests of a step launched on top of a drafting step still
    running that then rejected some of their drafts (their positions, scheduled as if all were
    accepted, corrected on the device)."""
    runner = llm.engine.core.executor.worker.runner
    dispatch, collect = runner.dispatch, runner.collect
    counts, ahead = [0], [set()]

    def dispatching(sched):  # noqa: ANN001, ANN202
        pending = dispatch(sched)
        if pending is not None:
            arrays = pending.arrays
            ahead[0] = {r for r, n in zip(arrays.req_ids, arrays.prev_drafts) if n > 0}
        return pending

    def collecting(pending):  # noqa: ANN001, ANN202
        out = collect(pending)
        if pending is not None:
            for req_id, drafts, tokens in zip(out.req_ids, pending.arrays.draft_token_ids,
                                              out.sampled_token_ids):
                counts[0] += req_id in ahead[0] and len(tokens) - 1 < len(drafts)
        return out

    runner.dispatch, runner.collect = dispatching, collecting
    return counts


@pytest.mark.parametrize("spec", [NGRAM, LAYER_SKIP], ids=["ngram", "layer_skip"])
def test_steps_run_ahead_of_drafting_steps_and_correct_their_positions(llama, expected,
                                                                      compile_cache_dir, spec):
    """Async scheduling with speculation: a step launched while the one before it verifies
    drafts assumes they are all accepted; where some are not, the device moves its positions
    back, and the tokens are still HF's."""
    llm = LLM(str(llama), compilation_cache_dir=compile_cache_dir, speculative_config=spec,
              **SMALL_ENGINE)
    corrected = count_corrected_requests(llm)
    outs = generate(llm, spec_workload(), temperature=0.0, max_tokens=MAX_TOKENS,
                    ignore_eos=True)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert corrected[0] > 0
    assert_no_leaks(llm.engine)


@pytest.fixture(scope="module")
def plain_and_spec(llama, compile_cache_dir):
    engines = {name: LLM(str(llama), compilation_cache_dir=compile_cache_dir,
                         **(SMALL_ENGINE | extra))
               for name, extra in (("plain", {}), ("ngram", {"speculative_config": NGRAM}),
                                   ("layer_skip", {"speculative_config": LAYER_SKIP}))}
    return engines


def generate(llm: LLM, prompts: list[list[int]], **params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**params),
                        use_tqdm=False)


@pytest.mark.parametrize("proposer", ["ngram", "layer_skip"])
def test_stops_and_max_tokens_inside_an_accepted_run(plain_and_spec, proposer):
    """A stop token, a stop string or max_tokens falling inside a run of accepted drafts ends
    the output exactly where the plain engine ends it."""
    prompts = [span * 3 for span in random_prompts(4, 4, 12, seed=22)]
    plain, spec = plain_and_spec["plain"], plain_and_spec[proposer]
    free = generate(plain, prompts, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        tokens = free[i].outputs[0].token_ids
        stop_token = tokens[9]
        stop_text = free[i].outputs[0].text[-8:-4]
        cases = [dict(stop_token_ids=[stop_token]), dict(max_tokens=7)]
        cases += [dict(stop=[stop_text])] if stop_text.strip() else []
        for case in cases:
            params = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True) | case
            want, got = generate(plain, [prompt], **params), generate(spec, [prompt], **params)
            assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids, case
            assert got[0].outputs[0].text == want[0].outputs[0].text, case
            assert got[0].outputs[0].finish_reason == want[0].outputs[0].finish_reason, case
    assert spec.stats().spec_decoding.num_accepted_tokens > 0
    assert_no_leaks(spec.engine)


@pytest.mark.parametrize("proposer", ["ngram", "layer_skip"])
def test_logprobs_of_accepted_tokens_equal_plain_decoding(plain_and_spec, proposer):
    prompts = [span * 3 for span in random_prompts(3, 4, 12, seed=25)]
    params = dict(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    want = generate(plain_and_spec["plain"], prompts, **params)
    got = generate(plain_and_spec[proposer], prompts, **params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for wpos, gpos in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert list(gpos) == list(wpos)  # same ids, same order
            for token_id, lp in wpos.items():
                assert gpos[token_id].rank == lp.rank
                assert gpos[token_id].logprob == pytest.approx(lp.logprob, abs=1e-4)
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob,
                                                                abs=1e-3)


@pytest.mark.parametrize("proposer", ["ngram", "layer_skip"])
def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(plain_and_spec,
                                                                           proposer):
    """Each position's draw uses its own (seed, step) key, and a draft is accepted exactly
    when that draw equals it: a seeded run samples what the plain engine samples."""
    prompts = [span * 3 for span in random_prompts(3, 4, 12, seed=26)]
    params = dict(temperature=0.8, top_k=20, max_tokens=16, ignore_eos=True, n=2, seed=7)
    want = generate(plain_and_spec["plain"], prompts, **params)
    before = plain_and_spec[proposer].stats().spec_decoding.num_draft_tokens
    got = generate(plain_and_spec[proposer], prompts, **params)
    assert [[c.token_ids for c in o.outputs] for o in got] == \
        [[c.token_ids for c in o.outputs] for o in want]
    assert len({tuple(c.token_ids) for o in got for c in o.outputs}) == 6  # really sampled
    # Drafts were verified by sampling (test_spec_decode_distribution has accepted ones).
    assert plain_and_spec[proposer].stats().spec_decoding.num_draft_tokens > before
    assert_no_leaks(plain_and_spec[proposer].engine)


@pytest.mark.parametrize("spec", [NGRAM, LAYER_SKIP], ids=["ngram", "layer_skip"])
def test_no_compilation_after_warm_up_with_speculation(llama, compile_cache_dir, spec):
    llm = LLM(str(llama), compilation_cache_dir=compile_cache_dir, precompile=True,
              strict_compile=True, speculative_config=spec, **SMALL_ENGINE)
    compiled = llm.stats().num_compilations
    prompts = spec_workload()
    generate(llm, prompts, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    generate(llm, prompts[:5], temperature=0.9, top_p=0.9, max_tokens=12, ignore_eos=True,
             logprobs=2)
    stats = llm.stats()
    assert stats.spec_decoding.num_accepted_tokens > 0
    assert stats.num_compilations == compiled  # strict_compile would also have raised


@pytest.mark.parametrize("config, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
    ({"method": "layer_skip", "num_speculative_tokens": 2}, "num_layers"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_layers": 1}, "num_layers"),
    ({"method": "draft_model", "model": "/x", "num_speculative_tokens": 2}, "method"),
    ("{not json", "speculative_config"),
])
def test_bad_speculative_config_is_a_value_error_naming_the_field(config, field):
    from jaxserve.config import EngineConfig

    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(speculative_config=config)


def test_layer_skip_needs_fewer_layers_than_the_model(llama):
    with pytest.raises(ValueError, match="num_layers"):
        LLM(str(llama), speculative_config=LAYER_SKIP | {"num_layers": 2}, **SMALL_ENGINE)


@pytest.mark.parametrize("disable_at, drafts", [(1, False), (64, True)])
def test_speculation_switches_itself_off_at_a_batch_size(llama, compile_cache_dir, disable_at,
                                                         drafts):
    llm = LLM(str(llama), compilation_cache_dir=compile_cache_dir, **SMALL_ENGINE,
              speculative_config=NGRAM | {"disable_by_batch_size": disable_at})
    generate(llm, spec_workload(), temperature=0.0, max_tokens=8, ignore_eos=True)
    assert (llm.stats().spec_decoding.num_drafts > 0) == drafts


def test_json_text_config_is_accepted_as_on_the_command_line():
    from jaxserve.config import EngineConfig

    config = EngineConfig.from_kwargs(
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    spec = config.scheduler.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min,
            spec.prompt_lookup_max) == ("ngram", 3, 5, 5)
    assert EngineConfig.from_kwargs(**config.to_kwargs()).scheduler.speculative_config == spec
