"""The speculation switch keeps whichever way measured more tokens per second."""

from __future__ import annotations

import pytest

from jaxserve.engine.spec_switch import SpeculationSwitch


def run(switch: SpeculationSwitch, steps: int, rate: dict[bool, float],
        requests: int = 1) -> list[bool]:
    """Feed `steps` steps of 1 s each, yielding rate[on] tokens to each of `requests`; the
    modes the steps ran in."""
    modes = []
    for _ in range(steps):
        modes.append(switch.on)
        switch.record(int(rate[switch.on]) * requests, requests, 1.0)
    return modes


@pytest.mark.parametrize("faster", [True, False])
def test_keeps_the_faster_way_after_measuring_both(faster):
    switch = SpeculationSwitch(window=4, hold=3)
    rate = {faster: 10.0, not faster: 6.0}
    modes = run(switch, 8 + 12, rate)
    assert modes[:8] == [True] * 4 + [False] * 4  # on first, then off
    assert modes[8:] == [faster] * 12  # held for hold windows
    # Then both again: the winner first, then the other, then the winner held.
    assert run(switch, 8, rate) == [faster] * 4 + [not faster] * 4
    assert switch.on == faster


def test_follows_a_workload_that_changes():
    switch = SpeculationSwitch(window=4, hold=3)
    run(switch, 20, {True: 10.0, False: 6.0})
    assert switch.on
    run(switch, 20, {True: 3.0, False: 6.0})  # drafts stop paying
    assert not switch.on


def test_a_shrinking_batch_does_not_make_the_way_measured_last_look_slower():
    """Drafting measured with 8 requests running, then not drafting with 2 left: per request,
    not drafting is faster, though the engine as a whole made fewer tokens a second."""
    switch = SpeculationSwitch(window=4, hold=3)
    run(switch, 4, {True: 3.0, False: 4.0}, requests=8)  # on: 24 tokens a step in all
    run(switch, 4, {True: 3.0, False: 4.0}, requests=2)  # off: 8 tokens a step in all
    assert not switch.on


def test_a_step_that_returned_no_tokens_is_not_counted():
    switch = SpeculationSwitch(window=2, hold=3)
    switch.record(0, 0, 5.0)  # e.g. the first step under async scheduling
    run(switch, 2, {True: 10.0, False: 6.0})
    run(switch, 2, {True: 10.0, False: 6.0})
    assert switch.on
