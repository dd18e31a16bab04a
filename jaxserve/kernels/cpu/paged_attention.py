"""Ragged paged attention on CPU as a native kernel (paged_attention.cc), called through
the XLA FFI: every request's rows (decodes, drafts, prefill chunks), each (request, KV head)'s
pages read once from the paged cache for a tile of its rows. The `cpu` attention backend.

It is built by cpu/native.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.kernels.cpu.native import available


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [L, Hkv, NB, BS, D]  f32 or bf16
    v_cache: jax.Array,  # [L, Hkv, NB, BS, D]
    layer: int | jax.Array,
    seq_lens: jax.Array,  # i32[R]
    block_tables: jax.Array,  # i32[R, P]
    query_start_loc: jax.Array,  # i32[R + 1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # [T, Hq, D]  padding rows zero
    if not available():
        raise RuntimeError("the native CPU kernels did not build here (see the log)")
    call = jax.ffi.ffi_call("jaxserve_cpu_paged_attention",
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), k_cache, v_cache, jnp.asarray(layer, jnp.int32),
               seq_lens, block_tables, query_start_loc,
               sm_scale=np.float32(sm_scale), soft_cap=np.float32(soft_cap or 0.0),
               window=np.int64(sliding_window or 0))
    return out.astype(q.dtype)
