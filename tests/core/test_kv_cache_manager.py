import pytest

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request, RequestStatus

BS = 4


def make_req(mgr: KVCacheManager, rid: str, tokens: list[int], **kw: object) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=None,
                   arrival_time=0.0, block_size=mgr.block_size, hash_seed=mgr.root_hash, **kw)


def admit(mgr: KVCacheManager, req: Request) -> list[int]:
    """Schedule the whole prompt in one step, then cache it as the scheduler does after it."""
    hits, num_hit = mgr.get_computed_blocks(req)
    new_ids = mgr.allocate_slots(req, req.num_tokens - num_hit, hits)
    assert new_ids is not None
    req.num_computed_tokens = req.num_tokens
    mgr.cache_blocks(req, req.num_computed_tokens)
    return new_ids


def snapshot(mgr: KVCacheManager) -> tuple:
    pool = mgr.block_pool
    return ([b.block_id for b in pool.free_block_queue], [b.ref_cnt for b in pool.blocks],
            [b.block_hash for b in pool.blocks], dict(pool.cached_block_hash_to_block),
            {k: list(v) for k, v in mgr.req_to_blocks.items()}, dict(mgr.num_cached_blocks))


def test_miss_on_empty_cache_records_query() -> None:
    mgr = KVCacheManager(10, BS)
    assert mgr.get_computed_blocks(make_req(mgr, "a", list(range(10)))) == ([], 0)
    assert (mgr.total_stats.queries, mgr.total_stats.hits) == (10, 0)


def test_shared_prefix_hits_full_cached_blocks() -> None:
    mgr = KVCacheManager(16, BS)
    a = make_req(mgr, "a", list(range(10)))
    a_ids = admit(mgr, a)
    b = make_req(mgr, "b", list(range(9)) + [77, 78, 79])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8 and [h.block_id for h in hits] == a_ids[:2]
    assert all(h.ref_cnt == 1 for h in hits)  # lookup takes no references


def test_lookup_stops_at_first_miss() -> None:
    mgr = KVCacheManager(16, BS)
    a = make_req(mgr, "a", list(range(13)))
    admit(mgr, a)
    # Drop block 1's entry while block 2 stays cached: block 2 must not be returned.
    pool = mgr.block_pool
    del pool.cached_block_hash_to_block[a.block_hashes[1]]
    pool.blocks[mgr.get_block_ids("a")[1]].block_hash = None
    assert pool.get_cached_block(a.block_hashes[2]) is not None
    hits, num_hit = mgr.get_computed_blocks(make_req(mgr, "b", list(range(13))))
    assert num_hit == 4 and [h.block_id for h in hits] == mgr.get_block_ids("a")[:1]


def test_changed_block_misses_it_and_every_later_block() -> None:
    mgr = KVCacheManager(16, BS)
    admit(mgr, make_req(mgr, "a", list(range(13))))
    tokens = list(range(13))
    tokens[5] = 500  # block 1 differs; block 2 has the same tokens but a different parent
    _, num_hit = mgr.get_computed_blocks(make_req(mgr, "b", tokens))
    assert num_hit == 4


@pytest.mark.parametrize("length, expected_hit", [(12, 8), (13, 12), (14, 12), (4, 0), (5, 4)])
def test_fully_cached_prompt_still_computes_a_token(length: int, expected_hit: int) -> None:
    mgr = KVCacheManager(16, BS)
    admit(mgr, make_req(mgr, "a", list(range(16))))
    _, num_hit = mgr.get_computed_blocks(make_req(mgr, "b", list(range(length))))
    assert num_hit == expected_hit and num_hit <= length - 1


def test_allocate_returns_hits_then_new_ids_and_grows_on_decode() -> None:
    mgr = KVCacheManager(16, BS)
    a_ids = admit(mgr, make_req(mgr, "a", list(range(8))))
    b = make_req(mgr, "b", list(range(8)) + [9, 9, 9])
    hits, num_hit = mgr.get_computed_blocks(b)
    ids = mgr.allocate_slots(b, b.num_tokens - num_hit, hits)
    assert ids is not None and ids[:2] == a_ids and len(ids) == 3 and ids[2] not in a_ids
    assert mgr.get_block_ids("b") == ids and hits[0].ref_cnt == 2
    b.num_computed_tokens = 11
    b.append_output_token_ids(5)
    assert mgr.allocate_slots(b, 1) == []  # token 12 still fits block 2
    b.num_computed_tokens = 12
    b.append_output_token_ids(6)
    grown = mgr.allocate_slots(b, 1)
    assert grown is not None and len(grown) == 1 and mgr.get_block_ids("b")[-1] == grown[0]


