"""The V1 scheduler, step by step, with fake sampled tokens (no jax, no model).

Every step also passes `check_step` and the WorkerView diff replay in sched_helpers.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_helpers import BS, EOS, Harness, expected_outputs

from jaxserve.core.request import RequestStatus


# ---- one token budget ------------------------------------------------------------------------
def test_running_requests_spend_the_budget_before_waiting_ones() -> None:
    h = Harness(budget=8)
    h.add("long", 20, max_tokens=2)
    h.add("late", 4, max_tokens=2)
    assert h.step().out.num_scheduled_tokens == {"long": 8}
    assert h.step().out.num_scheduled_tokens == {"long": 8}  # nothing left for "late"
    rec = h.step()
    assert rec.out.num_scheduled_tokens == {"long": 4, "late": 4}
    assert rec.out.scheduled_cached_reqs.req_ids == ["long"] and rec.new_ids == ["late"]
    h.run()
    h.assert_no_leaks()


def test_prefill_chunk_and_decode_share_one_step() -> None:
    h = Harness(budget=8)
    h.add("a", 4, max_tokens=6)
    h.step()
    h.add("b", 12, max_tokens=2)
    rec = h.step()
    assert rec.out.num_scheduled_tokens == {"a": 1, "b": 7}
    assert rec.is_decode("a") and not rec.is_decode("b")
    assert rec.out.total_num_scheduled_tokens == 8
    assert [o.request_id for o in rec.outputs] == ["a"]  # b's chunk sampled nothing real
    h.run()
    h.assert_no_leaks()


# ---- chunked prefill -------------------------------------------------------------------------
def test_long_prompt_is_chunked_by_the_budget_and_chunk_tokens_are_ignored() -> None:
    h = Harness(budget=8)
    req = h.add("a", 20, max_tokens=3)
    chunks, starts = [], []
    for _ in range(3):
        rec = h.step(tokens={"a": EOS})  # an EOS sampled after a prefill chunk must not count
        chunks.append(rec.out.num_scheduled_tokens["a"])
        starts.append(h.worker.computed["a"] - chunks[-1])
        if req.num_computed_tokens < 20:
            assert req.output_token_ids == [] and rec.outputs == []
    assert chunks == [8, 8, 4] and starts == [0, 8, 16]
    assert req.output_token_ids == [EOS] and h.history[-1].outputs[0].finish_reason == "stop"
    h.assert_no_leaks()


def test_threshold_caps_every_chunk_while_short_requests_keep_decoding() -> None:
    h = Harness(budget=16, threshold=3)
    short = h.add("short", 2, max_tokens=12)
    h.step()
    assert short.num_computed_tokens == 2
    h.add("long", 11, max_tokens=1)
    long_chunks = []
    while "long" in h.sched.requests:
        rec = h.step()
        assert rec.out.num_scheduled_tokens["short"] == 1 and rec.is_decode("short")
        long_chunks.append(rec.out.num_scheduled_tokens.get("long", 0))
    assert long_chunks == [3, 3, 3, 2]
    h.run()
    h.assert_no_leaks()


@pytest.mark.parametrize("chunked", [True, False])
def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits(chunked: bool) -> None:
    h = Harness(budget=8, chunked=chunked)
    h.add("a", 6, max_tokens=2)
    h.step()
    b = h.add("b", 8, max_tokens=1)
    rec = h.step()  # a's decode leaves 7 tokens: too few for b's 8
    if chunked:
        assert rec.out.num_scheduled_tokens == {"a": 1, "b": 7}
    else:
        assert rec.out.num_scheduled_tokens == {"a": 1} and b.status == RequestStatus.WAITING
        rec = h.step()  # a finished last step: the whole budget is free
        assert rec.out.num_scheduled_tokens == {"b": 8}
    h.run()
    h.assert_no_leaks()


def test_max_num_seqs_caps_running_requests() -> None:
    h = Harness(budget=16, max_num_seqs=2)
    for rid, max_tokens in (("a", 2), ("b", 5), ("c", 3), ("d", 3)):
        h.add(rid, 3, max_tokens=max_tokens)
    assert h.step().new_ids == ["a", "b"]
    assert h.step().new_ids == []  # budget is left, seats are not
    assert h.step().new_ids == ["c"]  # a finished in the step before
    h.run()
    assert max(len(rec.out.num_scheduled_tokens) for rec in h.history) == 2
    h.assert_no_leaks()


# ---- prefix caching at admission -------------------------------------------------------------
@pytest.mark.parametrize("caching", [True, False])
def test_second_request_is_admitted_with_its_cached_prefix(caching: bool) -> None:
    h = Harness(budget=16, caching=caching)
    prompt = list(range(100, 110))
    h.add("a", prompt, max_tokens=3)
    h.step()  # computes a's prompt; its two full blocks become hittable after the step
    a_blocks = h.blocks("a")
    h.add("b", prompt[:9] + [7, 7, 7], max_tokens=1)
    h.add("c", prompt[:8], max_tokens=1)  # all full blocks cached: capped at num_tokens - 1
    rec = h.step()
    new = {n.req_id: n for n in rec.out.scheduled_new_reqs}
    if caching:
        assert new["b"].num_computed_tokens == 8 and new["b"].block_ids[:2] == a_blocks[:2]
        assert rec.out.num_scheduled_tokens["b"] == 12 - 8
        assert new["c"].num_computed_tokens == BS and new["c"].block_ids[:1] == a_blocks[:1]
        assert new["c"].block_ids[1] not in a_blocks
        assert rec.out.num_scheduled_tokens["c"] == 8 - BS
    else:
        assert new["b"].num_computed_tokens == new["c"].num_computed_tokens == 0
        assert not set(new["b"].block_ids + new["c"].block_ids) & set(a_blocks)
    h.run()
    h.assert_no_leaks()


def test_request_admitted_in_the_same_step_misses_the_prefix_being_computed() -> None:
    h = Harness(budget=32)
    prompt = list(range(100, 110))
    h.add("a", prompt, max_tokens=2)
    h.add("b", prompt, max_tokens=2)
    rec = h.step()
    assert [n.num_computed_tokens for n in rec.out.scheduled_new_reqs] == [0, 0]
    h.run()
    h.assert_no_leaks()


# ---- preemption ------------------------------------------------------------------------------
def test_fcfs_preempts_the_newest_request_which_resumes_with_its_outputs() -> None:
    h = Harness(num_blocks=7, budget=16, max_num_seqs=3)  # 6 usable blocks
    for rid in "abc":
        h.add(rid, 4, max_tokens=10)
    h.step()
    h.add("d", 4, max_tokens=1)
    for _ in range(10):
        if (rec := h.step()).out.preempted_req_ids:
            break
    c = h.all["c"]
    assert rec.out.preempted_req_ids == {"c"} and h.sched.num_preemptions == 1
    assert rec.out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert rec.new_ids == []  # d waited although a seat and budget were free
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert h.blocks("c") == [] and c.num_preemptions == 1
    assert h.kv.num_free_blocks == 6 - len(h.blocks("a")) - len(h.blocks("b"))
    assert list(h.sched.waiting) == [c, h.all["d"]]  # back at the front
    outputs_so_far = list(c.output_token_ids)
    assert len(outputs_so_far) == 5
    while "c" not in (rec := h.step()).new_ids:
        pass
    resumed = next(n for n in rec.out.scheduled_new_reqs if n.req_id == "c")
    assert resumed.token_ids == c.prompt_token_ids + outputs_so_far
    assert resumed.num_output_tokens == 5 and resumed.num_prompt_tokens == 4
    h.run()
    assert c.output_token_ids == expected_outputs(10)
    h.assert_no_leaks()


def _fill_two_requests(policy: str, b_priority: int, b_arrival: float, a_arrival: float
                       ) -> Harness:
    """B (6-token prompt) runs first, A (4 tokens) joins; the 3-block pool is then full, and
    A's next decode needs a block: somebody must be preempted."""
    h = Harness(num_blocks=4, budget=16, policy=policy)
    h.add("B", 6, max_tokens=6, priority=b_priority, arrival=b_arrival)
    h.step()
    h.add("A", 4, max_tokens=8, priority=0, arrival=a_arrival)
    h.step()
    assert h.kv.num_free_blocks == 0 and [r.request_id for r in h.sched.running] == ["B", "A"]
    return h


