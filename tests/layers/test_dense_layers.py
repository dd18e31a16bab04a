"""The shared dense layers against float64 numpy written from their definitions."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.layers.mlp import gated_mlp
from jaxserve.layers.norm import rms_norm


def test_rms_norm_scales_each_row_by_its_root_mean_square():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 3, 16)), rng.standard_normal(16)
    want = w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    got = rms_norm(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), 1e-6)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_gated_mlp_is_down_of_silu_gate_times_up():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, 16))
    gate, up, down = (rng.standard_normal(s) * 0.3 for s in ((16, 32), (16, 32), (32, 16)))
    g = x @ gate
    want = (g / (1 + np.exp(-g)) * (x @ up)) @ down
    got = gated_mlp(*(jnp.asarray(a, jnp.float32) for a in (x, gate, up, down)), None)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
