"""The speculation switch keeps whichever way measured more tokens per second."""

from __future__ import annotations

import pytest

from jaxserve.engine.spec_switch import SpeculationSwitch


def run(switch: SpeculationSwitch, steps: int, rate: dict[bool, float]) -> list[bool]:
    """Feed `steps` steps of 1 s each, yielding rate[on] tokens; the modes the steps ran in."""
    modes = []
    for _ in range(steps):
        modes.append(switch.on)
        switch.record(int(rate[switch.on]), 1.0)
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
