"""The native CPU kernel's FFI entry (jaxserve/kernels/cpu/paged_attention.cc), called directly:
every mis-shaped buffer is refused with an error naming it, before the kernel indexes anything
by the wrong dims, and bad metadata in well-shaped buffers reads and writes within them.
test_cpu_native_sanitized.py runs these under AddressSanitizer too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import oracle
from jaxserve.kernels.cpu import native as cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(),
                                reason="the native CPU kernels did not build")

T, HQ, D, L, HKV, NB, BS, R, P = 6, 4, 16, 2, 2, 8, 8, 3, 4


def well_shaped() -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {
        "q": jnp.asarray(rng.standard_normal((T, HQ, D)), jnp.float32),
        "k_cache": jnp.asarray(rng.standard_normal((L, HKV, NB, BS, D)), jnp.float32),
        "v_cache": jnp.asarray(rng.standard_normal((L, HKV, NB, BS, D)), jnp.float32),
        "layer": jnp.int32(1),
        "seq_lens": jnp.asarray([5, 9, 3], jnp.int32),
        "block_tables": jnp.asarray(rng.integers(0, NB, (R, P)), jnp.int32),
        "query_start_loc": jnp.asarray([0, 1, 3, 5], jnp.int32),
    }


def call(args: dict[str, jax.Array], out_shape: tuple[int, ...] | None = None,
         window: int = 0) -> jax.Array:
    target = jax.ffi.ffi_call("jaxserve_cpu_paged_attention",
                              jax.ShapeDtypeStruct(out_shape or args["q"].shape, jnp.float32))
    return target(*args.values(), sm_scale=np.float32(D ** -0.5), soft_cap=np.float32(0.0),
                  window=np.int64(window))


MIS_SHAPES = {  # buffer -> (its replacement, what the error names)
    "q_rank": ("q", jnp.zeros((T, HQ * D)), "q must be"),
    "k_cache_rank": ("k_cache", jnp.zeros((HKV, NB, BS, D)), "k_cache must be"),
    "k_cache_head_dim": ("k_cache", jnp.zeros((L, HKV, NB, BS, D // 2)), "k_cache must be"),
    "k_cache_no_blocks": ("k_cache", jnp.zeros((L, HKV, 0, BS, D)), "k_cache must be"),
    "kv_heads_not_dividing": ("k_cache", jnp.zeros((L, 3, NB, BS, D)), "q's heads"),
    "v_cache_shape": ("v_cache", jnp.zeros((L, HKV, NB - 1, BS, D)), "v_cache must"),
    "v_cache_dtype": ("v_cache", jnp.zeros((L, HKV, NB, BS, D), jnp.bfloat16), "v_cache must"),
    "layer_not_one_index": ("layer", jnp.zeros((2,), jnp.int32), "layer must"),
    "block_tables_rank": ("block_tables", jnp.zeros((R * P,), jnp.int32), "block_tables must"),
    "seq_lens_too_short": ("seq_lens", jnp.zeros((R - 1,), jnp.int32), "seq_lens must"),
    "query_start_loc_too_short": ("query_start_loc", jnp.zeros((R,), jnp.int32),
                                  "query_start_loc must"),
}


@pytest.mark.parametrize("case", list(MIS_SHAPES))
def test_a_mis_shaped_buffer_is_refused_with_its_name(case):
    name, value, message = MIS_SHAPES[case]
    args = well_shaped() | {name: value}
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"paged attention: {message}"):
        call(args).block_until_ready()


def test_an_output_not_of_q_shape_is_refused():
    with pytest.raises(jax.errors.JaxRuntimeError, match="paged attention: out must"):
        call(well_shaped(), out_shape=(T + 1, HQ, D)).block_until_ready()


def test_caches_of_another_dtype_are_refused():
    caches = {name: jnp.zeros((L, HKV, NB, BS, D), jnp.float16) for name in ("k_cache",
                                                                           "v_cache")}
    with pytest.raises(jax.errors.JaxRuntimeError, match="must be f32 or bf16"):
        call(well_shaped() | caches).block_until_ready()


def test_metadata_of_another_dtype_is_refused_by_the_binding():
    args = well_shaped() | {"seq_lens": jnp.zeros((R,), jnp.float32)}
    with pytest.raises(jax.errors.JaxRuntimeError, match="(?i)dtype"):
        call(args).block_until_ready()


def test_bad_metadata_reads_and_writes_within_the_buffers():
    """Request 0's KV ends past its block table (its window sees none of the table), request 1's
    length is negative, request 3's rows run past q and its block ids outside the cache: the
    rows that see nothing are zero, and the well-formed request 2 beside them matches the
    oracle."""
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [6, 2, 0, 0], [NB + 5, -3, 1, 2]]
    args = well_shaped() | {
        "seq_lens": jnp.asarray([1000, -50, 9, 40], jnp.int32),
        "block_tables": jnp.asarray(tables, jnp.int32),
        "query_start_loc": jnp.asarray([0, 1, 3, 5, T + 4], jnp.int32),
    }
    out = np.asarray(call(args, window=10))
    assert np.all(out[:3] == 0) and np.all(np.isfinite(out))
    alone = {name: np.asarray(value) for name, value in args.items()} | {
        "q": np.asarray(args["q"])[3:5], "seq_lens": np.asarray([9], np.int32),
        "block_tables": np.asarray(tables[2:3], np.int32),
        "query_start_loc": np.asarray([0, 2], np.int32)}
    ref = oracle.ragged_paged_attention(
        alone["q"], alone["k_cache"], alone["v_cache"], 1, alone["seq_lens"],
        alone["block_tables"], alone["query_start_loc"], sm_scale=D ** -0.5, sliding_window=10,
        soft_cap=None)
    np.testing.assert_allclose(out[3:5], ref, atol=2e-5, rtol=0)