def test_allocate_counts_free_hit_blocks_and_fails_without_side_effects() -> None:
    mgr = KVCacheManager(5, BS)  # 4 usable blocks
    a = make_req(mgr, "a", list(range(9)))
    admit(mgr, a)
    mgr.free(a)  # 2 cached blocks + 1 unhashed, all free
    b = make_req(mgr, "b", list(range(8)) + [50] * 12)
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8
    # Needs 3 new blocks; plus the 2 free hit blocks it would take that is 5 > 4 free.
    before = snapshot(mgr)
    assert mgr.allocate_slots(b, b.num_tokens - num_hit, hits) is None
    assert snapshot(mgr) == before
    assert mgr.allocate_slots(b, 8, hits) is not None  # 2 new + 2 hits fit
    assert mgr.num_free_blocks == 0


def test_allocate_fails_without_side_effects_for_a_running_request() -> None:
    mgr = KVCacheManager(3, BS)
    a = make_req(mgr, "a", list(range(8)))
    admit(mgr, a)
    before = snapshot(mgr)
    assert mgr.allocate_slots(a, 1) is None
    assert snapshot(mgr) == before


def test_can_allocate_a_cached_prompt_in_fewer_free_blocks() -> None:
    mgr = KVCacheManager(7, BS)  # 6 usable blocks
    admit(mgr, make_req(mgr, "a", list(range(8))))  # 2 cached blocks, held by "a"
    b = make_req(mgr, "b", list(range(8)) + [50] * 12)  # 5 blocks, the first 2 cached
    assert mgr.num_free_blocks == 4
    assert not mgr.can_allocate(b, b.num_tokens)  # without the hit: 5 new blocks > 4 free
    hits, num_hit = mgr.find_cached_prefix(b)
    before = snapshot(mgr)
    assert mgr.can_allocate(b, b.num_tokens - num_hit, hits)  # with it: 3 new blocks
    assert snapshot(mgr) == before
    assert mgr.allocate_slots(b, b.num_tokens - num_hit, hits) is not None


def test_can_allocate_needs_no_free_block_for_a_hit_a_running_request_holds() -> None:
    # "a" holds the 2 hit blocks: they are neither free blocks nor ones the new request takes,
    # so only b's 3 new blocks count against the 3 free ones (not 3 + 2).
    mgr = KVCacheManager(6, BS)  # 5 usable blocks
    admit(mgr, make_req(mgr, "a", list(range(8))))
    b = make_req(mgr, "b", list(range(8)) + [50] * 12)
    hits, num_hit = mgr.find_cached_prefix(b)
    assert all(block.ref_cnt == 1 for block in hits) and mgr.num_free_blocks == 3
    assert mgr.can_allocate(b, b.num_tokens - num_hit, hits)
    assert mgr.allocate_slots(b, b.num_tokens - num_hit, hits) is not None
    assert mgr.num_free_blocks == 0 and all(block.ref_cnt == 2 for block in hits)


@pytest.mark.parametrize("num_extra, fits", [(8, True), (9, False)])
def test_can_allocate_at_an_exactly_full_pool(num_extra: int, fits: bool) -> None:
    mgr = KVCacheManager(5, BS)  # 4 usable blocks
    a = make_req(mgr, "a", list(range(9)))
    admit(mgr, a)
    mgr.free(a)  # its 2 full blocks stay cached, in the free queue
    b = make_req(mgr, "b", list(range(8)) + [50] * num_extra)
    hits, num_hit = mgr.find_cached_prefix(b)
    assert num_hit == 8 and all(block.ref_cnt == 0 for block in hits)
    # 2 free hit blocks (each one of the 4 free blocks, counted once) + 2 or 3 new blocks.
    assert mgr.can_allocate(b, b.num_tokens - num_hit, hits) is fits
    assert (mgr.allocate_slots(b, b.num_tokens - num_hit, hits) is not None) is fits
    assert mgr.num_free_blocks == (0 if fits else 4)


