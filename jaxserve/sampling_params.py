"""SamplingParams: how one request is sampled and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

import copy
import dataclasses
import json as _json
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from enum import IntEnum

import numpy as np

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing logits by a
# near-zero temperature is an argmax anyway, and one that overflows.
SAMPLING_EPS = 1e-5
SEED_MODULUS = 2**32  # per-request seeds live on the device as u32
INT32_MAX = 2**31 - 1  # token ids, counts and top_k live on the device as i32
FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_STOP_STRINGS = 64  # each is searched in every new piece of text: the cost is per step
MAX_STOP_CHARS = 4096  # summed over the stop strings


# Entries of HF's generation_config.json that vLLM takes as sampling defaults
# (generation_config="auto"); max_new_tokens is max_tokens here.
GENERATION_CONFIG_SAMPLING = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p",
                              "max_new_tokens")


def sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The SamplingParams fields a checkpoint's generation config sets."""
    out = {k: generation_config[k] for k in GENERATION_CONFIG_SAMPLING
           if generation_config.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ValueError(f"generation_config (the checkpoint's sampling defaults): {e}; "
                         "generation_config='vllm' ignores them") from None
    return out


class RequestOutputKind(IntEnum):
    """What each streamed output holds (vLLM's values): everything so far, only what is new,
    or nothing until the request has finished."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _check_int(name: str, value: object, *, allow_none: bool = False, low: int = 0,
               high: int = INT32_MAX) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _check_bool(name: str, value: object) -> None:
    # A string such as "no" is truthy: taken as a flag it would mean the opposite.
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain the output to one of: a JSON schema (dict or JSON text), a regex, a choice of
    strings, a Lark grammar (llguidance's dialect), or any JSON object (vLLM's names)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar, json_object; got {given or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = _json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from e
            if not isinstance(self.json, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema object, got "
                                 f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {value!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 f"strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool, "
                             f"got {self.json_object!r}")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what the grammar cache is keyed by."""
        if self.json is not None:
            return "json", _json.dumps(self.json, sort_keys=True)
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", _json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json_object", ""


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off (-1 is stored as 0)
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: str | list[str] | None = None  # stored as list[str]
    stop_token_ids: list[int] | None = None  # stored as list[int]
    ignore_eos: bool = False
    # Top-n logprobs of each sampled position / prompt position (and its own token's); -1
    # (vLLM's): the whole vocabulary, if the engine's max_logprobs allows it.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # how AsyncLLM streams
    structured_outputs: StructuredOutputsParams | None = None
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens (-1: all that fit)
    detokenize: bool = True  # False: token ids only (no text; no stop strings)
    extra_args: dict[str, Any] | None = None  # vLLM's, for custom sampling code: none reads it
    # vLLM's; only the values that ask for nothing (see _check_unsupported).
    spaces_between_special_tokens: bool = True
    # Token constraints (vLLM's), checked by _check_token_constraints
    logit_bias: dict[int, float] | None = None  # added to those tokens' logits (not logprobs)
    allowed_token_ids: list[int] | None = None  # the only tokens sampled (masked on the device)
    # Words never generated: a word's last token is blocked where the output ends with the rest
    # of it (vLLM's rule: the output only, not the prompt). The engine tokenizes each word as
    # written and after a space (`with_bad_words_token_ids`).
    bad_words: list[str] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        _check_int("n", self.n, low=1)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                     "detokenize", "spaces_between_special_tokens"):
            _check_bool(name, getattr(self, name))
        self._check_unsupported()
        self._check_token_constraints()
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

        self.temperature = _check_float("temperature", self.temperature)
        if not 0 <= self.temperature <= FLOAT32_MAX:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, low=-1)
        self.top_k = max(int(self.top_k), 0)
        self.min_p = _check_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        _check_int("seed", self.seed, allow_none=True, low=-(2**63), high=2**64 - 1)
        if self.seed == -1:  # vLLM's "random", as None
            self.seed = None
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= FLOAT32_MAX:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")

        _check_int("max_tokens", self.max_tokens, allow_none=True, low=1)
        _check_int("min_tokens", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        _check_int("logprobs", self.logprobs, allow_none=True, low=-1)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        _check_int("prompt_logprobs", self.prompt_logprobs, allow_none=True, low=-1)
        _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, allow_none=True,
                   low=-1)
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be >= 1 or -1, got 0")
        if not self.detokenize and self.stop:
            raise ValueError("stop strings need detokenize=True (they are matched in the text)")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict, got {type(self.extra_args).__name__}")

    def _check_unsupported(self) -> None:
        """vLLM's fields that the on-device sampler cannot honour: refused, never ignored."""
        if self.spaces_between_special_tokens is not True:
            raise ValueError("spaces_between_special_tokens=False is not supported (text is "
                             "decoded as the tokenizer's own decode does)")

    def _check_token_constraints(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0
                    and isinstance(b, numbers.Real) and not isinstance(b, bool)
                    and -100 <= b <= 100 for t, b in self.logit_bias.items()):
                raise ValueError(f"logit_bias must map token ids (ints >= 0) to biases in "
                                 f"[-100, 100], got {self.logit_bias!r}")
            self.logit_bias = {t: float(b) for t, b in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                           for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids (ints "
                             f">= 0), got {self.allowed_token_ids!r}")
        if self.bad_words is not None and (
                not isinstance(self.bad_words, (list, tuple))
                or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of non-blank strings, "
                             f"got {self.bad_words!r}")

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in items):
            raise ValueError(f"stop must not contain an empty string, got {stop!r}")
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings, "
                             f"got {len(items)}")
        if sum(len(s) for s in items) > MAX_STOP_CHARS:
            raise ValueError(f"stop strings must total at most {MAX_STOP_CHARS} characters, "
                             f"got {sum(len(s) for s in items)}")
        return list(items)

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)) or any(
                isinstance(t, bool) or not isinstance(t, numbers.Integral)
                or not 0 <= t <= INT32_MAX
                for t in ids):
            raise ValueError(f"stop_token_ids must be a list of integers in [0, {INT32_MAX}], "
                             f"got {ids!r}")
        return [int(t) for t in ids]

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's): changing it leaves this one as it is."""
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def needs_host_history(self) -> bool:
        """Whether each token depends on the ones before it on the host (penalties read the
        history, a grammar's mask follows it, bad words their first tokens; a token mask is
        written at the sample row of a step, which knows no drafts): async scheduling must not
        run ahead of it."""
        return (self.has_penalties or self.structured_outputs is not None
                or bool(self.bad_words_token_ids) or self.allowed_token_ids is not None)

    def with_bad_words_token_ids(self, encode: Callable[[str], list[int]]) -> SamplingParams:
        """A copy holding each bad word's tokens, as written and after a space (a word inside
        a text is usually tokenized with its leading space)."""
        ids = dict.fromkeys(tuple(encode(variant)) for word in self.bad_words or ()
                            for variant in (word.strip(), " " + word.strip()))
        return dataclasses.replace(self, bad_words_token_ids=tuple(t for t in ids if t))

    def blocked_by_bad_words(self, output_token_ids: Sequence[int]) -> list[int]:
        """The tokens a bad word forbids next: its last, where the output ends with the rest."""
        blocked = []
        for word in self.bad_words_token_ids:
            rest = len(word) - 1  # the tokens the output must end with
            if rest == 0 or (len(output_token_ids) >= rest
                             and list(output_token_ids[-rest:]) == list(word[:-1])):
                blocked.append(word[-1])
        return blocked


def request_seed(params: SamplingParams, rng: np.random.Generator, index: int = 0) -> int:
    """The u32 seed of sample `index` (of `params.n`) of one request.

    A request's own seed gives sample i the seed `seed + i` (as vLLM seeds its n children);
    otherwise each sample draws one from the engine's seeded `rng`, so a whole run is
    reproducible from the engine seed, and each request whatever the batch around it.
    """
    if params.seed is None:
        return int(rng.integers(0, SEED_MODULUS))
    return (int(params.seed) + index) % SEED_MODULUS


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's `LLM.beam_search` parameters: keep the `beam_width` likeliest sequences, scored
    by cumulative logprob / length ** length_penalty, for `max_tokens` steps."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check_int("beam_width", self.beam_width, low=1)
        _check_int("max_tokens", self.max_tokens, low=1)
        self.temperature = _check_float("temperature", self.temperature)
        if not 0 <= self.temperature <= FLOAT32_MAX:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        self.length_penalty = _check_float("length_penalty", self.length_penalty)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))
