"""Structured outputs: every output of a constrained request, sampled at temperature 1 from
random weights that know nothing of JSON, matches its schema, regex, choice or grammar; greedy
constrained outputs are the same with async scheduling on and off, prefix caching on and off,
and under preemption; bad constraints are ValueErrors; nothing leaks."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from engine_helpers import SMALL_ENGINE, assert_no_leaks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxserve import LLM, SamplingParams
from jaxserve.sampling_params import StructuredOutputsParams

PROMPT = "Write a record:"


@pytest.fixture(scope="module")
def llm(hf_checkpoint, compile_cache_dir) -> LLM:
    return LLM(str(hf_checkpoint("llama")), compilation_cache_dir=compile_cache_dir,
               **{**SMALL_ENGINE, "max_model_len": 256, "num_kv_blocks": 320})


def constrained(max_tokens: int = 200, temperature: float = 1.0, seed: int | None = 0,
                **so: object) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**so))


def texts(llm: LLM, params: list[SamplingParams], prompt: str = PROMPT) -> list[str]:
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
    return [o.outputs[0].text for o in outs]


# Schemas whose every instance is short: strings and arrays are bounded (a model that does
# not know JSON would otherwise write a string until max_tokens).
_leaf = st.one_of(
    st.just({"type": "boolean"}), st.just({"type": "null"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10},
              st.integers(-10, 10)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda vals: {"enum": vals}, st.lists(st.sampled_from(
        ["red", "green", 1, 2.5, None, True]), min_size=1, max_size=3, unique=True)))
_names = st.lists(st.sampled_from(["a", "id", "name", "x_y", "value"]), min_size=1,
                  max_size=3, unique=True)


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    def build(names: list[str], kids: list[dict], required: list[bool]) -> dict:
        props = dict(zip(names, kids))
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": [n for n, r in zip(names, required) if r]}
    return _names.flatmap(lambda names: st.builds(
        build, st.just(names), st.lists(children, min_size=len(names), max_size=len(names)),
        st.lists(st.booleans(), min_size=len(names), max_size=len(names))))


schemas = st.recursive(_leaf, lambda kids: st.one_of(
    _object(kids),
    st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, kids,
              st.integers(0, 3))), max_leaves=5)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=_object(schemas), seed=st.integers(0, 2**31))
def test_random_schemas_sampled_at_temperature_1_parse_and_validate(llm, schema, seed):
    (text,) = texts(llm, [constrained(json=schema, seed=seed)])
    jsonschema.validate(json.loads(text), schema)


def test_a_batch_of_schemas_regexes_and_choices_all_match(llm):
    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "tags": {"type": "array", "maxItems": 2,
                                                        "items": {"enum": ["x", "y"]}}},
              "required": ["n", "tags"], "additionalProperties": False}
    regex = r"[a-c]{2,5}-[0-9]{3}"
    choice = ["alpha", "beta", "gamma delta"]
    params = [constrained(json=schema, seed=s) for s in range(4)] \
        + [constrained(regex=regex, seed=s) for s in range(4)] \
        + [constrained(choice=choice, seed=s) for s in range(4)] \
        + [constrained(json_object=True, seed=1, max_tokens=60)] \
        + [SamplingParams(temperature=1.0, seed=2, max_tokens=20, ignore_eos=True)]
    outs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    got = [o.outputs[0] for o in outs]
    for out in got[:4]:
        jsonschema.validate(json.loads(out.text), schema)
    for out in got[4:8]:
        assert re.fullmatch(regex, out.text), out.text
    for out in got[8:12]:
        assert out.text in choice
    # Any JSON object has unbounded strings, which random weights may not close in time: the
    # output is a complete object, or a prefix every token of which the grammar accepted.
    if got[12].finish_reason == "stop":
        assert isinstance(json.loads(got[12].text), dict)
    else:
        assert accepts_prefix(llm, StructuredOutputsParams(json_object=True), got[12].token_ids)
    assert len(got[13].token_ids) == 20  # the free request beside them is unconstrained
    assert all(o.finish_reason == "stop" for o in got[:12])
    assert_no_leaks(llm.engine)


def accepts_prefix(llm: LLM, params: StructuredOutputsParams, token_ids: list[int]) -> bool:
    so = llm.engine.input_processor.structured_outputs().request(params)
    while not so.ready():
        pass
    return all(so.accept(t) for t in token_ids) and not so.is_terminated


def test_lark_grammar_output_parses(llm):
    grammar = r"""
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /0|[1-9][0-9]{0,2}/
"""
    outs = texts(llm, [constrained(grammar=grammar, seed=s, max_tokens=60) for s in range(3)])
    for text in outs:
        assert re.fullmatch(r"[0-9()+\-]+", text), text
        eval(text, {"__builtins__": {}})


@pytest.mark.parametrize("bad, field", [
    ({"json": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}, "json"),
    ({"regex": "(unclosed"}, "regex"),
    ({"grammar": "start: ( "}, "grammar"),
])
def test_invalid_constraint_is_a_value_error_naming_it(llm, bad, field):
    with pytest.raises(ValueError, match=f"structured_outputs.{field}"):
        llm.generate(PROMPT, constrained(**bad), use_tqdm=False)
    assert_no_leaks(llm.engine)


def test_params_must_name_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="structured_outputs.json"):
        StructuredOutputsParams(json="{not json")
    assert SamplingParams(structured_outputs={"regex": "a+"}).needs_host_history


def greedy_outputs(llm: LLM, prompts: list[str]) -> list[str]:
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8},
                                               "k": {"type": "integer"}},
              "required": ["word", "k"], "additionalProperties": False}
    params = [constrained(json=schema, temperature=0.0, seed=None, max_tokens=80),
              constrained(regex=r"[a-z]{3,20}", temperature=0.0, seed=None, max_tokens=40)]
    outs = llm.generate(prompts * 2, [p for p in params for _ in prompts], use_tqdm=False)
    return [o.outputs[0].text for o in outs]


@pytest.mark.slow
def test_greedy_constrained_outputs_same_async_sync_prefix_cache_and_preemption(
        hf_checkpoint, compile_cache_dir):
    path = str(hf_checkpoint("llama"))
    prompts = [f"{PROMPT} {i} " + "shared prefix " * (i % 3) for i in range(6)]
    results = {}
    for name, extra in [("async", {}), ("sync", {"async_scheduling": False}),
                        ("no-prefix-cache", {"enable_prefix_caching": False}),
                        ("preempting", {"num_kv_blocks": 24})]:
        llm = LLM(path, compilation_cache_dir=compile_cache_dir,
                  **{**SMALL_ENGINE, "max_model_len": 256, "num_kv_blocks": 320, **extra})
        results[name] = greedy_outputs(llm, prompts)
        if name == "preempting":
            assert llm.engine.core.stats().num_preemptions > 0
        assert_no_leaks(llm.engine)
    assert results["sync"] == results["async"]
    assert results["no-prefix-cache"] == results["async"]
    assert results["preempting"] == results["async"]


def test_async_scheduling_never_runs_a_constrained_request_ahead_of_its_matcher(llm):
    """Every constrained decode's input comes from the host (its token was accepted by the
    matcher before the mask of the next step was computed), never from the device."""
    batch = llm.engine.core.executor.worker.runner.batch
    prepare, device_inputs = batch.prepare, [0]

    def counting(*args, **kwargs):
        arrays = prepare(*args, **kwargs)
        device_inputs[0] += int((arrays.prev_rows >= 0).sum())
        return arrays

    assert llm.engine.config.scheduler.async_scheduling
    batch.prepare = counting
    try:
        outs = texts(llm, [constrained(regex=r"[0-9]{4,12}", seed=s, max_tokens=30)
                           for s in range(3)])
    finally:
        batch.prepare = prepare
    assert all(re.fullmatch(r"[0-9]{4,12}", t) for t in outs)
    assert device_inputs[0] == 0


def test_constraints_compose_with_n_logprobs_penalties_and_stop_strings(llm):
    regex = r"[a-e]{3,8}( [0-9]{1,3}){0,3}"
    params = SamplingParams(n=3, temperature=1.0, seed=4, top_k=20, top_p=0.9, max_tokens=60,
                            logprobs=2, repetition_penalty=1.2, presence_penalty=0.5,
                            structured_outputs=StructuredOutputsParams(regex=regex))
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert len(out.outputs) == 3
    for comp in out.outputs:
        assert comp.finish_reason == "stop" and re.fullmatch(regex, comp.text), comp.text
        assert len(comp.logprobs) == len(comp.token_ids)
    # A stop string ends a constrained output early: a prefix of a match, without the stop.
    stopped = SamplingParams(temperature=1.0, seed=6, max_tokens=60, stop="x",
                             structured_outputs=StructuredOutputsParams(
                                 regex=r"[a-e]{4,8}x[0-9]{2}"))
    (out,) = llm.generate(PROMPT, stopped, use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop"
    assert re.fullmatch(r"[a-e]{4,8}", out.outputs[0].text), out.outputs[0].text
    assert_no_leaks(llm.engine)
