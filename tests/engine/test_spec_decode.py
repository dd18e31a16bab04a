"""Speculative decoding: greedy tokens equal HF's with each proposer under the schedule matrix,
stops and logprobs inside accepted runs, no compilation after warm-up, and bad configs.

Draft models: "self" is the target as its own draft, whose drafts the target must accept all
(or nearly: float noise between its decode and verify passes) wherever its cache is in step
with the target's; "first_layer" is a checkpoint of its own cut from the target's first layer
with its KV heads doubled (another cache shape), which agrees with the target often, not
always. (test_spec_decode_distribution drafts from an unrelated random checkpoint of another
width.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_helpers import FEW_BUCKETS, SMALL_ENGINE, assert_no_leaks, hf_greedy, random_prompts
from full_run import params_with_full_run
from jaxserve import LLM, SamplingParams

MAX_TOKENS = 24
HERE = str(Path(__file__).parent)  # a path that exists (config checks never load it)
# Drafting always on (no adaptive switch): every test verifies drafts wherever it can.
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}
LAYER_SKIP = {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 1,
              "adaptive": False}
DRAFT_SELF = {"method": "draft_model", "model": "self", "num_speculative_tokens": 3,
              "adaptive": False}
DRAFT_FIRST_LAYER = DRAFT_SELF | {"model": "first_layer"}
SELF_ACCEPTANCE = 0.95  # the least share of the target's own drafts it must accept


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


@pytest.fixture(scope="module")
def drafts(llama, truncated_draft):
    """name -> the draft checkpoint's path (module docstring), built on first use."""
    builders = {"self": lambda: llama, "first_layer": lambda: truncated_draft(llama, 1, 4)}
    return lambda name: str(builders[name]())


def with_draft(args: dict, drafts) -> dict:  # noqa: ANN001 (the `drafts` fixture)
    """Engine arguments with a draft model's name replaced by its checkpoint's path."""
    spec = args.get("speculative_config", {})
    if spec.get("method") != "draft_model":
        return args
    return args | {"speculative_config": spec | {"model": drafts(spec["model"])}}


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
                                           "num_kv_blocks": 14, **FEW_BUCKETS},
    "layer_skip_threshold_small": {"speculative_config": LAYER_SKIP,
                                   "long_prefill_token_threshold": 8},
    # Prefix caching on (the shared prefix hits) and async scheduling on: the defaults.
    "draft_model_first_layer": {"speculative_config": DRAFT_FIRST_LAYER, **FEW_BUCKETS},
    "draft_model_self_scan_chunks_every_prompt_tiny_pool_preempts": {
        "speculative_config": DRAFT_SELF, "scan_layers": True, "max_num_batched_tokens": 16,
        "num_kv_blocks": 10, **FEW_BUCKETS},
}


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


# Preemption under speculation stays in the default run through the layer-skip and draft-model
# tiny-pool settings.
FULL_RUN_SETTINGS = ("ngram_k1_priority_tiny_pool",)


@pytest.mark.parametrize("name", params_with_full_run(SETTINGS, FULL_RUN_SETTINGS))
def test_greedy_tokens_equal_hf_with_speculation(llama, expected, compile_cache_dir, drafts,
                                                 name):
    """With async scheduling (on in every setting) a step launched while the one before it
    verifies drafts assumes they are all accepted; where some are not, the device moves its
    positions back: the tokens are still HF's."""
    llm = LLM(str(llama), compilation_cache_dir=compile_cache_dir,
              **with_draft(SMALL_ENGINE | SETTINGS[name], drafts))
    corrected = count_corrected_requests(llm)
    outs = generate(llm, spec_workload(), temperature=0.0, max_tokens=MAX_TOKENS,
                    ignore_eos=True)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.stats()
    spec = stats.spec_decoding
    assert spec.num_accepted_tokens > 0
    if "self" in name:  # the draft's cache is in step with the target's
        assert spec.num_accepted_tokens >= SELF_ACCEPTANCE * spec.num_draft_tokens, spec
    elif "adaptive" not in name:  # the switch may stop drafting before any is rejected
        assert spec.num_draft_tokens > spec.num_accepted_tokens
        assert corrected[0] > 0
    assert spec.num_accepted_tokens == sum(spec.num_accepted_tokens_per_pos)
    if "preempts" in name:
        assert stats.num_preemptions > 0
    assert_no_leaks(llm.engine)


