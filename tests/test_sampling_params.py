import re

import numpy as np
import pytest

from jaxserve.sampling_params import RequestOutputKind, SamplingParams, request_seed


def test_defaults_follow_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs) == (16, 0, None, None)
    assert (p.stop, p.stop_token_ids) == ([], [])
    assert not p.ignore_eos and p.skip_special_tokens and not p.include_stop_str_in_output
    assert not p.greedy and not p.has_penalties
    assert p.output_kind is RequestOutputKind.CUMULATIVE


def test_stop_and_top_k_are_normalised() -> None:
    p = SamplingParams(stop="###", stop_token_ids=(7, 9), top_k=-1)
    assert p.stop == ["###"]
    assert p.stop_token_ids == [7, 9]
    assert p.top_k == 0
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]


@pytest.mark.parametrize("kwargs, greedy", [
    ({"temperature": 0.0}, True),
    ({"temperature": 1e-7}, True),
    ({"temperature": 0.7, "top_k": 1}, True),
    ({"temperature": 0.7}, False),
    ({"temperature": 0.7, "top_k": 2}, False),
])
def test_greedy_property(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).greedy is greedy


@pytest.mark.parametrize("kwargs", [
    {"presence_penalty": 0.1}, {"frequency_penalty": -0.5}, {"repetition_penalty": 1.1}])
def test_has_penalties(kwargs: dict) -> None:
    assert SamplingParams(**kwargs).has_penalties


