"""Random interleavings of admissions (shared prefixes, salts, adapters), chunked prefill,
decode appends, preemption, finishes, aborts and cache resets, checked against a model of the
device KV cache so that every hit is proven to read exactly the KV its tokens need."""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request, RequestStatus

NUM_BLOCKS = 16
BS = 4
MAX_LIVE = 6
PREFIXES = [(), tuple(range(8)), tuple(range(100, 106)), tuple(range(8)) + (50, 51, 52, 53)]

SlotKey = tuple[str | None, tuple[int, ...]]


def slot_key(req: Request, pos: int) -> SlotKey:
    """What the KV at `pos` depends on: the tokens up to it and (for isolation) the salt."""
    return req.cache_salt, tuple(req.all_token_ids[: pos + 1])


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(NUM_BLOCKS, BS, hash_seed=0)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.held: dict[str, list[int]] = {}  # the model's view of each request's block ids
        self.kv: dict[int, list[SlotKey | None]] = {}  # simulated device KV per block
        self.queries = 0
        self.hits = 0
        self.count = 0

    def live(self) -> list[Request]:
        return self.waiting + self.running

    def snapshot(self) -> tuple:
        pool = self.mgr.block_pool
        return ([b.block_id for b in pool.free_block_queue], [b.ref_cnt for b in pool.blocks],
                [b.block_hash for b in pool.blocks], dict(pool.cached_block_hash_to_block),
                {k: list(v) for k, v in self.mgr.req_to_blocks.items()})

    @precondition(lambda self: len(self.live()) < MAX_LIVE)
    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 2), max_size=9),
          salt=st.sampled_from([None, "x", "y"]))
    def add_request(self, prefix: tuple[int, ...], suffix: list[int], salt: str | None) -> None:
        prompt = list(prefix) + suffix or [7]
        self.count += 1
        self.waiting.append(Request(
            request_id=f"r{self.count}", prompt_token_ids=prompt, sampling_params=None,
            arrival_time=float(self.count), block_size=BS, hash_seed=self.mgr.root_hash,
            cache_salt=salt))

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        scheduled: list[tuple[Request, int, int]] = []
        for req in list(self.running):
            if not data.draw(st.booleans(), label="schedule running"):
                continue
            n = data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens), label="n")
            before = self.snapshot()
            ids = self.mgr.allocate_slots(req, n)
            if ids is None:
                assert self.snapshot() == before
                if data.draw(st.booleans(), label="preempt"):
                    self.preempt(req)
                continue
            self.take_new(req, ids)
            scheduled.append((req, req.num_computed_tokens, n))
        for req in list(self.waiting):
            if not data.draw(st.booleans(), label="admit"):
                continue
            hits, num_hit = self.mgr.get_computed_blocks(req)
            if req.num_preemptions == 0:
                self.queries += req.num_tokens
                self.hits += num_hit
            assert num_hit == len(hits) * BS and num_hit < req.num_tokens
            for i, block in enumerate(hits):  # a hit reads exactly the KV it needs
                assert self.kv[block.block_id] == [slot_key(req, i * BS + j) for j in range(BS)]
            n = data.draw(st.integers(1, req.num_tokens - num_hit), label="n")
            before = self.snapshot()
            ids = self.mgr.allocate_slots(req, n, hits)
            if ids is None:
                assert self.snapshot() == before
                continue
            assert ids[: len(hits)] == [b.block_id for b in hits]
            self.held[req.request_id] = ids[: len(hits)]
            self.take_new(req, ids[len(hits):])
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.waiting.remove(req)
            self.running.append(req)
            scheduled.append((req, num_hit, n))
        self.execute(scheduled)
        for req, _, _ in scheduled:  # update_from_output: sample, then cache written blocks
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token_ids(data.draw(st.integers(0, 2), label="sampled"))
            self.mgr.cache_blocks(req, req.num_computed_tokens)

    def take_new(self, req: Request, new_ids: list[int]) -> None:
        for block_id in new_ids:
            self.kv[block_id] = [None] * BS  # a reused block holds garbage until written
        self.held.setdefault(req.request_id, []).extend(new_ids)

    def execute(self, scheduled: list[tuple[Request, int, int]]) -> None:
        for req, start, n in scheduled:
            ids = self.mgr.get_block_ids(req.request_id)
            for pos in range(start, start + n):
                block = self.mgr.block_pool.blocks[ids[pos // BS]]
                # Written blocks belong to this request alone and are not hittable yet.
                assert block.ref_cnt == 1 and block.block_hash is None
                self.kv[block.block_id][pos % BS] = slot_key(req, pos)
            req.num_computed_tokens = start + n

    def preempt(self, req: Request) -> None:
        self.mgr.free(req)
        self.held.pop(req.request_id, None)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.running.remove(req)
        self.waiting.insert(0, req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.running), label="finish")
        self.release(req, RequestStatus.FINISHED_STOPPED)

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.live()), label="abort")
        self.release(req, RequestStatus.FINISHED_ABORTED)

    @precondition(lambda self: self.mgr.block_pool.cached_block_hash_to_block)
    @rule()
    def reset_prefix_cache(self) -> None:
        in_use = any(self.held.values())
        assert self.mgr.reset_prefix_cache() == (not in_use)
        if not in_use:
            assert not self.mgr.block_pool.cached_block_hash_to_block

    def release(self, req: Request, status: RequestStatus) -> None:
        self.mgr.free(req)
        self.held.pop(req.request_id, None)
        req.status = status
        (self.running if req in self.running else self.waiting).remove(req)

    @invariant()
    def ref_counts_match_holders(self) -> None:
        counts = [0] * NUM_BLOCKS
        for req in self.live():
            ids = self.mgr.get_block_ids(req.request_id)
            assert ids == self.held.get(req.request_id, [])
            assert len(ids) == -(-req.num_computed_tokens // BS)
            assert len(set(ids)) == len(ids) and 0 not in ids
            for block_id in ids:
                counts[block_id] += 1
        assert set(self.mgr.req_to_blocks) <= {r.request_id for r in self.live()}
        assert [b.ref_cnt for b in self.mgr.block_pool.blocks] == counts

    @invariant()
    def free_queue_holds_exactly_unreferenced_blocks(self) -> None:
        pool = self.mgr.block_pool
        queue = [b.block_id for b in pool.free_block_queue]
        assert len(queue) == len(set(queue)) == pool.get_num_free_blocks()
        assert set(queue) == {b.block_id for b in pool.blocks if b.ref_cnt == 0 and not b.is_null}
        assert pool.null_block.ref_cnt == 0 and pool.null_block.block_hash is None

    @invariant()
    def hash_map_and_blocks_agree(self) -> None:
        pool = self.mgr.block_pool
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash
        hashed = [b for b in pool.blocks if b.block_hash is not None]
        assert len(hashed) == len(pool.cached_block_hash_to_block)
        assert all(pool.cached_block_hash_to_block[b.block_hash] is b for b in hashed)

    @invariant()
    def stats_count_first_lookups(self) -> None:
        stats = self.mgr.total_stats
        assert (stats.queries, stats.hits) == (self.queries, self.hits)

    def teardown(self) -> None:
        for req in self.live():
            self.mgr.free(req)
        pool = self.mgr.block_pool
        assert pool.get_num_free_blocks() == NUM_BLOCKS - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks) and not self.mgr.req_to_blocks
        assert len(list(pool.free_block_queue)) == NUM_BLOCKS - 1


KVCacheMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_kv_cache_manager_state_machine = KVCacheMachine.TestCase


class WindowedKVCacheMachine(KVCacheMachine):
    """The same, every layer attending over the last WINDOW positions: blocks before a
    request's window go back to the pool, and every query still finds its whole window."""
    WINDOW = 5

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(NUM_BLOCKS, BS, hash_seed=0, sliding_window=self.WINDOW)

    def execute(self, scheduled: list[tuple[Request, int, int]]) -> None:
        super().execute(scheduled)
        for req, start, n in scheduled:
            ids = self.mgr.get_block_ids(req.request_id)
            for pos in range(start, start + n):
                for seen in range(max(0, pos + 1 - self.WINDOW), pos + 1):
                    block_id = ids[seen // BS]
                    assert block_id != 0, (req.request_id, pos, seen)
                    assert self.kv[block_id][seen % BS] == slot_key(req, seen)

    @invariant()
    def ref_counts_match_holders(self) -> None:
        counts = [0] * NUM_BLOCKS
        for req in self.live():
            ids = self.mgr.get_block_ids(req.request_id)
            held = self.held.get(req.request_id, [])
            skipped = next((i for i, block_id in enumerate(ids) if block_id), len(ids))
            assert ids[skipped:] == held[skipped:] and 0 not in ids[skipped:]
            assert len(ids) == len(held) == -(-req.num_computed_tokens // BS)
            assert skipped * BS <= max(0, req.num_computed_tokens + 1 - self.WINDOW)
            for block_id in ids[skipped:]:
                counts[block_id] += 1
        assert set(self.mgr.req_to_blocks) <= {r.request_id for r in self.live()}
        assert [b.ref_cnt for b in self.mgr.block_pool.blocks] == counts


WindowedKVCacheMachine.TestCase.settings = KVCacheMachine.TestCase.settings
test_windowed_kv_cache_manager_state_machine = WindowedKVCacheMachine.TestCase
