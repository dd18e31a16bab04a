"""A step's host inputs: the model runner's persistent batch (per-request host state), the
step's ragged arrays and sampling metadata, and their packing into ONE int32 buffer.

Packed, a step's inputs are one host -> device copy instead of one per array (about 20 of them:
1.1-1.4 ms per step on CPU, ~0.4 ms packed), unpacked inside the jitted step. Every leaf is a
4-byte type (int32, uint32, float32) and travels bit for bit. The layout (tree structure,
shapes, dtypes) is static: it only changes with the step's buckets, so the jitted step compiles
once per layout, as it did per shape.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.layers.sampler import SamplingMetadata
from jaxserve.sampling_params import SEED_MODULUS, SamplingParams

HISTORY_MIN_BUCKET = 16  # smallest padded length of token histories (Lo, Lp) when present
BLOCKED_MIN_BUCKET = 4  # smallest padded width of blocked_token_ids when present


# ------------------------------------------------------------------ sampling metadata

@dataclass(slots=True)
class RowSpec:
    params: SamplingParams
    seed: int                                             # u32, from request_seed
    output_token_ids: Sequence[int] | np.ndarray = ()     # sampled so far and received
    prompt_token_ids: Sequence[int] | np.ndarray = ()     # read only for repetition_penalty
    num_pending: int = 0  # sampled by a step still running, not in output_token_ids yet


def _bucket(length: int, floor: int) -> int:
    return 0 if length == 0 else max(floor, 1 << (length - 1).bit_length())


def _pad_rows(entries: list[tuple[int, Sequence[int] | np.ndarray]], num_rows: int,
              floor: int, fill: int | float = -1, dtype: type = np.int32) -> np.ndarray:
    width = _bucket(max((len(ids) for _, ids in entries), default=0), floor)
    out = np.full((num_rows, width), fill, dtype)
    for row, ids in entries:
        out[row, :len(ids)] = ids
    return out


def logprobs_width(max_logprobs: int) -> int:
    """`num_logprobs` of a step where some row wants logprobs: at least 1, since the width is
    also the switch for the sampled token's rank, which a logprobs=0 row wants too."""
    return max(max_logprobs, 1)