def test_priority_victim_scheduled_earlier_in_the_step_is_refunded() -> None:
    h = Harness(num_blocks=5, budget=16, policy="priority")  # 4 usable blocks
    h.add("B", 6, max_tokens=6, priority=5)
    h.step()
    h.add("A", 4, max_tokens=8)
    h.add("C", 3, max_tokens=2)
    h.step()
    assert h.kv.num_free_blocks == 0 and [r.request_id for r in h.sched.running] == ["B", "A", "C"]
    b_blocks = h.blocks("B")
    rec = h.step()  # B decodes first, then A needs a block: B is the victim and is refunded
    cached = rec.out.scheduled_cached_reqs
    assert rec.out.preempted_req_ids == {"B"}
    assert rec.out.num_scheduled_tokens == {"A": 1, "C": 1}  # C is not skipped
    assert rec.out.total_num_scheduled_tokens == 2
    assert cached.req_ids == ["A", "C"] and cached.new_block_ids[1] == []
    assert len(cached.new_block_ids[0]) == 1 and cached.new_block_ids[0][0] in b_blocks
    assert h.all["B"].num_computed_tokens == 0 and h.sched.waiting[0] is h.all["B"]
    h.run()
    assert h.all["B"].output_token_ids == expected_outputs(6)
    h.assert_no_leaks()


