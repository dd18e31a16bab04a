"""What the user gets back: `RequestOutput` with one `CompletionOutput` per sample (n)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass
class Logprob:
    """vLLM's per-token logprob entry: the log-probability, its rank in the vocabulary (1 is
    the most likely), and the token's text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's shapes: per position, token id -> Logprob (the prompt's first position is None).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None  # the sampled token first, then the top-k by rank
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:  # a method, as vLLM's
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # wall time of each output token

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None  # a sample's step failed (its finish_reason is "error")
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs
    # vLLM's: what a KV connector hands the other engine after a prefill. jaxserve's
    # disaggregation moves the KV inside one engine (its KVConnector), so nothing sets it.
    kv_transfer_params: dict[str, Any] | None = None


def accumulate(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """The cumulative output after `delta` (vLLM's CUMULATIVE kind): a new object sharing no
    list with `total`, so one already handed to a caller never changes under it."""
    samples = {c.index: c for c in (total.outputs if total is not None else ())}
    for d in delta.outputs:
        old = samples.get(d.index)
        logprobs = None if d.logprobs is None else (
            list(d.logprobs) if old is None or old.logprobs is None else old.logprobs + d.logprobs)
        samples[d.index] = CompletionOutput(
            d.index, d.text if old is None else old.text + d.text,
            list(d.token_ids) if old is None else old.token_ids + d.token_ids,
            d.cumulative_logprob, logprobs, d.finish_reason, d.stop_reason)
    prompt_logprobs = delta.prompt_logprobs if delta.prompt_logprobs is not None or total is None \
        else total.prompt_logprobs
    return replace(delta, outputs=[samples[i] for i in sorted(samples)],
                   prompt_logprobs=prompt_logprobs)


@dataclass
class PoolingOutput:
    data: Any  # np.ndarray: f32[D], the pooled hidden state as its params shape it


@dataclass
class PoolingRequestOutput:
    """vLLM's output of a pooling request (`LLM.encode`)."""
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # its step failed: no data


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's output of `LLM.embed`."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool

    @staticmethod
    def from_base(out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.outputs.data.tolist()),
                                      out.prompt_token_ids, out.finished)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's output of `LLM.score`: one text pair's cosine similarity of embeddings."""
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # the pair's two prompts, concatenated (vLLM's)
    finished: bool
