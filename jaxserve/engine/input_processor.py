"""Input processing: tokenise, validate, and make the engine's `Request`s (n > 1 fans out)."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any, Union

import numpy as np

from jaxserve.config import ModelConfig, num_logprobs
from jaxserve.inputs import PROMPT_KEYS
from jaxserve.models.tokenizer import Tokenizer
from jaxserve.core.request import Request
from jaxserve.core.structured_output import StructuredOutputManager, allowed_tokens_mask
from jaxserve.sampling_params import SamplingParams, request_seed

PromptType = Union[str, dict[str, Any], list[int]]


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


def refuse_lora(lora_request: object | None) -> None:
    """LoRA adapters do not exist here: a request for one is refused, never served by the base
    model (vLLM's `lora_request=` argument is accepted so that `None` works as there)."""
    if lora_request is not None:
        raise ValueError(f"LoRA adapters are not supported, got lora_request={lora_request!r}: "
                         "this engine serves only its base model")


_GIL_SLICE = 1 << 16  # list items one C call may scan while the GIL is held

NO_TOKENIZER = ("prompt: this model has no tokenizer (its checkpoint carries none: a GGUF without "
                "tokenizer.ggml.* metadata, a llama2.c .bin without tok*.bin beside it); pass "
                "tokenizer= (an HF tokenizer directory, a GGUF or a llama2.c tokenizer file) or "
                "prompt_token_ids")


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int,
                 block_size: int, root_hash: bytes, limits: ModelConfig,
                 eos_token_ids: Sequence[int] = (), structured_outputs: bool = True,
                 prompt_logprobs: str | None = None,
                 default_params: SamplingParams | None = None):
        """`limits`: the engine's seed and per-request limits (max_logprobs, max_n).
        `prompt_logprobs`: None where they are served, else why not. `default_params`: a
        request's without its own (the checkpoint's sampling defaults)."""
        self.default_params = default_params or SamplingParams()
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.root_hash = root_hash
        self.max_logprobs = limits.logprobs_cap(vocab_size)
        self.max_n = limits.max_n
        self.rng = np.random.default_rng(limits.seed)
        self.eos_token_ids = tuple(eos_token_ids)
        self.supports_structured_outputs = structured_outputs
        self.no_prompt_logprobs = prompt_logprobs
        self._structured_lock = threading.Lock()
        self.set_tokenizer(tokenizer)

    def set_tokenizer(self, tokenizer: Tokenizer | None) -> None:
        """Tokenise the requests that follow with `tokenizer` (its grammars too)."""
        self.tokenizer = tokenizer
        per_token = None if tokenizer is None else tokenizer.max_token_chars()
        # A longer text has more than max_model_len tokens whatever it says.
        self.max_prompt_chars = None if per_token is None \
            else self.max_model_len * max(per_token, 1)
        with self._structured_lock:
            self._structured: StructuredOutputManager | None = None

    def check_prompt_chars(self, text: str, what: str = "prompt") -> None:
        """Refuse a text too long for the context before tokenising it (that costs time and
        memory in proportion to its length)."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise ValueError(f"{what}: {len(text)} characters are more than max_model_len "
                             f"({self.max_model_len}) tokens of this tokenizer can hold "
                             f"({self.max_prompt_chars} characters at most)")

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError(NO_TOKENIZER)
            self.check_prompt_chars(prompt)
            check_unicode(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - PROMPT_KEYS)
            if unknown:  # multi_modal_data, prompt_embeds, ...: not supported, never ignored
                raise ValueError(f"prompt: {unknown[0]!r} is not supported (a prompt dict "
                                 "holds 'prompt' and/or 'prompt_token_ids')")
            if "prompt_token_ids" in prompt:
                token_ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
                if not isinstance(token_ids, (list, tuple, np.ndarray)):
                    raise ValueError("prompt_token_ids: must be a list of ints, got "
                                     f"{type(token_ids).__name__}")
                if text is not None and not isinstance(text, str):
                    raise ValueError(f"prompt: must be a string, got {type(text).__name__}")
                return text, list(token_ids)
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt must be a str, a token id list or a dict, got {type(prompt)}")

    def validate_token_ids(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                   for t in token_ids):
            raise ValueError("prompt_token_ids must be integers")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt length {len(token_ids)} must be less than max_model_len "
                             f"({self.max_model_len})")
        low, high = min(token_ids), max(token_ids)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary "
                             f"[0, {self.vocab_size})")

    def check_params(self, params: object) -> None:
        """The engine's limits on sampling parameters (their own ranges are checked when they
        are made); reads only settings fixed at start, so any thread may call it."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params)}")
        if params.n > self.max_n:
            raise ValueError(f"n must be <= max_n ({self.max_n}), got {params.n}")
        if params.prompt_logprobs is not None and self.no_prompt_logprobs is not None:
            raise ValueError(f"prompt_logprobs is not supported {self.no_prompt_logprobs}")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and num_logprobs(asked, self.vocab_size) > self.max_logprobs:
                whole = f" (the whole vocabulary, {self.vocab_size})" if asked == -1 else ""
                raise ValueError(f"{name} must be <= max_logprobs ({self.max_logprobs}), got "
                                 f"{asked}{whole}")
        if params.structured_outputs is not None:
            self.structured_outputs().validate(params.structured_outputs)
        if params.allowed_token_ids is not None and not self.supports_structured_outputs:
            raise ValueError("allowed_token_ids is not supported with disaggregated "
                             "prefill/decode (its first token is sampled unmasked)")
        for name in ("allowed_token_ids", "logit_bias"):
            outside = [t for t in getattr(params, name) or () if t >= self.vocab_size]
            if outside:
                raise ValueError(f"{name}: {outside[0]} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")

    def stop_token_set(self, stop_token_ids: list[int]) -> set[int]:
        """A request's stop ids as a set, checked against the vocabulary. Built a slice at a
        time: a request may carry millions of ids, and one C call over all of them would hold
        the GIL (and the server's event loop with it) for ~0.1 s."""
        found: set[int] = set()
        for start in range(0, len(stop_token_ids), _GIL_SLICE):
            part = stop_token_ids[start:start + _GIL_SLICE]
            if max(part) >= self.vocab_size:
                bad = next(t for t in part if t >= self.vocab_size)
                raise ValueError(f"stop_token_ids: {bad} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
            found.update(part)
        return found

    def structured_outputs(self) -> StructuredOutputManager:
        """The grammar manager, made on first use (any thread)."""
        if not self.supports_structured_outputs:
            raise ValueError("structured_outputs is not supported with disaggregated "
                             "prefill/decode")
        with self._structured_lock:
            if self._structured is None:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs: this model has no tokenizer")
                self._structured = StructuredOutputManager(
                    self.tokenizer, self.vocab_size,
                    self.eos_token_ids or [self.tokenizer.eos_token_id])
            return self._structured

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | None,
                arrival_time: float | None = None, priority: int = 0,
                cache_salt: str | None = None, lora_request: object | None = None,
                ) -> tuple[str | None, list[Request]]:
        refuse_lora(lora_request)
        params = params if params is not None else self.default_params
        self.check_params(params)
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        if -1 in (params.logprobs, params.prompt_logprobs):
            params = dataclasses.replace(
                params, logprobs=num_logprobs(params.logprobs, self.vocab_size),
                prompt_logprobs=num_logprobs(params.prompt_logprobs, self.vocab_size))
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words: this model has no tokenizer")
            params = params.with_bad_words_token_ids(
                lambda word: self.tokenizer.encode(word, add_special_tokens=False))
        stop_token_set = self.stop_token_set(params.stop_token_ids)
        text, token_ids = self.tokenize(prompt)
        token_ids = truncated(token_ids, params.truncate_prompt_tokens, self.max_model_len)
        self.validate_token_ids(token_ids)
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        arrival_time = time.time() if arrival_time is None else arrival_time
        requests = [
            Request(request_id=child_request_id(request_id, i, params.n),
                    prompt_token_ids=token_ids, sampling_params=params,
                    arrival_time=arrival_time, block_size=self.block_size,
                    hash_seed=self.root_hash, priority=priority, cache_salt=cache_salt,
                    max_tokens=max_tokens, seed=request_seed(params, self.rng, i),
                    group_id=request_id if params.n > 1 else None,
                    stop_token_set=stop_token_set)
            for i in range(params.n)]
        if params.structured_outputs is not None:
            for request in requests:
                request.structured_output = self.structured_outputs().request(
                    params.structured_outputs)
        if params.allowed_token_ids is not None:
            mask = allowed_tokens_mask(params.allowed_token_ids, self.vocab_size)
            for request in requests:
                request.allowed_tokens_mask = mask
        return text, requests


def check_unicode(text: str, field: str) -> None:
    """A lone UTF-16 surrogate ("\\ud800") is not Unicode text: no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field}: text holds a lone surrogate at position {e.start} (not "
                         "valid Unicode)") from None


def truncated(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens (-1: as many as leave room for
    one generated token); None keeps them all."""
    if keep is None:
        return token_ids
    return token_ids[-(max_model_len - 1 if keep == -1 else keep):]
