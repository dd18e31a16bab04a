"""What a step must do whatever program runs it, and the batches a bucket is judged on.

The floor of a step on one device: read the weights once (of the embedding, only the rows it
looks up), read each request's visible KV once, write the new KV and the logits; and run the
dense layers' and attention's multiply-adds. Its time is the larger of bytes over HBM bandwidth
and flops over peak: a program can do no better, and `step_cost` says how close it comes.

Its sequential floor is the same work with the dense matmuls and attention taking turns, each
at its own bound, as a layer's data flow has them do unless the batch is split and its halves
interleaved: where many long decodes share a step with a prefill, attention is memory-bound
and the matmuls compute-bound, and no program that runs them one after the other reaches the
floor.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxserve.kernels.traffic import RaggedBatch, visible_range
from jaxserve.models.llama_config import LlamaConfig
from jaxserve.models.moe import MoeConfig
from jaxserve.placement.targets import Chip
from jaxserve.programs.input_batch import StepArrays

DECODE_CONTEXT = 1024  # tokens of context each decode in a judged batch has
DECODE_BATCH = 128  # requests in the decode batch every preset is judged on
LONG_PREFIX = 6144  # where the long-prompt batch's prefill chunk starts


@dataclass(frozen=True)
class Scenario:
    label: str  # e.g. "decode 128 @1024", "chunk 1793 @6144 + 255 decodes"
    batch: RaggedBatch


def bucket_scenarios(num_tokens: int, num_reqs: int, max_model_len: int,
                     token_buckets: Sequence[int]) -> list[Scenario]:
    """The batches a (T, R) bucket is judged on. A bucket with room for more tokens than
    requests is a mixed step: R - 1 decodes and one prefill chunk filling the rest, the chunk
    at position 0 and deep into a long prompt (at 6,144, or as deep as max_model_len lets
    it). Otherwise every request decodes; and the smallest bucket that holds 128 decodes is
    also judged on them (the batch a decode-heavy server runs most)."""
    context = min(DECODE_CONTEXT, max_model_len - 1)

    def decodes(n: int) -> Scenario:
        return Scenario(f"decode {n} @{context}", RaggedBatch((1,) * n, (context + 1,) * n))

    if num_tokens <= num_reqs:
        smallest = min((t for t in token_buckets if t >= DECODE_BATCH), default=None)
        extra = [decodes(DECODE_BATCH)] if num_tokens == smallest != DECODE_BATCH else []
        return extra + [decodes(num_tokens)]
    decode_rows = num_reqs - 1
    chunk = min(num_tokens - decode_rows, max_model_len)
    out = []
    for start in sorted({0, max(0, min(LONG_PREFIX, max_model_len - chunk))}):
        out.append(Scenario(f"chunk {chunk} @{start} + {decode_rows} decodes @{context}",
                            RaggedBatch((chunk,) + (1,) * decode_rows,
                                        (start + chunk,) + (context + 1,) * decode_rows)))
    return out


@dataclass(frozen=True)
class StepFloor:
    weights: float  # bytes
    kv_read: float
    kv_write: float
    logits: float
    flops: float
    seconds: float
    sequential_seconds: float  # dense matmuls, then attention, each at its own bound

    @property
    def hbm_bytes(self) -> float:
        return self.weights + self.kv_read + self.kv_write + self.logits


def step_floor(cfg: LlamaConfig, tp: int, weight_bytes: int, itemsize: int,
               batch: RaggedBatch, vocab_size: int, chip: Chip) -> StepFloor:
    """The floor of one step of `batch` on one device. `cfg`: the model as the devices hold
    it (KV heads duplicated under TP); `weight_bytes`: per device, all of them;
    `vocab_size`: the embedding's rows (padded for TP)."""
    tokens, rows = batch.num_tokens, len(batch.q_lens)  # rows: one sampled row a request
    embed = vocab_size * cfg.hidden_size * itemsize // tp  # and the LM head, tied or not
    kv_layer_token = 2 * cfg.num_kv_heads // tp * cfg.head_dim * itemsize  # one layer's
    # Per layer: the KV its window sees (layers of one window alike: counted once each)
    visible = attention_macs = 0
    for window, layers in Counter(kind.sliding_window for kind in cfg.layer_kinds).items():
        start = 0
        for q_len, kv_len in zip(batch.q_lens, batch.kv_lens):
            lo, hi = visible_range(start, q_len, kv_len, 0, q_len, window)
            visible += layers * (hi - lo)
            for row in range(q_len):  # row i sees its window of the first kv_len-q_len+i+1
                row_lo, row_hi = visible_range(start, q_len, kv_len, row, row + 1, window)
                attention_macs += layers * (row_hi - row_lo)
            start += q_len
    tables = embed if cfg.tie_word_embeddings else 2 * embed
    dense = (weight_bytes - tables) // itemsize  # every layer's weights
    # A mixture's experts: each token runs k of them (on whichever devices hold them: per
    # device 1/tp of the work, split by width or by experts); a step reads the experts its
    # tokens are routed to, at most all of them.
    experts = untouched = expert_flops = 0
    if isinstance(cfg, MoeConfig):
        experts = (cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size
                   * cfg.moe_intermediate_size // tp)
        pairs = tokens * cfg.num_experts_per_tok
        untouched = experts * max(0, cfg.num_experts - pairs) // cfg.num_experts
        expert_flops = 2 * pairs * experts // cfg.num_experts
    dense_flops = 2 * tokens * (dense - experts) + expert_flops + 2 * rows * (embed // itemsize)
    attention_flops = 2 * 2 * attention_macs * cfg.head_dim * cfg.num_heads // tp
    flops = dense_flops + attention_flops
    # the LM head whole, the embedding's looked-up rows only (a tied one is the head)
    weights = (weight_bytes - tables - untouched * itemsize + embed
               + tokens * cfg.hidden_size * itemsize // tp)
    kv_read, kv_write = visible * kv_layer_token, tokens * cfg.num_layers * kv_layer_token
    logits = rows * vocab_size // tp * 4
    bandwidth, peak = chip.hbm_bandwidth, chip.bf16_flops
    seconds = max((weights + kv_read + kv_write + logits) / bandwidth, flops / peak)
    sequential = (max((weights + logits) / bandwidth, dense_flops / peak)
                  + max((kv_read + kv_write) / bandwidth, attention_flops / peak))
    return StepFloor(weights, kv_read, kv_write, logits, flops, seconds, sequential)


def scenario_step(batch: RaggedBatch, num_tokens: int, num_reqs: int, block_size: int,
                  max_blocks_per_seq: int, num_blocks: int) -> StepArrays:
    """A step of `batch` in the (num_tokens, num_reqs) bucket, as the runner would build it:
    each request in blocks of its own (from block 1: 0 is the null block), sampling its last
    row. To time the real step beside its model (scripts/device_check.py)."""
    needed = 1 + sum(-(-kv // block_size) for kv in batch.kv_lens)
    if needed > num_blocks:
        raise ValueError(f"the batch needs {needed} KV blocks, the pool has {num_blocks}")
    empty = StepArrays.empty(num_tokens, num_reqs, max_blocks_per_seq)
    step = dataclasses.replace(empty, req_ids=[f"scenario-{r}" for r in range(len(batch.q_lens))],
                               positions=np.zeros(num_tokens, np.int32),
                               slot_mapping=np.zeros(num_tokens, np.int32))
    next_block = 1
    row = 0
    for r, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens)):
        blocks = np.arange(next_block, next_block + -(-kv_len // block_size), dtype=np.int32)
        next_block += len(blocks)
        step.block_tables[r, :len(blocks)] = blocks
        positions = np.arange(kv_len - q_len, kv_len, dtype=np.int32)
        step.positions[row:row + q_len] = positions
        step.slot_mapping[row:row + q_len] = blocks[positions // block_size] * block_size + \
            positions % block_size
        step.seq_lens[r] = kv_len
        row += q_len
        step.query_start_loc[r + 1:] = row
        step.logits_indices[r] = row - 1
    return step
