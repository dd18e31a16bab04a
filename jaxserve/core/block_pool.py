"""KV-cache blocks, the free_block_queue and the pool that hands blocks out and caches them.

Eviction is lazy: a freed block keeps its hash and stays hittable until allocation pops it from
the head of the free queue, and only then is its hash dropped from the map.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from jaxserve.core.block_hash import BlockHash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full, written and cached
    is_null: bool = False
    prev_free: KVCacheBlock | None = field(default=None, repr=False)  # free_block_queue links
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeKVCacheBlockQueue:
    """Doubly linked list threaded through the blocks: O(1) popleft, append, prepend and
    removal from the middle (a hit on a free cached block), with no per-node allocation.

    A block is in the queue exactly when both its links are set (sentinels sit at both ends).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next_free

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("popleft from an empty free_block_queue")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks, only {self.num_free_blocks} are free")
        out = []
        block = self._head.next_free
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        assert block is not None
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free_block_queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free, [block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        self._insert_after(self._tail.prev_free, blocks)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put `blocks` at the head, keeping their order (blocks[0] is popped first)."""
        self._insert_after(self._head, blocks)

    def _insert_after(self, anchor: KVCacheBlock | None, blocks: list[KVCacheBlock]) -> None:
        assert anchor is not None
        end = anchor.next_free
        prev = anchor
        for block in blocks:
            if block.prev_free is not None or block.next_free is not None:
                raise ValueError(f"block {block.block_id} is already in the free_block_queue")
            prev.next_free = block
            block.prev_free = prev
            prev = block
        prev.next_free = end
        assert end is not None
        end.prev_free = prev
        self.num_free_blocks += len(blocks)


class BlockPool:
    """All KV blocks of one cache, the free queue and the hash -> block map.

    Block 0 is the null block: reserved for padding writes, never handed out or freed.
    At most one block carries a given hash; a duplicate computed concurrently stays unhashed.
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2 (block 0 is the null block), "
                             f"got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable (non-null) blocks held by requests."""
        usable = self.num_blocks - 1
        return (usable - self.get_num_free_blocks()) / usable

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full, written block under `block_hash`. False (and the block stays
        unhashed) when another block already holds that hash."""
        if block.block_hash is not None:
            raise ValueError(f"block {block.block_id} is already cached")
        if block.is_null or block.ref_cnt == 0:
            raise ValueError(f"block {block.block_id} is not held by a request")
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop `n` blocks from the head of the free queue, evicting their hashes, ref_cnt = 1."""
        blocks = self.free_block_queue.popleft_n(n)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, given in eviction order (evict first comes first).

        Blocks reaching ref_cnt 0 return to the queue: unhashed ones at the head (reused first,
        nothing to lose), hashed ones at the tail (kept longest, least recently used first).
        """
        blocks = list(ordered_blocks)
        for block in blocks:
            if block.ref_cnt <= 0 or block.is_null:
                raise ValueError(f"block {block.block_id} freed more often than it was taken")
        unhashed: list[KVCacheBlock] = []
        hashed: list[KVCacheBlock] = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (unhashed if block.block_hash is None else hashed).append(block)
        self.free_block_queue.prepend_n(unhashed)
        self.free_block_queue.append_n(hashed)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed (True) when no request holds a block."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
