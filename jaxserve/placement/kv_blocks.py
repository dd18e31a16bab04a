"""Reading and writing whole KV-cache blocks, for moving a request's KV between engines.

Block counts are padded to power-of-two buckets (with the null block 0) so the jitted gather and
scatter compile once per bucket. When the two engines' tensor-parallel sizes differ, KV heads
are mapped between their layouts: a TP larger than the model's KV-head count holds each head
duplicated (see `expand_kv_heads`), so the gather picks, for every destination head, one source
copy of the same original head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxserve.config import power_of_two_buckets


def layout_heads(num_kv_heads: int, tp: int) -> int:
    """KV heads an engine with this TP stores (duplicated when TP exceeds the model's count)."""
    return tp if tp > num_kv_heads else num_kv_heads


def transfer_heads(num_kv_heads: int, src_tp: int, dst_tp: int) -> tuple[int, ...]:
    """For each destination head, the source head holding the same original KV head."""
    src_reps = layout_heads(num_kv_heads, src_tp) // num_kv_heads
    dst_reps = layout_heads(num_kv_heads, dst_tp) // num_kv_heads
    return tuple((j // dst_reps) * src_reps
                 for j in range(layout_heads(num_kv_heads, dst_tp)))


def block_buckets(max_blocks_per_seq: int) -> list[int]:
    return power_of_two_buckets(1, max_blocks_per_seq)


def padded_block_ids(block_ids: list[int], buckets: list[int]) -> np.ndarray:
    """i32[bucket]: the ids, then the null block 0."""
    n = len(block_ids)
    bucket = next((b for b in buckets if b >= n), None)
    if bucket is None or n == 0:
        raise ValueError(f"block count {n} must be in [1, {buckets[-1]}]")
    ids = np.zeros(bucket, np.int32)
    ids[:n] = block_ids
    return ids


@functools.lru_cache(maxsize=None)
def _gather_fn(heads: tuple[int, ...], out_sharding: NamedSharding):  # noqa: ANN202
    def gather(k_cache: jax.Array, v_cache: jax.Array,  # [L, H, NB, BS, D]
               block_ids: jax.Array) -> tuple[jax.Array, jax.Array]:  # i32[n] -> [L, Hd, n, BS, D]
        index = jnp.asarray(heads, jnp.int32)
        return (jnp.take(jnp.take(k_cache, block_ids, axis=2), index, axis=1),
                jnp.take(jnp.take(v_cache, block_ids, axis=2), index, axis=1))

    return jax.jit(gather, out_shardings=(out_sharding, out_sharding))


@functools.lru_cache(maxsize=None)
def _scatter_fn(kv_sharding: NamedSharding):  # noqa: ANN202
    def scatter(k_cache: jax.Array, v_cache: jax.Array,  # [L, H, NB, BS, D], donated
                block_ids: jax.Array,  # i32[n]
                k: jax.Array, v: jax.Array,  # [L, H, n, BS, D]
                ) -> tuple[jax.Array, jax.Array]:
        return k_cache.at[:, :, block_ids].set(k), v_cache.at[:, :, block_ids].set(v)

    return jax.jit(scatter, donate_argnums=(0, 1), out_shardings=(kv_sharding, kv_sharding))


def gather_blocks(k_cache: jax.Array, v_cache: jax.Array, block_ids: np.ndarray,
                  heads: tuple[int, ...], out_sharding: NamedSharding,
                  ) -> tuple[jax.Array, jax.Array]:
    """Dispatch a copy of the blocks (padded ids) in the destination's head layout. The copy is
    a new array: a later step that donates and overwrites the cache cannot change it."""
    ids = jax.device_put(block_ids, NamedSharding(k_cache.sharding.mesh,
                                                  jax.sharding.PartitionSpec()))
    return _gather_fn(heads, out_sharding)(k_cache, v_cache, ids)


def scatter_blocks(k_cache: jax.Array, v_cache: jax.Array, block_ids: np.ndarray,
                   k: jax.Array | np.ndarray, v: jax.Array | np.ndarray,
                   ) -> tuple[jax.Array, jax.Array]:
    """Write `k`/`v` (`[L, H, n_padded, BS, D]`, host or device) into the blocks `block_ids`
    (padded ids, same n). The caches are donated; use the returned ones."""
    sharding = k_cache.sharding
    ids = jax.device_put(block_ids, NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))
    k, v = jax.device_put((k, v), sharding)
    return _scatter_fn(sharding)(k_cache, v_cache, ids, k, v)


def pad_blocks(array: np.ndarray, bucket: int) -> np.ndarray:
    """Host KV `[L, H, n, BS, D]` zero-padded to `bucket` blocks."""
    n = array.shape[2]
    if n == bucket:
        return array
    pad = [(0, 0)] * array.ndim
    pad[2] = (0, bucket - n)
    return np.pad(array, pad)
