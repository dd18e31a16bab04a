"""The V1 scheduler: one token budget per step, spent on running requests first, then waiting ones.

There is no prefill or decode phase. Every request has `num_computed_tokens` and `num_tokens`,
and each step hands it up to `min(remaining, long_prefill_token_threshold, budget)` tokens, so
prefill chunks and decodes share a step. Preemption is by recompute: the victim's blocks are freed
and it goes back to the front of the waiting queue (its prefix usually comes back from the cache).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.scheduler_output import (CachedRequestData, EngineCoreOutput,
                                            ModelRunnerOutput, NewRequestData, SchedulerOutput)
from jaxserve.request import Request, RequestStatus

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheConfig, num_blocks: int,
                 max_model_len: int, eos_token_ids: Iterable[int], hash_seed: int | None):
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                 hash_seed=hash_seed)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_steps = 0
        self._prefill_only = False

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        if self.config.scheduling_policy == "priority":
            key = (request.priority, request.arrival_time)
            pos = next((i for i, r in enumerate(self.waiting)
                        if (r.priority, r.arrival_time) > key), len(self.waiting))
            self.waiting.insert(pos, request)
        else:
            self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Abort (or stop, for stop strings found by the output processor) requests by id."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._free(request, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        self._prefill_only = self._prefill_only_step()
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: set[str] = set()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                i += 1
                continue
            while (block_ids := self.kv.allocate_slots(request, num_new)) is None:
                victim = self._pick_victim()
                if self.running.index(victim) < i:  # priority policy: already scheduled, refund
                    i -= 1
                    budget += num_scheduled.pop(victim.request_id)
                    j = cached.req_ids.index(victim.request_id)
                    del cached.req_ids[j], cached.new_block_ids[j], cached.num_computed_tokens[j]
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            if block_ids is None:
                continue  # the request preempted itself; running[i] is now the next one
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append(block_ids)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            i += 1

        if not preempted and (self.config.enable_mixed_batching or self._prefill_only):
            budget = self._admit_waiting(budget, num_scheduled, new_reqs)

        for request in self.running:  # tokens count as computed from now on
            request.num_computed_tokens += num_scheduled.get(request.request_id, 0)
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            finished_req_ids=self.finished_req_ids, preempted_req_ids=preempted)
        self.finished_req_ids = set()
        self.num_steps += 1
        return out

    def _admit_waiting(self, budget: int, num_scheduled: dict[str, int],
                       new_reqs: list[NewRequestData]) -> int:
        deferred: list[Request] = []
        prefilling = {r.group_id for r in self.running if r.num_computed_tokens < r.num_tokens}
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.group_id is not None and request.group_id in prefilling:
                # A sibling (n > 1) is computing the shared prompt: wait one step, then hit
                # its blocks in the prefix cache instead of computing the prompt again.
                deferred.append(self.waiting.popleft())
                continue
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if self.config.long_prefill_token_threshold > 0:
                num_new = min(num_new, self.config.long_prefill_token_threshold)
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            block_ids = self.kv.allocate_slots(request, num_new, hit_blocks)
            if block_ids is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if request.group_id is not None:
                prefilling.add(request.group_id)
            new_reqs.append(NewRequestData(
                req_id=request.request_id, token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params, seed=request.seed,
                num_output_tokens=request.num_output_tokens,
                block_ids=self.kv.get_block_ids(request.request_id),
                num_computed_tokens=num_hit))
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))
        return budget

    def _prefill_only_step(self) -> bool:
        """Without mixed batching, a step serves prefills whenever any are pending (V0)."""
        return (not self.config.enable_mixed_batching
                and (bool(self.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens
                                               for r in self.running)))

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        if self._prefill_only and request.num_computed_tokens >= request.num_prompt_tokens:
            return 0  # a decode, held back while prefills run
        num_new = request.num_tokens - request.num_computed_tokens
        if self.config.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        return min(num_new, budget)

    def _pick_victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- after the step ------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput,
                           result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        logprobs = result.logprobs or [None] * len(result.req_ids)
        for req_id, token, lp in zip(result.req_ids, result.sampled_token_ids, logprobs):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            # The step wrote this KV, so its full blocks may now be hit by others.
            self.kv.cache_blocks(request, request.num_computed_tokens)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk: its sampled token is not real
            request.append_output_token_ids(token)
            status = self._check_stop(request, token)
            out = EngineCoreOutput(req_id, [token], [lp] if lp is not None else [],
                                   num_cached_tokens=max(request.num_cached_tokens, 0))
            if status is not None:
                self.running.remove(request)
                self._free(request, status)
                out.finish_reason = FINISH_REASONS[status]
                out.stop_reason = request.stop_reason
            outputs.append(out)
        return outputs

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_tokens >= self.max_model_len or request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if request.num_output_tokens < params.min_tokens:
            return None
        if token in self.eos_token_ids and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if params.stop_token_ids and token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        return None

    def stats(self) -> SchedulerStats:
        totals = self.kv.total_stats
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage,
                              totals.queries, totals.hits, self.num_preemptions, self.num_steps)
