"""The mixture-of-experts MLP against a per-token numpy reference, whole, from a stack of
layers, and split over experts as expert parallelism splits it; and its cost-model reading."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.kernels.traffic import RaggedBatch
from jaxserve.layers.moe import EXPERTS_SCOPE, hbm_traffic, moe_mlp

T, D, F, E, K, L = 12, 16, 8, 6, 2, 3


def weights(seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((T, D), np.float32), rng.standard_normal((D, E), np.float32),
            *(0.3 * rng.standard_normal(s, np.float32) for s in ((L, E, D, F), (L, E, D, F),
                                                                   (L, E, F, D))))


def reference(x, router, gate, up, down, normalize: bool) -> np.ndarray:
    """Token by token: softmax, top k, renormalised or not, each expert's gated MLP weighted."""
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(T):
        top = np.argsort(-probs[t], kind="stable")[:K]
        w = probs[t, top] / (probs[t, top].sum() if normalize else 1.0)
        for e, we in zip(top, w):
            h = x[t] @ gate[e]
            out[t] += we * ((h / (1 + np.exp(-h)) * (x[t] @ up[e])) @ down[e])
    return out


@pytest.mark.parametrize("normalize", [True, False])
def test_moe_mlp_matches_the_per_token_reference(normalize):
    x, router, gate, up, down = weights(0)
    for layer in range(L):
        want = reference(x, router, gate[layer], up[layer], down[layer], normalize)
        one = moe_mlp(x, router, gate[layer], up[layer], down[layer], K, normalize)
        stacked = jax.jit(moe_mlp, static_argnums=(5, 6))(
            x, router, gate, up, down, K, normalize, jnp.int32(layer))
        np.testing.assert_allclose(one, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(stacked, want, rtol=1e-5, atol=1e-5)


def test_devices_holding_a_share_of_the_experts_each_add_their_part():
    """Expert parallelism's parts: experts [2i, 2i + 2) on device i; their sum is the whole."""
    x, router, gate, up, down = weights(1)
    want = reference(x, router, gate[1], up[1], down[1], True)
    parts = [moe_mlp(x, router, gate[:, i:i + 2], up[:, i:i + 2], down[:, i:i + 2], K, True,
                     1, first_expert=i) for i in range(0, E, 2)]
    assert all(np.abs(p).max() > 0 for p in parts)
    np.testing.assert_allclose(sum(parts), want, rtol=1e-5, atol=1e-5)


def test_the_cost_model_reads_the_experts_routed_to_once():
    """A grouped matmul of 40 rows over a stack of 3 layers x 32 local experts (of 128): the
    layer's 32 experts' weights once (all touched), a quarter of the rows' work; 16 rows touch
    at most 16 experts."""
    def call(rows: int) -> list[tuple[tuple[int, ...], int]]:
        return [((1,), 4), ((97,), 4), ((rows, 2048), 2), ((3 * 32, 2048, 768), 2)]

    name = f"{EXPERTS_SCOPE}_e32_n128"
    many, few = (hbm_traffic(name, call(rows), RaggedBatch((1,), (1,))) for rows in (40, 16))
    assert many.manual_operands == (3,)
    assert many.weights == 32 * 2048 * 768 * 2 and few.weights == 16 * 2048 * 768 * 2
    assert many.flops == 2 * 10 * 2048 * 768
