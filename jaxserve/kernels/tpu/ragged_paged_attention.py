"""Ragged paged attention as a Mosaic TPU kernel, with the step's KV write fused in.

Grid: one step per KV head. The head's query rows, regrouped as [T * G, D] (the G query heads
that share the KV head, token-major), stay in VMEM whole with their f32 softmax state. The kernel
walks the step's requests and, for each, the KV blocks its rows can see (ragged_schedule): each
block's pages are copied HBM -> VMEM once, the next block in flight while this one computes, so
a prefill chunk reads its prefix once however long it is. A request's last page is read only up
to the tile holding its last token.

With the write fused in, the rows of the request's new tokens are merged into the block in VMEM
and written back to the cache in whole tiles (a DMA's unit: 8 rows of 32-bit values, 16 of
bf16). The block read already brought the tile's other rows in, so nothing is read twice.

Then the request's query rows that can see the block update their online softmax, in sub-tiles
of rows: a small one for a decode, large ones for a prefill chunk, skipping those the block is
causally (or by the window) hidden from. The layer index, lengths, flattened block table,
query_start_loc and each request's first new-row tile are scalar-prefetched to SMEM, so the
stacked cache is read and written in place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxserve.kernels.ragged_schedule import TileSchedule
from jaxserve.kernels.tiling import (check_attention_args, default_tpu_tiles, tpu_sublanes,
                                    tpu_vmem_bytes, validate_tpu_tiling)
from jaxserve.kernels.traffic import (KernelTraffic, RaggedBatch, name_params, tiled_name,
                                      visible_range)

KERNEL = "ragged_paged_attention_tpu"
_MASK_VALUE = -1e30  # as the xla backend: finite, so a row that sees nothing gives 0, not NaN
_NT_DIMS = (((1,), (1,)), ((), ()))  # q @ k.T


def _cdiv(a: jax.Array | int, b: int) -> jax.Array | int:
    return (a + b - 1) // b


def _kernel(
    layer_ref,  # i32[1]                        SMEM
    seq_lens_ref,  # i32[R]                     SMEM
    tables_ref,  # i32[R * P]                   SMEM
    qsl_ref,  # i32[R + 1]                      SMEM
    unit_start_ref,  # i32[R]  SMEM  the request's first new-row tile in `k_new`/`v_new`
    q_ref,  # [N, D]      N >= T * G + sub_rows: this head's query rows, padded
    k_new,  # [U, TR, D]  the step's new K rows at their rows in the cache tile they land in
    v_new,  # [U, TR, D]
    k_hbm,  # [L, Hkv, NB, BS, D]  HBM (with the write: aliased to the cache outputs)
    v_hbm,  # [L, Hkv, NB, BS, D]
    o_ref,  # [N, D]
    *refs,  # with the write: the cache outputs (the same buffers); then the scratch:
    # k_buf, v_buf [2, BT, D] VMEM; sems DMA [2, 3] (slot, k / v / write); m, l f32[N, 128]
    # (the running max and denominator, equal across lanes); acc f32[N, D]
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    group: int,
    pages_per_block: int,
    pages_per_seq: int,
    num_reqs: int,
    sub_rows: int,
    small_rows: int,
    write: bool,
):
    if write:
        k_hbm, v_hbm, *refs = refs  # the outputs: the same buffers as the inputs
    k_buf, v_buf, sems, m_ref, l_ref, acc_ref = refs
    head = pl.program_id(0)
    head_dim = q_ref.shape[1]
    tile_rows = k_new.shape[1]
    page_size = k_hbm.shape[3]
    block_tokens = pages_per_block * page_size
    align = tpu_sublanes(q_ref.dtype)
    sched = TileSchedule(seq_lens_ref, qsl_ref, 0, (q_ref.shape[0] - sub_rows) // group,
                         num_reqs, page_size, pages_per_block, pages_per_seq, sliding_window)
    layer = layer_ref[0]

    def new_rows(r: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[first, kv_len): the positions of request r's tokens this step."""
        _, q_len, kv_len = sched.request_rows(r)
        return kv_len - q_len, kv_len

    def page_block(r: jax.Array, page: jax.Array) -> jax.Array:
        row = jnp.clip(r, 0, num_reqs - 1) * pages_per_seq
        return tables_ref[row + jnp.clip(page, 0, pages_per_seq - 1)]

    def reads(r: jax.Array, b: jax.Array, slot: jax.Array) -> list[tuple[jax.Array, object]]:
        """(needed, copy) for block b of request r: whole pages, but the last one tile by
        tile up to the last token."""
        # The new rows' whole tiles lie inside: a window spans at least a tile (_call checks).
        lo, hi = sched.token_range(r)
        last = (hi - 1) // page_size
        out = []
        for kv, (src, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
            for i in range(pages_per_block):
                page = b * pages_per_block + i
                needed = (page >= lo // page_size) & (page < last) & (hi > lo)
                out.append((needed, pltpu.make_async_copy(
                    src.at[layer, head, page_block(r, page)],
                    buf.at[slot, pl.ds(i * page_size, page_size)], sems.at[slot, kv])))
            in_block = (last >= b * pages_per_block) & (last < (b + 1) * pages_per_block)
            at = (last - b * pages_per_block) * page_size
            for t in range(page_size // tile_rows):
                needed = in_block & (hi > lo) & (t * tile_rows < hi - last * page_size)
                out.append((needed, pltpu.make_async_copy(
                    src.at[layer, head, page_block(r, last), pl.ds(t * tile_rows, tile_rows)],
                    buf.at[slot, pl.ds(pl.multiple_of(at + t * tile_rows, tile_rows),
                                       tile_rows)], sems.at[slot, kv])))
        return out

    def start(r: jax.Array, b: jax.Array, slot: jax.Array) -> None:
        for needed, cp in reads(r, b, slot):
            pl.when(needed)(cp.start)

    def wait(r: jax.Array, b: jax.Array, slot: jax.Array) -> None:
        for needed, cp in reads(r, b, slot):
            pl.when(needed)(cp.wait)

    def each_new_tile(r: jax.Array, b: jax.Array,
                      fn: Callable[[jax.Array, jax.Array], None]) -> None:
        """fn(unit, tile) for the cache tiles of block b that request r's new rows land in:
        `unit` indexes k_new / v_new, `tile` counts tiles from position 0."""
        first, end = new_rows(r)
        tiles_per_block = block_tokens // tile_rows
        lo = jnp.maximum(first // tile_rows, b * tiles_per_block)
        hi = jnp.minimum(_cdiv(end, tile_rows), (b + 1) * tiles_per_block)
        base = unit_start_ref[jnp.clip(r, 0, num_reqs - 1)] - first // tile_rows
        jax.lax.fori_loop(lo, jnp.maximum(lo, hi), lambda t, _: fn(base + t, t), None)

    def write_copies(r: jax.Array, b: jax.Array, slot: jax.Array, tile: jax.Array,
                     ) -> list[object]:
        """The copies of one tile of new rows, K and V, from the block back to the cache."""
        at = pl.multiple_of(tile * tile_rows - b * block_tokens, tile_rows)
        page = tile * tile_rows // page_size
        row = pl.multiple_of(tile * tile_rows % page_size, tile_rows)
        return [pltpu.make_async_copy(
            buf.at[slot, pl.ds(at, tile_rows)],
            cache.at[layer, head, page_block(r, page), pl.ds(row, tile_rows)],
            sems.at[slot, 2]) for buf, cache in ((k_buf, k_hbm), (v_buf, v_hbm))]

    def merge_and_write(r: jax.Array, b: jax.Array, slot: jax.Array) -> None:
        """Put request r's new rows into block b and start writing their tiles back."""
        first, end = new_rows(r)
        rows = jax.lax.broadcasted_iota(jnp.int32, (tile_rows, head_dim), 0)

        def merge(unit: jax.Array, tile: jax.Array) -> None:
            at = pl.multiple_of(tile * tile_rows - b * block_tokens, tile_rows)
            pos = rows + tile * tile_rows
            new = (pos >= first) & (pos < end)
            for buf, src in ((k_buf, k_new), (v_buf, v_new)):
                buf[slot, pl.ds(at, tile_rows)] = jnp.where(
                    new, src[unit].astype(buf.dtype), buf[slot, pl.ds(at, tile_rows)])
            for cp in write_copies(r, b, slot, tile):
                cp.start()

        each_new_tile(r, b, merge)

    def wait_writes(r: jax.Array, b: jax.Array, slot: jax.Array) -> None:
        def wait_tile(unit: jax.Array, tile: jax.Array) -> None:
            for cp in write_copies(r, b, slot, tile):
                cp.wait()

        each_new_tile(r, b, wait_tile)

    def compute(r: jax.Array, b: jax.Array, slot: jax.Array) -> None:
        q_start, q_len, kv_len = sched.request_rows(r)
        lo, hi = sched.token_range(r)
        first_pos = kv_len - q_len
        kv_pos = jax.lax.broadcasted_iota(jnp.int32, (block_tokens, head_dim), 0) + \
            b * block_tokens
        # Zero V outside what the rows may see: pages not copied hold stale VMEM and slots past
        # seq_len stale cache, either maybe NaN, which p = 0 would not cancel. Scores are masked.
        k = k_buf[slot]
        v = jnp.where((kv_pos >= lo) & (kv_pos < hi), v_buf[slot], jnp.zeros_like(v_buf[slot]))
        row_lo, row_hi = q_start * group, (q_start + q_len) * group
        base = row_lo - row_lo % align

        def sub_tile(s: jax.Array, rows: int) -> None:
            q = q_ref[pl.ds(s, rows)]
            scores = jax.lax.dot_general(q, k, _NT_DIMS,
                                         preferred_element_type=jnp.float32) * sm_scale
            if soft_cap is not None:
                scores = soft_cap * jnp.tanh(scores / soft_cap)
            shape = (rows, block_tokens)
            token = (jax.lax.broadcasted_iota(jnp.int32, shape, 0) + s) // group - q_start
            col = jax.lax.broadcasted_iota(jnp.int32, shape, 1) + b * block_tokens
            pos = first_pos + token
            mask = (token >= 0) & (token < q_len) & (col <= pos)
            if sliding_window is not None:
                mask &= col > pos - sliding_window
            scores = jnp.where(mask, scores, _MASK_VALUE)
            m_prev, l_prev = m_ref[pl.ds(s, rows)], l_ref[pl.ds(s, rows)]
            m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(scores - _lane_broadcast(m_next, block_tokens)), 0.0)
            alpha = jnp.exp(m_prev - m_next)
            m_ref[pl.ds(s, rows)] = m_next
            l_ref[pl.ds(s, rows)] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            acc_ref[pl.ds(s, rows)] = acc_ref[pl.ds(s, rows)] * \
                _lane_broadcast(alpha, head_dim) + pv

        def sweep(rows: int) -> None:
            """The request's sub-tiles of `rows` rows that block b is not hidden from."""
            j_lo, j_hi = sweep_bounds(jnp, b * block_tokens, (b + 1) * block_tokens, q_start,
                                      q_len, kv_len, group, rows, align, sliding_window)

            def body(j: jax.Array, carry: None) -> None:
                sub_tile(pl.multiple_of(base + j * rows, align), rows)

            jax.lax.fori_loop(j_lo, jnp.maximum(j_lo, j_hi), body, None)

        small = row_hi - base <= small_rows
        pl.when(small)(lambda: sweep(small_rows))
        pl.when(~small)(lambda: sweep(sub_rows))

    m_ref[...] = jnp.full(m_ref.shape, _MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # Software pipeline: iteration i starts the copy of work item i and computes item i - 1,
    # so each copy/compute is traced once and the next block is in flight during the compute.
    r_first, r_end = sched.request_bounds()
    r0 = sched.first_busy(r_first, r_end)
    b0, _ = sched.block_range(r0)

    def body(carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        prev_r, prev_b, r, b, slot, has_prev = carry
        fetch = r < r_end
        pl.when(fetch)(lambda: start(r, b, slot))

        @pl.when(has_prev)
        def _() -> None:
            wait(prev_r, prev_b, 1 - slot)
            if write:
                merge_and_write(prev_r, prev_b, 1 - slot)
            compute(prev_r, prev_b, 1 - slot)
            if write:  # before the slot's buffer takes the block after next
                wait_writes(prev_r, prev_b, 1 - slot)

        r_next, b_next = sched.next(r, b, r_end)
        return r, b, r_next, b_next, 1 - slot, fetch

    init = (r0, b0, r0, b0, jnp.int32(0), jnp.bool_(False))
    jax.lax.while_loop(lambda c: (c[2] < r_end) | c[5], body, init)

    l = _lane_broadcast(l_ref[...], head_dim)
    out = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0)
    o_ref[...] = out.astype(o_ref.dtype)


def sweep_bounds(xp: Any, kv_lo: Any, kv_hi: Any, q_start: Any, q_len: Any, kv_len: Any,
                 group: int, rows: int, align: int, sliding_window: int | None) -> tuple[Any, Any]:
    """[j_lo, j_hi): the sub-tiles of `rows` query rows of a request that KV positions
    [kv_lo, kv_hi) are visible to. Sub-tile j holds rows base + j * rows onwards, base being the
    request's first row (q_start * group) rounded down to `align`. `xp`: numpy for the cost
    model's ints, jax.numpy inside the kernel."""
    row_lo = q_start * group
    base = row_lo - row_lo % align
    count = _cdiv((q_start + q_len) * group - base, rows)
    first_pos = kv_len - q_len
    # causal: the sub-tile's last token, (base + (j + 1) * rows - 1) // group - q_start, must be
    # at or after kv_lo
    need = kv_lo - first_pos + q_start
    j_lo = xp.maximum(0, _cdiv(need * group - base + 1, rows) - 1)
    j_hi = count
    if sliding_window is not None:  # its first token's window must still reach kv_hi - 1
        reach = kv_hi + sliding_window - 2 - first_pos + q_start
        j_hi = xp.minimum(count, (reach * group + group - 1 - base) // rows + 1)
    return j_lo, j_hi


def _lane_broadcast(x: jax.Array, width: int) -> jax.Array:
    """[rows, 128] with equal lanes -> [rows, width]."""
    lanes = x.shape[1]
    if width == lanes:
        return x
    if width < lanes:
        return x[:, :width]
    tiled = jnp.tile(x, (1, -(-width // lanes)))
    return tiled if tiled.shape[1] == width else tiled[:, :width]


def _new_tiles(k: jax.Array, v: jax.Array, seq_lens: jax.Array, query_start_loc: jax.Array,
               tile_rows: int, num_units: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The step's new K and V rows [T, Hkv, D] grouped by the cache tile they land in:
    ([Hkv, U, TR, D] twice, each row at its row in the tile, and i32[R]: each request's first
    tile). A request's tokens are consecutive positions, so its tiles are consecutive units."""
    T = k.shape[0]
    R = seq_lens.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    r = jnp.clip(jnp.searchsorted(query_start_loc, t, side="right") - 1, 0, R - 1)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    pos = seq_lens[r] - q_lens[r] + t - query_start_loc[r]
    real = t < query_start_loc[-1]
    tile = pos // tile_rows
    starts = real & ((t == query_start_loc[r]) | (tile != jnp.roll(tile, 1)))
    unit = jnp.where(real, jnp.cumsum(starts.astype(jnp.int32)) - 1, num_units)  # past: drop
    unit_start = unit[jnp.clip(query_start_loc[:-1], 0, T - 1)]

    def by_tile(x: jax.Array) -> jax.Array:
        tiles = jnp.zeros((num_units, tile_rows) + x.shape[1:], x.dtype)
        tiles = tiles.at[unit, pos % tile_rows].set(x, mode="drop")
        return tiles.transpose(2, 0, 1, 3)  # [Hkv, U, TR, D]

    return by_tile(k), by_tile(v), unit_start.astype(jnp.int32)


def _call(q: jax.Array, new: tuple[jax.Array, jax.Array] | None, k_cache: jax.Array,
          v_cache: jax.Array, layer: int | jax.Array, seq_lens: jax.Array,
          block_tables: jax.Array, query_start_loc: jax.Array, *, sm_scale: float,
          sliding_window: int | None, soft_cap: float | None,
          num_kv_pages_per_block: int | None, sub_rows: int | None,
          vmem_limit_bytes: int | None, interpret: bool | pltpu.InterpretParams,
          validate: bool) -> tuple[jax.Array, ...]:
    T, Hq, D = q.shape
    L, Hkv, NB, BS, Dk = k_cache.shape
    R, P = block_tables.shape
    check_attention_args(q.shape, k_cache.shape, v_cache.shape, sliding_window, soft_cap)
    G = Hq // Hkv
    TR = tpu_sublanes(k_cache.dtype)
    align = tpu_sublanes(q.dtype)
    default_pages, default_sub = default_tpu_tiles(block_size=BS)
    pages = num_kv_pages_per_block or default_pages
    sub = sub_rows or default_sub
    small = 2 * align
    write = new is not None
    if write and sliding_window is not None and sliding_window < TR:
        raise ValueError(f"sliding_window={sliding_window} must be at least {TR} for the fused "
                         "KV write (its tiles are read whole)")
    if validate:
        validate_tpu_tiling(num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, block_size=BS,
                            max_num_seqs=R, pages_per_seq=P, num_kv_pages_per_block=pages,
                            sub_rows=sub, num_tokens=T, q_dtype=q.dtype, kv_dtype=k_cache.dtype,
                            vmem_limit_bytes=vmem_limit_bytes)
    N = -(-T * G // align) * align + sub  # room for the last sub-tile to run past the rows
    qg = q.reshape(T, Hkv, G, D).transpose(1, 0, 2, 3).reshape(Hkv, T * G, D)
    qg = jnp.pad(qg, ((0, 0), (0, N - T * G), (0, 0)))
    U = T // TR + 2 * R if write else 1
    if write:
        k_new, v_new, unit_start = _new_tiles(*new, seq_lens.astype(jnp.int32),
                                               query_start_loc.astype(jnp.int32), TR, U)
    else:
        k_new = v_new = jnp.zeros((Hkv, U, TR, D), k_cache.dtype)
        unit_start = jnp.zeros((R,), jnp.int32)
    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap), group=G,
        pages_per_block=pages, pages_per_seq=P, num_reqs=R, sub_rows=sub, small_rows=small,
        write=write)
    # One buffer each: a head's rows are used for the whole of its (long) grid step, so the
    # next head's would be in flight for little gain and twice the VMEM.
    rows_spec = pl.BlockSpec((None, N, D), lambda h, *_: (h, 0, 0), pl.Buffered(1))
    new_spec = pl.BlockSpec((None, U, TR, D), lambda h, *_: (h, 0, 0, 0), pl.Buffered(1))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    cache_shapes = [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in (k_cache, v_cache)]
    need = tpu_vmem_bytes(group=G, head_dim=D, block_size=BS, kv_itemsize=k_cache.dtype.itemsize,
                          q_itemsize=q.dtype.itemsize, num_kv_pages_per_block=pages,
                          sub_rows=sub, num_tokens=T, max_num_seqs=R)
    name = tiled_name(KERNEL, g=G, p=pages, s=sub, m=small, t=TR, w=sliding_window or 0,
                      x=int(write))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(Hkv,),
            in_specs=[rows_spec, new_spec, new_spec, hbm, hbm],
            out_specs=[rows_spec] + ([hbm, hbm] if write else []),
            scratch_shapes=[
                pltpu.VMEM((2, pages * BS, D), k_cache.dtype),
                pltpu.VMEM((2, pages * BS, D), v_cache.dtype),
                pltpu.SemaphoreType.DMA((2, 3)),
                pltpu.VMEM((N, 128), jnp.float32),
                pltpu.VMEM((N, 128), jnp.float32),
                pltpu.VMEM((N, D), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",),
            vmem_limit_bytes=vmem_limit_bytes or need + (4 << 20)),
        out_shape=[jax.ShapeDtypeStruct((Hkv, N, D), q.dtype)] + (cache_shapes if write else []),
        input_output_aliases={8: 1, 9: 2} if write else {},  # counting the 5 scalar arrays
        interpret=interpret,
        name=name,
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        seq_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32).reshape(-1),
        query_start_loc.astype(jnp.int32),
        unit_start,
        qg, k_new, v_new, k_cache, v_cache,
    )
    o = out[0][:, :T * G].reshape(Hkv, T, G, D).transpose(1, 0, 2, 3).reshape(T, Hq, D)
    return (o, *out[1:])


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    v_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    layer: int | jax.Array,  # i32[]
    seq_lens: jax.Array,  # i32[R]
    block_tables: jax.Array,  # i32[R, P]
    query_start_loc: jax.Array,  # i32[R + 1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_kv_pages_per_block: int | None = None,
    sub_rows: int | None = None,
    vmem_limit_bytes: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    validate: bool = True,
) -> jax.Array:  # [T, Hq, D]
    """Same contract as xla_attention.ragged_paged_attention (the step's KV already written).
    `validate=False` skips the tiling checks (only to show that the compiler itself rejects a
    bad configuration)."""
    return _call(q, None, k_cache, v_cache, layer, seq_lens, block_tables, query_start_loc,
                 sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                 num_kv_pages_per_block=num_kv_pages_per_block, sub_rows=sub_rows,
                 vmem_limit_bytes=vmem_limit_bytes, interpret=interpret, validate=validate)[0]


def write_and_attend(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]  this step's new keys
    v: jax.Array,  # [T, Hkv, D]
    k_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    v_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    layer: int | jax.Array,  # i32[]
    seq_lens: jax.Array,  # i32[R]  after this step
    block_tables: jax.Array,  # i32[R, P]
    query_start_loc: jax.Array,  # i32[R + 1]
    **kwargs: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # o [T, Hq, D], k_cache, v_cache
    """Writes the step's new K/V (request r's tokens at positions seq_lens[r] - q_len onwards,
    through its block table; tokens past query_start_loc[R] are padding and write nothing),
    then the same attention as `ragged_paged_attention`, in one kernel. Donate the caches to
    the enclosing jit so the update happens in place."""
    return _call(q, (k, v), k_cache, v_cache, layer, seq_lens, block_tables, query_start_loc,
                 **{"sliding_window": None, "soft_cap": None, "num_kv_pages_per_block": None,
                    "sub_rows": None, "vmem_limit_bytes": None, "interpret": False,
                    "validate": True} | kwargs)


def hbm_traffic(name: str, operands: list[tuple[tuple[int, ...], int]],
                batch: RaggedBatch) -> KernelTraffic:
    """What one call reads and writes of the caches by DMA, and the flops it runs. `operands`:
    (dims, itemsize) of the call's operands as in the HLO: five scalar arrays, q
    [Hkv, N, D], the new rows' tiles [Hkv, U, TR, D] twice, the caches [L, Hkv, NB, BS, D]
    twice."""
    tiles = name_params(name, KERNEL)
    group, rows_large, rows_small, tile_rows = tiles["g"], tiles["s"], tiles["m"], tiles["t"]
    window, write = tiles["w"] or None, bool(tiles["x"])
    (hkv, _, head_dim), q_itemsize = operands[5]
    (_, _, _, page_size, _), itemsize = operands[8]
    block_tokens = tiles["p"] * page_size
    align = 8 * max(1, 4 // q_itemsize)
    row_bytes = 2 * head_dim * itemsize  # K and V
    out = KernelTraffic(manual_operands=(8, 9))
    for q_start, q_len, kv_len in zip(batch.query_start_loc, batch.q_lens, batch.kv_lens):
        lo, hi = visible_range(q_start, q_len, kv_len, 0, q_len, window)
        last = (hi - 1) // page_size
        out.kv_read += row_bytes * ((last - lo // page_size) * page_size
                                    + _cdiv(hi - last * page_size, tile_rows) * tile_rows)
        first = kv_len - q_len
        if write:
            out.kv_write += row_bytes * tile_rows * ((kv_len - 1) // tile_rows
                                                     - first // tile_rows + 1)
        base = q_start * group - q_start * group % align
        rows = rows_small if (q_start + q_len) * group - base <= rows_small else rows_large
        for b in range(lo // block_tokens, _cdiv(hi, block_tokens)):
            j_lo, j_hi = sweep_bounds(np, b * block_tokens, (b + 1) * block_tokens, q_start,
                                      q_len, kv_len, group, rows, align, window)
            out.flops += 2 * 2 * max(0, j_hi - j_lo) * rows * block_tokens * head_dim
    out.kv_read *= hkv
    out.kv_write *= hkv
    out.flops *= hkv
    return out
