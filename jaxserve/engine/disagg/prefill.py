"""The prefill side: an EngineCore that runs each request only up to its first output token.

A request whose first token does not finish it is detached from its scheduler and parked,
still holding its blocks, until the decode side pulls its KV (`read_kv`). The pull dispatches a
copy of the blocks and releases them at once: they stay in the prefix cache for later prompts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax

from jaxserve.core.scheduler_output import EngineCoreOutput, SchedulerOutput
from jaxserve.engine.core import EngineCore, EngineStats
from jaxserve.executor.model_runner import PendingStep
from jaxserve.core.request import Request, RequestStatus


@dataclass(slots=True)
class Parked:
    request: Request
    rank: int
    since: float  # time.time() when its first token came out


@dataclass(slots=True)
class PendingPrefill:
    scheds: list[SchedulerOutput]
    steps: list[PendingStep | None]


class PrefillSide:
    def __init__(self, core: EngineCore, max_parked: int):
        self.core = core
        self.max_parked = max_parked
        self.parked: dict[str, Parked] = {}
        self.block_size = core.config.cache.block_size

    def add_request(self, request: Request) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        parked = [r for r in request_ids if r in self.parked]
        for req_id in parked:
            self.release(req_id)
        self.core.abort_requests([r for r in request_ids if r not in parked], status)

    def has_work(self) -> bool:
        return self.core.has_unfinished_requests()

    def dispatch(self) -> PendingPrefill | None:
        """Launch a prefill step, unless too many requests are parked already: then the decode
        side is full, and prefilling more would only fill this side's blocks (back-pressure)."""
        if not self.has_work() or len(self.parked) >= self.max_parked:
            return None
        scheds = [s.schedule() for s in self.core.schedulers]
        return PendingPrefill(scheds, self.core.executor.dispatch(scheds))

    def collect(self, pending: PendingPrefill | None) -> list[EngineCoreOutput]:
        """Finish the step: every output is a request's first token; those that do not finish
        the request park it."""
        if pending is None:
            return []
        core = self.core
        results = core.executor.collect(pending.steps)
        outputs: list[EngineCoreOutput] = []
        now = time.time()
        for rank, (scheduler, sched, result) in enumerate(
                zip(core.schedulers, pending.scheds, results)):
            for out in scheduler.update_from_output(sched, result):
                core.router.forget(out.request_id)
                if out.finish_reason is None:
                    self.parked[out.request_id] = Parked(
                        scheduler.detach_request(out.request_id), rank, now)
                outputs.append(out)
        core.num_steps += 1
        return outputs

    def read_kv(self, request_id: str, heads: tuple[int, ...]
                ) -> tuple[jax.Array, jax.Array, int]:
        """Dispatch a copy of a parked request's prompt blocks (in the destination head layout,
        padded to a block bucket) and release the blocks. Returns (k, v, number of blocks)."""
        parked = self.parked.pop(request_id)
        n = -(-parked.request.num_prompt_tokens // self.block_size)
        kv = self.core.schedulers[parked.rank].kv
        block_ids = kv.get_block_ids(request_id)[:n]
        k, v = self.core.executor.workers[parked.rank].runner.read_blocks(block_ids, heads)
        # Freeing before the copy has run is safe: the copy already holds the cache by value,
        # and the next step that may overwrite these blocks donates that cache, which the
        # runtime hands over only after the copy's read is done.
        kv.free(parked.request)
        return k, v, n

    def release(self, request_id: str) -> None:
        parked = self.parked.pop(request_id)
        self.core.schedulers[parked.rank].kv.free(parked.request)

    def stats(self) -> EngineStats:
        stats = self.core.stats()
        stats.num_running += len(self.parked)  # parked requests hold blocks: count them
        return stats

    def num_free_blocks(self) -> list[int]:
        return [s.kv.num_free_blocks for s in self.core.schedulers]

    def warm_up_reads(self, heads: tuple[int, ...]) -> None:
        for worker in self.core.executor.workers:
            worker.runner.warm_up_blocks(heads, write=False)
