"""Whether drafting pays: each request's output tokens per second measured with it on and off,
the faster kept.

Drafting costs a bigger step and, since drafts follow the tokens of the step before, the
overlap of async scheduling; what it saves depends on the acceptance, the batch, the model and
the machine. So the engine measures rather than guesses: it runs `window` steps each way (wall
time between steps: the caller's work counts, which async scheduling overlaps), keeps the
faster for `hold` windows, then measures both again (the workload may have changed). Each
measurement that keeps the same winner doubles the hold after it, up to 8 times: measuring
costs half its steps in the slower way.

The two ways take turns while measuring, `stride` steps at a time: the batch drifts as requests
finish or arrive and a request's text changes what its drafts catch, so two windows one after
the other would time two different workloads, and the later one (a smaller batch, faster
steps) would win whatever drafting did. The first `settle` steps of a turn are not counted:
with async scheduling a step returns the tokens of the step launched before it, so they would
time one way's work as the other's. A step's tokens are counted per request that got any, as
the batch drifts.

Drafting is kept only when it measured `margin` faster: a few windows on a shared machine
differ by several percent, and a wrong "on" held costs the drafting steps' whole price (a
layer-skip step of a model whose drafts are never accepted: 2.5x a plain one), where a wrong
"off" costs at most the margin.
"""

from __future__ import annotations


class SpeculationSwitch:
    def __init__(self, window: int = 16, hold: int = 12, stride: int = 8, settle: int = 2,
                 margin: float = 0.05):
        self.window, self.hold, self.stride, self.settle = window, hold, stride, settle
        self.margin = margin
        self.on = True
        self._exploring = True  # measuring both ways, not holding the winner
        self._steps = {True: 0, False: 0}  # counted steps of the current measurement or hold
        self._tokens = {True: 0.0, False: 0.0}  # per request, summed over steps
        self._seconds = {True: 0.0, False: 0.0}
        self._in_a_row = 0  # steps this way since the last turn
        self._held: bool | None = None  # the last measurement's winner
        self._same_winner = 0  # measurements in a row that kept it

    def record(self, num_tokens: int, num_requests: int, seconds: float) -> bool:
        """Count one engine step that took `seconds` and returned `num_tokens` tokens to
        `num_requests` requests (a step that returned none is not counted); returns whether
        the next step drafts."""
        if num_requests == 0:
            return self.on
        way = self.on
        if not self._exploring:
            self._steps[way] += 1
            if self._steps[way] == self.window * self.hold * 2 ** min(self._same_winner, 3):
                self._reset(exploring=True)  # measure again, the held way first
            return self.on
        self._in_a_row += 1
        if self._in_a_row > self.settle:
            self._steps[way] += 1
            self._tokens[way] += num_tokens / num_requests
            self._seconds[way] += seconds
        if min(self._steps.values()) >= self.window:
            rate = {w: self._tokens[w] / max(self._seconds[w], 1e-9) for w in (True, False)}
            self._reset(exploring=False)
            winner = rate[True] > rate[False] * (1 + self.margin)
            self._same_winner = self._same_winner + 1 if winner == self._held else 0
            self.on = self._held = winner
        elif self._in_a_row == self.stride or self._steps[way] >= self.window:
            self.on, self._in_a_row = not way, 0
        return self.on

    def _reset(self, exploring: bool) -> None:
        self._exploring, self._in_a_row = exploring, 0
        self._steps = {True: 0, False: 0}
        self._tokens = {True: 0.0, False: 0.0}
        self._seconds = {True: 0.0, False: 0.0}
