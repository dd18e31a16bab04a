"""The speculation switch keeps whichever way measured more tokens per second."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from jaxserve.engine.spec_switch import SpeculationSwitch


def run(switch: SpeculationSwitch, steps: int, rate: Callable[[bool, int], float],
        requests: Callable[[bool], int] = lambda on: 1) -> list[bool]:
    """Feed `steps` steps of 1 s each; step i (counted from 0) in way `on` yields
    rate(on, i) tokens to each of requests(on) requests. The ways the steps ran in."""
    ways = []
    for i in range(steps):
        on = switch.on
        ways.append(on)
        switch.record(int(rate(on, i)) * requests(on), requests(on), 1.0)
    return ways


def fixed(on_rate: float, off_rate: float) -> Callable[[bool, int], float]:
    return lambda on, i: on_rate if on else off_rate


@pytest.mark.parametrize("faster", [True, False])
def test_keeps_the_faster_way_after_measuring_both_in_turns(faster):
    switch = SpeculationSwitch(window=4, hold=3, stride=2, settle=0)
    rate = fixed(10.0, 6.0) if faster else fixed(6.0, 10.0)
    ways = run(switch, 8 + 12, rate)
    assert ways[:8] == [True, True, False, False] * 2  # on first, turns of 2 steps
    assert ways[8:] == [faster] * 12  # held for hold windows
    # Then both again, the held way first, then the winner held.
    assert run(switch, 8, rate) == [faster, faster, not faster, not faster] * 2
    assert switch.on == faster


def test_follows_a_workload_that_changes():
    switch = SpeculationSwitch(window=4, hold=3, stride=2, settle=0)
    run(switch, 20, fixed(10.0, 6.0))
    assert switch.on
    run(switch, 20, fixed(3.0, 6.0))  # drafts stop paying
    assert not switch.on


def test_a_workload_that_speeds_up_does_not_favour_the_way_measured_later():
    """Steps get faster as the batch shrinks; drafting is 30% faster at any moment. Measured
    one after the other (on, then off), not drafting would have won by half."""
    switch = SpeculationSwitch(window=8, hold=3, stride=2, settle=0)
    run(switch, 16, lambda on, i: (10.0 + 2 * i) * (1.3 if on else 1.0))
    assert switch.on


def test_a_shrinking_batch_does_not_make_the_way_with_fewer_requests_look_slower():
    """Drafting steps with 8 requests running, the others with 2: per request, not drafting is
    faster, though those steps made fewer tokens in all."""
    switch = SpeculationSwitch(window=4, hold=3, stride=2, settle=0)
    run(switch, 8, fixed(3.0, 4.0), requests=lambda on: 8 if on else 2)
    assert not switch.on


def test_a_step_that_returned_no_tokens_is_not_counted():
    switch = SpeculationSwitch(window=2, hold=3, stride=2, settle=0)
    switch.record(0, 0, 5.0)  # e.g. the first step under async scheduling
    run(switch, 4, fixed(10.0, 6.0))
    assert switch.on


def test_the_first_steps_of_a_turn_are_not_counted():
    """With async scheduling a turn's first step returns the other way's tokens: a switch that
    counted them would credit each way with the other's last step (here: not drafting with a
    drafting step's 50 tokens, and it would win)."""
    switch = SpeculationSwitch(window=2, hold=3, stride=3, settle=1)
    # Every turn's first step is an outlier (what the way before it left); the rest are honest.
    ways = run(switch, 6, lambda on, i: 50.0 if i % 3 == 0 and not on else (10.0 if on else 6.0))
    assert ways == [True] * 3 + [False] * 3
    assert switch.on


def test_a_winner_measured_again_is_held_twice_as_long_up_to_eight_times():
    switch = SpeculationSwitch(window=2, hold=3, stride=2, settle=0)
    ways = run(switch, 300, fixed(6.0, 10.0))  # not drafting wins every measurement
    # Between two measurements' drafting turns: the hold, then the next measurement's first
    # turn (the held way first); the first measurement's own turn not drafting before that.
    off_runs = [len(r) for r in "".join("T" if w else "F" for w in ways).split("T") if r]
    assert off_runs[:6] == [2 + 6 + 2, 12 + 2, 24 + 2, 48 + 2, 48 + 2, 48 + 2]
    # Drafting wins from now on: once measured, its first hold is the shortest again.
    ways = run(switch, 100, fixed(10.0, 6.0))
    on_runs = [len(r) for r in "".join("T" if w else "F" for w in ways).split("F") if r]
    assert on_runs[:3] == [2 + 6 + 2, 12 + 2, 24 + 2]


@pytest.mark.parametrize("gain, kept", [(1.03, False), (1.08, True)])
def test_drafting_is_kept_only_when_it_measured_the_margin_faster(gain, kept):
    """A drafting way 3% faster is within a shared machine's noise: not drafting is kept."""
    switch = SpeculationSwitch(window=4, hold=3, stride=2, settle=0, margin=0.05)
    run(switch, 8, lambda on, i: 100.0 * gain if on else 100.0)
    assert switch.on == kept
