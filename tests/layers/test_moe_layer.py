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


def test_the_hopper_kernel_is_modelled_a_read_and_a_row_tile_per_expert_and_tile():
    """The Hopper kernel (`m64`, its operands group sizes, rows, experts): 1024 rows over 128
    experts touch at most 128 experts and span 16 row tiles, so at most 144 (tile, expert)
    pairs, each reading its expert once and running 64 rows; 16 rows: at most 16 + 1."""
    def call(rows: int) -> list[tuple[tuple[int, ...], int]]:
        return [((128,), 4), ((rows, 2048), 2), ((128, 2048, 768), 2)]

    name = f"{EXPERTS_SCOPE}_e128_n128_m64"
    many, few = (hbm_traffic(name, call(rows), RaggedBatch((1,), (1,))) for rows in (1024, 16))
    assert many.manual_operands == (2,)
    assert many.weights == 144 * 2048 * 768 * 2 and few.weights == 17 * 2048 * 768 * 2
    assert many.flops == 2 * 144 * 64 * 2048 * 768


class _Device:
    def __init__(self, platform: str, compute_capability: str | None = None) -> None:
        self.platform, self.compute_capability = platform, compute_capability


def test_each_device_runs_a_mixtures_grouped_matmuls_in_its_own_kernel():
    from jaxserve.models.llama_config import LlamaConfig
    from jaxserve.models.moe import MoeConfig
    from jaxserve.placement.sharding import with_device_kernels

    moe = MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_layers=2,
                    num_heads=2, num_kv_heads=2, head_dim=64, num_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=128,
                    architecture="MixtralForCausalLM")
    kernels = {device: with_device_kernels(moe, _Device(*device)).grouped_matmul
               for device in (("gpu", "9.0"), ("gpu", "8.0"), ("gpu", "10.0"), ("tpu",),
                              ("cpu",))}
    assert kernels == {("gpu", "9.0"): "hopper", ("gpu", "8.0"): "ragged_dot",
                       ("gpu", "10.0"): "ragged_dot", ("tpu",): "ragged_dot",
                       ("cpu",): "row_tiles"}
    dense = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=128, num_layers=2,
                        num_heads=2, num_kv_heads=2, head_dim=64)
    assert with_device_kernels(dense, _Device("gpu", "9.0")) is dense


@pytest.mark.parametrize("rows", [1, 12, 300])
def test_row_tiles_equal_the_ragged_dot_from_a_stack_and_with_experts_held_elsewhere(rows):
    """The CPU's loop over (row tile, expert) pairs: 16-row tiles (and 64-row past 256 rows),
    groups of a stack's other layers empty, pairs of experts another device holds left out
    (zero), and groups that tiles straddle."""
    x, router, gate, up, down = weights(3)
    x = np.resize(x, (rows, D))
    for first in (0, 2):
        want = moe_mlp(x, router, gate[:, :4], up[:, :4], down[:, :4], K, True, 2, first)
        got = jax.jit(moe_mlp, static_argnums=(5, 6, 9))(
            x, router, gate[:, :4], up[:, :4], down[:, :4], K, True, jnp.int32(2), first,
            "row_tiles")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert np.abs(np.asarray(got)).max() > 0


def test_weights_off_the_hopper_kernels_tiles_take_the_ragged_dot():
    """float32 experts, a stack of layers (scanned layers) or widths the tiles do not divide
    run XLA's ragged dot even where the device has the kernel: the same answer as without."""
    x, router, gate, up, down = weights(2)
    want = moe_mlp(x, router, gate, up, down, K, True, 1)
    np.testing.assert_array_equal(
        moe_mlp(x, router, gate, up, down, K, True, 1, kernel="hopper"), want)
    np.testing.assert_array_equal(
        moe_mlp(x, router, gate[1], up[1], down[1], K, True, kernel="hopper"),
        moe_mlp(x, router, gate[1], up[1], down[1], K, True))
    with pytest.raises(ValueError, match="grouped matmul must be one of"):
        moe_mlp(x, router, gate[1], up[1], down[1], K, True, kernel=True)
