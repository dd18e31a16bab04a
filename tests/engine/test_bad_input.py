"""Bad input gets a ValueError naming the field, and the engine keeps serving the others."""

from __future__ import annotations

import pytest

from engine_helpers import SMALL_ENGINE, assert_no_leaks, hf_greedy, random_prompts
from jaxserve import LLM, LLMEngine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(hf_checkpoint):
    return hf_checkpoint("llama")


BAD_PROMPTS = [
    ({"prompt_token_ids": list(range(2, 130))}, "max_model_len"),
    ({"prompt_token_ids": []}, "prompt"),
    ("", "prompt"),
    ({"prompt_token_ids": [5, 320, 7]}, "prompt_token_ids"),
    ({"prompt_token_ids": [5, -1]}, "prompt_token_ids"),
    ({"wrong": 1}, "prompt"),
    # Each was a TypeError deep in the engine or the tokenizer, not naming the field.
    ({"prompt_token_ids": 5}, "^prompt_token_ids: must be a list of ints, got int$"),
    ({"prompt_token_ids": None}, "^prompt_token_ids: must be a list of ints, got NoneType$"),
    ({"prompt_token_ids": "5 6"}, "^prompt_token_ids: must be a list of ints, got str$"),
    ({"prompt_token_ids": [5, 6], "prompt": 7}, "^prompt: must be a string, got int$"),
    ("Once \ud800", "^prompt: text holds a lone surrogate at position 5"),
    ({"prompt": "\udfff"}, "^prompt: text holds a lone surrogate at position 0"),
]


def test_bad_requests_fail_alone_while_others_keep_running(llama, compile_cache_dir):
    engine = LLMEngine.from_engine_args(model=str(llama), compilation_cache_dir=compile_cache_dir,
                                        **SMALL_ENGINE)
    good = random_prompts(2, 10, 30, seed=31)
    engine.add_request("good0", {"prompt_token_ids": good[0]}, GREEDY)
    engine.step()  # the good request is running when the bad ones arrive
    for i, (prompt, field) in enumerate(BAD_PROMPTS):
        with pytest.raises(ValueError, match=field):
            engine.add_request(f"bad{i}", prompt, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good0", {"prompt_token_ids": good[1]}, GREEDY)
    engine.add_request("good1", {"prompt_token_ids": good[1]}, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert set(done) == {"good0", "good1"}
    expected = hf_greedy(llama, good, 8)
    assert [done["good0"].outputs[0].token_ids, done["good1"].outputs[0].token_ids] == expected
    assert_no_leaks(engine)


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_k": -3}, "top_k"),
    ({"n": 0}, "n"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_a_bad_prompt_in_a_batch_rejects_the_batch_and_leaks_nothing(llama, compile_cache_dir):
    llm = LLM(str(llama), compilation_cache_dir=compile_cache_dir, **SMALL_ENGINE)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"prompt_token_ids": [3, 4]}, {"prompt_token_ids": [3, 999]}], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert_no_leaks(llm.engine)
    for prompts, message in (({"prompt_token_ids": 5}, "prompt_token_ids: must be a list"),
                             (5, "prompts must be a prompt .* got int"),
                             (["Once", "\ud800"], "prompt: text holds a lone surrogate")):
        with pytest.raises(ValueError, match=message):
            llm.generate(prompts, GREEDY)
    with pytest.raises(ValueError, match=r"messages\[0\]: text holds a lone surrogate"):
        llm.chat([{"role": "user", "content": "Hi \ud83d"}], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate({"prompt_token_ids": [3, 4]}, GREEDY)[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("kwargs,field", [
    ({"not_an_arg": 1}, "not_an_arg"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"block_size": 12}, "block_size"),
    ({"attention_backend": "cuda-magic"}, "attention_backend"),
    ({"dtype": "float8"}, "dtype"),
    ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
    ({"token_buckets": [16, 32]}, "token_buckets"),
])
def test_bad_engine_arguments_name_the_argument(llama, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(str(llama), **(SMALL_ENGINE | kwargs))


def test_unknown_architecture_and_missing_model_are_clear_errors(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))
    for text, kind in (("[1, 2]", "list"), ('"llama"', "str"), ("7", "int")):
        (tmp_path / "config.json").write_text(text)  # was an AttributeError in the loader
        with pytest.raises(ValueError, match=f"config.json: must hold a JSON object, got {kind}"):
            LLM(str(tmp_path))


def test_a_kv_pool_smaller_than_one_full_sequence_is_refused(llama, compile_cache_dir):
    # max_model_len 128 in blocks of 16 needs 8 blocks, plus the null block: 9.
    args = SMALL_ENGINE | dict(compilation_cache_dir=compile_cache_dir)
    with pytest.raises(ValueError, match=r"num_kv_blocks .*8 \+ 1"):
        LLM(str(llama), **(args | {"num_kv_blocks": 8}))
    llm = LLM(str(llama), **(args | {"num_kv_blocks": 9}))
    long = random_prompts(1, 120, 120, seed=32)[0]  # the longest prompt fits alone
    out = llm.generate({"prompt_token_ids": long}, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8
    assert_no_leaks(llm.engine)


def test_n_is_capped_by_max_n(llama, compile_cache_dir):
    engine = LLMEngine.from_engine_args(model=str(llama), compilation_cache_dir=compile_cache_dir,
                                        **(SMALL_ENGINE | {"max_n": 4}))
    with pytest.raises(ValueError, match=r"n must be <= max_n \(4\), got 5"):
        engine.add_request("big", {"prompt_token_ids": [3, 4]}, SamplingParams(n=5))
    engine.add_request("ok", {"prompt_token_ids": [3, 4]}, SamplingParams(n=4, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(engine)
    with pytest.raises(ValueError, match="max_n"):
        LLM(str(llama), **(SMALL_ENGINE | {"max_n": 0}))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_wrong_typed_priority_is_refused_and_leaves_nothing_behind(llama, compile_cache_dir,
                                                                     policy):
    engine = LLMEngine.from_engine_args(model=str(llama), compilation_cache_dir=compile_cache_dir,
                                        **(SMALL_ENGINE | {"scheduling_policy": policy}))
    engine.add_request("first", {"prompt_token_ids": [3, 4]}, GREEDY)
    for bad in ("high", 1.5, None, True):
        with pytest.raises(ValueError, match="priority must be an integer"):
            engine.add_request("p", {"prompt_token_ids": [3, 4]}, GREEDY, priority=bad)
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(engine)
