"""Requests through LLMEngine: identical and fully cached prompts, aborts, n > 1, stop rules."""

from __future__ import annotations

import time

import pytest

from engine_helpers import SMALL_ENGINE, assert_no_leaks, hf_greedy, random_prompts
from jaxserve import LLM, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(hf_checkpoint):
    return hf_checkpoint("llama")


@pytest.fixture
def llm(llama, compile_cache_dir):
    return LLM(str(llama), compilation_cache_dir=compile_cache_dir, **SMALL_ENGINE)


def test_the_engine_lets_go_of_the_loaders_weights(llm):
    """The model holds the weights it runs (on CPU, packed copies); the loader's arrays are
    dropped, or a CPU engine would keep every weight twice for as long as it runs."""
    worker = llm.engine.core.executor.worker
    assert worker.loaded.params == {}
    assert llm.generate(["Hello"], GREEDY)[0].outputs[0].token_ids


def test_identical_prompts_submitted_together_are_all_correct(llm, llama):
    prompt = random_prompts(1, 50, 50, seed=21)[0]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 4, GREEDY, use_tqdm=False)
    expected = hf_greedy(llama, [prompt], 12)[0]
    assert all(o.outputs[0].token_ids == expected for o in outs)
    assert_no_leaks(llm.engine)


def test_a_prompt_that_is_entirely_cached_still_computes_its_last_token(llm, llama):
    prompt = random_prompts(1, 48, 48, seed=22)[0]  # exactly three full blocks
    first = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32  # the last block is recomputed for its logits
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == hf_greedy(
        llama, [prompt], 12)[0]
    assert_no_leaks(llm.engine)


def test_aborts_mid_prefill_and_mid_decode_free_every_block(llama, compile_cache_dir):
    engine = LLMEngine.from_engine_args(
        model=str(llama), compilation_cache_dir=compile_cache_dir,
        **(SMALL_ENGINE | {"long_prefill_token_threshold": 16}))
    prompts = random_prompts(6, 40, 90, seed=23)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
    engine.step()  # every prompt is mid-prefill now (16 tokens each at most)
    sched = engine.core.scheduler
    assert any(0 < r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)
    engine.abort_request(["r0", "r1"])
    for _ in range(6):
        engine.step()
    engine.abort_request("r2")  # mid-decode
    engine.abort_request("no-such-request")  # unknown ids are ignored
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"r3", "r4", "r5"}
    assert finished["r3"].outputs[0].token_ids == hf_greedy(llama, [prompts[3]], 12)[0]
    assert_no_leaks(engine)


def test_n_samples_share_the_prompt_blocks_and_are_reproducible(llm):
    prompt = random_prompts(1, 40, 40, seed=24)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    samples = [c.token_ids for c in out.outputs]
    assert len({tuple(s) for s in samples}) > 1  # different seeds per sample
    assert llm.stats().prefix_cache_hits >= 32  # siblings hit the first sample's prompt blocks
    again = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == samples
    assert_no_leaks(llm.engine)


def test_stop_token_ids_min_tokens_and_max_tokens(llm, llama):
    prompt = random_prompts(1, 20, 20, seed=25)[0]
    free_run = hf_greedy(llama, [prompt], 12)[0]
    stop_at = free_run[4]
    first = free_run.index(stop_at)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)
    # Hundreds of thousands of stop ids (the set is built a slice at a time, once for n).
    unseen = next(t for t in range(1, 300) if t not in free_run)
    many = [unseen] * 200_000 + [stop_at]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0.0, max_tokens=12, stop_token_ids=many, n=2), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [free_run[:first + 1]] * 2
    with pytest.raises(ValueError, match=r"stop_token_ids: \d+ is outside the vocabulary"):
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(
            stop_token_ids=many + [llm.llm_engine.input_processor.vocab_size]), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5
    assert_no_leaks(llm.engine)


def test_stop_strings_end_the_text_and_the_request(llm):
    tokenizer = llm.get_tokenizer()
    free = llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    out = llm.generate("Once upon a time", SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert comp.text == free.text[:free.text.index(stop)]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", stop)
    assert len(comp.token_ids) < 12
    assert tokenizer.decode(comp.token_ids).startswith(comp.text)
    assert_no_leaks(llm.engine)


def test_stop_strings_are_skipped_until_min_tokens(llm):
    free = llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0]
    stop = free.text[3:6]
    out = llm.generate("Once upon a time", SamplingParams(
        temperature=0.0, max_tokens=12, min_tokens=10, ignore_eos=True, stop=[stop]),
        use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 10  # as vLLM: no stop string check before min_tokens
    assert out.text.startswith(free.text[:free.text.index(stop) + len(stop)])
    assert out.token_ids == free.token_ids[:len(out.token_ids)]
    assert_no_leaks(llm.engine)


def test_chat_uses_the_tokenizer_chat_template(llm):
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hello robot"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == tokenizer.apply_chat_template(messages,
                                                                 add_generation_prompt=True)
    direct = llm.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids


def test_request_metrics_and_engine_stats(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in random_prompts(3, 5, 30, seed=26)],
                        GREEDY, use_tqdm=False)
    for out in outs:
        m = out.metrics
        assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
        assert len(m.token_times) == 12
    stats = llm.stats()
    assert stats.num_steps > 0 and stats.num_compilations > 0 and stats.kv_cache_usage == 0.0


def test_every_step_phase_is_timed_from_inside(llm):
    before = dict(llm.stats().step_seconds)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in random_prompts(4, 5, 40, seed=27)], GREEDY,
                 use_tqdm=False)
    wall = time.perf_counter() - start
    spent = {k: v - before[k] for k, v in llm.stats().step_seconds.items()}
    mask = spent.pop("mask")  # a part of schedule and update, for structured outputs only
    assert set(spent) == {"schedule", "prep", "dispatch", "device", "update", "output"}
    assert all(v > 0 for v in spent.values()), spent
    assert mask == 0.0  # no request was constrained
    assert sum(spent.values()) <= wall  # phases do not overlap on the host
