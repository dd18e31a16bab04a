"""The `xla` backend (jaxserve/kernels/xla/attention.py) and the `cpu` backend's native kernel
(jaxserve/kernels/cpu/paged_attention.py) against the plain oracle (jaxserve/kernels/oracle.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels import oracle
from jaxserve.kernels.cpu import native as cpu_native
from jaxserve.kernels.cpu.paged_attention import ragged_paged_attention as native_attention
from jaxserve.kernels.xla.attention import ragged_paged_attention, write_kv

L, HKV, NB, BS, D, HQ = 2, 2, 96, 8, 16, 4


CASES = {
    "decode": ([1] * 6, [5, 17, 40, 1, 64, 33]),
    "one_long_prefill": ([60], [70]),
    "mixed": ([1, 1, 13, 1, 30, 2], [9, 30, 13, 50, 45, 2]),
    "chunks_and_padding_rows": ([7, 1, 20], [20, 8, 60]),
    # decodes verifying drafts, a whole 5-token prompt, and an 8-row chunk
    "verify": ([5, 1, 3, 5, 8, 2], [20, 9, 40, 5, 30, 2]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window,cap", [(None, None), (6, None), (None, 5.0)])
def test_xla_backend_matches_the_oracle(case, window, cap):
    check_against_oracle(case, window, cap, items_per_iter=8)


@pytest.mark.parametrize("items_per_iter", [1, 3])
@pytest.mark.parametrize("window", [None, 20])
def test_work_items_fold_into_tiles_in_any_grouping(items_per_iter, window):
    """Several chunks of one tile in one iteration, or one chunk per iteration, and windows
    that start a tile's work past its first chunk: all the same attention."""
    check_against_oracle("mixed", window, None, items_per_iter)
    check_against_oracle("one_long_prefill", window, None, items_per_iter)


@pytest.mark.parametrize("case", ["decode", "mixed"])
@pytest.mark.parametrize("window", [None, 20])
def test_decodes_fold_their_kv_chunks_in_any_number_of_iterations(case, window):
    """One page of every decode per iteration (the longest decode's pages all run), or all of
    its pages in one."""
    for chunk_bytes in (1, 1 << 30):
        check_against_oracle(case, window, None, 8, decode_chunk_bytes=chunk_bytes)


@pytest.mark.parametrize("decode_rows", [2, 5])
@pytest.mark.parametrize("window,cap", [(None, None), (6, None), (None, 5.0)])
def test_requests_of_up_to_decode_rows_rows_attend_as_decodes(decode_rows, window, cap):
    """The decode path takes requests of 1..decode_rows rows (a decode with its drafts), all
    rows of one request over its pages at once, each row with its own causal end; longer
    requests stay with the tiles. Chunked one page per iteration, or all pages at once; a step
    of single-row decodes only (the path without room for drafts)."""
    for case in ("verify", "mixed", "decode"):
        for chunk_bytes in (1, 1 << 30):
            check_against_oracle(case, window, cap, 8, decode_chunk_bytes=chunk_bytes,
                                 decode_rows=decode_rows)


@pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels did not build")
@pytest.mark.parametrize("window,cap", [(None, None), (6, None), (None, 5.0)])
def test_native_cpu_kernel_matches_the_oracle(window, cap):
    """The `cpu` backend: every request in the native kernel (decodes, decodes with drafts,
    prefill chunks, a 60-row prefill in two tiles of rows), padding rows zero."""
    for case in CASES:
        check_against_oracle(case, window, cap, 8, native=True)


def test_as_many_requests_as_rows_with_multi_row_requests():
    """Padding requests can make R equal T while some requests have several rows."""
    check_against_oracle("chunks_and_padding_rows", None, None, 8, pad_requests=28,
                         pad_rows=3)


def check_against_oracle(case, window, cap, items_per_iter, decode_chunk_bytes=1 << 20,
                         pad_requests=2, pad_rows=5, decode_rows=1, native=False):
    q_lens, kv_lens = CASES[case]
    rng = np.random.default_rng(0)
    k_cache = rng.standard_normal((L, HKV, NB, BS, D)).astype(np.float32)
    v_cache = rng.standard_normal((L, HKV, NB, BS, D)).astype(np.float32)
    P = 10
    tables = np.zeros((len(q_lens) + pad_requests, P), np.int32)  # empty padding requests
    blocks = iter(rng.permutation(np.arange(1, NB)))
    for r, kl in enumerate(kv_lens):
        tables[r, :-(-kl // BS)] = [next(blocks) for _ in range(-(-kl // BS))]
    T = sum(q_lens) + pad_rows  # padding rows past the real ones
    q = rng.standard_normal((T, HQ, D)).astype(np.float32)
    qsl = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * pad_requests]).astype(np.int32)
    seq_lens = np.array(kv_lens + [0] * pad_requests, np.int32)
    args = (jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache), 1,
            jnp.asarray(seq_lens), jnp.asarray(tables), jnp.asarray(qsl))
    kwargs = dict(sm_scale=D ** -0.5, sliding_window=window, soft_cap=cap)
    if native:
        out = native_attention(*args, **kwargs)
    else:
        out = ragged_paged_attention(*args, **kwargs, kv_chunk_tokens=16,
                                     items_per_iter=items_per_iter,
                                     decode_chunk_bytes=decode_chunk_bytes,
                                     decode_rows=decode_rows)
    out = np.asarray(out)
    ref = oracle.ragged_paged_attention(q, k_cache, v_cache, 1, seq_lens, tables, qsl,
                                        sm_scale=D ** -0.5, sliding_window=window, soft_cap=cap)
    n = sum(q_lens)
    np.testing.assert_allclose(out[:n], ref[:n], atol=2e-5, rtol=0)
    assert np.all(out[n:] == 0)  # padding rows: zeros, never NaN


def test_write_kv_scatters_each_token_to_its_slot_only():
    k_cache = jnp.zeros((L, HKV, NB, BS, D))
    k = jnp.ones((3, HKV, D)) * jnp.arange(1, 4)[:, None, None]
    slots = jnp.asarray([5 * BS + 3, 0, 7 * BS + 7], jnp.int32)
    k2, _ = write_kv(k_cache, k_cache, jnp.int32(1), k, k, slots)
    k2 = np.asarray(k2)
    assert np.all(k2[1, :, 5, 3] == 1) and np.all(k2[1, :, 7, 7] == 3)
    assert np.all(k2[0] == 0)  # other layers untouched
    assert np.count_nonzero(k2[1]) == 3 * HKV * D
