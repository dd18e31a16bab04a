"""The engine's view of one request: tokens, progress, status, block hashes, and whether the
token it just got stops it (no jax)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from collections.abc import Set
from typing import Any

from jaxserve.core.block_hash import HASH_NBYTES, BlockHash, extend_block_hashes


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Disaggregated decode: the prompt's KV and first token come from a prefill engine; the
    # request waits (skipped by admission) until they are in its blocks.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Every status after PREEMPTED is a finished one.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # the step carrying it raised (vLLM's FINISHED_ERROR)

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        """OpenAI-style finish reason: "stop", "length", "abort", "error", or None while
        unfinished."""
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class KVTransfer(enum.Enum):
    """A request's part in disaggregated prefill/decode (None: computed here, start to end)."""
    SEND = "send"  # prefill side: after its first token, hold its blocks until they are read
    RECEIVE = "receive"  # decode side: its first token and prompt KV come from the prefill side


@dataclass(slots=True, eq=False)
class Request:
    """Construct with keyword arguments:

    Request(request_id=..., prompt_token_ids=..., sampling_params=..., arrival_time=...,
            block_size=cache_block_size, hash_seed=kv_cache_manager.root_hash,
            priority=0, cache_salt=None, max_tokens=2**31 - 1, seed=0,
            group_id=None, kv_transfer=None, stop_token_set=None)

    `all_token_ids` and `block_hashes` are derived (not constructor arguments) and kept current
    by `append_output_token_ids`; `block_hashes` holds the chained hash of every full block.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    arrival_time: float
    block_size: int
    hash_seed: BlockHash
    priority: int = 0
    cache_salt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Output tokens scheduled but not yet received: 1 while a step that samples for this request
    # runs, 2 when the next step was scheduled on top of it (async scheduling).
    num_output_placeholders: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(init=False)
    stop_reason: int | str | None = None
    max_tokens: int = 2**31 - 1  # output tokens allowed, already capped by max_model_len
    seed: int = 0  # the sampler's per-request seed
    group_id: str | None = None  # the parent request of n > 1 samples, which share the prompt
    kv_transfer: KVTransfer | None = None
    # sampling_params.stop_token_ids as a set (None: built here); the input processor builds it
    # once for all n samples of a request, which may carry millions of ids.
    stop_token_set: Set[int] | None = None
    structured_output: Any = None  # StructuredOutputRequest: its grammar's matcher
    allowed_tokens_mask: Any = None  # i32[ceil(V / 32)]: allowed_token_ids as a bitmask row
    # Speculative decoding: verifications in a row that accepted no draft, and the scheduler
    # step before which it drafts no more (backing off while drafts keep missing).
    draft_misses: int = 0
    drafts_resume_step: int = 0
    # The drafts of steps still running (-1: the step proposes them), counted as accepted until
    # their step's update: async scheduling schedules the next step on top of them.
    draft_placeholders: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty str, got {self.request_id!r}")
        if len(self.prompt_token_ids) == 0:
            raise ValueError(f"prompt_token_ids must not be empty (request {self.request_id})")
        if not _is_int(self.block_size) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0, got {self.max_tokens!r}")
        if not isinstance(self.hash_seed, bytes) or len(self.hash_seed) != HASH_NBYTES:
            raise ValueError(f"hash_seed must be {HASH_NBYTES} bytes "
                             f"(KVCacheManager.root_hash), got {self.hash_seed!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a str or None, got {self.cache_salt!r}")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.output_token_ids = list(self.output_token_ids)
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids
        self.block_hashes = []
        self._extend_block_hashes()
        if self.stop_token_set is None:
            self.stop_token_set = frozenset(getattr(self.sampling_params, "stop_token_ids", None)
                                            or ())

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_in_flight(self) -> int:
        """Tokens that steps still running will add at most: a sample and its drafts each."""
        return self.num_output_placeholders + len(self.draft_placeholders)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        self._extend_block_hashes()

    def stop_status(self, token: int, num_output_tokens: int, max_model_len: int,
                    eos_token_ids: Set[int]) -> RequestStatus | None:
        """The finished status `token`, output token number `num_output_tokens` (counted from
        1), gives this request: length caps, EOS, stop token ids; None: it goes on. Stop strings
        are checked on detokenized text by the output processor, not here."""
        params = self.sampling_params
        if (self.num_prompt_tokens + num_output_tokens >= max_model_len
                or num_output_tokens >= self.max_tokens):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if num_output_tokens < params.min_tokens:
            return None
        if token in eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token in self.stop_token_set:
            self.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        return None

    def grammar_status(self, token: int) -> RequestStatus | None:
        """Feed a sampled token to the request's matcher: stopped once the grammar is complete
        (nothing but EOS could follow), failed if the matcher refuses it (the mask forbids that
        unless every token was masked, e.g. EOS held back by min_tokens)."""
        if not self.structured_output.accept(token):
            return RequestStatus.FINISHED_ERROR
        return RequestStatus.FINISHED_STOPPED if self.structured_output.is_terminated else None

    def _extend_block_hashes(self) -> None:
        extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size,
                            self.hash_seed, self.cache_salt)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
