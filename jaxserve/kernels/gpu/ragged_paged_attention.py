"""Ragged paged attention for GPUs, through Pallas' Triton lowering.

Grid (query tile, kv head). The queries are read as [T, Hkv, Gp, D] (Gp: q heads per KV head,
padded to a power of two for Triton; a plain reshape of q when G is one), so one program owns the
Gp heads sharing a KV head for num_queries_per_block tokens, as [tokens * Gp, D] rows. It walks
the (request, kv block) pairs its tokens need (see ragged_schedule), gathering each block's pages
straight from the stacked cache, which is viewed as [L * Hkv * NB, BS, D] so the traced layer
index is just an offset.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from jaxserve.kernels.ragged_schedule import TileSchedule
from jaxserve.kernels.tiling import (check_attention_args, default_gpu_tiles, next_pow2,
                                    validate_gpu_tiling)
from jaxserve.kernels.traffic import (KernelTraffic, RaggedBatch, name_params, tile_walk_traffic,
                                      tiled_name)

KERNEL = "ragged_paged_attention_gpu"

_MASK_VALUE = -1e30  # as the xla backend: finite, so a row that sees nothing gives 0, not NaN
_NT_DIMS = (((1,), (1,)), ((), ()))  # q @ k.T


def _kernel(
    layer_ref,  # i32[1]
    seq_lens_ref,  # i32[R]
    tables_ref,  # i32[R * P]
    qsl_ref,  # i32[R + 1]
    q_ref,  # [Q, Gp, D]  Q = queries_per_block
    k_ref,  # [L * Hkv * NB, BS, D]
    v_ref,  # [L * Hkv * NB, BS, D]
    o_ref,  # [Q, Gp, D]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    group: int,
    queries_per_block: int,
    pages_per_block: int,
    pages_per_seq: int,
    num_reqs: int,
    num_kv_heads: int,
    num_blocks: int,
):
    tile, head = pl.program_id(0), pl.program_id(1)
    rows, head_dim = queries_per_block * group, q_ref.shape[-1]
    page_size = k_ref.shape[1]
    block_tokens = pages_per_block * page_size
    q_lo = tile * queries_per_block
    sched = TileSchedule(seq_lens_ref, qsl_ref, q_lo, q_lo + queries_per_block, num_reqs,
                         page_size, pages_per_block, pages_per_seq, sliding_window)
    page_base = (layer_ref[0] * num_kv_heads + head) * num_blocks
    q = q_ref[...].reshape(rows, head_dim)

    def body(carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        r, b, m, l, acc = carry
        page_lo, page_hi = sched.page_range(r)
        page = b * pages_per_block + jnp.arange(pages_per_block, dtype=jnp.int32)
        needed = (page >= page_lo) & (page < page_hi)
        row = jnp.clip(r, 0, num_reqs - 1) * pages_per_seq
        block_ids = tables_ref[row + jnp.minimum(page, pages_per_seq - 1)]
        # Pages the request does not need read the null block 0 instead of a table entry that may
        # be stale. V outside the visible KV is zeroed (p = 0 would not cancel a NaN there) and
        # the scores are masked.
        block_ids = page_base + jnp.where(needed, block_ids, 0)
        k = k_ref[block_ids].reshape(block_tokens, head_dim)
        v = v_ref[block_ids].reshape(block_tokens, head_dim)
        tok_lo, tok_hi = sched.token_range(r)
        kv_pos = jax.lax.broadcasted_iota(jnp.int32, v.shape, 0) + b * block_tokens
        v = jnp.where((kv_pos >= tok_lo) & (kv_pos < tok_hi), v, jnp.zeros_like(v))

        s = jax.lax.dot_general(q, k, _NT_DIMS, preferred_element_type=jnp.float32) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = sched.mask(r, b, s.shape, group)
        s = jnp.where(mask, s, _MASK_VALUE)
        m_next = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
        alpha = jnp.exp(m - m_next)
        l = alpha * l + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        acc = acc * alpha[:, None] + pv
        r_next, b_next = sched.next(r, b, r_end)
        return r_next, b_next, m_next, l, acc

    r_first, r_end = sched.request_bounds()
    r0 = sched.first_busy(r_first, r_end)
    b0, _ = sched.block_range(r0)
    init = (r0, b0, jnp.full((rows,), _MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))
    _, _, _, l, acc = jax.lax.while_loop(lambda c: c[0] < r_end, body, init)
    safe_l = jnp.where(l > 0, l, 1.0)
    out = jnp.where(l[:, None] > 0, acc / safe_l[:, None], 0.0)
    o_ref[...] = out.astype(o_ref.dtype).reshape(o_ref.shape)


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
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
    validate: bool = True,
) -> jax.Array:  # [T, Hq, D]
    """Same contract as xla_attention.ragged_paged_attention."""
    T, Hq, D = q.shape
    L, Hkv, NB, BS, Dk = k_cache.shape
    R, P = block_tables.shape
    check_attention_args(q.shape, k_cache.shape, v_cache.shape, sliding_window, soft_cap)
    G = Hq // Hkv
    Gp = next_pow2(G)
    pages, queries = default_gpu_tiles(group=G, block_size=BS, num_tokens=T, num_reqs=R)
    pages = num_kv_pages_per_block or pages
    queries = num_queries_per_block or queries
    if validate:
        validate_gpu_tiling(num_q_heads=Hq, num_kv_heads=Hkv, head_dim=D, block_size=BS,
                            num_kv_pages_per_block=pages, num_queries_per_block=queries)
    num_tiles = -(-T // queries)
    Tp = num_tiles * queries
    qg = q.reshape(T, Hkv, G, D)
    if (Tp, Gp) != (T, G):  # padding copies q: the presets' buckets and groups need none
        qg = jnp.pad(qg, ((0, Tp - T), (0, 0), (0, Gp - G), (0, 0)))

    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap), group=Gp,
        queries_per_block=queries, pages_per_block=pages, pages_per_seq=P, num_reqs=R,
        num_kv_heads=Hkv, num_blocks=NB)
    tile_spec = pl.BlockSpec((queries, None, Gp, D), lambda t, h: (t, h, 0, 0))
    whole = pl.no_block_spec
    out = pl.pallas_call(
        kernel,
        grid=(num_tiles, Hkv),
        in_specs=[whole, whole, whole, whole, tile_spec, whole, whole],
        out_specs=tile_spec,
        out_shape=jax.ShapeDtypeStruct((Tp, Hkv, Gp, D), q.dtype),
        compiler_params=plgpu_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=tiled_name(KERNEL, g=Gp, q=queries, p=pages, w=sliding_window or 0),
    )(
        jnp.asarray(layer, jnp.int32).reshape(1),
        seq_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32).reshape(-1),
        query_start_loc.astype(jnp.int32),
        qg,
        k_cache.reshape(L * Hkv * NB, BS, D),
        v_cache.reshape(L * Hkv * NB, BS, D),
    )
    return out[:T, :, :G].reshape(T, Hq, D)


def hbm_traffic(name: str, operands: list[tuple[tuple[int, ...], int]],
                batch: RaggedBatch) -> KernelTraffic:
    """`operands`: (dims, itemsize) of the call's operands as in the HLO: layer, seq_lens,
    block table, query_start_loc, q [Tp, Hkv, Gp, D], k and v caches [L*Hkv*NB, BS, D]. A page
    a request does not need reads the null block, which stays in L2: not counted."""
    tiles = name_params(name, KERNEL)
    (padded_tokens, hkv, _, head_dim), _ = operands[4]
    cache_dims, kv_itemsize = operands[5]
    return tile_walk_traffic(batch, (5, 6), num_kv_heads=hkv, group=tiles["g"],
                             num_tokens_padded=padded_tokens,
                             queries_per_block=tiles["q"], pages_per_block=tiles["p"],
                             page_size=cache_dims[1], head_dim=head_dim,
                             kv_itemsize=kv_itemsize, sliding_window=tiles["w"] or None)