@pytest.fixture(scope="module")
def plain_and_spec(llama, compile_cache_dir, drafts):
    engines = {name: LLM(str(llama), compilation_cache_dir=compile_cache_dir,
                         **with_draft(SMALL_ENGINE | extra, drafts))
               for name, extra in (("plain", {}), ("ngram", {"speculative_config": NGRAM}),
                                   ("layer_skip", {"speculative_config": LAYER_SKIP}),
                                   ("draft_model", {"speculative_config": DRAFT_FIRST_LAYER,
                                                    **FEW_BUCKETS}))}
    return engines


PROPOSERS = ["ngram", "layer_skip", "draft_model"]


def generate(llm: LLM, prompts: list[list[int]], **params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(**params),
                        use_tqdm=False)


@pytest.mark.parametrize("proposer", PROPOSERS)
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


@pytest.mark.parametrize("proposer", PROPOSERS)
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


@pytest.mark.parametrize("proposer", [pytest.param("ngram", marks=pytest.mark.full),
                                      "layer_skip", "draft_model"])
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


@pytest.mark.parametrize("spec", [pytest.param(NGRAM, marks=pytest.mark.full), LAYER_SKIP,
                                  DRAFT_FIRST_LAYER], ids=["ngram", "layer_skip", "draft_model"])
def test_no_compilation_after_warm_up_with_speculation(llama, compile_cache_dir, drafts, spec):
    llm = LLM(str(llama), compilation_cache_dir=compile_cache_dir, precompile=True,
              strict_compile=True,
              **with_draft(SMALL_ENGINE | FEW_BUCKETS | {"speculative_config": spec}, drafts))
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
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "draft_model", "model": "/no/such/draft", "num_speculative_tokens": 2},
     "speculative_config.model"),
    ({"method": "draft_model", "model": HERE, "num_speculative_tokens": 0},
     "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "model": HERE, "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"model": "/x/eagle-llama3-8b", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "draft_model", "model": HERE, "num_speculative_tokens": 2,
      "draft_tensor_parallel_size": 2}, "speculative_config.draft_tensor_parallel_size"),
    ({"method": "draft_model", "model": HERE, "num_speculative_tokens": 2,
      "quantization": "fp8"}, "speculative_config.quantization"),
    ({"method": "draft_model", "model": HERE, "num_speculative_tokens": 2, "num_layers": 1},
     "speculative_config.num_layers"),
    ("{not json", "speculative_config"),
])
def test_bad_speculative_config_is_a_value_error_naming_the_field(config, field):
    from jaxserve.config import EngineConfig

    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(speculative_config=config)


def test_default_token_buckets_hold_one_verify_step_unpadded():
    from jaxserve.config import EngineConfig
    from jaxserve.programs.step_shapes import step_buckets

    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    with_spec = EngineConfig.from_kwargs(speculative_config=ngram, max_num_batched_tokens=64)
    assert step_buckets(with_spec)[0] == [1, 2, 4, 5, 8, 16, 32, 64]
    assert step_buckets(EngineConfig.from_kwargs(max_num_batched_tokens=64))[0] == [
        1, 2, 4, 8, 16, 32, 64]
    explicit = EngineConfig.from_kwargs(speculative_config=ngram, max_num_batched_tokens=64,
                                        token_buckets=[8, 64])
    assert step_buckets(explicit)[0] == [8, 64]  # the user's buckets stay as given


@pytest.mark.parametrize("draft, field", [
    (dict(vocab_size=8), "vocabulary"),
    (dict(max_position_embeddings=64), "max_position_embeddings"),
])
def test_a_draft_model_that_does_not_fit_the_target_is_a_value_error(llama, hf_checkpoint,
                                                                      draft, field):
    path = hf_checkpoint("llama", **draft)
    with pytest.raises(ValueError, match=f"speculative_config.model: .*{field}"):
        LLM(str(llama), speculative_config=DRAFT_SELF | {"model": str(path)}, **SMALL_ENGINE)


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


@pytest.mark.parametrize("given, method, model", [
    ({"model": HERE}, "draft_model", HERE),  # vLLM infers the method from the model
    ({"model": "[ngram]"}, "ngram", None),
    ({"method": "draft_model", "model": HERE, "draft_tensor_parallel_size": 1,
      "quantization": None}, "draft_model", HERE),
])
def test_vllm_spellings_of_a_draft_model(given, method, model):
    from jaxserve.config import EngineConfig

    spec = EngineConfig.from_kwargs(speculative_config=json.dumps(
        given | {"num_speculative_tokens": 2})).scheduler.speculative_config
    assert (spec.method, spec.model) == (method, model)
