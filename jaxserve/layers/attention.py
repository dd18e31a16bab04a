"""Attention metadata for one ragged step, and the attention backends behind one interface."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import jax

from pallas_kernels import reference

BACKENDS = ("auto", "xla", "pallas", "pallas_interpret")


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["positions", "slot_mapping", "query_start_loc", "seq_lens",
                                "block_tables"],
                   meta_fields=[])
@dataclass(frozen=True)
class AttentionMetadata:
    positions: jax.Array  # i32[T_padded]
    slot_mapping: jax.Array  # i32[T_padded]  block_id * block_size + offset; padding -> 0 (null block)
    query_start_loc: jax.Array  # i32[R_padded + 1]  padding requests are empty
    seq_lens: jax.Array  # i32[R_padded]  tokens in the KV cache after this step
    block_tables: jax.Array  # i32[R_padded, max_blocks_per_seq]


AttendFn = Callable[..., jax.Array]


@dataclass(frozen=True)
class AttentionBackend:
    """`attend(q, k_cache, v_cache, layer, md, sm_scale=, sliding_window=, soft_cap=)`.

    The KV write is always the batch-wide scatter, done before any attention read in the same
    layer: a prefix-cache hit on a block filled earlier in the same step then reads written KV."""
    name: str
    kernel: AttendFn

    def write(self, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array, k: jax.Array,
              v: jax.Array, md: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
        return reference.write_kv(k_cache, v_cache, layer, k, v, md.slot_mapping)

    def attend(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer: jax.Array,
               md: AttentionMetadata, **kwargs: object) -> jax.Array:
        return self.kernel(q, k_cache, v_cache, layer, md.seq_lens, md.block_tables,
                           md.query_start_loc, **kwargs)


def get_attention_backend(name: str, platform: str | None = None) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    platform = platform or jax.default_backend()
    if name == "auto":
        name = "pallas" if platform in ("tpu", "gpu", "cuda") else "xla"
    if name == "xla":
        return AttentionBackend("xla", reference.ragged_paged_attention)
    from pallas_kernels import pallas_attention_for_platform  # noqa: PLC0415 (kernels are optional)
    interpret = name == "pallas_interpret"
    return AttentionBackend(name, pallas_attention_for_platform(platform, interpret=interpret))