@pytest.mark.parametrize("start, end, span", [(0, 10, (0, [0, 1, 2])), (4, 9, (1, [1, 2])),
                                               (8, 8, (2, [])), (0, 4, (0, [0]))])
def test_block_span_covers_the_tokens_asked(start: int, end: int, span: tuple) -> None:
    mgr = KVCacheManager(8, BS)
    ids = admit(mgr, make_req(mgr, "a", list(range(10))))
    first, block_ids = mgr.get_block_span("a", start, end)
    assert (first, [ids.index(i) for i in block_ids]) == span


def test_same_prompt_admitted_in_same_step_gets_distinct_correct_blocks() -> None:
    mgr = KVCacheManager(16, BS)
    prompt = list(range(100, 110))
    kv: dict[int, list[int]] = {}  # block id -> tokens whose KV the step wrote there
    step = []
    for rid in ("a", "b"):
        req = make_req(mgr, rid, prompt)
        hits, num_hit = mgr.get_computed_blocks(req)
        assert (hits, num_hit) == ([], 0)  # nothing is hittable before the step ran
        assert mgr.allocate_slots(req, req.num_tokens, hits) is not None
        step.append(req)
    a_ids, b_ids = mgr.get_block_ids("a"), mgr.get_block_ids("b")
    assert len(a_ids) == len(b_ids) == 3 and not set(a_ids) & set(b_ids)
    for req in step:  # the step writes KV, then the scheduler caches
        for pos, tok in enumerate(req.all_token_ids):
            kv.setdefault(mgr.get_block_ids(req.request_id)[pos // BS], []).append(tok)
        req.num_computed_tokens = req.num_tokens
    for req in step:
        mgr.cache_blocks(req, req.num_computed_tokens)
    cached = mgr.block_pool.cached_block_hash_to_block
    assert [b.block_id for b in cached.values()] == a_ids[:2]
    assert all(mgr.block_pool.blocks[i].block_hash is None for i in b_ids)
    c = make_req(mgr, "c", prompt + [7])
    hits, _ = mgr.get_computed_blocks(c)
    assert [h.block_id for h in hits] == a_ids[:2]
    assert [kv[h.block_id] for h in hits] == [prompt[:4], prompt[4:8]]
    for rid, req in (("a", step[0]), ("b", step[1])):
        mgr.free(req)
    assert mgr.num_free_blocks == 15
    assert all(b.ref_cnt == 0 for b in mgr.block_pool.blocks)
    assert [b.block_id for b in mgr.block_pool.free_block_queue][:3] == b_ids[::-1]


def test_blocks_become_hittable_only_through_cache_blocks() -> None:
    mgr = KVCacheManager(16, BS)
    a = make_req(mgr, "a", list(range(12)))
    mgr.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    b = make_req(mgr, "b", list(range(12)))
    assert mgr.get_computed_blocks(b)[1] == 0
    mgr.cache_blocks(a, 6)  # chunk of 6 tokens: one full block
    assert mgr.get_computed_blocks(b)[1] == 4
    mgr.allocate_slots(a, 6)
    mgr.cache_blocks(a, 12)
    assert mgr.get_computed_blocks(b)[1] == 8  # capped at 11 tokens


def test_generated_tokens_fill_cacheable_blocks() -> None:
    mgr = KVCacheManager(16, BS)
    a = make_req(mgr, "a", list(range(6)))
    admit(mgr, a)
    a.append_output_token_ids([40, 41, 42])
    assert len(a.block_hashes) == 2
    mgr.allocate_slots(a, 3)
    a.num_computed_tokens = 9
    mgr.cache_blocks(a, 9)
    b = make_req(mgr, "b", list(range(6)) + [40, 41, 42])
    assert mgr.get_computed_blocks(b)[1] == 8


@pytest.mark.parametrize("kw_a, kw_b, shares", [
    ({"cache_salt": "t1"}, {"cache_salt": "t2"}, False),
    ({"cache_salt": "t1"}, {"cache_salt": "t1"}, True),
    ({"cache_salt": "t1"}, {}, False),
])
def test_cache_salt_isolates_caches(kw_a: dict, kw_b: dict, shares: bool) -> None:
    mgr = KVCacheManager(16, BS)
    admit(mgr, make_req(mgr, "a", list(range(12)), **kw_a))
    _, num_hit = mgr.get_computed_blocks(make_req(mgr, "b", list(range(12)), **kw_b))
    assert num_hit == (8 if shares else 0)


def test_seeded_managers_agree_on_hashes() -> None:
    m1, m2 = KVCacheManager(8, BS, hash_seed=3), KVCacheManager(8, BS, hash_seed=3)
    assert m1.root_hash == m2.root_hash
    tokens = list(range(9))
    assert make_req(m1, "a", tokens).block_hashes == make_req(m2, "a", tokens).block_hashes
    assert KVCacheManager(8, BS).root_hash != KVCacheManager(8, BS).root_hash


def test_stats_total_and_preemption() -> None:
    mgr = KVCacheManager(16, BS)
    a = make_req(mgr, "a", list(range(12)))
    admit(mgr, a)
    admit(mgr, make_req(mgr, "b", list(range(10))))  # 8 of 10 tokens hit
    s = mgr.total_stats
    assert (s.requests, s.queries, s.hits) == (2, 22, 8) and s.hit_rate == pytest.approx(8 / 22)
    mgr.free(a)
    a.num_computed_tokens, a.num_preemptions = 0, 1
    assert mgr.get_computed_blocks(a)[1] == 8  # a resumed request still hits...
    assert mgr.total_stats.requests == 2  # ...but is not counted
    assert (mgr.total_stats.queries, mgr.total_stats.hits) == (22, 8)


def test_caching_disabled_never_hits_or_records() -> None:
    mgr = KVCacheManager(16, BS, enable_caching=False)
    admit(mgr, make_req(mgr, "a", list(range(12))))
    assert mgr.get_computed_blocks(make_req(mgr, "b", list(range(12)))) == ([], 0)
    assert not mgr.block_pool.cached_block_hash_to_block and mgr.total_stats.queries == 0


def test_free_releases_tail_first_and_keeps_hashed_blocks_longest() -> None:
    mgr = KVCacheManager(8, BS)
    a = make_req(mgr, "a", list(range(10)))
    ids = admit(mgr, a)
    mgr.free(a)
    queue = [b.block_id for b in mgr.block_pool.free_block_queue]
    assert queue[0] == ids[2] and queue[-2:] == [ids[1], ids[0]]
    assert mgr.get_block_ids("a") == [] and mgr.num_free_blocks == 7 and mgr.usage == 0.0
    mgr.free(a)  # freeing a request that holds nothing is a no-op
    assert mgr.num_free_blocks == 7


def test_usage_reports_fraction_in_use() -> None:
    mgr = KVCacheManager(9, BS)
    admit(mgr, make_req(mgr, "a", list(range(8))))
    assert mgr.usage == 0.25 and mgr.num_free_blocks == 6


def test_reset_prefix_cache() -> None:
    mgr = KVCacheManager(8, BS)
    a = make_req(mgr, "a", list(range(9)))
    admit(mgr, a)
    assert not mgr.reset_prefix_cache()
    mgr.free(a)
    assert mgr.reset_prefix_cache()
    assert mgr.get_computed_blocks(make_req(mgr, "b", list(range(9))))[1] == 0


def test_stale_hits_are_rejected() -> None:
    mgr = KVCacheManager(4, BS)
    a = make_req(mgr, "a", list(range(8)))
    admit(mgr, a)
    mgr.free(a)
    b = make_req(mgr, "b", list(range(8)) + [1])
    hits, _ = mgr.get_computed_blocks(b)
    admit(mgr, make_req(mgr, "c", [9] * 12))  # reuses (and evicts) every free block
    with pytest.raises(ValueError, match="no longer caches"):
        mgr.allocate_slots(b, 1, hits)


def test_bad_arguments_raise_value_error() -> None:
    mgr = KVCacheManager(8, BS)
    with pytest.raises(ValueError, match="num_new_tokens"):
        mgr.allocate_slots(make_req(mgr, "a", [1]), -1)
    other = KVCacheManager(8, BS)
    with pytest.raises(ValueError, match="hash_seed"):
        mgr.get_computed_blocks(make_req(other, "a", [1, 2, 3, 4, 5]))
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(8, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(1, BS)


def test_request_keeps_tokens_and_hashes_in_sync() -> None:
    mgr = KVCacheManager(8, BS)
    r = make_req(mgr, "a", [1, 2, 3])
    assert r.block_hashes == [] and r.num_cached_tokens == -1
    r.append_output_token_ids(4)
    r.append_output_token_ids([5, 6, 7, 8])
    assert r.all_token_ids == list(range(1, 9)) and r.output_token_ids == [4, 5, 6, 7, 8]
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (8, 3, 5)
    assert r.block_hashes == make_req(mgr, "b", list(range(1, 9))).block_hashes


def test_request_status() -> None:
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    assert RequestStatus.is_finished(RequestStatus.FINISHED_ABORTED)
    mgr = KVCacheManager(8, BS)
    r = make_req(mgr, "a", [1])
    assert not r.is_finished and r.get_finished_reason() is None
    r.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert r.is_finished and r.get_finished_reason() == "length"


@pytest.mark.parametrize("field, value", [
    ("request_id", ""), ("prompt_token_ids", []), ("block_size", 0), ("hash_seed", b"x"),
    ("cache_salt", 3), ("max_tokens", -1), ("max_tokens", 2.0),
])
def test_request_rejects_bad_fields(field: str, value: object) -> None:
    kw: dict = dict(request_id="r", prompt_token_ids=[1, 2], sampling_params=None,
                    arrival_time=0.0, block_size=BS, hash_seed=bytes(32))
    kw[field] = value
    with pytest.raises(ValueError, match=field):
        Request(**kw)


def decode(mgr: KVCacheManager, req: Request, steps: int) -> None:
    """`steps` decode steps of one token each, as the scheduler runs them."""
    for token in range(steps):
        assert mgr.allocate_slots(req, 1) is not None
        req.append_output_token_ids(100 + token)
        req.num_computed_tokens += 1
        mgr.cache_blocks(req, req.num_computed_tokens)


def test_a_sliding_window_gives_back_the_blocks_its_queries_no_longer_see() -> None:
    mgr = KVCacheManager(32, BS, sliding_window=6)
    req = make_req(mgr, "a", list(range(10)))
    admit(mgr, req)  # positions 0..9 in blocks 0..2
    assert mgr.num_free_blocks == 31 - 3
    decode(mgr, req, 1)  # the query at 10 sees 5..10: block 0 (0..3) is given back
    ids = mgr.get_block_ids("a")
    assert ids[0] == mgr.block_pool.null_block.block_id and len(ids) == 3
    decode(mgr, req, 9)  # the query at 19 sees 14..19: blocks 0..2 given back
    held = [b for b in mgr.req_to_blocks["a"] if not b.is_null]
    assert len(mgr.get_block_ids("a")) == 5 and len(held) == 2
    assert mgr.num_free_blocks == 31 - 2
    # Blocks given back keep their hashes: the same prompt hits them while they last.
    again = make_req(mgr, "b", list(range(10)))
    hits, num_hit = mgr.get_computed_blocks(again)
    assert num_hit == 8
    assert mgr.allocate_slots(again, 2, hits) is not None  # the query at 8 sees 3..8
    assert [b.is_null for b in mgr.req_to_blocks["b"]] == [False, False, False]
    again.num_computed_tokens = 10
    decode(mgr, again, 1)  # the query at 10 sees 5..10
    assert [b.is_null for b in mgr.req_to_blocks["b"]] == [True, False, False]
    mgr.free(req)
    mgr.free(again)
    assert mgr.num_free_blocks == 31 and not mgr.num_skipped_blocks


def test_drafts_that_may_be_rejected_keep_their_window() -> None:
    mgr = KVCacheManager(32, BS, sliding_window=6, num_lookahead_tokens=3)
    req = make_req(mgr, "a", list(range(10)))
    admit(mgr, req)
    decode(mgr, req, 1)  # three drafts back, the query at 7 sees 2..7: block 0 is kept
    assert not mgr.req_to_blocks["a"][0].is_null
    decode(mgr, req, 3)  # the query at 10 sees 5..10
    assert mgr.req_to_blocks["a"][0].is_null and not mgr.req_to_blocks["a"][1].is_null
