import pytest

from jaxserve.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks: object) -> list[int]:
    return [b.block_id for b in blocks]  # type: ignore[attr-defined]


def make_queue(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def test_queue_starts_in_block_id_order() -> None:
    _, q = make_queue(5)
    assert ids(q) == [0, 1, 2, 3, 4] and len(q) == 5


def test_queue_popleft_and_popleft_n_take_from_head() -> None:
    _, q = make_queue(5)
    assert q.popleft().block_id == 0
    assert ids(q.popleft_n(3)) == [1, 2, 3]
    assert ids(q) == [4] and q.num_free_blocks == 1
    assert q.popleft_n(0) == []


def test_queue_remove_from_middle_and_ends() -> None:
    blocks, q = make_queue(5)
    q.remove(blocks[2])
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert ids(q) == [1, 3] and len(q) == 2
    assert blocks[2].prev_free is None and blocks[2].next_free is None


def test_queue_append_and_prepend_n_keep_order() -> None:
    blocks, q = make_queue(6)
    taken = q.popleft_n(4)
    q.append(taken[0])
    q.prepend_n([taken[2], taken[3]])
    q.append_n([taken[1]])
    assert ids(q) == [2, 3, 4, 5, 0, 1] and len(q) == 6


def test_queue_rejects_misuse() -> None:
    blocks, q = make_queue(2)
    with pytest.raises(ValueError, match="already in the free_block_queue"):
        q.append(blocks[0])
    q.popleft_n(2)
    with pytest.raises(ValueError, match="not in the free_block_queue"):
        q.remove(blocks[0])
    with pytest.raises(ValueError, match="empty"):
        q.popleft()
    with pytest.raises(ValueError, match="cannot pop 1"):
        q.popleft_n(1)


def test_pool_reserves_block_zero_as_null() -> None:
    pool = BlockPool(4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 3
    assert 0 not in ids(pool.get_new_blocks(3))


@pytest.mark.parametrize("bad", [1, 0, -3, 2.0, True])
def test_pool_rejects_bad_num_blocks(bad: object) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(bad)  # type: ignore[arg-type]


def test_get_new_blocks_sets_ref_and_raises_when_short() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    assert [b.ref_cnt for b in blocks] == [1, 1] and ids(blocks) == [1, 2]
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.get_num_free_blocks() == 1


def test_cache_block_and_lookup() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, b"h" * 32)
    assert pool.get_cached_block(b"h" * 32) is a and a.block_hash == b"h" * 32
    # A second copy of the same hash stays unhashed; the first keeps the entry.
    assert not pool.cache_block(b, b"h" * 32)
    assert b.block_hash is None and pool.get_cached_block(b"h" * 32) is a
    with pytest.raises(ValueError, match="already cached"):
        pool.cache_block(a, b"g" * 32)


def test_cache_block_requires_a_held_block() -> None:
    pool = BlockPool(3)
    with pytest.raises(ValueError, match="not held"):
        pool.cache_block(pool.blocks[1], b"h" * 32)
    with pytest.raises(ValueError, match="not held"):
        pool.cache_block(pool.null_block, b"h" * 32)


def test_free_puts_unhashed_at_head_and_hashed_at_tail_in_given_order() -> None:
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(4)  # ids 1..4; 5, 6, 7 stay free
    pool.cache_block(blocks[0], b"a" * 32)
    pool.cache_block(blocks[1], b"b" * 32)
    pool.free_blocks(reversed(blocks))  # tail of the chain first
    assert ids(pool.free_block_queue) == [4, 3, 5, 6, 7, 2, 1]
    assert all(b.ref_cnt == 0 for b in blocks)


def test_allocation_lazily_evicts_hash_of_reused_block() -> None:
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"a" * 32)
    pool.free_blocks([a, b])
    # Freed but still cached: hittable until reused.
    assert pool.get_cached_block(b"a" * 32) is a
    assert ids(pool.get_new_blocks(1)) == [b.block_id]  # unhashed one goes first
    assert pool.get_cached_block(b"a" * 32) is a
    assert pool.get_new_blocks(1) == [a]
    assert pool.get_cached_block(b"a" * 32) is None and a.block_hash is None


def test_touch_takes_free_block_out_of_queue_and_shares_held_one() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"a" * 32)
    pool.free_blocks([a])
    assert a in list(pool.free_block_queue)
    pool.touch([a, b])
    assert a.ref_cnt == 1 and b.ref_cnt == 2
    assert a not in list(pool.free_block_queue) and pool.get_num_free_blocks() == 1


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([a])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([b, a])
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([pool.null_block])


def test_reset_prefix_cache_only_when_nothing_is_held() -> None:
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"a" * 32)
    pool.free_blocks([a])
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(b"a" * 32) is a
    pool.free_blocks([b])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(b"a" * 32) is None and a.block_hash is None
    assert pool.get_num_free_blocks() == 3


def test_usage_counts_usable_blocks_only() -> None:
    pool = BlockPool(5)
    assert pool.get_usage() == 0.0
    pool.get_new_blocks(1)
    assert pool.get_usage() == 0.25
    pool.get_new_blocks(3)
    assert pool.get_usage() == 1.0
