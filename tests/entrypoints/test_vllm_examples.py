"""Our versions of vLLM's offline examples: each runs as vLLM's does, but for the import line
(and a tiny model), and gives outputs of the same structure."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from jaxserve import (LLM, AsyncEngineArgs, AsyncLLM, EngineArgs, LLMEngine, RequestOutputKind,
                      SamplingParams)
from jaxserve.config.vllm_args import accept_vllm_args
from jaxserve.inputs import TextPrompt, TokensPrompt
from jaxserve.outputs import Logprob

# vLLM's example scripts pass these; here they have no effect (one log line each).
VLLM_NO_EFFECT = dict(enforce_eager=True, trust_remote_code=True, disable_log_stats=True,
                      swap_space=4, compilation_config=3, revision=None, quantization=None,
                      kv_cache_dtype="auto", dtype="float")
PROMPTS = ["Hello, my name is", "The president of the United States is",
           "The capital of France is", "The future of AI is"]


@pytest.fixture(scope="module")
def llm(engine_args: dict[str, Any]) -> LLM:
    return LLM(**engine_args, **VLLM_NO_EFFECT)


def test_basic_generation(llm: LLM) -> None:  # examples/offline_inference/basic/basic.py
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(PROMPTS, sampling_params)
    assert [o.prompt for o in outputs] == PROMPTS
    for output in outputs:
        generated_text = output.outputs[0].text
        assert isinstance(generated_text, str) and 0 < len(output.outputs[0].token_ids) <= 16
        assert output.finished is True


def test_prompt_types_give_the_same_output(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    outs = [llm.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids
            for p in (PROMPTS[0], TextPrompt(prompt=PROMPTS[0]), TokensPrompt(prompt_token_ids=ids),
                      ids)]  # a bare list[int] is one prompt
    assert all(o == outs[0] for o in outs)
    with pytest.raises(ValueError, match="'multi_modal_data' is not supported"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": None}}, greedy)


def test_n_seed_and_logprobs(llm: LLM) -> None:  # sampling parameters / logprobs examples
    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=6, logprobs=2)
    first, again = (llm.generate("Once upon a time", params, use_tqdm=False)[0]
                    for _ in range(2))
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert all(len(c.logprobs) == 6 and c.cumulative_logprob < 0 for c in first.outputs)


def test_chat(llm: LLM) -> None:  # examples/offline_inference/basic/chat.py
    conversation = [{"role": "system", "content": "You are a helpful assistant"},
                    {"role": "user", "content": "Hello"}]
    outputs = llm.chat(conversation, SamplingParams(temperature=0.5, max_tokens=5),
                       use_tqdm=False)
    assert len(outputs) == 1 and outputs[0].outputs[0].finish_reason in ("stop", "length")
    # As vLLM's: the output carries the rendered prompt, and the ids are that text's.
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                         tokenize=False)
    assert outputs[0].prompt == text and "Hello" in text
    assert outputs[0].prompt_token_ids == tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True)


def test_chat_options_reach_the_template(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    template = ("{% for m in messages %}{{ m['role'] }}={{ m['content'] }};{% endfor %}"
                "{% if tools %}tools={{ tools | length }};{% endif %}{{ mood }}"
                "{% if add_generation_prompt %}assistant={% endif %}")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    conversation = [{"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                 {"type": "text", "text": "robot"}]},
                    {"role": "assistant", "content": "Hello"}]
    out = llm.chat(conversation, greedy, use_tqdm=False, chat_template=template, tools=tools,
                   chat_template_kwargs={"mood": "calm;"}, add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert out.prompt_token_ids == tokenizer.encode("user=Hi robot;assistant=Hello",
                                                    add_special_tokens=False)
    again = llm.chat(conversation, greedy, use_tqdm=False, chat_template=template, tools=tools,
                     chat_template_kwargs={"mood": "calm;"}, add_generation_prompt=False,
                     continue_final_message=False)[0]
    assert again.prompt_token_ids == tokenizer.encode(
        "user=Hi robot;assistant=Hello;tools=1;calm;", add_special_tokens=False)
    want = llm.generate({"prompt_token_ids": out.prompt_token_ids}, greedy, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize("kwargs, field", [
    (dict(continue_final_message=True), "add_generation_prompt and continue_final_message"),
    (dict(mm_processor_kwargs={"x": 1}), "mm_processor_kwargs"),
    (dict(chat_template_content_format="html"), "chat_template_content_format"),
    (dict(chat_template="no/such/template.jinja"), "chat_template"),
    (dict(lora_request=object()), "lora_request"),
    (dict(chat_template_kwargs={"tokenize": False}), "chat_template_kwargs.tokenize"),
    (dict(chat_template_kwargs=["x"]), "chat_template_kwargs must be a dict")])
def test_chat_refuses_what_it_cannot_do_naming_the_field(llm: LLM, kwargs: dict[str, Any],
                                                         field: str) -> None:
    with pytest.raises(ValueError, match=field):
        llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False, **kwargs)
    assert not llm.engine.has_unfinished_requests()


def test_truncate_prompt_tokens_keeps_the_last_tokens_and_detokenize_false_gives_no_text(
        llm: LLM) -> None:
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    greedy = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
    cut = llm.generate(PROMPTS[1], SamplingParams(truncate_prompt_tokens=3, **greedy),
                       use_tqdm=False)[0]
    tail = llm.generate({"prompt_token_ids": ids[-3:]}, SamplingParams(**greedy),
                        use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-3:] and len(ids) > 3
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    bare = llm.generate({"prompt_token_ids": ids[-3:]}, SamplingParams(
        detokenize=False, logprobs=1, **greedy), use_tqdm=False)[0].outputs[0]
    assert bare.token_ids == tail.outputs[0].token_ids and bare.text == ""
    assert all(lp.decoded_token is None for e in bare.logprobs for lp in e.values())


def test_beam_search_gives_vllms_output_and_refuses_what_it_cannot(llm: LLM) -> None:
    from jaxserve.sampling_params import BeamSearchParams

    outs = llm.beam_search([TextPrompt(prompt=PROMPTS[0]), {"prompt_token_ids": [5, 6, 7]}],
                           BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    assert len(outs) == 2 and all(len(o.sequences) == 2 for o in outs)
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    for seq in outs[0].sequences:
        assert seq.tokens[:len(ids)] == ids and len(seq.tokens) == len(ids) + 3
        assert seq.text == llm.get_tokenizer().decode(seq.tokens)
        assert seq.cum_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(seq.tokens[len(ids):], seq.logprobs)), abs=1e-5)
    assert outs[0].sequences[0].cum_logprob >= outs[0].sequences[1].cum_logprob
    with pytest.raises(ValueError, match="beam_width must be <= max_logprobs / 2"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="params must be a BeamSearchParams"):
        llm.beam_search([PROMPTS[0]], SamplingParams())
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=200))
    assert not llm.engine.has_unfinished_requests()


def test_get_metrics_reads_vllm_named_series(llm: LLM) -> None:
    from jaxserve.engine.metrics_reader import Counter, Gauge

    before = {m.name: m for m in llm.get_metrics()}
    llm.generate({"prompt_token_ids": list(range(50, 90))}, SamplingParams(max_tokens=2),
                 use_tqdm=False)
    after = {m.name: m for m in llm.get_metrics()}
    assert isinstance(after["vllm:num_requests_running"], Gauge)
    assert isinstance(after["vllm:kv_cache_usage_perc"], Gauge)
    assert after["vllm:num_requests_waiting"].value == 0
    queries = after["vllm:prefix_cache_queries_total"]
    assert isinstance(queries, Counter) and queries.labels["engine"] == "0"
    assert queries.value > before["vllm:prefix_cache_queries_total"].value
    assert {"vllm:num_preemptions_total", "vllm:prefix_cache_hits_total"} <= set(after)


def test_llm_engine_methods_and_reset_prefix_cache(llm: LLM) -> None:
    assert llm.llm_engine is llm.engine
    prompt = {"prompt_token_ids": list(range(5, 5 + 40))}
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(prompt, greedy, use_tqdm=False)
    hits = llm.stats().prefix_cache_hits
    llm.generate(prompt, greedy, use_tqdm=False)
    assert llm.stats().prefix_cache_hits > hits  # served from the cache
    assert llm.reset_prefix_cache() is True
    hits = llm.stats().prefix_cache_hits
    llm.generate(prompt, greedy, use_tqdm=False)
    assert llm.stats().prefix_cache_hits == hits  # the cache was emptied


def test_llm_engine_getters_vllm_users_call(llm: LLM, engine_args: dict[str, Any]) -> None:
    engine = llm.llm_engine
    assert engine.get_tokenizer() is llm.get_tokenizer() is not None
    config = engine.get_model_config()
    assert (config.model, config.max_model_len) == (engine_args["model"], 128)
    assert engine.get_num_unfinished_requests() == 0
    engine.add_request("a", "Once upon a time", SamplingParams(n=2, max_tokens=2))
    engine.add_request("b", "Once upon a time", SamplingParams(max_tokens=2))
    assert engine.get_num_unfinished_requests() == 2  # requests, not samples
    engine.abort_request(["a", "b"])
    assert engine.get_num_unfinished_requests() == 0 and not engine.has_unfinished_requests()
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.kv_transfer_params is None  # vLLM's field: no KV connector set it


def test_llm_engine_from_engine_args_step_loop(engine_args: dict[str, Any],
                                               llm: LLM) -> None:  # llm_engine_example.py
    engine = LLMEngine.from_engine_args(EngineArgs(**engine_args))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("0", "Once upon a time", params)
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    want = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
    assert [o.outputs[0].token_ids for o in finished] == [want.token_ids]


def test_llm_engine_step_gives_each_request_its_own_output_kind(engine_args: dict[str, Any],
                                                               llm: LLM) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(**engine_args))
    greedy = dict(temperature=0.0, max_tokens=5, ignore_eos=True)
    for kind in RequestOutputKind:
        engine.add_request(kind.name, "Once upon a time",
                           SamplingParams(output_kind=kind, **greedy))
    seen: dict[str, list] = {kind.name: [] for kind in RequestOutputKind}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    want = llm.generate("Once upon a time", SamplingParams(**greedy),
                        use_tqdm=False)[0].outputs[0].token_ids
    cumulative, delta, final = (seen[k] for k in ("CUMULATIVE", "DELTA", "FINAL_ONLY"))
    assert [o.outputs[0].token_ids for o in cumulative] == [
        want[:len(o.outputs[0].token_ids)] for o in cumulative]
    assert len(cumulative) > 1 and cumulative[-1].outputs[0].token_ids == want
    assert [o.finished for o in cumulative] == [False] * (len(cumulative) - 1) + [True]
    assert [t for o in delta for t in o.outputs[0].token_ids] == want
    assert len(delta) == len(cumulative)
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == want


def test_logprobs_and_prompt_logprobs_have_vllms_shape(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=1,
                            ignore_eos=True)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    comp, tokenizer = out.outputs[0], llm.get_tokenizer()
    assert out.finished is True and comp.finished() is True  # a field, and vLLM's method
    assert len(comp.logprobs) == len(comp.token_ids) == 4
    for token, entry in zip(comp.token_ids, comp.logprobs):
        assert all(isinstance(lp, Logprob) for lp in entry.values())
        assert next(iter(entry)) == token and entry[token].rank == 1 and len(entry) == 2
        assert entry[token].decoded_token == tokenizer.decode([token], skip_special_tokens=False)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert next(iter(entry)) == token and len(entry) in (1, 2)


def test_async_llm_output_kinds(engine_args: dict[str, Any], llm: LLM) -> None:
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))
    want = llm.generate("Once upon a time", SamplingParams(
        n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]

    async def stream(kind: RequestOutputKind | None, request_id: str) -> list:
        kwargs = {} if kind is None else {"output_kind": kind}
        params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                                **kwargs)
        return [out async for out in engine.generate("Once upon a time", params, request_id)]

    try:
        cumulative, delta, final = asyncio.run(_gather(
            stream(None, "c"), stream(RequestOutputKind.DELTA, "d"),
            stream(RequestOutputKind.FINAL_ONLY, "f")))
    finally:
        engine.shutdown()
    # vLLM's default: each output holds everything so far; the usual loop keeps the last.
    assert len(cumulative) > 2
    for i in range(2):
        texts = [c.text for o in cumulative for c in o.outputs if c.index == i]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    for got in (cumulative[-1], final[-1]):
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
        assert [c.text for c in got.outputs] == [c.text for c in want.outputs]
    assert len(final) == 1 and final[0].finished
    for c in want.outputs:
        assert "".join(d.text for o in delta for d in o.outputs if d.index == c.index) == c.text


async def _gather(*coros: Any) -> list:
    return list(await asyncio.gather(*coros))


def test_vllm_arguments_without_effect_log_once_and_the_others_are_refused(
        caplog: pytest.LogCaptureFixture, engine_args: dict[str, Any]) -> None:
    with caplog.at_level(logging.INFO, logger="jaxserve.config.vllm_args"):
        accept_vllm_args({"max_seq_len_to_capture": 1})
        accept_vllm_args({"max_seq_len_to_capture": 2})
    assert sum("max_seq_len_to_capture" in r.message for r in caplog.records) == 1
    assert accept_vllm_args({"dtype": "float"}) == {"dtype": "float32"}
    assert accept_vllm_args({"dtype": "half"}) == {"dtype": "float16"}
    for name, value, words in [("dtype", "half", "dtype 'float16': the cpu attention backend"),
                               ("revision", "main", "revision='main' is not supported"),
                               ("quantization", "awq", "quantization='awq'"),
                               ("kv_cache_dtype", "fp8", "kv_cache_dtype='fp8'")]:
        with pytest.raises(ValueError, match=words):
            LLM(**engine_args | {name: value})
    with pytest.raises(ValueError, match=r"max_model_len \(512\) is more than the model's "
                                         r"context \(max_position_embeddings = 256\)"):
        LLM(**engine_args | {"max_model_len": 512})


def test_engine_args_read_as_attributes_and_fail_early(engine_args: dict[str, Any]) -> None:
    args = EngineArgs(**engine_args)
    assert (args.max_num_seqs, args.enable_prefix_caching) == (4, True)
    with pytest.raises(AttributeError, match="no engine argument 'nope'"):
        _ = args.nope
    with pytest.raises(ValueError, match="unknown engine argument"):
        EngineArgs(model="x", max_num_seq=3)


def test_the_tokenizer_argument_is_honoured(engine_args: dict[str, Any], llm: LLM,
                                            tmp_path: Path) -> None:
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import _tokenizer

    model = llm.engine.core.model_config
    config = EngineConfig.from_kwargs(**engine_args | {"tokenizer": engine_args["model"]})
    tok = _tokenizer(config, None, model)  # not the checkpoint's (None here): the named one
    assert tok is not None and tok.encode("Hello") == llm.get_tokenizer().encode("Hello")
    config = EngineConfig.from_kwargs(**engine_args | {"tokenizer": str(tmp_path)})
    with pytest.raises(ValueError, match="tokenizer: no tokenizer.json"):
        _tokenizer(config, None, model)


def test_set_tokenizer_tokenises_and_detokenises_later_requests(llm: LLM, tiny_model: Path,
                                                               ) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model)
    hf.add_tokens(["<robot>"])  # the model's vocabulary (320) has room past the checkpoint's
    robot, own = hf.convert_tokens_to_ids("<robot>"), llm.get_tokenizer()
    params = SamplingParams(max_tokens=2, allowed_token_ids=[robot])
    try:
        llm.set_tokenizer(hf)
        out = llm.generate("Hello <robot>", params, use_tqdm=False)[0]
        assert out.prompt_token_ids == hf.encode("Hello <robot>")
        assert out.prompt_token_ids[-1] == robot and out.outputs[0].token_ids == [robot, robot]
        assert out.outputs[0].text == "<robot><robot>"
        assert llm.get_tokenizer().encode("<robot>") == [robot]
    finally:
        llm.set_tokenizer(own)
    out = llm.generate("Hello <robot>", params, use_tqdm=False)[0]
    assert out.prompt_token_ids == own.encode("Hello <robot>") and robot not in \
        out.prompt_token_ids and out.outputs[0].text != "<robot><robot>"
    for bad in ("gpt2", None):
        with pytest.raises(ValueError, match="tokenizer must be a jaxserve Tokenizer or an HF"):
            llm.set_tokenizer(bad)
