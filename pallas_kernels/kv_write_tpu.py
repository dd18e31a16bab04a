"""The step's KV write as a Mosaic TPU kernel that updates the cache in place.

XLA's scatter into the stacked cache wants a layout of its own on TPU (KV heads inside the
block's rows), so with the attention kernel beside it the compiler copies the whole cache to
and fro for every layer. This kernel takes the cache aliased in and out and writes it with
DMAs, so the cache keeps the one layout the attention kernel reads.

A DMA moves whole native tiles (8 rows of 32-bit values, 16 of bf16), so the write works in
units of one tile of one block: the rows of [block, tile] that this step's tokens fill. A unit
whose tokens fill only some rows (a decode, the ends of a prefill chunk) first reads the tile
back and keeps its other rows. A request's new tokens are consecutive slots in blocks of its
own, so no two units of a step share a tile.
"""

from __future__ import annotations

from typing import Callable


import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tiling import tpu_sublanes

UNITS_PER_STEP = 8  # units per grid step: their tile reads, then writes, are in flight together


def max_write_units(num_tokens: int, num_reqs: int, tile_rows: int) -> int:
    """A request of q tokens touches at most ceil(q / tile_rows) + 1 tiles."""
    bound = min(num_tokens, num_tokens // tile_rows + 2 * num_reqs)
    return -(-max(bound, 1) // UNITS_PER_STEP) * UNITS_PER_STEP


def _kernel(
    layer_ref,  # i32[1]   SMEM
    num_units_ref,  # i32[1]   SMEM
    tile_ref,  # i32[U]   SMEM  global tile index: slot // tile_rows
    lo_ref,  # i32[U]   SMEM  first row of the tile this step writes
    hi_ref,  # i32[U]   SMEM  one past the last
    k_new,  # [C, H, G, D]  VMEM  the new rows, at their rows in the tile
    v_new,  # [C, H, G, D]  VMEM
    k_in,  # [L, H, NB, BS, D]  HBM, aliased to k_out
    v_in,  # [L, H, NB, BS, D]  HBM, aliased to v_out
    k_out,  # [L, H, NB, BS, D]  HBM
    v_out,  # [L, H, NB, BS, D]  HBM
    k_buf,  # [C, H, G, D]  VMEM
    v_buf,  # [C, H, G, D]  VMEM
    sems,  # DMA semaphores [2, 2]  (read/write, k/v)
):
    del k_in, v_in  # the same buffers as k_out / v_out
    C, H, G, D = k_buf.shape
    tiles_per_block = k_out.shape[3] // G
    layer = layer_ref[0]
    first = pl.program_id(0) * C

    def copies(c: jax.Array, to_cache: bool) -> list[pltpu.AsyncCopyDescriptor]:
        tile = tile_ref[first + c]
        block = tile // tiles_per_block
        row = pl.multiple_of((tile % tiles_per_block) * G, G)
        out = []
        for kv, (cache, buf) in enumerate(((k_out, k_buf), (v_out, v_buf))):
            for h in range(H):
                page = cache.at[layer, h, block, pl.ds(row, G)]
                src, dst = (buf.at[c, h], page) if to_cache else (page, buf.at[c, h])
                out.append(pltpu.make_async_copy(src, dst, sems.at[int(to_cache), kv]))
        return out

    def live(c: jax.Array) -> jax.Array:
        return first + c < num_units_ref[0]

    def partial(c: jax.Array) -> jax.Array:  # the tile keeps rows this step does not write
        return live(c) & ((lo_ref[first + c] > 0) | (hi_ref[first + c] < G))

    def each_unit(when: Callable[[jax.Array], jax.Array], to_cache: bool, wait: bool) -> None:
        def body(c: jax.Array, carry: None) -> None:
            for cp in copies(c, to_cache):
                pl.when(when(c))(cp.wait if wait else cp.start)
        jax.lax.fori_loop(0, C, body, None)

    each_unit(partial, to_cache=False, wait=False)
    each_unit(partial, to_cache=False, wait=True)
    rows = jax.lax.broadcasted_iota(jnp.int32, (H, G, D), 1)

    def merge(c: jax.Array, carry: None) -> None:
        new = (rows >= lo_ref[first + c]) & (rows < hi_ref[first + c])
        k_buf[c] = jnp.where(new, k_new[c], k_buf[c])
        v_buf[c] = jnp.where(new, v_new[c], v_buf[c])

    jax.lax.fori_loop(0, C, merge, None)
    each_unit(live, to_cache=True, wait=False)
    each_unit(live, to_cache=True, wait=True)


def write_units(slot_mapping: jax.Array, num_tokens: jax.Array, tile_rows: int,
                max_units: int) -> tuple[jax.Array, ...]:
    """Group the step's tokens by the cache tile they land in (tokens of one tile are
    consecutive). Returns (num_units i32[], tile i32[U], lo i32[U], hi i32[U], src i32[U, G]):
    src is the token whose row goes to each row of the unit's tile, or -1."""
    T = slot_mapping.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    valid = t < num_tokens
    tile = slot_mapping // tile_rows
    first = valid & ((t == 0) | (tile != jnp.roll(tile, 1)))
    unit_id = jnp.cumsum(first.astype(jnp.int32)) - 1
    drop = max_units  # index past the end: the scatter drops it
    first_token = jnp.zeros(max_units, jnp.int32).at[jnp.where(first, unit_id, drop)].set(
        t, mode="drop")
    count = jnp.zeros(max_units, jnp.int32).at[jnp.where(valid, unit_id, drop)].add(
        1, mode="drop")
    lo = slot_mapping[first_token] % tile_rows
    hi = lo + count
    g = jnp.arange(tile_rows, dtype=jnp.int32)
    src = first_token[:, None] + g - lo[:, None]
    src = jnp.where((g >= lo[:, None]) & (g < hi[:, None]), src, -1)
    return jnp.sum(first, dtype=jnp.int32), tile[first_token], lo, hi, src


def write_kv(
    k_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    v_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    layer: int | jax.Array,  # i32[]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T]  block_id * block_size + offset
    query_start_loc: jax.Array,  # i32[R + 1]  tokens from query_start_loc[R] on are padding
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Same result as xla_attention.write_kv for the step's tokens (padding tokens write nothing).
    Donate the caches to the enclosing jit so the update happens in place."""
    T, H, D = k.shape
    BS = k_cache.shape[3]
    G = tpu_sublanes(k_cache.dtype)
    if BS % G:
        raise ValueError(f"block_size={BS} must be a multiple of {G} for the TPU KV write")
    U = max_write_units(T, query_start_loc.shape[0] - 1, G)
    num_units, tile, lo, hi, src = write_units(slot_mapping, query_start_loc[-1], G, U)

    def by_tile(x: jax.Array) -> jax.Array:  # [T, H, D] -> [U, H, G, D]
        rows = jnp.where(src[..., None, None] >= 0, x[jnp.maximum(src, 0)], 0)
        return rows.astype(k_cache.dtype).transpose(0, 2, 1, 3)

    C = UNITS_PER_STEP
    new_spec = pl.BlockSpec((C, H, G, D), lambda i, *_: (i, 0, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        _kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(U // C,),
            in_specs=[new_spec, new_spec, hbm, hbm],
            out_specs=[hbm, hbm],
            scratch_shapes=[pltpu.VMEM((C, H, G, D), k_cache.dtype),
                            pltpu.VMEM((C, H, G, D), v_cache.dtype),
                            pltpu.SemaphoreType.DMA((2, 2))],
        ),
        out_shape=[jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        input_output_aliases={7: 0, 8: 1},  # operands count the 5 scalar-prefetch arrays
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="kv_write_tpu",
    )(jnp.asarray(layer, jnp.int32).reshape(1), num_units.reshape(1), tile, lo, hi,
      by_tile(k), by_tile(v), k_cache, v_cache)
