"""Per-request KV block bookkeeping over a BlockPool, with prefix caching and hit-rate stats.

When a block becomes hittable: only `cache_blocks`, which the scheduler calls AFTER the step that
writes the block's KV has been launched, registers a block's hash. Every later step takes the KV
cache arrays that step returns, so it reads the block after the write. A request admitted in the
same step as the one computing a prefix misses it and computes its own copy, so a cache hit can
never read KV that is not written yet, whatever order the kernel writes and reads KV in.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.core.block_hash import BlockHash, make_root_hash
from jaxserve.core.block_pool import BlockPool, KVCacheBlock
from jaxserve.core.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    requests: int = 0  # lookups counted (first scheduling; resumes after preemption excluded)
    queries: int = 0  # tokens looked up
    hits: int = 0  # of those, tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit_tokens


class KVCacheManager:
    """`sliding_window`: every layer attends over at most that many positions (Mistral,
    Phi-3), so a request's blocks that no later query can see go back to the pool as it moves
    on (the null block holds their place in its block table); a freed block keeps its hash and
    stays hittable until evicted. `num_lookahead_tokens`: draft tokens a verification may
    reject, moving the next query back by as many positions."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_seed: int | str | None = None, sliding_window: int | None = None,
                 num_lookahead_tokens: int = 0) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(
                sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got "
                             f"{sliding_window!r}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_lookahead_tokens = num_lookahead_tokens
        self.enable_caching = enable_caching
        self.root_hash: BlockHash = make_root_hash(hash_seed)
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each request already passed through cache_blocks (or hit).
        self.num_cached_blocks: dict[str, int] = {}
        # Leading blocks of each request given back as its window moved past them.
        self.num_skipped_blocks: dict[str, int] = {}
        self.total_stats = PrefixCacheStats()  # since start: what Scheduler.stats reports

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def find_cached_prefix(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The cached blocks of the request's longest cached prefix and the tokens they hold (no
        references, no stats): also what data-parallel routing compares across ranks."""
        if not self.enable_caching:
            return [], 0
        self._check_request(request)
        # At least one token must be computed so the step produces logits for this request.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break  # the chain makes every later block a miss too
            hits.append(block)
        return hits, len(hits) * self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request's full blocks, counted in the hit-rate stats;
        takes no references."""
        if not self.enable_caching:
            return [], 0
        hits, num_hit_tokens = self.find_cached_prefix(request)
        self.record_query(request, num_hit_tokens)
        return hits, num_hit_tokens

    def record_query(self, request: Request, num_hit_tokens: int) -> None:
        """Count one prefix lookup in the hit-rate stats (a resumed request's is not new)."""
        if request.num_preemptions == 0:
            self.total_stats.record(request.num_tokens, num_hit_tokens)

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: list[KVCacheBlock] | None = None) -> bool:
        """Whether `allocate_slots` with these arguments would succeed now."""
        return self._blocks_to_take(request, num_new_tokens, new_computed_blocks) is not None

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> list[int] | None:
        """Grow the request's blocks to fit its computed tokens, the hit blocks and
        `num_new_tokens` more. Returns the ids appended (hits first), or None with nothing
        changed when the pool is short of blocks."""
        num_new = self._blocks_to_take(request, num_new_tokens, new_computed_blocks)
        if num_new is None:
            return None
        self._free_outside_window(request.request_id, request.num_computed_tokens)
        hits = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        self.block_pool.touch(hits)
        new_blocks = self.block_pool.get_new_blocks(num_new)
        if request.request_id not in self.req_to_blocks:
            self.req_to_blocks[request.request_id] = blocks
        blocks.extend(hits)
        blocks.extend(new_blocks)
        if hits:
            self.num_cached_blocks[request.request_id] = len(hits)
            self._free_outside_window(request.request_id, len(hits) * self.block_size)
        return [block.block_id for block in hits] + [block.block_id for block in new_blocks]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Make the request's full blocks within its first `num_computed_tokens` tokens hittable.

        THE rule that keeps hits safe: call this only after the step that writes those tokens'
        KV has been launched, never at schedule time (see the module docstring).
        """
        if not self.enable_caching:
            return
        self._check_request(request)
        blocks = self.req_to_blocks.get(request.request_id, [])
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_computed_tokens // self.block_size, len(request.block_hashes), len(blocks))
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is None and not block.is_null:
                # False when an identical block computed in the same step was cached first:
                # this copy then stays unhashed and is reused first once freed.
                self.block_pool.cache_block(block, request.block_hashes[i])
        if end > start:
            self.num_cached_blocks[request.request_id] = end

    def free(self, request: Request) -> None:
        self.num_cached_blocks.pop(request.request_id, None)
        skipped = self.num_skipped_blocks.pop(request.request_id, 0)
        blocks = self.req_to_blocks.pop(request.request_id, [])
        # Tail of the chain first: among blocks freed together, the ones ending this prompt are
        # evicted before the shared prefix that other prompts are likely to start with.
        self.block_pool.free_blocks(reversed(blocks[skipped:]))

    def _window_span(self, request_id: str, num_computed_tokens: int) -> tuple[int, int]:
        """The request's held blocks [start, end) before its window: its next query, at
        position `num_computed_tokens` (less the drafts a verification may reject), sees
        positions from `sliding_window` - 1 before it."""
        start = self.num_skipped_blocks.get(request_id, 0)
        if self.sliding_window is None:
            return start, start
        first_seen = num_computed_tokens - self.num_lookahead_tokens + 1 - self.sliding_window
        end = min(max(0, first_seen) // self.block_size,
                  len(self.req_to_blocks.get(request_id, [])))
        return start, max(start, end)

    def _free_outside_window(self, request_id: str, num_computed_tokens: int) -> None:
        start, end = self._window_span(request_id, num_computed_tokens)
        if end == start:
            return
        blocks = self.req_to_blocks[request_id]
        self.block_pool.free_blocks(reversed(blocks[start:end]))
        blocks[start:end] = [self.block_pool.null_block] * (end - start)
        self.num_skipped_blocks[request_id] = end

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def get_block_span(self, request_id: str, start: int, end: int) -> tuple[int, list[int]]:
        """The request's blocks holding its tokens start..end-1: the first one's index in the
        request's blocks, and their ids."""
        first, stop = start // self.block_size, -(-end // self.block_size)
        return first, self.get_block_ids(request_id)[first:stop]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def _blocks_to_take(self, request: Request, num_new_tokens: int,
                        new_computed_blocks: list[KVCacheBlock] | None) -> int | None:
        """The new blocks allocate_slots would take from the pool, or None when it is short."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        hits = new_computed_blocks or []
        blocks = self.req_to_blocks.get(request.request_id, [])
        if hits:
            self._check_hits(request, blocks, hits)
        num_tokens = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_new = max(0, -(-num_tokens // self.block_size) - len(blocks) - len(hits))
        # A hit block nobody holds sits in the free queue: touching it takes it out of the pool
        # too (it is one of the free blocks, so it counts once).
        num_free_hits = sum(1 for block in hits if block.ref_cnt == 0)
        # Blocks the window gives back first, which no other request holds.
        start, end = self._window_span(request.request_id, request.num_computed_tokens)
        num_given_back = sum(1 for block in blocks[start:end] if block.ref_cnt == 1)
        free = self.block_pool.get_num_free_blocks() + num_given_back
        return num_new if num_new + num_free_hits <= free else None

    def _check_request(self, request: Request) -> None:
        if request.block_size != self.block_size:
            raise ValueError(f"request {request.request_id} block_size {request.block_size} "
                             f"!= cache block_size {self.block_size}")
        if request.hash_seed != self.root_hash:
            raise ValueError(f"request {request.request_id} hash_seed is not this cache's "
                             "root_hash; build requests with hash_seed=manager.root_hash")

    def _check_hits(self, request: Request, blocks: list[KVCacheBlock],
                    hits: list[KVCacheBlock]) -> None:
        # Hits must come straight from get_computed_blocks for a request holding no blocks; an
        # allocation in between could have evicted (and re-handed out) one of them.
        if blocks or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id} already holds blocks or computed "
                             "tokens; new_computed_blocks are only for its first allocation")
        for i, block in enumerate(hits):
            if i >= len(request.block_hashes) or block.block_hash != request.block_hashes[i]:
                raise ValueError(f"new_computed_blocks[{i}] (block {block.block_id}) no longer "
                                 f"caches block {i} of request {request.request_id}")