@pytest.mark.parametrize("policy,victim", [("priority", "B"), ("fcfs", "A")])
def test_priority_ties_preempt_the_latest_arrival_fcfs_the_newest_running(
        policy: str, victim: str) -> None:
    # B was admitted first but arrived later than A (same priority)
    h = _fill_two_requests(policy, b_priority=0, b_arrival=5.0, a_arrival=1.0)
    rec = h.step()
    assert rec.out.preempted_req_ids == {victim}
    assert victim not in rec.out.num_scheduled_tokens and len(rec.out.num_scheduled_tokens) == 1
    h.run()
    h.assert_no_leaks()


def test_priority_policy_admits_by_priority_then_arrival() -> None:
    h = Harness(budget=4, policy="priority", max_num_seqs=1)
    h.add("low", 2, max_tokens=1, priority=3, arrival=0.0)
    h.add("high_late", 2, max_tokens=1, priority=1, arrival=2.0)
    h.add("high_early", 2, max_tokens=1, priority=1, arrival=1.0)
    order = [rec.new_ids[0] for rec in (h.step(), h.step(), h.step())]
    assert order == ["high_early", "high_late", "low"]
    h.assert_no_leaks()


# ---- aborts and stop conditions --------------------------------------------------------------
def test_abort_of_waiting_running_and_mid_prefill_requests_frees_blocks() -> None:
    h = Harness(num_blocks=16, budget=8, max_num_seqs=2)
    h.add("dec", 3, max_tokens=20)
    h.add("pre", 20, max_tokens=2)
    h.add("wait", 3, max_tokens=2)
    h.step()
    h.step()
    assert h.all["pre"].num_computed_tokens < 20 and h.blocks("pre")
    h.abort("pre", "wait", "unknown-id")
    assert h.kv.num_free_blocks == 15 - len(h.blocks("dec"))
    assert h.step().out.finished_req_ids == {"pre", "wait"}
    assert h.step().out.finished_req_ids == set()
    rec = h.schedule()
    h.abort("dec")  # while its step runs: the late sampled token is dropped
    h.update(rec)
    assert rec.outputs == [] and h.schedule().out.finished_req_ids == {"dec"}
    assert h.all["dec"].status == RequestStatus.FINISHED_ABORTED
    h.assert_no_leaks()


def _decode_with(h: Harness, rid: str, tokens: list[int]) -> list:
    outs = []
    for token in tokens:
        if rid not in h.sched.requests:
            break
        outs += [o for o in h.step(tokens={rid: token}).outputs if o.request_id == rid]
    return outs


