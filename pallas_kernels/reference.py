"""Pure-JAX ragged paged attention and KV-cache write: the `xla` backend and the kernels' reference.

KV cache layout, shared by every backend: one stacked array per K and V,
    k_cache, v_cache: [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
head-major so one (head, block) page is a contiguous [block_size, head_dim] tile.

A step is a ragged batch: request r owns query rows query_start_loc[r]:query_start_loc[r + 1] and,
after this step's write, seq_lens[r] tokens of KV reachable through block_tables[r]. Its query rows
are the last q_len positions of the sequence, so causality is kv_pos <= seq_len - q_len + row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASK_VALUE = -1e30  # finite, so fully masked rows (padding) give 0 instead of NaN


def write_kv(
    k_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    v_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    layer: jax.Array,  # i32[]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T]  block_id * block_size + offset; padding -> null block 0
) -> tuple[jax.Array, jax.Array]:
    block_size = k_cache.shape[3]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    # The indexed dims are split by the head slice, so the indexed axis (T) leads: values [T, Hkv, D].
    k_cache = k_cache.at[layer, :, blocks, offsets].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[layer, :, blocks, offsets].set(v.astype(v_cache.dtype))
    return k_cache, v_cache


def query_tile_size(num_tokens: int, num_reqs: int, max_tile: int = 32) -> int:
    """Rows per query tile, from static shapes only: decode-heavy steps (about one row per
    request) use tiles of 1; prefill-heavy ones share each gathered KV chunk between rows."""
    ratio = max(1, num_tokens // max(1, num_reqs))
    return min(max_tile, 1 << (ratio.bit_length() - 1))


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    v_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    layer: jax.Array,  # i32[]
    seq_lens: jax.Array,  # i32[R]      KV length of each request after this step
    block_tables: jax.Array,  # i32[R, P]
    query_start_loc: jax.Array,  # i32[R + 1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_chunk_tokens: int = 256,
) -> jax.Array:  # [T, Hq, D]
    """Cut each request's rows into tiles of TQ rows, gather each tile's KV through its
    request's block table one chunk of pages at a time (online softmax), looping only as far as
    the longest sequence in the step, and scatter the tiles' rows back."""
    T, Hq, D = q.shape
    R = seq_lens.shape[0]
    Hkv, BS = k_cache.shape[1], k_cache.shape[3]
    G = Hq // Hkv
    P = block_tables.shape[1]
    TQ = query_tile_size(T, R)
    NT = -(-T // TQ) + (R * (TQ - 1)) // TQ  # enough tiles whatever the split of T over R
    pages_per_chunk = max(1, min(P, kv_chunk_tokens // BS))
    num_chunks_max = -(-P // pages_per_chunk)
    pad = num_chunks_max * pages_per_chunk - P
    tables = jnp.pad(block_tables, ((0, 0), (0, pad)))

    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # i32[R]
    tiles_per_req = (q_lens + TQ - 1) // TQ
    tiles_end = jnp.cumsum(tiles_per_req)
    tile = jnp.arange(NT, dtype=jnp.int32)
    req = jnp.clip(jnp.searchsorted(tiles_end, tile, side="right", method="compare_all"),
                   0, R - 1).astype(jnp.int32)  # i32[NT]
    first_row = query_start_loc[req] + (tile - (tiles_end[req] - tiles_per_req[req])) * TQ
    rows = first_row[:, None] + jnp.arange(TQ, dtype=jnp.int32)  # i32[NT, TQ]
    valid = (tile < tiles_end[-1])[:, None] & (rows < query_start_loc[req + 1][:, None])
    q_pos = seq_lens[req][:, None] - query_start_loc[req + 1][:, None] + rows  # i32[NT, TQ]
    qt = q[jnp.clip(rows, 0, T - 1)].astype(jnp.float32) * sm_scale  # [NT, TQ, Hq, D]
    qt = qt.reshape(NT, TQ, Hkv, G, D)

    def chunk(c: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(tables, c * pages_per_chunk, pages_per_chunk, 1)
        pages = pages[req]  # i32[NT, C]
        k = k_cache[layer, :, pages].astype(jnp.float32)  # [NT, C, Hkv, BS, D]
        v = v_cache[layer, :, pages].astype(jnp.float32)
        s = jnp.einsum("nqhgd,nchsd->nhqgcs", qt, k).reshape(NT, Hkv, TQ, G, -1)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = c * pages_per_chunk * BS + jnp.arange(pages_per_chunk * BS, dtype=jnp.int32)
        mask = (kv_pos[None, None, :] <= q_pos[..., None]) & valid[..., None]  # [NT, TQ, S]
        if sliding_window is not None:
            mask &= kv_pos[None, None, :] > q_pos[..., None] - sliding_window
        mask = mask[:, None, :, None, :]
        s = jnp.where(mask, s, _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None]) * mask
        scale = jnp.exp(m - m_new)
        l = l * scale + p.sum(-1)
        pv = jnp.einsum("nhqgcs,nchsd->nhqgd",
                        p.reshape(NT, Hkv, TQ, G, pages_per_chunk, BS), v)
        acc = acc * scale[..., None] + pv
        return m_new, l, acc

    max_len = jnp.max(seq_lens)
    num_chunks = jnp.minimum((max_len + pages_per_chunk * BS - 1) // (pages_per_chunk * BS),
                             num_chunks_max)
    shape = (NT, Hkv, TQ, G)
    init = (jnp.full(shape, _MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, D), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_chunks, chunk, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
    out = out.transpose(0, 2, 1, 3, 4).reshape(NT * TQ, Hq, D)  # rows of tiles, heads
    dest = jnp.where(valid, rows, T).reshape(-1)  # invalid rows fall off the end
    return jnp.zeros((T, Hq, D), q.dtype).at[dest].set(out.astype(q.dtype), mode="drop")
