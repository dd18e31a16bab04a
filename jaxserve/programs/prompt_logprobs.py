"""Prompt logprobs on the host side: which token rows of a step a request's prompt logprobs
come from, and their accumulation over the prefill's chunks until the prompt is done.

Token row t of a step at prompt position p predicts prompt token p + 1: its target. The device
computes every row's target logprob, rank and top-k in one fixed-shape pass (the model step's
prompt-logprobs variant, run only when a row asks); this module picks out the rows asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.core.scheduler_output import PromptLogprobs
from jaxserve.programs.input_batch import CachedRequestState, PromptLogprobsAccum, StepArrays


@dataclass(slots=True)
class Span:
    state: CachedRequestState
    first: int  # the prompt position of the span's first token row
    row: int    # that token row in the step
    count: int


@dataclass(slots=True)
class PromptLogprobsPlan:
    targets: np.ndarray  # i32[T]   each token row's next prompt token (0 where not asked)
    spans: list[Span]


def plan_prompt_logprobs(arrays: StepArrays, states: list[CachedRequestState],
                         num_top: int) -> PromptLogprobsPlan | None:
    """None when no row of this step needs prompt logprobs (the plain step runs)."""
    spans: list[Span] = []
    targets: np.ndarray | None = None
    for i, state in enumerate(states):
        if state.row.params.prompt_logprobs is None:
            continue
        num_prompt = state.num_prompt_tokens
        if state.prompt_logprobs is None:
            k = min(num_top, state.row.params.prompt_logprobs)
            state.prompt_logprobs = PromptLogprobsAccum(
                np.zeros(num_prompt - 1, np.float32), np.zeros(num_prompt - 1, np.int32),
                np.zeros((num_prompt - 1, k), np.int32), np.zeros((num_prompt - 1, k), np.float32),
                np.zeros(num_prompt - 1, bool))
        lo, hi = int(arrays.query_start_loc[i]), int(arrays.query_start_loc[i + 1])
        first = int(arrays.positions[lo])
        count = min(hi - lo, num_prompt - 1 - first)
        if count <= 0 or state.prompt_logprobs.emitted:
            continue
        if targets is None:
            targets = np.zeros(len(arrays.input_ids), np.int32)
        targets[lo:lo + count] = state.token_ids[first + 1:first + 1 + count]
        spans.append(Span(state, first, lo, count))
    return None if targets is None else PromptLogprobsPlan(targets, spans)


def record_prompt_logprobs(plan: PromptLogprobsPlan | None, logprobs: np.ndarray,
                           ranks: np.ndarray, top_ids: np.ndarray, top_lps: np.ndarray) -> None:
    """Store a finished step's rows (host arrays of the device's TokenLogprobs) per request."""
    if plan is None:
        return
    for span in plan.spans:
        acc = span.state.prompt_logprobs
        if acc is None:
            continue
        dst = slice(span.first, span.first + span.count)
        src = slice(span.row, span.row + span.count)
        k = acc.top_ids.shape[1]
        acc.logprobs[dst], acc.ranks[dst] = logprobs[src], ranks[src]
        acc.top_ids[dst], acc.top_lps[dst] = top_ids[src, :k], top_lps[src, :k]
        acc.filled[dst] = True


def finished_prompt_logprobs(arrays: StepArrays, requests: dict[str, CachedRequestState],
                             ) -> dict[str, PromptLogprobs]:
    """The prompt logprobs of the requests whose prompt this step completed (once each)."""
    done: dict[str, PromptLogprobs] = {}
    for i, req_id in enumerate(arrays.req_ids):
        state = requests.get(req_id)
        acc = None if state is None else state.prompt_logprobs
        if acc is None or acc.emitted or not arrays.completes_sequence[i] \
                or not acc.filled.all():
            continue
        acc.emitted = True
        done[req_id] = PromptLogprobs(
            acc.logprobs.tolist(), acc.ranks.tolist(),
            [list(zip(ids, lps)) for ids, lps in zip(acc.top_ids.tolist(), acc.top_lps.tolist())])
    return done