@pytest.mark.parametrize("params,tokens,n_out,reason,stop_reason", [
    ({}, [5, EOS, 6], 2, "stop", None),
    ({"ignore_eos": True}, [EOS, EOS, EOS, EOS], 4, "length", None),
    ({"stop_token_ids": [77]}, [5, 77, 6], 2, "stop", 77),
    ({"min_tokens": 3}, [EOS, EOS, EOS, 6], 3, "stop", None),
    ({"min_tokens": 3, "stop_token_ids": [77]}, [77, 77, 77], 3, "stop", 77),
    ({}, [5, 6, 7, 8, 9], 4, "length", None),  # max_tokens
])
def test_stop_conditions(params: dict, tokens: list[int], n_out: int, reason: str,
                         stop_reason: int | None) -> None:
    h = Harness()
    req = h.add("r", 5, max_tokens=4, **params)
    outs = _decode_with(h, "r", tokens)
    assert len(outs) == n_out and req.output_token_ids == tokens[:n_out]
    assert [o.finish_reason for o in outs] == [None] * (n_out - 1) + [reason]
    assert outs[-1].stop_reason == stop_reason and req.stop_reason == stop_reason
    assert h.schedule().out.finished_req_ids == {"r"}
    h.assert_no_leaks()


def test_max_model_len_caps_the_output() -> None:
    h = Harness(max_model_len=8)
    req = h.add("r", 6, max_tokens=100)
    outs = _decode_with(h, "r", [5, 6, 7])
    assert req.num_tokens == 8 and outs[-1].finish_reason == "length" and len(outs) == 2
    h.assert_no_leaks()


# ---- V0-style steps --------------------------------------------------------------------------
def test_without_mixed_batching_no_step_mixes_prefill_and_decode() -> None:
    h = Harness(budget=8, mixed=False)
    h.add("a", 4, max_tokens=8)
    h.step()
    h.step()
    h.add("b", 12, max_tokens=3)
    h.add("c", 3, max_tokens=3)
    h.run()
    kinds = [{rec.is_decode(r) for r in rec.out.num_scheduled_tokens} for rec in h.history]
    assert all(len(k) <= 1 for k in kinds)
    assert {True} in kinds and {False} in kinds
    h.assert_no_leaks()


def test_without_mixed_batching_a_full_batch_does_not_deadlock() -> None:
    h = Harness(mixed=False, max_num_seqs=1)
    h.add("a", 6, max_tokens=3)
    h.add("b", 6, max_tokens=3)
    h.run(max_steps=50)


def test_without_mixed_batching_preemption_does_not_deadlock() -> None:
    h = Harness(mixed=False, num_blocks=5, budget=8)
    h.add("a", 4, max_tokens=12)
    h.add("b", 4, max_tokens=12)
    h.run(max_steps=100)


def test_without_mixed_batching_recompute_after_preemption_is_not_mixed_with_decodes() -> None:
    h = Harness(mixed=False, num_blocks=5, budget=4, caching=False)
    h.add("r0", 1, max_tokens=8)
    h.add("r1", 4, max_tokens=6)
    h.run()
    assert h.sched.num_preemptions > 0
    for rec in h.history:
        assert len({rec.is_decode(r) for r in rec.out.num_scheduled_tokens}) <= 1


def test_without_mixed_batching_a_free_cached_block_counts_once_so_decodes_run() -> None:
    """r1 is preempted; its cached first block sits in the free queue. Counting that block both
    as free and as a hit made every step a prefill step that could admit nobody: a hang."""
    h = Harness(mixed=False, budget=6, chunked=False, max_num_seqs=2, num_blocks=3)
    h.add("r0", [10], max_tokens=3)
    h.add("r1", [10, 10, 10, 10], max_tokens=2)
    for i in range(2, 5):
        h.add(f"r{i}", [10], max_tokens=1)
    h.run(max_steps=40)
    assert h.sched.num_preemptions > 0
    assert h.all["r0"].output_token_ids == expected_outputs(3)
    h.assert_no_leaks()


# ---- n > 1 siblings --------------------------------------------------------------------------
def test_sibling_waits_while_the_shared_prompt_is_computed_then_hits_it() -> None:
    h = Harness(budget=8, threshold=4)
    prompt = list(range(100, 110))
    h.add("s0", prompt, max_tokens=3, group_id="g")
    s1 = h.add("s1", prompt, max_tokens=3, group_id="g")
    h.add("other", 2, max_tokens=1)
    first = h.step()
    assert first.new_ids == ["s0", "other"]  # the sibling is skipped, not a barrier
    while h.all["s0"].num_computed_tokens < len(prompt):
        assert s1.status == RequestStatus.WAITING
        h.step()
    s0_blocks = h.blocks("s0")
    while "s1" not in (rec := h.step()).new_ids:
        pass
    new = rec.out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 8 and new.block_ids[:2] == s0_blocks[:2]
    h.run()
    h.assert_no_leaks()


