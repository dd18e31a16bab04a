"""Ragged paged attention as a Mosaic TPU kernel.

Grid (kv head, query tile). Query rows are regrouped as [Hkv, T * G, D] so one tile holds the G
query heads that share a KV head, for num_queries_per_block tokens. Each grid step walks the
(request, kv block) pairs its tokens need (see ragged_schedule), copying the block's pages
HBM -> VMEM with two buffers: the next pair's pages are in flight while this pair is computed.
The layer index, lengths, flattened block table and query_start_loc are scalar-prefetched to SMEM,
so the full stacked cache is read in place (no per-layer slice).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_schedule import TileSchedule
from pallas_kernels.tiling import check_attention_args, default_tpu_tiles, validate_tpu_tiling

_MASK_VALUE = -1e30  # as the xla backend: finite, so a row that sees nothing gives 0, not NaN
_NT_DIMS = (((1,), (1,)), ((), ()))  # q @ k.T


def _lane_broadcast(x: jax.Array, width: int) -> jax.Array:
    """[rows, 128] with equal lanes -> [rows, width]."""
    lanes = x.shape[1]
    if width == lanes:
        return x
    if width < lanes:
        return x[:, :width]
    tiled = jnp.tile(x, (1, -(-width // lanes)))
    return tiled if tiled.shape[1] == width else tiled[:, :width]


def _kernel(
    layer_ref,  # i32[1]                        SMEM
    seq_lens_ref,  # i32[R]                     SMEM
    tables_ref,  # i32[R * P]                   SMEM
    qsl_ref,  # i32[R + 1]                      SMEM
    q_ref,  # [N, D]      N = queries_per_block * G
    k_hbm,  # [L, Hkv, NB, BS, D]               HBM
    v_hbm,  # [L, Hkv, NB, BS, D]               HBM
    o_ref,  # [N, D]
    k_buf,  # [2, pages_per_block * BS, D]      VMEM
    v_buf,  # [2, pages_per_block * BS, D]      VMEM
    sems,  # DMA semaphores [2, 2]  (buffer, k/v)
    m_ref,  # f32[N, 128]  running max, equal across lanes
    l_ref,  # f32[N, 128]  running denominator, equal across lanes
    acc_ref,  # f32[N, D]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    group: int,
    queries_per_block: int,
    pages_per_block: int,
    pages_per_seq: int,
    num_reqs: int,
):
    head, tile = pl.program_id(0), pl.program_id(1)
    rows, head_dim = q_ref.shape
    page_size = k_hbm.shape[3]
    block_tokens = pages_per_block * page_size
    q_lo = tile * queries_per_block
    sched = TileSchedule(seq_lens_ref, qsl_ref, q_lo, q_lo + queries_per_block, num_reqs,
                         page_size, pages_per_block, pages_per_seq, sliding_window)
    layer = layer_ref[0]

    def copies(r: jax.Array, b: jax.Array, slot: jax.Array) -> list[tuple[jax.Array, object]]:
        page_lo, page_hi = sched.page_range(r)
        row = jnp.clip(r, 0, num_reqs - 1) * pages_per_seq
        out = []
        for i in range(pages_per_block):
            page = b * pages_per_block + i
            block_id = tables_ref[row + jnp.minimum(page, pages_per_seq - 1)]
            needed = (page >= page_lo) & (page < page_hi)
            for kv, (src, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
                dst = buf.at[slot, pl.ds(i * page_size, page_size)]
                out.append((needed, pltpu.make_async_copy(src.at[layer, head, block_id], dst,
                                                          sems.at[slot, kv])))
        return out

    def start(r: jax.Array, b: jax.Array, slot: jax.Array) -> None:
        for needed, cp in copies(r, b, slot):
            pl.when(needed)(cp.start)

    def wait(r: jax.Array, b: jax.Array, slot: jax.Array) -> None:
        for needed, cp in copies(r, b, slot):
            pl.when(needed)(cp.wait)

    q = q_ref[...]

    def compute(r: jax.Array, b: jax.Array, slot: jax.Array) -> None:
        k, v = k_buf[slot], v_buf[slot]  # [block_tokens, D]
        # Zero V outside the KV this tile may see: pages not copied hold stale VMEM and slots past
        # seq_len stale cache, either maybe NaN, which p = 0 would not cancel. Scores are masked.
        tok_lo, tok_hi = sched.token_range(r)
        kv_pos = jax.lax.broadcasted_iota(jnp.int32, v.shape, 0) + b * block_tokens
        v = jnp.where((kv_pos >= tok_lo) & (kv_pos < tok_hi), v, jnp.zeros_like(v))
        s = jax.lax.dot_general(q, k, _NT_DIMS, preferred_element_type=jnp.float32) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = sched.mask(r, b, s.shape, group)
        s = jnp.where(mask, s, _MASK_VALUE)
        m_prev, l_prev = m_ref[...], l_ref[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - _lane_broadcast(m_next, block_tokens)), 0.0)
        alpha = jnp.exp(m_prev - m_next)
        m_ref[...] = m_next
        l_ref[...] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        acc_ref[...] = acc_ref[...] * _lane_broadcast(alpha, head_dim) + pv

    m_ref[...] = jnp.full(m_ref.shape, _MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # Software pipeline: iteration i starts the copy of work item i and computes item i - 1, so
    # each copy/compute is traced once and the next block is in flight during the compute.
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
            compute(prev_r, prev_b, 1 - slot)

        r_next, b_next = sched.next(r, b, r_end)
        return r, b, r_next, b_next, 1 - slot, fetch

    init = (r0, b0, r0, b0, jnp.int32(0), jnp.bool_(False))
    jax.lax.while_loop(lambda c: (c[2] < r_end) | c[5], body, init)

    l = _lane_broadcast(l_ref[...], head_dim)
    out = jnp.where(l > 0, acc_ref[...] / jnp.where(l > 0, l, 1.0), 0.0)
    o_ref[...] = out.astype(o_ref.dtype)


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
    num_queries_per_block: int | None = None,
    vmem_limit_bytes: int | None = None,
    interpret: bool = False,
    validate: bool = True,
) -> jax.Array:  # [T, Hq, D]
    """Same contract as xla_attention.ragged_paged_attention. `validate=False` skips the tiling
    checks (only to show that the compiler itself rejects a bad configuration)."""
    T, Hq, D = q.shape
    L, Hkv, NB, BS, Dk = k_cache.shape
    R, P = block_tables.shape
    check_attention_args(q.shape, k_cache.shape, v_cache.shape, sliding_window, soft_cap)
    G = Hq // Hkv
    pages, queries = default_tpu_tiles(group=G, block_size=BS, num_tokens=T, q_dtype=q.dtype)
    pages = num_kv_pages_per_block or pages
    queries = num_queries_per_block or queries
    if validate:
        validate_tpu_tiling(num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, block_size=BS,
                            max_num_seqs=R, pages_per_seq=P, num_kv_pages_per_block=pages,
                            num_queries_per_block=queries, q_dtype=q.dtype, kv_dtype=k_cache.dtype,
                            vmem_limit_bytes=vmem_limit_bytes)
    num_tiles = -(-T // queries)
    Tp = num_tiles * queries
    rows = queries * G
    qg = q.reshape(T, Hkv, G, D).transpose(1, 0, 2, 3)
    qg = jnp.pad(qg, ((0, 0), (0, Tp - T), (0, 0), (0, 0))).reshape(Hkv, Tp * G, D)

    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap), group=G,
        queries_per_block=queries, pages_per_block=pages, pages_per_seq=P, num_reqs=R)
    tile_spec = pl.BlockSpec((None, rows, D), lambda h, t, *_: (h, t, 0))
    hbm_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(Hkv, num_tiles),
            in_specs=[tile_spec, hbm_spec, hbm_spec],
            out_specs=tile_spec,
            scratch_shapes=[
                pltpu.VMEM((2, pages * BS, D), k_cache.dtype),
                pltpu.VMEM((2, pages * BS, D), v_cache.dtype),
                pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.VMEM((rows, 128), jnp.float32),
                pltpu.VMEM((rows, 128), jnp.float32),
                pltpu.VMEM((rows, D), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=vmem_limit_bytes),
        out_shape=jax.ShapeDtypeStruct((Hkv, Tp * G, D), q.dtype),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        seq_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32).reshape(-1),
        query_start_loc.astype(jnp.int32),
        qg, k_cache, v_cache,
    )
    out = out.reshape(Hkv, Tp, G, D)[:, :T].transpose(1, 0, 2, 3)
    return out.reshape(T, Hq, D)