def make_sampling_metadata(rows: Sequence[RowSpec | None], num_rows_padded: int, *,
                           eos_token_ids: Sequence[int] = (),
                           num_logprobs: int | None = None,
                           token_bitmask: np.ndarray | None = None) -> SamplingMetadata:
    """Host-side (numpy) SamplingMetadata for one step; None rows and padding are greedy dummies.

    Token histories are padded to powers of two (at least HISTORY_MIN_BUCKET) so the number of
    compiled shapes stays small. `num_logprobs` defaults to the largest any row asks for; pass
    a fixed value to pin the compiled shape. `token_bitmask`: i32[num_rows_padded, W], the
    grammar mask of a step with constrained rows. Move the result with one `jax.device_put(md)`.
    """
    if num_rows_padded < len(rows):
        raise ValueError(f"num_rows_padded must be >= the number of rows ({len(rows)}), "
                         f"got {num_rows_padded}")
    n = num_rows_padded
    temperature = np.zeros(n, np.float32)
    top_k = np.zeros(n, np.int32)
    top_p = np.ones(n, np.float32)
    min_p = np.zeros(n, np.float32)
    seeds = np.zeros(n, np.uint32)
    steps = np.zeros(n, np.int32)
    presence = np.zeros(n, np.float32)
    frequency = np.zeros(n, np.float32)
    repetition = np.ones(n, np.float32)
    outputs: list[tuple[int, Sequence[int] | np.ndarray]] = []
    prompts: list[tuple[int, Sequence[int] | np.ndarray]] = []
    blocked: list[tuple[int, Sequence[int] | np.ndarray]] = []
    bias_ids: list[tuple[int, Sequence[int]]] = []
    bias_values: list[tuple[int, Sequence[float]]] = []
    max_logprobs = 0

    for i, row in enumerate(rows):
        if row is None:
            continue
        p = row.params
        if not 0 <= row.seed < SEED_MODULUS:
            raise ValueError(f"seed must be in [0, 2**32), got {row.seed}")
        seeds[i] = row.seed
        steps[i] = len(row.output_token_ids) + row.num_pending
        if not p.greedy:  # neutral filters on greedy rows let the device skip filtering
            temperature[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
        if p.has_penalties:
            if row.num_pending:
                raise RuntimeError("penalties need the whole output history on the host; a "
                                   "step with a penalised row must not run ahead of its tokens")
            presence[i], frequency[i] = p.presence_penalty, p.frequency_penalty
            repetition[i] = p.repetition_penalty
            outputs.append((i, row.output_token_ids))
            if p.repetition_penalty != 1.0:
                prompts.append((i, row.prompt_token_ids))
        blocked_ids = p.blocked_by_bad_words(row.output_token_ids)
        if steps[i] < p.min_tokens:
            blocked_ids += list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        if blocked_ids:
            blocked.append((i, blocked_ids))
        if p.logit_bias:
            bias_ids.append((i, list(p.logit_bias)))
            bias_values.append((i, list(p.logit_bias.values())))
        if p.logprobs is not None:
            max_logprobs = max(max_logprobs, logprobs_width(p.logprobs))

    if num_logprobs is None:
        num_logprobs = max_logprobs
    elif num_logprobs < max_logprobs:
        raise ValueError(f"num_logprobs must be >= the largest requested logprobs "
                         f"({max_logprobs}), got {num_logprobs}")
    return SamplingMetadata(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds,
        steps=steps, presence_penalty=presence, frequency_penalty=frequency,
        repetition_penalty=repetition,
        output_token_ids=_pad_rows(outputs, n, HISTORY_MIN_BUCKET),
        prompt_token_ids=_pad_rows(prompts, n, HISTORY_MIN_BUCKET),
        blocked_token_ids=_pad_rows(blocked, n, BLOCKED_MIN_BUCKET),
        bias_token_ids=_pad_rows(bias_ids, n, BLOCKED_MIN_BUCKET),
        bias_values=_pad_rows(bias_values, n, BLOCKED_MIN_BUCKET, 0.0, np.float32),
        token_bitmask=np.zeros((n, 0), np.int32) if token_bitmask is None else token_bitmask,
        all_greedy=bool(np.all(temperature == 0)), num_logprobs=int(num_logprobs))


# ------------------------------------------------------------------ the persistent batch


@dataclass(slots=True)
class PromptLogprobsAccum:
    """One request's prompt logprobs so far, by position (a recomputed chunk overwrites)."""
    logprobs: np.ndarray  # f32[P - 1]
    ranks: np.ndarray     # i32[P - 1]
    top_ids: np.ndarray   # i32[P - 1, k]
    top_lps: np.ndarray   # f32[P - 1, k]
    filled: np.ndarray    # bool[P - 1]
    emitted: bool = False


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
    # i32[T_padded]  -1, or the first sample row, in the step still running, of the request
    # whose sample there is this input (after the drafts it accepts: known on the device)
    prev_rows: np.ndarray
    positions: np.ndarray  # i32[T_padded]
    slot_mapping: np.ndarray  # i32[T_padded]   padding -> slot 0 of the null block
    query_start_loc: np.ndarray  # i32[R_padded + 1]
    seq_lens: np.ndarray  # i32[R_padded]
    block_tables: np.ndarray  # i32[R_padded, max_blocks_per_seq]
    # i32[S_padded]  the query rows sampled: each request's last, after those of its drafts
    logits_indices: np.ndarray
    completes_sequence: np.ndarray  # bool[R]     the step reaches the last known token
    # i32[R + 1]  request i's sample rows are sample_starts[i] .. sample_starts[i + 1] - 1
    sample_starts: np.ndarray
    draft_token_ids: list[list[int]]  # per request: its draft slots (-1 each; the step fills them)
    draft_starts: np.ndarray  # i32[R_padded]  the row of each request's last known token
    num_drafts: np.ndarray  # i32[R_padded]    its drafts (0: none; padding)
    # i32[R_padded]  the request's first sample row in the step still running, -1 if none; and
    # the drafts it carries there, whose rejected ones move this step's positions back
    prev_base: np.ndarray
    prev_drafts: np.ndarray
    device_drafts: bool = False  # the drafting program: the step proposes the drafts

    @staticmethod
    def empty(num_tokens: int, num_reqs: int, max_blocks_per_seq: int,
              num_sample_rows: int | None = None, device_drafts: bool = False,
              ) -> "StepArrays":
        """A step of only padding, in the (num_tokens, num_reqs, num_sample_rows) bucket
        (one sample row per request by default), of the drafting program or not: what
        warm-up runs."""
        T, R = num_tokens, num_reqs
        S = R if num_sample_rows is None else num_sample_rows
        zeros = np.zeros(T, np.int32)
        return StepArrays(req_ids=[], input_ids=zeros, prev_rows=np.full(T, -1, np.int32),
                          positions=zeros, slot_mapping=zeros,
                          query_start_loc=np.zeros(R + 1, np.int32),
                          seq_lens=np.zeros(R, np.int32),
                          block_tables=np.zeros((R, max_blocks_per_seq), np.int32),
                          logits_indices=np.zeros(S, np.int32),
                          completes_sequence=np.zeros(0, bool),
                          sample_starts=np.zeros(1, np.int32), draft_token_ids=[],
                          draft_starts=np.zeros(R, np.int32), num_drafts=np.zeros(R, np.int32),
                          prev_base=np.full(R, -1, np.int32), prev_drafts=np.zeros(R, np.int32),
                          device_drafts=device_drafts)


def pick_bucket(buckets: Sequence[int], n: int, what: str) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


class InputBatch:
    def __init__(self, block_size: int, max_blocks_per_seq: int):
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.requests: dict[str, CachedRequestState] = {}
        # Those that ask for prompt logprobs: no other step runs that feature's code.
        self.prompt_logprobs_ids: set[str] = set()

    def update(self, sched: SchedulerOutput) -> None:
        """Apply the scheduler's diff: drop finished and preempted requests, add new ones,
        extend block tables of the others."""
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.requests.pop(req_id, None)
            self.prompt_logprobs_ids.discard(req_id)
        for new in sched.scheduled_new_reqs:
            if new.sampling_params.prompt_logprobs is not None:
                self.prompt_logprobs_ids.add(new.req_id)
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

    def prepare(self, sched: SchedulerOutput, token_buckets: Sequence[int],
                request_buckets: Sequence[int], running_rows: Mapping[str, tuple[int, int]],
                num_speculative_tokens: int = 0) -> StepArrays:
        """`running_rows`: request -> (its first sample row, its drafts) in the step still
        running, for the requests whose next input that step samples (async scheduling: their
        positions here assume it accepts every draft). A step with drafts is the drafting
        program's, which proposes them on the device."""
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
        prev_base = np.full(R, -1, np.int32)
        prev_drafts = np.zeros(R, np.int32)
        ids: list[int] = []
        spec = sched.scheduled_spec_decode_tokens
        drafts = [spec.get(r, []) for r in req_ids]
        for i, (state, c, n, d) in enumerate(zip(states, starts, counts, drafts)):
            tokens = state.token_ids[c:c + n - len(d)]
            ids += tokens
            if len(tokens) < n - len(d):  # the last input is still being sampled: on the device
                prev_base[i], prev_drafts[i] = running_rows[state.req_id]
                prev_rows[len(ids)] = prev_base[i]
                ids.append(0)
            ids += [0] * len(d)  # draft slots: the step fills them
        input_ids[:num_tokens] = ids
        seq_lens = np.zeros(R, np.int32)
        seq_lens[:len(req_ids)] = starts + counts
        num_drafts = np.fromiter(map(len, drafts), np.int32, len(drafts))
        sample_starts = np.zeros(len(req_ids) + 1, np.int32)
        np.cumsum(num_drafts + 1, out=sample_starts[1:])
        num_rows = int(sample_starts[-1])
        device_drafts = num_rows > len(req_ids)
        S = min(T, R * (1 + num_speculative_tokens)) if device_drafts else R
        logits_indices = np.zeros(S, np.int32)
        # Request i's rows: the query rows of its last num_drafts[i] + 1 tokens.
        row_request = np.repeat(np.arange(len(req_ids)), num_drafts + 1)
        logits_indices[:num_rows] = (query_start_loc[row_request + 1] - 1 - num_drafts[row_request]
                                     + np.arange(num_rows) - sample_starts[row_request])
        lengths = np.fromiter((len(s.token_ids) + s.row.num_pending for s in states), np.int32,
                              len(states))
        draft_starts = np.zeros(R, np.int32)
        draft_starts[:len(req_ids)] = query_start_loc[1:len(req_ids) + 1] - 1 - num_drafts
        padded_drafts = np.zeros(R, np.int32)
        padded_drafts[:len(req_ids)] = num_drafts
        return StepArrays(req_ids, input_ids, prev_rows, positions, slot_mapping,
                          query_start_loc, seq_lens, block_tables, logits_indices,
                          (starts + counts) >= lengths, sample_starts, drafts, draft_starts,
                          padded_drafts, prev_base, prev_drafts, device_drafts)

    def rows(self, arrays: StepArrays) -> list[RowSpec]:
        """The sampler's rows: per request, one for each draft, then its own, each at its own
        step (the key of a seeded draw, and min_tokens, count the tokens before it)."""
        out = []
        for req_id, d in zip(arrays.req_ids, arrays.draft_token_ids):
            row = self.requests[req_id].row
            out.append(row)
            # The constructor, not dataclasses.replace: ~0.2 us a row against ~1.1 us
            out += [RowSpec(row.params, row.seed, row.output_token_ids, row.prompt_token_ids,
                            row.num_pending + j) for j in range(1, len(d) + 1)]
        return out

    def mark_pending(self, arrays: StepArrays) -> None:
        """The step is launched: the tokens it samples are pending until `append_sampled`, as
        many as if it accepts every draft (the step after corrects its step keys on the
        device when fewer were)."""
        for i, req_id in enumerate(arrays.req_ids):
            if arrays.completes_sequence[i]:
                self.requests[req_id].row.num_pending += 1 + int(arrays.num_drafts[i])

    def append_sampled(self, arrays: StepArrays, tokens: list[list[int]]) -> None:
        """Record the tokens of requests whose step reached their last token (accepted drafts
        and the sampled one). A request finished or preempted while the step ran is gone from
        the batch: its tokens are dropped."""
        for i, req_id in enumerate(arrays.req_ids):
            state = self.requests.get(req_id)
            if arrays.completes_sequence[i] and state is not None:
                state.token_ids += tokens[i]
                state.row.output_token_ids += tokens[i]
                state.row.num_pending -= 1 + int(arrays.num_drafts[i])


# ------------------------------------------------------------------ one buffer

@dataclass(frozen=True)
class PackedLayout:
    treedef: Any  # jax PyTreeDef: hashable, and carries the pytrees' static metadata
    leaves: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype) per leaf


def pack(tree: Any) -> tuple[np.ndarray, PackedLayout]:
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [np.ascontiguousarray(leaf) for leaf in leaves]
    for a in arrays:
        if a.dtype.itemsize != 4:
            raise TypeError(f"packed step inputs must be 4-byte types, got {a.dtype}")
    buf = np.concatenate([a.view(np.int32).ravel() for a in arrays]) if arrays else np.zeros(
        0, np.int32)
    return buf, PackedLayout(treedef, tuple((a.shape, a.dtype.str) for a in arrays))


def unpack(layout: PackedLayout, buf: jax.Array) -> Any:  # buf: i32[total elements], traced
    leaves, offset = [], 0
    for shape, dtype in layout.leaves:
        n = math.prod(shape)
        leaf = jax.lax.bitcast_convert_type(buf[offset:offset + n], np.dtype(dtype))
        leaves.append(leaf.reshape(shape))
        offset += n
    return jax.tree.unflatten(layout.treedef, leaves)
