"""Facts the engine derives from its config, the model and the device, each decided here once:
the worker, the compile check and AOT compilation read them from these functions."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from jaxserve.config import EngineConfig
from jaxserve.models.llama_config import LlamaConfig


def resolve_max_model_len(config: EngineConfig, cfg: LlamaConfig) -> int:
    """The engine's max_model_len: as configured, else the model's context."""
    return config.model.max_model_len or cfg.max_position_embeddings


def resolve_dtype(config: EngineConfig, platform: str) -> Any:
    """The weights' and KV cache's dtype on `platform`: "auto" is float32 on CPU, bfloat16
    elsewhere."""
    if config.model.dtype == "auto":
        return jnp.float32 if platform == "cpu" else jnp.bfloat16
    return jnp.dtype(config.model.dtype)


def blocks_per_seq(max_model_len: int, block_size: int) -> int:
    """The KV blocks one max_model_len sequence fills."""
    return -(-max_model_len // block_size)


def min_kv_blocks(max_model_len: int, block_size: int) -> int:
    """The smallest KV pool: one max_model_len sequence and the null block."""
    return blocks_per_seq(max_model_len, block_size) + 1


def check_pool_holds_a_sequence(num_blocks: int, max_model_len: int, block_size: int,
                                block_bytes: int | None = None) -> None:
    """A pool that cannot hold one max_model_len sequence lets a long prompt wait forever (it
    blocks the FCFS queue) and a request that outgrows the pool preempt itself forever.
    `block_bytes`: the pool was sized from a memory budget at that many bytes a block (else
    num_kv_blocks gave it)."""
    if num_blocks >= min_kv_blocks(max_model_len, block_size):
        return
    per_seq = blocks_per_seq(max_model_len, block_size)
    if block_bytes is None:
        raise ValueError(f"num_kv_blocks ({num_blocks}) must hold one max_model_len "
                         f"({max_model_len}) sequence: at least {per_seq} + 1 (the null "
                         "block); lower max_model_len or add blocks")
    raise ValueError(f"KV cache budget holds {num_blocks} blocks of {block_bytes} bytes, "
                     f"fewer than one max_model_len sequence needs ({per_seq} + 1); "
                     "lower max_model_len or raise the memory budget")