def test_sibling_is_admitted_as_soon_as_the_shared_prompt_is_computed() -> None:
    h = Harness(budget=16)
    prompt = list(range(100, 110))
    h.add("s0", prompt, max_tokens=6, group_id="g")
    h.add("s1", prompt, max_tokens=6, group_id="g")
    assert h.step().new_ids == ["s0"]
    rec = h.step()
    assert rec.new_ids == ["s1"] and rec.is_decode("s0")


# ---- random workloads ------------------------------------------------------------------------
@dataclass(frozen=True)
class Arrival:
    rid: str
    prompt: list[int]
    max_tokens: int
    step: int
    priority: int
    abort_at: int | None
    group_id: str | None


tokens_st = st.lists(st.integers(10, 13), max_size=10)  # few distinct ids: prefixes repeat


@st.composite
def workloads(draw: st.DrawFn) -> tuple[dict, list[Arrival]]:
    prefixes = draw(st.lists(tokens_st, min_size=1, max_size=3))
    arrivals: list[Arrival] = []
    for i in range(draw(st.integers(1, 7))):
        prompt = (draw(st.sampled_from(prefixes)) + draw(tokens_st)) or [10]
        n = draw(st.sampled_from([1, 1, 1, 2, 3]))  # n > 1: siblings sharing the prompt
        step, max_tokens = draw(st.integers(0, 12)), draw(st.integers(1, 8))
        priority = draw(st.integers(0, 3))
        for k in range(n):
            abort_at = draw(st.none() | st.none() | st.integers(0, 30))
            arrivals.append(Arrival(f"r{i}.{k}", prompt, max_tokens, step, priority, abort_at,
                                    f"g{i}" if n > 1 else None))
    longest = max(len(a.prompt) + a.max_tokens for a in arrivals)
    budget = draw(st.integers(4, 24))
    cfg = {"budget": budget,
           "threshold": draw(st.just(0) | st.integers(1, budget)),
           "chunked": draw(st.booleans()),
           "policy": draw(st.sampled_from(["fcfs", "priority"])),
           "caching": draw(st.booleans()),
           "max_num_seqs": draw(st.integers(1, 6)),
           "max_partial": draw(st.sampled_from([0, 0, 1, 2])),
           "mixed": draw(st.booleans()),
           "async_scheduling": draw(st.booleans()),
           # every request fits the pool alone, so preemption always ends
           "num_blocks": -(-longest // BS) + 1 + draw(st.sampled_from([0, 0, 1, 2, 3, 6, 12]))}
    if not cfg["chunked"]:
        cfg["budget"] = max(budget, longest)  # else a prompt (or a resume) never fits: a hang
    return cfg, arrivals


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_random_workloads_keep_every_invariant_and_finish(
        workload: tuple[dict, list[Arrival]]) -> None:
    cfg, arrivals = workload
    async_scheduling = cfg.pop("async_scheduling")
    h = Harness(**cfg)
    streamed: dict[str, list[int]] = {a.rid: [] for a in arrivals}
    finish: dict[str, str] = {}
    step = 0
    while step <= max(a.step for a in arrivals) or h.sched.has_unfinished_requests():
        assert step < 2000, "the scheduler stopped making progress"
        for a in arrivals:
            if a.step == step:
                h.add(a.rid, a.prompt, max_tokens=a.max_tokens, priority=a.priority,
                      arrival=float(a.step), group_id=a.group_id)
            if a.abort_at == step and a.rid in h.sched.requests:
                h.abort(a.rid)
        # check_step and the WorkerView run inside
        for out in h.step_ahead() if async_scheduling else h.step().outputs:
            assert out.request_id not in finish
            streamed[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
        step += 1
    h.assert_no_leaks()
    for a in arrivals:
        req = h.all[a.rid]
        assert streamed[a.rid] == req.output_token_ids
        if a.rid in h.aborted:
            assert req.status == RequestStatus.FINISHED_ABORTED and a.rid not in finish
        else:
            assert req.output_token_ids == expected_outputs(a.max_tokens)
            assert finish[a.rid] == "length"
