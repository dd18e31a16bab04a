"""Moving whole KV blocks between meshes of different TP sizes (8 forced CPU devices)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.placement.kv_blocks import (block_buckets, gather_blocks, layout_heads,
                                          pad_blocks, padded_block_ids, scatter_blocks,
                                          transfer_heads)
from jaxserve.placement.sharding import kv_cache_sharding

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (forced) CPU devices")
L, NB, BS, D = 2, 12, 4, 8


def _mesh(devices: list) -> Mesh:
    return Mesh(np.array(devices).reshape(1, len(devices)), ("data", "model"))


def _cache_in_layout(original: np.ndarray, tp: int) -> np.ndarray:
    """The cache an engine with this TP holds: heads duplicated when TP exceeds them."""
    heads = original.shape[1]
    return np.repeat(original, layout_heads(heads, tp) // heads, axis=1)


@pytest.mark.parametrize("heads,src,dst,expected", [
    (2, 4, 2, (0, 2)), (2, 1, 8, (0, 0, 0, 0, 1, 1, 1, 1)), (2, 4, 4, (0, 0, 2, 2)),
    (4, 2, 1, (0, 1, 2, 3)), (2, 8, 4, (0, 0, 4, 4)),
])
def test_transfer_heads_pick_a_copy_of_the_same_original_head(heads, src, dst, expected):
    assert transfer_heads(heads, src, dst) == expected


def test_block_ids_are_padded_to_a_power_of_two_bucket_with_the_null_block():
    buckets = block_buckets(8)
    assert buckets == [1, 2, 4, 8]
    assert padded_block_ids([5, 6, 7], buckets).tolist() == [5, 6, 7, 0]
    with pytest.raises(ValueError, match="block count 9"):
        padded_block_ids(list(range(1, 10)), buckets)
    assert pad_blocks(np.ones((1, 1, 3, 1, 1)), 4)[0, 0, :, 0, 0].tolist() == [1, 1, 1, 0]


@pytest.mark.parametrize("src_tp,dst_tp", [(4, 2), (2, 4), (1, 2)])
def test_blocks_move_between_tp_layouts_into_other_block_ids(src_tp, dst_tp):
    rng = np.random.default_rng(src_tp * 10 + dst_tp)
    original_k = rng.standard_normal((L, 2, NB, BS, D)).astype(np.float32)
    original_v = rng.standard_normal((L, 2, NB, BS, D)).astype(np.float32)
    devices = jax.devices()
    src_mesh, dst_mesh = _mesh(devices[:src_tp]), _mesh(devices[4:4 + dst_tp])
    src_k, src_v = (jax.device_put(_cache_in_layout(x, src_tp), kv_cache_sharding(src_mesh))
                    for x in (original_k, original_v))
    dst_shape = (L, layout_heads(2, dst_tp), NB, BS, D)
    dst_k, dst_v = (jax.device_put(np.zeros(dst_shape, np.float32),
                                   kv_cache_sharding(dst_mesh)) for _ in range(2))
    src_ids, dst_ids = [3, 7, 1], [2, 9, 5]
    buckets = block_buckets(NB)
    heads = transfer_heads(2, src_tp, dst_tp)
    k, v = gather_blocks(src_k, src_v, padded_block_ids(src_ids, buckets), heads,
                         NamedSharding(src_mesh, P()))
    dst_k, dst_v = scatter_blocks(dst_k, dst_v, padded_block_ids(dst_ids, buckets), k, v)
    assert dst_k.sharding == kv_cache_sharding(dst_mesh)
    want_k = _cache_in_layout(original_k, dst_tp)
    got_k, got_v = np.asarray(dst_k), np.asarray(dst_v)
    np.testing.assert_array_equal(got_k[:, :, dst_ids], want_k[:, :, src_ids])
    np.testing.assert_array_equal(got_v[:, :, dst_ids],
                                  _cache_in_layout(original_v, dst_tp)[:, :, src_ids])
    untouched = [b for b in range(1, NB) if b not in dst_ids]  # block 0 takes the padding
    assert not got_k[:, :, untouched].any()


def test_a_dispatched_copy_is_not_changed_by_a_later_donated_overwrite():
    """Why the prefill side may free a request's blocks right after dispatching their copy."""
    mesh = _mesh(jax.devices()[:4])
    sharding = kv_cache_sharding(mesh)
    host = np.random.default_rng(0).standard_normal((L, 4, NB, BS, D)).astype(np.float32)
    k_cache, v_cache = jax.device_put(host, sharding), jax.device_put(-host, sharding)
    ids = padded_block_ids([4, 5], block_buckets(NB))
    k, v = gather_blocks(k_cache, v_cache, ids, (0, 1, 2, 3), sharding)
    junk = np.full((L, 4, 2, BS, D), 7.0, np.float32)
    k_cache, v_cache = scatter_blocks(k_cache, v_cache, ids, junk, junk)  # donates the caches
    np.testing.assert_array_equal(np.asarray(k), host[:, :, [4, 5]])
    np.testing.assert_array_equal(np.asarray(v), -host[:, :, [4, 5]])
    assert (np.asarray(k_cache)[:, :, [4, 5]] == 7.0).all()
