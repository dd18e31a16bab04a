"""Per-phase wall time of the engine's steps, recorded where each phase runs, cheap enough to
stay on (two perf_counter calls a phase). Phases: schedule (the scheduler), prep (persistent
batch, ragged arrays, sampling metadata), dispatch (the jitted calls until they return
un-awaited arrays, host-to-device copies included), device (waiting for the sampled ids),
update (recording ids, update_from_output), output (detokenising, RequestOutputs) and mask
(structured outputs: grammar bitmasks in the scheduler, matchers advanced in its update; a part
of schedule and update, not added to them)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

PHASES = ("schedule", "prep", "dispatch", "device", "update", "output", "mask")


@dataclass(slots=True)
class StepTimings:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def merged(self, *others: "StepTimings") -> "StepTimings":
        out = StepTimings(dict(self.seconds))
        for other in others:
            for name, secs in other.seconds.items():
                out.seconds[name] += secs
        return out
