"""The model runner's persistent batch: per-request host state, and the step's ragged arrays."""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.layers.sampler import RowSpec

if TYPE_CHECKING:
    from jaxserve.executor.prompt_logprobs import PromptLogprobsAccum


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + every token sampled so far
    num_prompt_tokens: int
    block_table: np.ndarray  # i32[max_blocks_per_seq], 0 past the request's blocks
    num_blocks: int
    num_computed_tokens: int
    row: RowSpec  # sampling parameters, seed, and the token history (appended in place)
    prompt_logprobs: PromptLogprobsAccum | None = None  # when the request asks for them


@dataclass(slots=True)
class StepArrays:
    """Host (numpy) arrays of one step, already padded to their buckets."""
    req_ids: list[str]  # the real requests, in row order
    input_ids: np.ndarray  # i32[T_padded]
    # i32[T_padded]  -1, or the row of the step still running whose sampled id is this input
    prev_rows: np.ndarray
    positions: np.ndarray  # i32[T_padded]
    slot_mapping: np.ndarray  # i32[T_padded]   padding -> slot 0 of the null block
    query_start_loc: np.ndarray  # i32[R_padded + 1]
    seq_lens: np.ndarray  # i32[R_padded]
    block_tables: np.ndarray  # i32[R_padded, max_blocks_per_seq]
    logits_indices: np.ndarray  # i32[R_padded]   last query row of each request
    completes_sequence: np.ndarray  # bool[R]     the step reaches the last known token

    @staticmethod
    def empty(num_tokens: int, num_reqs: int, max_blocks_per_seq: int) -> "StepArrays":
        """A step of only padding, in the (num_tokens, num_reqs) bucket: what warm-up runs."""
        T, R = num_tokens, num_reqs
        zeros = np.zeros(T, np.int32)
        return StepArrays(req_ids=[], input_ids=zeros, prev_rows=np.full(T, -1, np.int32),
                          positions=zeros, slot_mapping=zeros,
                          query_start_loc=np.zeros(R + 1, np.int32),
                          seq_lens=np.zeros(R, np.int32),
                          block_tables=np.zeros((R, max_blocks_per_seq), np.int32),
                          logits_indices=np.zeros(R, np.int32),
                          completes_sequence=np.zeros(0, bool))


def pick_bucket(buckets: list[int], n: int, what: str) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


class InputBatch:
    def __init__(self, block_size: int, max_blocks_per_seq: int):
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.requests: dict[str, CachedRequestState] = {}

    def update(self, sched: SchedulerOutput) -> None:
        """Apply the scheduler's diff: drop finished and preempted requests, add new ones,
        extend block tables of the others."""
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in sched.scheduled_new_reqs:
            table = np.zeros(self.max_blocks_per_seq, np.int32)
            table[:len(new.block_ids)] = new.block_ids
            tokens = list(new.token_ids)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, token_ids=tokens, num_prompt_tokens=new.num_prompt_tokens,
                block_table=table, num_blocks=len(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                row=RowSpec(new.sampling_params, new.seed,
                            output_token_ids=tokens[new.num_prompt_tokens:],
                            prompt_token_ids=tokens[:new.num_prompt_tokens]))
        cached = sched.scheduled_cached_reqs
        for req_id, block_ids, computed in zip(cached.req_ids, cached.new_block_ids,
                                               cached.num_computed_tokens):
            state = self.requests[req_id]
            state.block_table[state.num_blocks:state.num_blocks + len(block_ids)] = block_ids
            state.num_blocks += len(block_ids)
            state.num_computed_tokens = computed

    def prepare(self, sched: SchedulerOutput, token_buckets: list[int],
                request_buckets: list[int], running_rows: Mapping[str, int]) -> StepArrays:
        """`running_rows`: request -> its row in the step still running, for the requests whose
        next input that step samples (async scheduling)."""
        req_ids = list(sched.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        counts = np.fromiter(sched.num_scheduled_tokens.values(), np.int32, len(req_ids))
        starts = np.fromiter((s.num_computed_tokens for s in states), np.int32, len(states))
        num_tokens = int(counts.sum())
        T = pick_bucket(token_buckets, num_tokens, "scheduled tokens")
        R = min(pick_bucket(request_buckets, len(req_ids), "scheduled requests"), T)

        query_start_loc = np.full(R + 1, num_tokens, np.int32)
        query_start_loc[0] = 0
        np.cumsum(counts, out=query_start_loc[1:len(req_ids) + 1])
        row_of_token = np.repeat(np.arange(len(req_ids), dtype=np.int32), counts)
        positions = np.zeros(T, np.int32)
        positions[:num_tokens] = (np.arange(num_tokens, dtype=np.int32)
                                  - query_start_loc[row_of_token] + starts[row_of_token])
        block_tables = np.zeros((R, self.max_blocks_per_seq), np.int32)
        for i, state in enumerate(states):
            block_tables[i] = state.block_table
        slot_mapping = np.zeros(T, np.int32)
        pos = positions[:num_tokens]
        slot_mapping[:num_tokens] = (block_tables[row_of_token, pos // self.block_size]
                                     * self.block_size + pos % self.block_size)
        input_ids = np.zeros(T, np.int32)
        prev_rows = np.full(T, -1, np.int32)
        ids: list[int] = []
        for state, c, n in zip(states, starts, counts):
            tokens = state.token_ids[c:c + n]
            ids += tokens
            if len(tokens) < n:  # the last input is still being sampled: the device has it
                prev_rows[len(ids)] = running_rows[state.req_id]
                ids.append(0)
        input_ids[:num_tokens] = ids
        seq_lens = np.zeros(R, np.int32)
        seq_lens[:len(req_ids)] = starts + counts
        logits_indices = np.zeros(R, np.int32)
        logits_indices[:len(req_ids)] = query_start_loc[1:len(req_ids) + 1] - 1
        lengths = np.fromiter((len(s.token_ids) + s.row.num_pending for s in states), np.int32,
                              len(states))
        return StepArrays(req_ids, input_ids, prev_rows, positions, slot_mapping,
                          query_start_loc, seq_lens, block_tables, logits_indices,
                          (starts + counts) >= lengths)

    def rows(self, req_ids: list[str]) -> list[RowSpec]:
        return [self.requests[r].row for r in req_ids]

    def mark_pending(self, arrays: StepArrays) -> None:
        """The step is launched: the tokens it samples are pending until `append_sampled`."""
        for i, req_id in enumerate(arrays.req_ids):
            if arrays.completes_sequence[i]:
                self.requests[req_id].row.num_pending += 1

    def append_sampled(self, arrays: StepArrays, sampled: np.ndarray) -> None:
        """Record tokens sampled for requests whose step reached their last token. A request
        finished or preempted while the step ran is gone from the batch: its token is dropped."""
        for i, req_id in enumerate(arrays.req_ids):
            state = self.requests.get(req_id)
            if arrays.completes_sequence[i] and state is not None:
                token = int(sampled[i])
                state.token_ids.append(token)
                state.row.output_token_ids.append(token)
                state.row.num_pending -= 1
