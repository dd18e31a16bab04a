"""Block-pool operations per second at 10k and 100k blocks: jaxserve's BlockPool (intrusive
doubly linked free queue) against a naive pool on a deque, whose removal from the middle (a hit
on a free cached block) is O(n). Writes results/bench_block_pool.md and prints it.

    python scripts/bench_block_pool.py [--sizes 10000 100000] [--seconds 0.5]
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import random
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from jaxserve.core.block_hash import extend_block_hashes, make_root_hash
from jaxserve.core.block_pool import BlockPool, KVCacheBlock

BATCH = 16  # blocks per allocate/free call, like one request's prompt of 16 blocks


class NaiveBlockPool:
    """Same operations as BlockPool, but the free list is a deque: `remove` scans it."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free: collections.deque[KVCacheBlock] = collections.deque(self.blocks[1:])
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        out = [self.free.popleft() for _ in range(n)]
        for block in out:
            if block.block_hash is not None:
                del self.cached_block_hash_to_block[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                self.free.remove(block)  # O(n) scan
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free.appendleft(block)
                else:
                    self.free.append(block)


Pool = BlockPool | NaiveBlockPool


def fill_cache(pool: Pool, num_blocks: int) -> list[bytes]:
    """Hand out every block, cache it under a distinct hash, free it: all free and hittable."""
    blocks = pool.get_new_blocks(num_blocks - 1)
    hashes = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(num_blocks - 1)]
    for block, block_hash in zip(blocks, hashes):
        pool.cache_block(block, block_hash)
    pool.free_blocks(blocks)
    return hashes


def ops_per_second(op: Callable[[], int], seconds: float) -> float:
    done, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        done += op()
    return done / elapsed


def bench(make: Callable[[int], Pool], num_blocks: int, seconds: float) -> dict[str, float]:
    rng = random.Random(0)
    pool = make(num_blocks)
    hashes = fill_cache(pool, num_blocks)

    def allocate_free() -> int:
        blocks = pool.get_new_blocks(BATCH)
        pool.free_blocks(reversed(blocks))
        return BATCH

    def hit() -> int:
        # A prefix hit on a free cached block anywhere in the queue, then its release.
        block = pool.get_cached_block(hashes[rng.randrange(len(hashes))])
        if block is None:
            return 0
        pool.touch([block])
        pool.free_blocks([block])
        return 1

    def lookup() -> int:
        pool.get_cached_block(hashes[rng.randrange(len(hashes))])
        return 1

    return {"allocate+free (per block)": ops_per_second(allocate_free, seconds),
            "hit+release (free cached block)": ops_per_second(hit, seconds),
            "random hash lookup only (memory baseline)": ops_per_second(lookup, seconds)}


def hash_prompt_us(num_tokens: int = 4096, block_size: int = 16, reps: int = 200) -> float:
    tokens = [random.Random(1).randrange(128_000) for _ in range(num_tokens)]
    root = make_root_hash(0)
    times = []
    for _ in range(reps):
        out: list[bytes] = []
        start = time.perf_counter()
        extend_block_hashes(out, tokens, block_size, root, cache_salt="s")
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    parser.add_argument("--out", type=Path, default=Path("results/bench_block_pool.md"))
    args = parser.parse_args()

    pools: dict[str, Callable[[int], Pool]] = {"BlockPool": BlockPool,
                                               "naive deque": NaiveBlockPool}
    results = {(name, n): bench(make, n, args.seconds) for name, make in pools.items()
               for n in args.sizes}
    ops = list(next(iter(results.values())))
    small, large = args.sizes[0], args.sizes[-1]
    lines = ["# Block pool: operations per second", "",
             "| operation | pool | " + " | ".join(f"{n:,} blocks" for n in args.sizes)
             + f" | {large:,} / {small:,} |",
             "|---|---|" + "---:|" * (len(args.sizes) + 1)]
    for op in ops:
        for name in pools:
            rates = [results[(name, n)][op] for n in args.sizes]
            lines.append(f"| {op} | {name} | " + " | ".join(f"{r:,.0f}" for r in rates)
                         + f" | {rates[-1] / rates[0]:.2f}x |")
    lines += ["", "A hit touches a random block among all of them, so part of its drop with pool "
              "size is cache misses, which the lookup-only baseline shows too; the naive pool's "
              "drop is its O(n) deque scan.", "",
              "Hashing a 4,096-token prompt (block_size 16, salt + adapter keys): "
              f"{hash_prompt_us():.0f} us (median).", ""]
    table = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