@pytest.mark.parametrize("kwargs", [
    {"top_p": 1.0}, {"top_p": 1e-6}, {"min_p": 0.0}, {"min_p": 1.0}, {"top_k": 1},
    {"presence_penalty": -2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 1e-3},
    {"max_tokens": None}, {"max_tokens": 1}, {"min_tokens": 16, "max_tokens": 16},
    {"min_tokens": 100, "max_tokens": None}, {"logprobs": 0}, {"seed": 0}, {"n": 4},
    {"temperature": 0}, {"top_p": 1}, {"stop_token_ids": [0]},
])
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field, value", [
    ({"n": 0}, "n", "0"),
    ({"n": 1.5}, "n", "1.5"),
    ({"temperature": -0.1}, "temperature", "-0.1"),
    ({"temperature": float("nan")}, "temperature", "nan"),
    ({"temperature": float("inf")}, "temperature", "inf"),
    ({"temperature": "hot"}, "temperature", "hot"),
    ({"top_p": 0.0}, "top_p", "0.0"),
    ({"top_p": 1.5}, "top_p", "1.5"),
    ({"top_p": float("nan")}, "top_p", "nan"),
    ({"top_k": -2}, "top_k", "-2"),
    ({"top_k": 2.0}, "top_k", "2.0"),
    ({"min_p": -0.1}, "min_p", "-0.1"),
    ({"min_p": 1.1}, "min_p", "1.1"),
    ({"seed": 1.0}, "seed", "1.0"),
    ({"seed": "7"}, "seed", "7"),
    ({"presence_penalty": 2.5}, "presence_penalty", "2.5"),
    ({"presence_penalty": -2.1}, "presence_penalty", "-2.1"),
    ({"frequency_penalty": 3}, "frequency_penalty", "3"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "0.0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty", "-1.0"),
    ({"max_tokens": 0}, "max_tokens", "0"),
    ({"max_tokens": -5}, "max_tokens", "-5"),
    ({"max_tokens": True}, "max_tokens", "True"),
    ({"min_tokens": -1}, "min_tokens", "-1"),
    ({"min_tokens": 17}, "min_tokens", "17"),
    ({"stop": [""]}, "stop", "''"),
    ({"stop": ["ok", 3]}, "stop", "3"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "-1"),
    ({"stop_token_ids": 5}, "stop_token_ids", "5"),
    ({"logprobs": -2}, "logprobs", "-2"),  # -1: the whole vocabulary
    ({"prompt_logprobs": -2}, "prompt_logprobs", "-2"),
    # Values the device holds as int32 / float32 (issue 21: top_k 2**31 crashed the step).
    ({"top_k": 2**31}, "top_k", "2147483648"),
    ({"max_tokens": 2**31}, "max_tokens", "2147483648"),
    ({"min_tokens": 2**31, "max_tokens": None}, "min_tokens", "2147483648"),
    ({"logprobs": 2**31}, "logprobs", "2147483648"),
    ({"n": 2**31}, "n", "2147483648"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids", "2147483648"),
    ({"temperature": 1e39}, "temperature", "1e+39"),
    ({"repetition_penalty": 1e39}, "repetition_penalty", "1e+39"),
    ({"seed": 2**64}, "seed", "18446744073709551616"),
    ({"stop": [str(i) for i in range(65)]}, "stop", "65"),
    ({"stop": ["x" * 4097]}, "stop", "4097"),
    ({"output_kind": 1}, "output_kind", "1"),  # the enum's value, not the enum
    # A truthy string would have turned each flag on (issue 53: ignore_eos="no" was true).
    ({"ignore_eos": "no"}, "ignore_eos", "'no'"),
    ({"ignore_eos": 1}, "ignore_eos", "1"),
    ({"skip_special_tokens": "false"}, "skip_special_tokens", "'false'"),
    ({"include_stop_str_in_output": "no"}, "include_stop_str_in_output", "'no'"),
    ({"detokenize": 0}, "detokenize", "0"),
    ({"spaces_between_special_tokens": "yes"}, "spaces_between_special_tokens", "'yes'"),
])
def test_invalid_parameter_raises_value_error_naming_field_and_value(
        kwargs: dict, field: str, value: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(field)
    assert value in str(info.value)


def test_own_seed_gives_children_consecutive_seeds() -> None:
    rng = np.random.default_rng(0)
    p = SamplingParams(seed=41, n=3)
    assert [request_seed(p, rng, i) for i in range(3)] == [41, 42, 43]
    assert request_seed(SamplingParams(seed=2**32 + 5), rng) == 5
    assert request_seed(SamplingParams(seed=-2), rng) == 2**32 - 2  # -1 is "random" (vLLM)


def test_drawn_seeds_are_reproducible_from_engine_seed() -> None:
    p = SamplingParams()
    first = [request_seed(p, np.random.default_rng(123), 0)]
    rng_a, rng_b = np.random.default_rng(123), np.random.default_rng(123)
    seeds_a = [request_seed(p, rng_a, i) for i in range(8)]
    seeds_b = [request_seed(p, rng_b, i) for i in range(8)]
    assert seeds_a == seeds_b
    assert seeds_a[0] == first[0]
    assert len(set(seeds_a)) == 8
    assert all(0 <= s < 2**32 for s in seeds_a)
    assert seeds_a != [request_seed(p, np.random.default_rng(124), i) for i in range(8)]


def test_seed_minus_one_means_random_as_vllm():
    from jaxserve.sampling_params import SamplingParams as SP

    assert SP(seed=-1).seed is None and SP(seed=None).seed is None and SP(seed=0).seed == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(logit_bias={5: 101.0}), r"logit_bias must map token ids \(ints >= 0\) to biases"),
    (dict(logit_bias={"5": 1.0}), "logit_bias must map token ids"),
    (dict(logit_bias={5: float("nan")}), "logit_bias must map token ids"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list of token ids"),
    (dict(allowed_token_ids=[5, -1]), "allowed_token_ids must be a non-empty list"),
    (dict(allowed_token_ids=5), "allowed_token_ids must be a non-empty list"),
    (dict(bad_words=["robot", " "]), "bad_words must be a list of non-blank strings"),
    (dict(bad_words="robot"), "bad_words must be a list of non-blank strings"),
    (dict(spaces_between_special_tokens=False), "spaces_between_special_tokens=False"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be >= 1 or -1"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens must be in"),
    (dict(detokenize=False, stop=["x"]), "stop strings need detokenize=True"),
    (dict(detokenize=1), "detokenize must be a bool"),
    (dict(extra_args=[1]), "extra_args must be a dict")])
def test_vllms_other_fields_are_refused_or_checked_naming_them(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_vllms_other_fields_take_their_no_op_values() -> None:
    p = SamplingParams(logit_bias={}, allowed_token_ids=None, bad_words=[],
                       spaces_between_special_tokens=True, extra_args={"k": 1},
                       truncate_prompt_tokens=-1, detokenize=False)
    assert p.extra_args == {"k": 1} and p.truncate_prompt_tokens == -1 and not p.detokenize


def test_clone_is_a_deep_copy() -> None:
    p = SamplingParams(temperature=0.5, stop=["###"], stop_token_ids=[7], extra_args={"k": [1]},
                       structured_outputs={"choice": ["a", "b"]})
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("!!!")
    q.extra_args["k"].append(2)
    q.structured_outputs.choice.append("c")
    assert (p.stop, p.extra_args, p.structured_outputs.choice) == (["###"], {"k": [1]}, ["a", "b"])
