"""Async scheduling in the scheduler: the next step is scheduled before this one's tokens arrive
(output placeholders), with fake sampled tokens. The random-workload property test in
test_scheduler.py runs both modes."""

from __future__ import annotations

from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.core.scheduler_output import ModelRunnerOutput
from sched_helpers import EOS, FIRST_SAMPLED, Harness, expected_outputs


def test_a_decode_is_scheduled_on_its_token_in_flight_until_max_tokens_is_covered() -> None:
    h = Harness()
    req = h.add("r", 6, max_tokens=3)
    s1 = h.schedule()  # the prefill, which samples the first output
    assert s1.out.sampling_req_ids == {"r"} and req.num_output_placeholders == 1
    s2 = h.schedule()  # no update yet: decode the token in flight
    assert s2.out.num_scheduled_tokens == {"r": 1} and s2.out.sampling_req_ids == {"r"}
    assert req.num_computed_tokens == 7 and req.num_output_placeholders == 2
    assert [o.new_token_ids for o in h.update(s1).outputs] == [[FIRST_SAMPLED]]
    assert req.num_output_placeholders == 1
    s3 = h.schedule()  # 1 output + 1 in flight + this one = max_tokens
    h.update(s2)
    assert h.schedule().out.is_empty  # 2 outputs + 1 in flight: nothing more to compute
    assert h.update(s3).outputs[0].finish_reason == "length"
    assert req.output_token_ids == expected_outputs(3)
    h.assert_no_leaks()


def test_a_token_computed_after_the_stop_token_is_dropped() -> None:
    h = Harness()
    req = h.add("r", 6, max_tokens=10)
    s1 = h.schedule()
    s2 = h.schedule()
    assert h.update(s1, {"r": EOS}).outputs[0].finish_reason == "stop"
    assert h.update(s2).outputs == [] and req.output_token_ids == [EOS]
    h.assert_no_leaks()


def test_preemption_drops_the_token_in_flight_and_recomputes_it() -> None:
    h = Harness(num_blocks=5, budget=8)  # 4 usable blocks of 4 tokens
    a, b = h.add("a", 7, max_tokens=8), h.add("b", 6, max_tokens=8)
    pending = h.schedule()  # both prefills
    while "b" not in (record := h.schedule()).out.preempted_req_ids:
        h.update(pending)
        pending = record
    assert b.num_output_placeholders == 0 and b.num_computed_tokens == 0
    h.update(pending)  # b's token from that step is dropped: b is waiting again
    while h.sched.has_unfinished_requests():
        h.update(record)
        record = h.schedule()
    h.update(record)
    assert a.output_token_ids == expected_outputs(8) and b.output_token_ids == expected_outputs(8)
    h.assert_no_leaks()


def test_drafts_are_scheduled_on_a_drafting_step_in_flight_and_taken_back_by_its_update():
    """With speculation the next step counts the drafts in flight as accepted: one input (the
    sample after them, on the device) and new draft slots (-1: the step fills them on the
    device); the update takes back the rejected ones, and the counts meet what the worker
    computes."""
    spec = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2,
                             adaptive=False)
    h = Harness(speculative_config=spec)
    req = h.add("r", [5, 6, 7, 5, 6, 7, 5, 6], max_tokens=20)
    s1 = h.schedule()  # the prompt; its sample is in flight
    s2 = h.schedule()
    assert s2.out.scheduled_spec_decode_tokens == {"r": [-1, -1, -1]}
    assert s2.out.num_scheduled_tokens == {"r": 4} and req.num_computed_tokens == 12
    h.sched.update_from_output(s1.out, ModelRunnerOutput(["r"], [[7]]))
    s3 = h.schedule()  # on top of s2 as if it accepted its 3 drafts
    assert s3.out.scheduled_spec_decode_tokens == {"r": [-1, -1, -1]}
    assert s3.out.num_scheduled_tokens == {"r": 4} and req.num_computed_tokens == 16
    # s2 accepts one draft and samples 9: two positions back (the device moved s3 with them)
    h.sched.update_from_output(s2.out, ModelRunnerOutput(["r"], [[5, 9]]))
    assert req.output_token_ids == [7, 5, 9] and req.num_computed_tokens == 14
    assert req.draft_placeholders == [-1, -1, -1] and req.num_output_placeholders == 1
    h.sched.update_from_output(s3.out, ModelRunnerOutput(["r"], [[6, 7, 5, 8]]))
    assert req.output_token_ids == [7, 5, 9, 6, 7, 5, 8]
    assert req.num_computed_tokens == req.num_tokens - 1 and not req.draft_placeholders
    h.abort("r")
    h.assert_no_leaks()
