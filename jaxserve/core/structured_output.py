"""Structured outputs on the host: grammars (JSON schema, regex, choice, Lark) compiled by
llguidance off the step's critical path, one matcher per request, and the step's token bitmask.

A request's matcher only ever consumes tokens the scheduler has received: the engine does not
run a constrained request ahead of its tokens (`SamplingParams.needs_host_history`), so the
mask of each step follows every token before it, and a preempted request's dropped in-flight
token never reached its matcher (nothing to roll back).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import llguidance
import llguidance.numpy
import numpy as np

from jaxserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from jaxserve.core.request import Request

MAX_CACHED_GRAMMARS = 256


def mask_words(vocab_size: int) -> int:
    """int32 words of one row of the token bitmask: one bit per token."""
    return (vocab_size + 31) // 32


class Vocabulary(Protocol):
    """What structured outputs read of a tokenizer (models/tokenizer.py's `Tokenizer`)."""
    eos_token_id: int | None

    def to_json(self) -> str | None: ...


def ll_tokenizer(tokenizer: Vocabulary, vocab_size: int,
                 eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """llguidance's view of our tokenizer, over the model's (possibly padded) vocabulary."""
    vocabulary = tokenizer.to_json()
    if vocabulary is None:
        raise ValueError(f"structured outputs: the vocabulary of a {type(tokenizer).__name__} "
                         "is not known")
    eos = [int(t) for t in eos_token_ids] or [tokenizer.eos_token_id]
    return llguidance.LLTokenizer(vocabulary, n_vocab=vocab_size, eos_token=eos)


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for one request's constraint."""
    LL = llguidance.LLMatcher
    # Compact JSON, no free whitespace: a model may otherwise pad with whitespace forever.
    compact = {"whitespace_flexible": False}
    if params.json is not None:
        return LL.grammar_from_json_schema(json.dumps(params.json), defaults=compact)
    if params.json_object:
        return LL.grammar_from_json_schema('{"type": "object"}', defaults=compact)
    if params.regex is not None:
        return LL.grammar_from_regex(params.regex)
    if params.choice is not None:
        return LL.grammar_from_regex("|".join(re.escape(c) for c in params.choice))
    return LL.grammar_from_lark(params.grammar)


@dataclass(slots=True, eq=False)
class StructuredOutputRequest:
    """One request's matcher, ready once its grammar has compiled."""
    template: Future  # Future[llguidance.LLMatcher], shared by requests with the same grammar
    num_words: int  # of a bitmask row: mask_words(the model's vocabulary)
    matcher: llguidance.LLMatcher | None = None
    error: str | None = field(default=None)

    def ready(self) -> bool:
        if self.matcher is None and self.error is None:
            if not self.template.done():
                return False
            template = self.template.result()
            if template.is_error():
                self.error = f"structured_outputs: the grammar did not compile: " \
                             f"{template.get_error()}"
            else:
                self.matcher = template.deep_copy()
        return True

    def accept(self, token: int) -> bool:
        """Advance the matcher by a sampled token; False (with `error` set) if it is refused."""
        if not self.matcher.consume_token(token):
            self.error = f"structured_outputs: token {token} refused: {self.matcher.get_error()}"
            return False
        return True

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into row `row` of bitmask (i32[n, num_words])."""
        llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask, row)


def allowed_tokens_mask(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """i32[mask_words(vocab_size)]: the bits of `token_ids` set (allowed_token_ids)."""
    bits = np.zeros(mask_words(vocab_size) * 32, np.uint8)
    bits[list(token_ids)] = 1
    return np.packbits(bits.reshape(-1, 32), axis=1, bitorder="little").view(np.int32)[:, 0]


def step_bitmask(requests: Sequence[Request]) -> np.ndarray:
    """i32[len(requests), num_words]: the tokens each constrained request may take next, its
    grammar's (or all) and its allowed_token_ids' together."""
    num_words = next(r.structured_output.num_words if r.structured_output is not None
                     else len(r.allowed_tokens_mask) for r in requests)
    bitmask = np.full((len(requests), num_words), -1, np.int32)
    for i, request in enumerate(requests):
        if request.structured_output is not None:
            request.structured_output.fill_bitmask(bitmask, i)
        if request.allowed_tokens_mask is not None:
            bitmask[i] &= request.allowed_tokens_mask
    return bitmask


class StructuredOutputManager:
    """Compiles grammars on a worker thread, caches them by their text (LRU), and hands each
    request its own matcher."""

    def __init__(self, tokenizer: Vocabulary, vocab_size: int, eos_token_ids: Sequence[int]):
        """Building llguidance's tokenizer costs up to ~1 s for a large vocabulary: make the
        manager when the first constrained request comes."""
        self.vocab_size = vocab_size
        self.tokenizer = ll_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()  # by params.key
        self._valid: dict[tuple[str, str], str] = {}  # params.key -> grammar text

    def validate(self, params: StructuredOutputsParams) -> str:
        """The grammar text, or ValueError naming what is wrong with the constraint. Valid
        ones are remembered: the server validates on its request thread, and the engine
        thread then only looks the grammar up."""
        grammar = self._valid.get(params.key)
        if grammar is not None:
            return grammar
        try:
            grammar = grammar_of(params)
        except (ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{params.key[0]} is invalid: {e}") from e
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer)
        if is_error:
            raise ValueError(f"structured_outputs.{params.key[0]} is invalid: {messages[0]}")
        if len(self._valid) >= MAX_CACHED_GRAMMARS:
            self._valid.clear()
        self._valid[params.key] = grammar
        return grammar

    def request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """A matcher for one request, its grammar compiling (or compiled) on the worker."""
        key = params.key
        future = self._cache.get(key)
        if future is None:
            future = self._pool.submit(llguidance.LLMatcher, self.tokenizer,
                                       self.validate(params), log_level=0)
            self._cache[key] = future
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return StructuredOutputRequest(future, mask_words(self.vocab_size))
