"""The TPU's in-place KV write (interpret mode) stores exactly what the reference scatter does.

Hypothesis draws ragged steps: requests of 1..40 new tokens starting anywhere in a block (tile
rows before the start must be kept), several requests per step, padding tokens after them. The
shapes are fixed so the kernel compiles once per dtype."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import kv_write_tpu
from pallas_kernels.kv_write_tpu import max_write_units, write_units
from pallas_kernels.xla_attention import write_kv

L, H, NB, BS, D = 2, 2, 24, 32, 128
T, R = 96, 6


@functools.cache
def _kernel():  # noqa: ANN202
    return jax.jit(functools.partial(kv_write_tpu, interpret=True))


def _step(draw_lens: list[int], starts: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
    """Slots of requests with these new-token counts, each in blocks of its own."""
    slots, next_block = [], 1
    for q, start in zip(draw_lens, starts):
        first = next_block * BS + start
        slots.extend(range(first, first + q))
        next_block += -(-(start + q) // BS)
    n = len(slots)
    qsl = np.concatenate([[0], np.cumsum(draw_lens), [n] * (R - len(draw_lens))])
    return np.pad(np.asarray(slots, np.int32), (0, T - n)), qsl.astype(np.int32), n


requests = st.lists(st.tuples(st.integers(1, 40), st.integers(0, BS - 1)), min_size=0,
                    max_size=R).filter(lambda rs: sum(q for q, _ in rs) <= T
                                       and sum(-(-(s + q) // BS) for q, s in rs) < NB)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests, seed=st.integers(0, 2**16))
def test_kernel_write_equals_the_reference_scatter(dtype, reqs, seed):
    rng = np.random.default_rng(seed)
    slots, qsl, n = _step([q for q, _ in reqs], [s for _, s in reqs])
    k_cache, v_cache = (jnp.asarray(rng.standard_normal((L, H, NB, BS, D)), dtype)
                        for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((T, H, D)), dtype) for _ in range(2))
    got = _kernel()(k_cache, v_cache, jnp.int32(1), k, v, jnp.asarray(slots), jnp.asarray(qsl))
    want = write_kv(k_cache, v_cache, 1, k[:n], v[:n], jnp.asarray(slots[:n]))
    for g, w in zip(got, want):
        assert np.array_equal(np.asarray(g), np.asarray(w))  # bit for bit, padding wrote nothing


def test_units_cover_each_token_once_in_tiles_of_its_own():
    slots, qsl, n = _step([1, 17, 3], [7, 5, 0])  # a decode, a chunk across 3 tiles, a prefill
    G = 8
    U = max_write_units(T, R, G)
    num_units, tile, lo, hi, src = (np.asarray(x) for x in write_units(
        jnp.asarray(slots), jnp.int32(n), G, U))
    assert num_units == 1 + 3 + 1
    assert list(tile[:num_units]) == sorted(set(slots[:n] // G))
    covered = sorted(int(t) for t in src[:num_units].ravel() if t >= 0)
    assert covered == list(range(n))  # every real token exactly once, no padding token
    assert list(hi[:num_units] - lo[:num_units]) == [1, 3, 8, 6, 3]
