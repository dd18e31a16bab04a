"""Pure-JAX ragged paged attention and KV-cache write: the `xla` backend, optimised (split-KV
over query tiles, work proportional to the visible KV). The kernels are tested against it, and it
against the plain per-row oracle (oracle.py).

KV cache layout, shared by every backend: one stacked array per K and V,
    k_cache, v_cache: [num_layers, num_kv_heads, num_blocks, block_size, head_dim]
head-major so one (head, block) page is a contiguous [block_size, head_dim] tile.

A step is a ragged batch: request r owns query rows query_start_loc[r]:query_start_loc[r + 1] and,
after this step's write, seq_lens[r] tokens of KV reachable through block_tables[r]. Its query rows
are the last q_len positions of the sequence, so causality is kv_pos <= seq_len - q_len + row.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

_MASK_VALUE = -1e30  # finite, so fully masked rows (padding) give 0 instead of NaN


def write_kv(
    k_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    v_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    layer: int | jax.Array,  # static from the model's unrolled layers; tests pass i32[]
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


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    v_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    layer: int | jax.Array,  # a static index from the model's unrolled layers; tests pass i32[]
    seq_lens: jax.Array,  # i32[R]      KV length of each request after this step
    block_tables: jax.Array,  # i32[R, P]
    query_start_loc: jax.Array,  # i32[R + 1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    kv_chunk_tokens: int | None = None,
    items_per_iter: int | None = None,
    max_query_tile: int = 32,
) -> jax.Array:  # [T, Hq, D]
    """Split-KV attention with work proportional to the KV each row can see.

    Requests are cut into query tiles: one row per tile for single-row requests (decodes), up
    to `max_query_tile` rows for the others (prefill chunks), so a chunk's rows share each KV
    page they gather and a decode does not pay for a tile of padding rows. A work item is one
    tile against one chunk of `kv_chunk_tokens` of its KV: only the chunks up to the tile's last
    position, and from its first position's window. Each class of tiles runs a loop of
    ceil(items / items_per_iter) iterations, each gathering its items' pages, computing their
    partial softmax (max, sum, weighted V) and folding them into per-tile accumulators: padding
    tiles and short sequences beside a long one cost nothing.

    `kv_chunk_tokens` / `items_per_iter` default per class (decodes: 64 / 32, other tiles:
    128 / 8, what runs fastest on XLA:CPU); a value given applies to both classes."""
    T = q.shape[0]
    R = seq_lens.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # i32[R]
    tile_rows = min(max_query_tile, 1 << (max(1, T // 2).bit_length() - 1))
    single = q_lens == 1
    out = jnp.zeros(q.shape, q.dtype)
    for select, TQ, NT, chunk, items in (
            (single, 1, min(R, T), 64, 32),
            # multi-row requests have >= 2 rows each: at most T // 2 of them
            (~single, tile_rows, -(-T // tile_rows) + min(R, T // 2), 128, 8)):
        tiles = _QueryTiles.make(jnp.where(select, q_lens, 0), query_start_loc, seq_lens, TQ, NT)
        out = _attend_tiles(out, q, k_cache, v_cache, layer, tiles, block_tables,
                            sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                            kv_chunk_tokens=kv_chunk_tokens or chunk,
                            items_per_iter=items_per_iter or items)
    return out


@dataclass(frozen=True)
class _QueryTiles:
    """NT tiles of TQ query rows, each within one request; tiles past the last are invalid."""
    req: jax.Array  # i32[NT]      the request of each tile
    rows: jax.Array  # i32[NT, TQ]  its rows in q
    valid: jax.Array  # bool[NT, TQ]
    q_pos: jax.Array  # i32[NT, TQ]  each row's position in its sequence

    @staticmethod
    def make(q_lens: jax.Array, query_start_loc: jax.Array, seq_lens: jax.Array, TQ: int,
             NT: int) -> "_QueryTiles":
        R = seq_lens.shape[0]
        tiles_per_req = (q_lens + TQ - 1) // TQ  # i32[R]
        tiles_end = jnp.cumsum(tiles_per_req)
        tile = jnp.arange(NT, dtype=jnp.int32)
        req = jnp.clip(jnp.searchsorted(tiles_end, tile, side="right", method="compare_all"),
                       0, R - 1).astype(jnp.int32)
        first_row = query_start_loc[req] + (tile - (tiles_end[req] - tiles_per_req[req])) * TQ
        rows = first_row[:, None] + jnp.arange(TQ, dtype=jnp.int32)
        # A request's rows end at query_start_loc[r] + q_lens[r] (q_lens is 0 for requests of
        # the other class), and its last row is at position seq_len - 1.
        q_end = (query_start_loc[req] + q_lens[req])[:, None]
        valid = (tile < tiles_end[-1])[:, None] & (rows < q_end)
        return _QueryTiles(req, rows, valid, seq_lens[req][:, None] - q_end + rows)


def _attend_tiles(
    out: jax.Array,  # [T, Hq, D]  rows of other tiles already filled in
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    v_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    layer: int | jax.Array,
    tiles: _QueryTiles,
    block_tables: jax.Array,  # i32[R, P]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    kv_chunk_tokens: int,
    items_per_iter: int,
) -> jax.Array:  # [T, Hq, D]
    T, Hq, D = q.shape
    Hkv, BS = k_cache.shape[1], k_cache.shape[3]
    G = Hq // Hkv
    P = block_tables.shape[1]
    NT, TQ = tiles.rows.shape
    C = max(1, min(P, kv_chunk_tokens // BS))  # pages per chunk
    S = C * BS  # KV positions per chunk
    tables = jnp.pad(block_tables, ((0, 0), (0, -(-P // C) * C - P)))
    W = min(items_per_iter, NT * -(-P // C))  # a lone tile may take all its chunks at once
    req, rows, valid, q_pos = tiles.req, tiles.rows, tiles.valid, tiles.q_pos
    tile_valid = valid[:, 0]  # bool[NT]
    # The KV chunks a tile needs: up to its last row's position; from its first row's window.
    last_pos = jnp.max(jnp.where(valid, q_pos, -1), axis=1)  # i32[NT]
    chunk_hi = (last_pos + S) // S  # exclusive
    if sliding_window is None:
        chunk_lo = jnp.zeros_like(chunk_hi)
    else:
        first_pos = jnp.min(jnp.where(valid, q_pos, jnp.iinfo(jnp.int32).max), axis=1)
        chunk_lo = jnp.clip(first_pos - sliding_window + 1, 0) // S
    n_items = jnp.where(tile_valid, jnp.maximum(chunk_hi - chunk_lo, 0), 0)  # i32[NT]
    items_end = jnp.cumsum(n_items)
    total = items_end[-1]

    qt = q[jnp.clip(rows, 0, T - 1)].astype(jnp.float32) * sm_scale  # [NT, TQ, Hq, D]
    qt = qt.reshape(NT, TQ, Hkv, G, D)

    def body(it: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        m, l, acc = carry  # per tile: running max, softmax sum, weighted V
        item = it * W + jnp.arange(W, dtype=jnp.int32)  # i32[W]
        it_tile = jnp.clip(jnp.searchsorted(items_end, item, side="right", method="compare_all"),
                           0, NT - 1).astype(jnp.int32)
        it_chunk = chunk_lo[it_tile] + item - (items_end[it_tile] - n_items[it_tile])  # i32[W]
        live = item < total
        pages = jax.vmap(lambda r, c: jax.lax.dynamic_slice_in_dim(tables[r], c * C, C))(
            req[it_tile], jnp.where(live, it_chunk, 0))  # i32[W, C]
        kv_pos = it_chunk[:, None] * S + jnp.arange(S, dtype=jnp.int32)  # [W, S]
        qp = q_pos[it_tile]  # [W, TQ]
        mask = (kv_pos[:, None, :] <= qp[..., None]) & (valid[it_tile] & live[:, None])[..., None]
        if sliding_window is not None:
            mask &= kv_pos[:, None, :] > qp[..., None] - sliding_window
        partials = _decode_partials if TQ == 1 else _tile_partials
        m_i, l_i, a_i = partials(qt[it_tile], k_cache, v_cache, layer, pages, mask, soft_cap)
        # Fold into the tiles (one tile may own several of this iteration's items): raise each
        # tile's max first, then rescale its old sums and the items' sums to that max.
        dest = jnp.where(live, it_tile, NT)  # dead items fall off the end
        m_new = m.at[dest].max(m_i, mode="drop")
        scale = jnp.exp(m - m_new)
        beta = jnp.exp(m_i - m_new[it_tile])
        l = (l * scale).at[dest].add(l_i * beta, mode="drop")
        acc = (acc * scale[..., None]).at[dest].add(a_i * beta[..., None], mode="drop")
        return m_new, l, acc

    shape = (NT, Hkv, TQ, G)
    init = (jnp.full(shape, _MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, D), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, (total + W - 1) // W, body, init)
    o = jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
    o = o.transpose(0, 2, 1, 3, 4).reshape(NT * TQ, Hq, D)  # rows of tiles, heads
    dest = jnp.where(valid, rows, T).reshape(-1)  # invalid rows fall off the end
    return out.at[dest].set(o.astype(q.dtype), mode="drop")


Partials = tuple[jax.Array, jax.Array, jax.Array]  # m, l: [W, Hkv, TQ, G]; acc: [..., D]


def _softmax_partials(s: jax.Array, mask: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    s = jnp.where(mask, s, _MASK_VALUE)
    m = s.max(axis, keepdims=True)
    return m, jnp.exp(s - m) * mask  # a fully masked row: m = -1e30, p = 0


def _tile_partials(
    qt: jax.Array,  # f32[W, TQ, Hkv, G, D]  scaled queries of each item's tile
    k_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    v_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    layer: int | jax.Array,
    pages: jax.Array,  # i32[W, C]
    mask: jax.Array,  # bool[W, TQ, S]
    soft_cap: float | None,
) -> Partials:
    """Multi-row tiles: the chunk's pages shared by a tile's rows, one [TQ * G, S] score block
    per item and head."""
    W, TQ, Hkv, G, _ = qt.shape
    C, BS = pages.shape[1], k_cache.shape[3]
    k = k_cache[layer, :, pages].astype(jnp.float32)  # [W, C, Hkv, BS, D]
    v = v_cache[layer, :, pages].astype(jnp.float32)
    s = jnp.einsum("wqhgd,wchsd->whqgcs", qt, k).reshape(W, Hkv, TQ, G, C * BS)
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    m, p = _softmax_partials(s, mask[:, None, :, None, :], -1)
    a = jnp.einsum("whqgcs,wchsd->whqgd", p.reshape(W, Hkv, TQ, G, C, BS), v)
    return m[..., 0], p.sum(-1), a


def _decode_partials(
    qt: jax.Array,  # f32[W, 1, Hkv, G, D]
    k_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    v_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    layer: int | jax.Array,
    pages: jax.Array,  # i32[W, C]
    mask: jax.Array,  # bool[W, 1, S]
    soft_cap: float | None,
) -> Partials:
    """Single-row tiles (decodes). The pages are gathered head-major, [Hkv, W, S, D], so each
    dot reads its big operand as laid out: K as the left side of K q ([S, D] @ [D, G] per
    item and head), V as the right side of p V. The layout of `_tile_partials` makes XLA:CPU
    transpose every gathered chunk for its dots: the dummy model's step of 32 decodes took
    ~25% longer with it."""
    W, _, Hkv, _, D = qt.shape
    S = pages.shape[1] * k_cache.shape[3]
    k = _gather_pages(k_cache, layer, pages).astype(jnp.float32).reshape(Hkv, W, S, D)
    v = _gather_pages(v_cache, layer, pages).astype(jnp.float32).reshape(Hkv, W, S, D)
    s = jnp.matmul(k, qt[:, 0].transpose(1, 0, 3, 2))  # [Hkv, W, S, G]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    m, p = _softmax_partials(s, mask[:, 0][None, :, :, None], 2)
    a = jnp.matmul(p.transpose(0, 1, 3, 2), v)  # [Hkv, W, G, D]
    return (m[:, :, 0].transpose(1, 0, 2)[:, :, None], p.sum(2).transpose(1, 0, 2)[:, :, None],
            a.transpose(1, 0, 2, 3)[:, :, None])


def _gather_pages(cache: jax.Array, layer: int | jax.Array, pages: jax.Array) -> jax.Array:
    """cache[layer, :, pages] laid out head-major, [Hkv, W, C, BS, D], in one gather (indexing
    puts the gathered axes first and a transpose would copy the chunk)."""
    Hkv, BS, D = cache.shape[1], cache.shape[3], cache.shape[4]
    idx = jnp.stack([jnp.broadcast_to(jnp.asarray(layer, jnp.int32), pages.shape), pages], -1)
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(0, 3, 4), collapsed_slice_dims=(0, 2),
                                          start_index_map=(0, 2))
    return jax.lax.gather(cache, idx, dims, (1, Hkv, 1, BS, D),
                          mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)
