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


def token_request_index(query_start_loc: jax.Array, num_tokens: int) -> jax.Array:
    """i32[T]: the request each query row belongs to (padding rows map to the last request)."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    idx = jnp.searchsorted(query_start_loc, rows, side="right",
                           method="compare_all").astype(jnp.int32) - 1
    return jnp.clip(idx, 0, query_start_loc.shape[0] - 2)


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
    """Gather each query row's KV through its request's block table, one chunk of pages at a time
    with an online softmax, looping only as far as the longest sequence in the step."""
    T, Hq, D = q.shape
    Hkv, BS = k_cache.shape[1], k_cache.shape[3]
    G = Hq // Hkv
    P = block_tables.shape[1]
    pages_per_chunk = max(1, min(P, kv_chunk_tokens // BS))
    num_chunks_max = -(-P // pages_per_chunk)
    pad = num_chunks_max * pages_per_chunk - P
    tables = jnp.pad(block_tables, ((0, 0), (0, pad)))

    req = token_request_index(query_start_loc, T)  # i32[T]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    row = jnp.arange(T, dtype=jnp.int32) - query_start_loc[req]
    q_pos = seq_lens[req] - q_lens[req] + row  # i32[T]  position of each query row
    valid_row = row < q_lens[req]
    qg = (q.astype(jnp.float32) * sm_scale).reshape(T, Hkv, G, D)

    def chunk(c: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(tables, c * pages_per_chunk, pages_per_chunk, 1)
        pages = pages[req]  # i32[T, C]
        k = k_cache[layer, :, pages].astype(jnp.float32)  # [T, C, Hkv, BS, D]
        v = v_cache[layer, :, pages].astype(jnp.float32)
        s = jnp.einsum("thgd,tchsd->thgcs", qg, k).reshape(T, Hkv, G, -1)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = c * pages_per_chunk * BS + jnp.arange(pages_per_chunk * BS, dtype=jnp.int32)
        mask = (kv_pos[None, :] <= q_pos[:, None]) & valid_row[:, None]
        if sliding_window is not None:
            mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        s = jnp.where(mask[:, None, None, :], s, _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None]) * mask[:, None, None, :]
        scale = jnp.exp(m - m_new)
        l = l * scale + p.sum(-1)
        pv = jnp.einsum("thgcs,tchsd->thgd", p.reshape(T, Hkv, G, pages_per_chunk, BS), v)
        acc = acc * scale[..., None] + pv
        return m_new, l, acc

    max_len = jnp.max(seq_lens)
    num_chunks = jnp.minimum((max_len + pages_per_chunk * BS - 1) // (pages_per_chunk * BS),
                             num_chunks_max)
    init = (jnp.full((T, Hkv, G), _MASK_VALUE, jnp.float32), jnp.zeros((T, Hkv, G), jnp.float32),
            jnp.zeros((T, Hkv, G, D), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_chunks, chunk, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
    return out.reshape(T, Hq, D).astype(q.dtype)
