"""Engine logprobs to vLLM's output shape: per position, token id -> Logprob."""

from __future__ import annotations

from jaxserve.core.scheduler_output import Logprobs
from jaxserve.core.scheduler_output import PromptLogprobs as CorePromptLogprobs
from jaxserve.models.tokenizer import Tokenizer
from jaxserve.outputs import Logprob, PromptLogprobs


def _decoded(tokenizer: Tokenizer | None, token_id: int) -> str | None:
    return None if tokenizer is None else tokenizer.decode([token_id], skip_special_tokens=False)


def position_logprobs(token_id: int, logprob: float, rank: int | None,
                      top: list[tuple[int, float]], tokenizer: Tokenizer | None,
                      ) -> dict[int, Logprob]:
    """The given token first, then the top-k by rank (vLLM's order; the token appears once)."""
    entry = {token_id: Logprob(logprob, rank, _decoded(tokenizer, token_id))}
    for k, (top_id, top_lp) in enumerate(top, start=1):
        if top_id not in entry:
            entry[top_id] = Logprob(top_lp, k, _decoded(tokenizer, top_id))
    return entry


def prompt_logprobs_of(core: CorePromptLogprobs, prompt_token_ids: list[int], num_top: int | None,
                       tokenizer: Tokenizer | None) -> PromptLogprobs:
    k = num_top or 0
    return [None] + [position_logprobs(token, lp, rank, top[:k], tokenizer)
                     for token, lp, rank, top in zip(prompt_token_ids[1:], core.logprobs,
                                                     core.ranks, core.top)]


def sample_logprobs(core: Logprobs, tokenizer: Tokenizer | None) -> dict[int, Logprob]:
    """One sampled position: the sampled token with its rank in the vocabulary, then the top-k."""
    return position_logprobs(core.token_id, core.logprob, core.rank, core.top, tokenizer)


def top_logprobs(entry: dict[int, Logprob], k: int) -> list[tuple[int, float]]:
    """The `k` likeliest tokens of one position's entry, as (token id, logprob) by rank."""
    ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items()
                    if lp.rank is not None and lp.rank <= k)
    return [(t, logprob) for _, t, logprob in ranked]
