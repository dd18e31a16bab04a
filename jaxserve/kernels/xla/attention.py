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
# A decode iteration gathers every decode's next pages: about this many bytes of K (V as many
# again), and at most DECODE_CHUNK_TOKENS positions, so a few decodes in a long max_model_len
# gather little past their context.
DECODE_CHUNK_BYTES = 1 << 20
DECODE_CHUNK_TOKENS = 256


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
    # The indexed dims are split by the head slice, so the indexed axis (T) leads: values
    # [T, Hkv, D].
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
    decode_chunk_bytes: int = DECODE_CHUNK_BYTES,
    decode_rows: int = 1,
) -> jax.Array:  # [T, Hq, D]
    """Split-KV attention with work proportional to the KV each row can see.

    Decodes (requests of 1 to `decode_rows` query rows: a decode, or a decode verifying its
    speculative drafts) go together: one loop over their KV in chunks of pages, each iteration
    one gather of every decode's next pages (about `decode_chunk_bytes` of K), shared by all its
    rows, and two batched dots, folded by online softmax; the loop runs to the longest decode's
    context. (Work items like the tiles' below, one chunk of one decode each, took 2.6x as long
    in a step of 32 decodes of stories260K, 1.1x of the dummy model: small gathers and dots,
    scatter folds; 8 requests verifying 4 drafts each in 32-row tiles took 4.4x as long.)
    The other requests are cut into query tiles of up to `max_query_tile` rows, so a
    prefill chunk's rows share each KV page they gather. A work item is one tile against one
    chunk of `kv_chunk_tokens` (default 128) of its KV: only the chunks up to the tile's last
    position, and from its first position's window. The tiles run a loop of
    ceil(items / items_per_iter) (default 8) iterations, each gathering its items' pages,
    computing their partial softmax (max, sum, weighted V) and folding them into per-tile
    accumulators: padding tiles and short sequences beside a long one cost nothing."""
    T = q.shape[0]
    R = seq_lens.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # i32[R]

    def attend_decodes(max_rows: int) -> jax.Array:
        return _attend_decodes(q, k_cache, v_cache, layer, q_lens, seq_lens, block_tables,
                               query_start_loc, max_rows=max_rows, sm_scale=sm_scale,
                               sliding_window=sliding_window, soft_cap=soft_cap,
                               chunk_bytes=decode_chunk_bytes)

    if decode_rows == 1:
        out = attend_decodes(1)
    else:  # room for drafts (Q * G query rows a request) made a step of 32 plain decodes
        # ~10% slower (dummy-30m): only when some request has 2..decode_rows rows
        out = jax.lax.cond(jnp.any((q_lens > 1) & (q_lens <= decode_rows)),
                           lambda: attend_decodes(decode_rows), lambda: attend_decodes(1))
    tile_rows = min(max_query_tile, 1 << (max(1, T // 2).bit_length() - 1))
    # the other requests have > decode_rows rows each: at most T // (decode_rows + 1) of them
    NT = -(-T // tile_rows) + min(R, T // (decode_rows + 1))
    multi = jnp.where(q_lens > decode_rows, q_lens, 0)

    def attend_tiles(out: jax.Array) -> jax.Array:
        tiles = _QueryTiles.make(multi, query_start_loc, seq_lens, tile_rows, NT)
        return _attend_tiles(out, q, k_cache, v_cache, layer, tiles, block_tables,
                             sm_scale=sm_scale, sliding_window=sliding_window,
                             soft_cap=soft_cap, kv_chunk_tokens=kv_chunk_tokens or 128,
                             items_per_iter=items_per_iter or 8)

    # A step of decodes only skips the tiles' set-up (~5% of a stories260K step of 32 decodes)
    return jax.lax.cond(jnp.any(multi > 0), attend_tiles, lambda out: out, out)


def _attend_decodes(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    v_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    layer: int | jax.Array,
    q_lens: jax.Array,  # i32[R]
    seq_lens: jax.Array,  # i32[R]
    block_tables: jax.Array,  # i32[R, P]
    query_start_loc: jax.Array,  # i32[R + 1]
    *,
    max_rows: int,  # requests of 1..max_rows query rows are decodes
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    chunk_bytes: int,
) -> jax.Array:  # [T, Hq, D]  the decodes' rows; zeros elsewhere
    T, Hq, D = q.shape
    R, P = block_tables.shape
    Hkv, BS = k_cache.shape[1], k_cache.shape[3]
    G = Hq // Hkv
    Q = max_rows
    page_bytes = R * Hkv * BS * D * k_cache.dtype.itemsize  # one page of every request
    C = max(1, min(P, chunk_bytes // page_bytes, DECODE_CHUNK_TOKENS // BS))  # pages an iteration
    S = C * BS
    tables = jnp.pad(block_tables, ((0, 0), (0, -(-P // C) * C - P)))
    row = jnp.arange(Q, dtype=jnp.int32)
    decode = (q_lens <= Q)[:, None] & (row < q_lens[:, None])  # bool[R, Q]  a decode's rows
    q_rows = jnp.minimum(query_start_loc[:-1, None] + row, T - 1)  # i32[R, Q]
    # KV visible to each row (the last q_len positions are the rows'); 0: not a decode row
    lens = jnp.where(decode, (seq_lens - q_lens)[:, None] + 1 + row, 0)  # i32[R, Q]
    # [Hkv, R, Q * G, D]: the dots are q K^T and p V, batched over (head, request), which
    # XLA:CPU runs ~1.6x faster than K q and p^T V (whose transposed operand it copies)
    qh = (q[q_rows].astype(jnp.float32) * sm_scale).reshape(R, Q, Hkv, G, D)
    qh = qh.transpose(2, 0, 1, 3, 4).reshape(Hkv, R, Q * G, D)
    if sliding_window is None:
        first = jnp.zeros((), jnp.int32)
        lo = jnp.zeros_like(lens)
    else:
        lo = jnp.maximum(lens - sliding_window, 0)  # the first visible position
        first = jnp.min(jnp.where(decode, lo, jnp.iinfo(jnp.int32).max)) // S

    def body(c: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        m, l, acc = carry  # [Hkv, R, Q * G], [Hkv, R, Q * G], [Hkv, R, Q * G, D]
        pages = jax.lax.dynamic_slice_in_dim(tables, c * C, C, axis=1)  # i32[R, C]
        k = _gather_pages(k_cache, layer, pages).astype(jnp.float32).reshape(Hkv, R, S, D)
        v = _gather_pages(v_cache, layer, pages).astype(jnp.float32).reshape(Hkv, R, S, D)
        s = jnp.einsum("hrgd,hrsd->hrgs", qh, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kv_pos = c * S + jnp.arange(S, dtype=jnp.int32)
        mask = (kv_pos < lens[..., None]) & (kv_pos >= lo[..., None])  # [R, Q, S]
        mask = jnp.broadcast_to(mask[:, :, None], (R, Q, G, S)).reshape(1, R, Q * G, S)
        m_c, p = _softmax_partials(s, mask, -1)
        m_new = jnp.maximum(m, m_c[..., 0])
        scale, beta = jnp.exp(m - m_new), jnp.exp(m_c[..., 0] - m_new)
        l = l * scale + p.sum(-1) * beta
        acc = acc * scale[..., None] + jnp.einsum("hrgs,hrsd->hrgd", p, v) * beta[..., None]
        return m_new, l, acc

    shape = (Hkv, R, Q * G)
    init = (jnp.full(shape, _MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, D), jnp.float32))
    last = (jnp.max(lens) + S - 1) // S
    _, l, acc = jax.lax.fori_loop(first, jnp.maximum(first, last), body, init)
    o = jnp.where(l[..., None] > 0, acc / jnp.maximum(l, 1e-30)[..., None], 0.0)
    o = o.reshape(Hkv, R, Q, G, D).transpose(1, 2, 0, 3, 4).reshape(R * Q, Hq, D)
    dest = jnp.where(decode, q_rows, T).reshape(-1)  # other rows fall off the end
    return jnp.zeros(q.shape, q.dtype).at[dest].set(o.astype(q.dtype), mode="drop")


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
        m_i, l_i, a_i = _tile_partials(qt[it_tile], k_cache, v_cache, layer, pages, mask, soft_cap)
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


def _gather_pages(cache: jax.Array, layer: int | jax.Array, pages: jax.Array) -> jax.Array:
    """cache[layer, h, pages] for every head h, [Hkv, *pages.shape, BS * D]: each page one
    contiguous row, gathered per head (a batch dimension of the gather), so the result comes
    out head-major as laid out, with no transpose to copy it."""
    L, Hkv, NB, BS, D = cache.shape
    rows = cache.reshape(L, Hkv, NB, BS * D)
    return jax.vmap(lambda head: head[layer, pages], in_axes=1)(rows)
