"""The facts the engine derives from its config, the model and the devices, resolved once into a
frozen plan: the worker (live devices) and the compile check and AOT compilation (a target's
compile-only devices) build it with `resolve_plan` and read its fields, so they cannot disagree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.config import EngineConfig
from jaxserve.models.llama_config import LlamaConfig
from jaxserve.programs.step_shapes import (bucket_pairs, max_sample_rows, num_speculative_tokens,
                                           step_buckets)


@dataclass(frozen=True, slots=True)
class ResolvedPlan:
    platform: str  # "cpu" | "gpu" | "tpu"
    mesh_shape: tuple[int, ...]  # one rank's mesh: (data, model)
    mesh_axes: tuple[str, ...]
    dtype: np.dtype  # the weights' and the KV cache's
    max_model_len: int
    block_size: int
    blocks_per_seq: int  # the KV blocks one max_model_len sequence fills
    token_buckets: tuple[int, ...]
    request_buckets: tuple[int, ...]
    num_speculative_tokens: int
    max_sample_rows: int  # the most rows any step samples: the length of `prev_sampled`
    max_logprobs: int  # the top-n width of a step that computes logprobs (logprobs_cap)
    num_kv_blocks: int  # the pool's blocks, the null block included
    # Per device, the bytes a block took when the pool was sized from a memory budget; None
    # when the pool was given (num_kv_blocks, or a compiled directory's).
    kv_block_bytes: int | None = None

    def __post_init__(self) -> None:
        # A pool that cannot hold one max_model_len sequence lets a long prompt wait forever (it
        # blocks the FCFS queue) and a request that outgrows the pool preempt itself forever.
        if self.num_kv_blocks >= self.min_kv_blocks:
            return
        if self.kv_block_bytes is None:
            raise ValueError(f"num_kv_blocks ({self.num_kv_blocks}) must hold one max_model_len "
                             f"({self.max_model_len}) sequence: at least {self.blocks_per_seq} "
                             "+ 1 (the null block); lower max_model_len or add blocks")
        raise ValueError(f"KV cache budget holds {self.num_kv_blocks} blocks of "
                         f"{self.kv_block_bytes} bytes, fewer than one max_model_len sequence "
                         f"needs ({self.blocks_per_seq} + 1); lower max_model_len or raise the "
                         "memory budget")

    @property
    def min_kv_blocks(self) -> int:
        """The smallest pool: one max_model_len sequence and the null block."""
        return self.blocks_per_seq + 1

    @property
    def bucket_pairs(self) -> list[tuple[int, int]]:
        return bucket_pairs(self.token_buckets, self.request_buckets)

    def with_pool(self, num_kv_blocks: int, kv_block_bytes: int | None = None) -> ResolvedPlan:
        """This plan with the pool sized (at `kv_block_bytes` a block, from a memory budget)."""
        return dataclasses.replace(self, num_kv_blocks=num_kv_blocks,
                                   kv_block_bytes=kv_block_bytes)


def resolve_plan(config: EngineConfig, cfg: LlamaConfig, platform: str,
                 mesh: Mesh) -> ResolvedPlan:
    """The plan of an engine with this model on `mesh`'s devices of `platform`. Its pool is
    num_kv_blocks, else the smallest until `with_pool` sizes it: the pool the largest step is
    profiled on (its temporaries do not grow with the pool)."""
    max_model_len = config.model.max_model_len or cfg.max_position_embeddings
    block_size = config.cache.block_size
    per_seq = -(-max_model_len // block_size)
    token_buckets, request_buckets = step_buckets(config)
    k = num_speculative_tokens(config)
    num_kv_blocks = config.cache.num_kv_blocks
    return ResolvedPlan(
        platform=platform, mesh_shape=tuple(mesh.devices.shape),
        mesh_axes=tuple(mesh.axis_names), dtype=_dtype(config.model.dtype, platform),
        max_model_len=max_model_len, block_size=block_size, blocks_per_seq=per_seq,
        token_buckets=tuple(token_buckets), request_buckets=tuple(request_buckets),
        num_speculative_tokens=k,
        max_sample_rows=max_sample_rows(bucket_pairs(token_buckets, request_buckets), k),
        max_logprobs=config.model.logprobs_cap(cfg.vocab_size),
        num_kv_blocks=per_seq + 1 if num_kv_blocks is None else num_kv_blocks)


def _dtype(configured: str, platform: str) -> np.dtype:
    """The weights' and KV cache's dtype: "auto" is float32 on CPU, bfloat16 elsewhere."""
    if configured == "auto":
        return jnp.dtype(jnp.float32 if platform == "cpu" else jnp.bfloat16)
    return jnp.dtype(configured)
