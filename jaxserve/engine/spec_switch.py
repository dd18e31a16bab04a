"""Whether drafting pays: each request's output tokens per second measured with it on and off,
the faster kept.

Drafting costs a bigger step and, since drafts follow the tokens of the step before, the
overlap of async scheduling; what it saves depends on the acceptance, the batch, the model and
the machine. So the engine measures rather than guesses: it runs `window` steps each way (wall
time between steps: the caller's work counts, which async scheduling overlaps), keeps the
faster for `hold` windows, then measures both again (the workload may have changed).

A step's tokens are counted per request that got any: as requests finish or arrive, the
engine's tokens per step follow the batch, and a window that happened to run fewer requests
would read as the slower way.
"""

from __future__ import annotations


class SpeculationSwitch:
    def __init__(self, window: int = 16, hold: int = 12):
        self.window, self.hold = window, hold
        self.on = True
        self._rates: dict[bool, float] = {}
        self._steps = 0  # in the current stretch
        self._tokens = 0.0  # per request, summed over steps
        self._seconds = 0.0
        self._exploring = True  # measuring one way or the other, not holding the winner

    def record(self, num_tokens: int, num_requests: int, seconds: float) -> bool:
        """Count one engine step that took `seconds` and returned `num_tokens` tokens to
        `num_requests` requests (a step that returned none is not counted); returns whether
        the next step drafts."""
        if num_requests == 0:
            return self.on
        self._seconds += seconds
        self._tokens += num_tokens / num_requests
        self._steps += 1
        if self._exploring and self._steps == self.window:
            self._rates[self.on] = self._tokens / max(self._seconds, 1e-9)
            if len(self._rates) < 2:
                self._switch(not self.on)  # now the other way
            else:
                self._exploring = False
                self._switch(max(self._rates, key=self._rates.get))
        elif not self._exploring and self._steps == self.window * self.hold:
            self._rates.clear()
            self._exploring = True
            self._switch(self.on)  # measure this way again, then the other
        return self.on

    def _switch(self, on: bool) -> None:
        self.on, self._steps, self._tokens, self._seconds = on, 0, 0.0, 0.0
