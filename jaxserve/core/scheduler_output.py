"""What crosses the scheduler <-> worker boundary each step: diffs, not full state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class NewRequestData:
    """A request the worker has not seen, or one resumed after preemption (sent in full again)."""
    req_id: str
    token_ids: list[int]  # prompt, plus outputs generated before a preemption
    num_prompt_tokens: int
    sampling_params: Any
    seed: int
    num_output_tokens: int  # outputs already in token_ids (penalties and seeded steps count them)
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit: KV already in these blocks


@dataclass(slots=True)
class CachedRequestData:
    """Known requests scheduled again: only what changed."""
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class KVLoad:
    """Disaggregated decode: blocks allocated this step for a request's prompt KV, to be filled
    from the prefill side's blocks of the same positions (those before `first_block` were hit
    in this side's prefix cache and are not moved)."""
    req_id: str
    block_ids: list[int]  # this side's blocks for prompt blocks first_block, first_block + 1, ..
    first_block: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished or aborted since the last step: the worker drops them
    preempted_req_ids: set[str]
    # Requests whose tokens this step reach their end: their sampled token is a real output
    # (the others are prefill chunks, whose sample is dropped).
    sampling_req_ids: set[str] = field(default_factory=set)
    step: int = 0  # the scheduler's count of steps before this one
    kv_loads: list[KVLoad] = field(default_factory=list)
    # Structured outputs: the tokens each constrained sampling request may take this step,
    # one bit per token; rows in the order of structured_output_req_ids.
    structured_output_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None  # i32[len(structured_output_req_ids), ceil(V / 32)] | None
    # Speculative decoding: each decoding request's drafts, scheduled as inputs after its last
    # token and verified in this step; -1 for a draft the step proposes on the device.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class Logprobs:
    """Log-probabilities of one sampled position: the sampled token and the top-n."""
    token_id: int
    logprob: float
    rank: int  # 1 + the number of tokens likelier than the sampled one
    top: list[tuple[int, float]]


@dataclass(slots=True)
class PromptLogprobs:
    """A whole prompt's logprobs: entry j is prompt token j + 1's (the first token has none)."""
    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]]  # the top-k at each position (k = the request's ask)


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]  # in the order of sampled_token_ids
    # Per request: its accepted drafts, then the token sampled after them (one token without
    # drafts).
    sampled_token_ids: list[list[int]]
    logprobs: list[list[Logprobs] | None] | None = None  # one per token, where asked
    # Requests whose prompt this step finished, when they asked for prompt logprobs.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # A pooling engine's requests that this step took to their last token: its final hidden
    # state (np.ndarray f32[D]).
    pooled: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class SpecDecodingStats:
    """Speculative decoding since start (vLLM's vllm:spec_decode_* counters)."""
    num_drafts: int = 0  # request-steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One request-step's verification, counted in place (every drafting step's)."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos += [0] * (num_drafted - len(per_pos))
        for pos in range(num_accepted):
            per_pos[pos] += 1

    def add(self, other: SpecDecodingStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos += [0] * (len(other.num_accepted_tokens_per_pos) - len(per_pos))
        for pos, n in enumerate(other.num_accepted_tokens_per_pos):
            per_pos[pos] += n


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None  # with the first output token, when asked
    pooled: Any = None  # a pooling request's last hidden state (np.ndarray f32[D])
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # with finish_reason "error": what the failed step raised
