"""The native CPU matmul (pallas_kernels/cpu_matmul.cc) against numpy, and the rule that
picks it (layers/dense.py). Model-level: tests/models/test_model_vs_hf.py and every CPU engine
test, whose default backend runs it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxserve.layers.dense import concat_columns, pack, uses_native_matmul
from pallas_kernels import cpu_matmul

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason="no C++ compiler here")


@functools.partial(jax.jit, static_argnums=2)
def _matmul(x: jax.Array, w: jax.Array, columns: int) -> jax.Array:
    return cpu_matmul.matmul(x, w, columns)


def _check(m: int, k: int, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    got = np.asarray(_matmul(jnp.asarray(x), jnp.asarray(pack(w)), n))
    expected = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.sqrt(k))


# Rows around the 8-row tile and 64-row block, columns around the 32-column panel
@pytest.mark.parametrize("m", [1, 5, 8, 9, 64, 65, 130])
@pytest.mark.parametrize("k,n", [(512, 1408), (64, 172), (7, 32), (33, 1)])
def test_matches_numpy(m, k, n):
    _check(m, k, n)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 80), st.integers(1, 300), st.integers(1, 200), st.integers(0, 2**16))
def test_matches_numpy_on_any_shape(m, k, n, seed):
    _check(m, k, n, seed)


def test_a_row_does_not_depend_on_the_rest_of_the_batch():
    """One in-order sum per output: a request's logits are the same at any batch size."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((37, 256)).astype(np.float32))
    w = jnp.asarray(pack(rng.standard_normal((256, 96)).astype(np.float32)))
    whole = np.asarray(_matmul(x, w, 96))
    for rows in (slice(0, 1), slice(3, 8), slice(20, 37)):
        assert np.array_equal(np.asarray(_matmul(x[rows], w, 96)), whole[rows])


def test_weights_fused_side_by_side_give_each_part_its_own_result():
    """The model fuses q/k/v and gate/up (layers/dense.py FUSED_DENSE): each part's columns,
    sliced from the fused product, equal that part's own product bit for bit, widths that do
    not fill a panel included."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((13, 96)).astype(np.float32))
    parts = [rng.standard_normal((96, n)).astype(np.float32) for n in (40, 24, 57)]
    fused = np.asarray(_matmul(x, jnp.asarray(pack(concat_columns(parts))), 121))
    for part, start in zip(parts, (0, 40, 64)):
        alone = np.asarray(_matmul(x, jnp.asarray(pack(part)), part.shape[1]))
        assert np.array_equal(fused[:, start:start + part.shape[1]], alone)


def test_fewer_columns_than_the_panels_hold_are_the_first_ones():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 16)).astype(np.float32)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    got = np.asarray(_matmul(jnp.asarray(x), jnp.asarray(pack(w)), 40))
    np.testing.assert_allclose(got, (x @ w)[:, :40], rtol=1e-5, atol=1e-5)


def test_pack_keeps_leading_axes_and_zero_pads_the_last_panel():
    w = np.arange(2 * 3 * 40, dtype=np.float32).reshape(2, 3, 40)
    packed = pack(w)
    assert packed.shape == (2, 2, 3, 32)
    np.testing.assert_array_equal(packed[1, 0], w[1, :, :32])
    np.testing.assert_array_equal(packed[1, 1, :, :8], w[1, :, 32:])
    assert not packed[:, 1, :, 8:].any()


def test_a_packed_weight_stays_on_its_device():
    device = jax.devices()[-1]
    packed = pack(jax.device_put(np.ones((8, 32), np.float32), device))
    assert packed.devices() == {device}


def test_wrong_shapes_are_an_error_not_a_crash():
    x = jnp.ones((4, 16), jnp.float32)
    with pytest.raises(Exception, match="matmul: x \\[M, K\\], w \\[P, K, 32\\]"):
        _matmul(x, jnp.ones((2, 8, 32), jnp.float32), 64)  # K differs
    with pytest.raises(Exception, match="matmul: x \\[M, K\\]"):
        _matmul(x, jnp.ones((1, 16, 32), jnp.float32), 33)  # more columns than one panel


def test_the_cpu_backend_uses_it_on_one_device_in_float32_only():
    assert uses_native_matmul("cpu", 1, jnp.float32)
    assert not uses_native_matmul("cpu", 2, jnp.float32)  # tensor parallel: XLA's dots
    assert not uses_native_matmul("cpu", 1, jnp.bfloat16)
    assert not uses_native_matmul("xla", 1, jnp.float32)
