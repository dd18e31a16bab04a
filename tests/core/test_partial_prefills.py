"""`max_num_partial_prefills`: at most N requests get prefill tokens in one step; decodes are
never held back by it, held-back prefills keep their blocks, and every request still finishes.

Every step also passes `check_step` (which asserts the cap) and the WorkerView diff replay.
"""

from __future__ import annotations

import pytest
from sched_helpers import FIRST_SAMPLED, Harness, StepRecord

from jaxserve.core.request import RequestStatus

THRESHOLD = 16
LONG_LEN = 48  # three chunks of THRESHOLD
DECODES = ("d0", "d1", "d2", "d3")
LONGS = ("L0", "L1", "L2")


def expected_outputs(n: int) -> list[int]:
    return [FIRST_SAMPLED + k for k in range(n)]


def prefills_of(rec: StepRecord) -> list[str]:
    return [r for r in rec.out.num_scheduled_tokens if not rec.is_decode(r)]


def decoding_harness(max_partial: int, **kwargs: object) -> Harness:
    """Four short requests already decoding when three long prompts arrive together."""
    h = Harness(budget=64, threshold=THRESHOLD, max_partial=max_partial, num_blocks=128,
                **kwargs)
    for rid in DECODES:
        h.add(rid, 4, max_tokens=40)
    while any(h.all[rid].num_output_tokens == 0 for rid in DECODES):
        h.step()
    for rid in LONGS:
        h.add(rid, LONG_LEN, max_tokens=3)
    return h


@pytest.mark.parametrize("cap", [0, 1, 2])
def test_cap_bounds_prefills_per_step_and_never_holds_back_a_decode(cap: int) -> None:
    h = decoding_harness(cap)
    per_step: list[list[str]] = []
    while any(h.all[rid].num_computed_tokens < LONG_LEN for rid in LONGS):
        rec = h.step()
        for rid in DECODES:
            assert rec.is_decode(rid), f"{rid} was not decoded in a step with prefills"
        per_step.append(prefills_of(rec))
    assert max(len(p) for p in per_step) == (cap or len(LONGS))
    assert all(len(p) >= 1 for p in per_step)  # the budget always had room for one
    if cap == 1:  # FCFS: one long prompt after another, each in LONG_LEN / THRESHOLD chunks
        assert per_step == [[rid] for rid in LONGS for _ in range(LONG_LEN // THRESHOLD)]
    if cap == 0:
        assert per_step[0] == list(LONGS)  # all three chunked together from the first step
    h.run()
    for rid in DECODES:
        assert h.all[rid].output_token_ids == expected_outputs(40)
    for rid in LONGS:
        assert h.all[rid].output_token_ids == expected_outputs(3)
    h.assert_no_leaks()


def test_oldest_prefill_always_progresses_even_behind_newer_arrivals() -> None:
    h = Harness(budget=20, threshold=8, max_partial=1)
    h.add("old", 40, max_tokens=2)
    chunks = []
    for i in range(5):
        h.add(f"new{i}", 30, max_tokens=2)  # a newcomer every step must not jump the queue
        rec = h.step()
        assert prefills_of(rec) == ["old"]
        chunks.append(rec.out.num_scheduled_tokens["old"])
    assert chunks == [8] * 5
    h.run()
    h.assert_no_leaks()


def test_held_back_running_prefill_keeps_its_blocks_and_is_not_preempted() -> None:
    h = Harness(budget=64, threshold=THRESHOLD, max_partial=3, num_blocks=128)
    for rid in LONGS:
        h.add(rid, LONG_LEN, max_tokens=2)
    assert prefills_of(h.step()) == list(LONGS)
    h.sched.config.max_num_partial_prefills = 1  # read at every step, like the threshold
    held = {rid: h.blocks(rid) for rid in LONGS[1:]}
    for _ in range(LONG_LEN // THRESHOLD - 1):
        rec = h.step()
        assert prefills_of(rec) == ["L0"] and not rec.out.preempted_req_ids
        for rid, blocks in held.items():
            req = h.all[rid]
            assert req.status == RequestStatus.RUNNING and req in h.sched.running
            assert h.blocks(rid) == blocks and req.num_computed_tokens == THRESHOLD
    assert h.all["L0"].num_computed_tokens == LONG_LEN
    rec = h.step()  # L0 decodes, L1 (the older of the held two) takes the one prefill slot
    assert rec.is_decode("L0") and prefills_of(rec) == ["L1"]
    h.run()
    assert h.sched.num_preemptions == 0
    h.assert_no_leaks()


def test_cap_with_v0_phases_keeps_steps_pure_and_one_prefill_each() -> None:
    h = decoding_harness(1, mixed=False)
    h.run()
    assert any(len(prefills_of(rec)) == 1 for rec in h.history)
    for rec in h.history:
        kinds = {rec.is_decode(r) for r in rec.out.num_scheduled_tokens}
        assert len(kinds) <= 1, "a V0-style step mixed prefill and decode"
        assert len(prefills_of(rec)) <= 1
    for rid in LONGS:
        assert h.all[rid].output_token_ids == expected_outputs(3)
    h.assert_no_leaks()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("mixed", [True, False])
def test_cap_with_preemption_finishes_everything_without_leaks(policy: str, mixed: bool) -> None:
    h = Harness(num_blocks=12, budget=16, threshold=8, max_partial=1, policy=policy,
                mixed=mixed, caching=False)  # 11 usable blocks for ~20 blocks of demand
    for i in range(5):
        h.add(f"r{i}", 12 + 4 * i, max_tokens=10, priority=i % 3)
    h.run(max_steps=400)
    assert h.sched.num_preemptions > 0
    for i in range(5):
        assert h.all[f"r{i}"].output_token_ids == expected_outputs(10)
    h.assert_no_leaks()


def test_priority_victim_held_back_this_step_is_preempted_without_a_refund() -> None:
    """V0-style prefill step under the priority policy: the low-priority decodes are held back
    (earlier in `running`, not scheduled), then the prefill behind them needs a block."""
    h = Harness(num_blocks=4, budget=8, policy="priority", mixed=False)  # 3 usable blocks
    h.add("D", 4, max_tokens=6, priority=5)
    h.step()
    h.add("P", 4, max_tokens=3, priority=0)
    h.add("Q", 8, max_tokens=3, priority=0)
    assert h.step().out.num_scheduled_tokens == {"P": 4, "Q": 4}
    assert h.kv.num_free_blocks == 0
    rec = h.step()
    assert rec.out.preempted_req_ids == {"D"} and rec.out.num_scheduled_tokens == {"Q": 4}
    h.run()
    for rid, n in (("D", 6), ("P", 3), ("Q", 3)):
        assert h.all[rid].output_token_ids == expected_outputs(n)
    h.assert_no_leaks()
