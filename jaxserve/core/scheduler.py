"""The V1 scheduler: one token budget per step, spent on running requests first, then waiting ones.

There is no prefill or decode phase. Every request has `num_computed_tokens` and `num_tokens`,
and each step hands it up to `min(remaining, long_prefill_token_threshold, budget)` tokens, so
prefill chunks and decodes share a step. `max_num_partial_prefills` (> 0) caps how many requests
get prefill tokens in one step (running ones first, in order, then admissions); decodes are never
capped. Preemption is by recompute: the victim's blocks are freed and it goes back to the front
of the waiting queue (its prefix usually comes back from the cache).

Speculative decoding: a decoding request also gets draft slots as inputs after its last token
(-1: the step proposes the drafts on the device), verified in the same step;
`update_from_output` takes back the computed tokens of rejected drafts, whose KV is simply
overwritten later. Who drafts, and how many: core/draft_policy.py.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from jaxserve.config import CacheConfig, SchedulerConfig
from jaxserve.core.block_pool import KVCacheBlock
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.draft_policy import DraftPolicy
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler_kv_connector import Hold, SchedulerKVConnector
from jaxserve.core.scheduler_output import (CachedRequestData, EngineCoreOutput, Logprobs,
                                            ModelRunnerOutput, NewRequestData, PromptLogprobs,
                                            SchedulerOutput, SpecDecodingStats)
from jaxserve.core.step_timing import StepTimings
from jaxserve.core.structured_output import step_bitmask


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    spec_decoding: SpecDecodingStats | None = None  # with speculative decoding on


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheConfig, num_blocks: int,
                 max_model_len: int, eos_token_ids: Iterable[int], hash_seed: int | None,
                 connector: SchedulerKVConnector | None = None,
                 sliding_window: int | None = None):
        """`connector`: a side of disaggregated prefill/decode (core/scheduler_kv_connector.py).
        `sliding_window`: every layer's attention window, whose KV blocks are freed as requests
        move past them (KVCacheManager)."""
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        spec = config.speculative_config
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                                 hash_seed=hash_seed, sliding_window=sliding_window,
                                 num_lookahead_tokens=0 if spec is None
                                 else spec.num_speculative_tokens)
        self.connector = connector
        if connector is not None:
            connector.bind(self.kv)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_steps = 0
        # Ids freed while a step that carries them may still run (async scheduling), mapped to
        # the number of steps that must be updated before a new request may take the id: its
        # worker state and in-flight token would otherwise land on the newcomer.
        self._unsettled: dict[str, int] = {}
        self._num_updated = 0
        self._phase: str | None = None
        # Structured outputs: requests failed before they ran (their grammar did not compile),
        # reported by the next update; the mask work is timed as its own phase.
        self._failed: list[EngineCoreOutput] = []
        self.draft_policy = None if spec is None else DraftPolicy(spec, max_model_len)
        self.timings = StepTimings()

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in this scheduler")
        self.requests[request.request_id] = request
        if self.connector is not None:
            self.connector.add_request(request)
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
        if self.connector is None or not self.connector.request_finished(request):
            self.kv.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        self._unsettled[request.request_id] = self.num_steps

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        self._phase = self._v0_phase()
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: set[str] = set()
        prefills: set[str] = set()  # requests given prefill tokens this step
        drafts: dict[str, list[int]] = {}

        budget = self._schedule_running(budget, num_scheduled, cached, preempted, prefills,
                                        drafts)
        if self._phase == "prefill" and not num_scheduled and not preempted \
                and not self._can_admit():
            # V0-style steps: no prefill can run (no seat or blocks), so run the decodes.
            self._phase = "decode"
            budget = self._schedule_running(budget, num_scheduled, cached, preempted, prefills,
                                            drafts)

        if not preempted and self._phase != "decode":
            budget = self._admit_waiting(budget, num_scheduled, new_reqs, prefills)

        sampling: set[str] = set()
        for request in self.running:  # tokens count as computed from now on
            num_new = num_scheduled.get(request.request_id, 0)
            request.num_computed_tokens += num_new
            if num_new and request.num_computed_tokens == (request.num_tokens
                                                           + request.num_tokens_in_flight):
                request.num_output_placeholders += 1
                sampling.add(request.request_id)
        constrained = [r for r in self.running if r.request_id in sampling and (
            r.structured_output is not None or r.allowed_tokens_mask is not None)]
        bitmask = None
        if constrained:
            with self.timings.phase("mask"):
                bitmask = step_bitmask(constrained)
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            finished_req_ids=self.finished_req_ids, preempted_req_ids=preempted,
            sampling_req_ids=sampling, step=self.num_steps,
            kv_loads=[] if self.connector is None else self.connector.take_loads(),
            structured_output_req_ids=[r.request_id for r in constrained],
            grammar_bitmask=bitmask, scheduled_spec_decode_tokens=drafts)
        self.finished_req_ids = set()
        self.num_steps += 1
        return out

    def _schedule_running(self, budget: int, num_scheduled: dict[str, int],
                          cached: CachedRequestData, preempted: set[str],
                          prefills: set[str], drafts: dict[str, list[int]]) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            prefilling = _is_prefilling(request)
            # Over the cap, a prefill just sits this step out: no preemption, it keeps its blocks.
            num_new = 0 if prefilling and self._prefill_cap_reached(prefills) \
                else self._num_new_tokens(request, budget)
            if num_new == 0:
                i += 1
                continue
            spec = [] if prefilling or self.draft_policy is None else \
                self.draft_policy.drafts(request, budget - num_new, len(self.running),
                                         self.num_steps)
            num_new += len(spec)
            while (block_ids := self.kv.allocate_slots(request, num_new)) is None:
                victim = self._pick_victim()
                if self.running.index(victim) < i:  # priority policy: an earlier one
                    i -= 1
                    if victim.request_id in num_scheduled:  # already scheduled: refund
                        budget += num_scheduled.pop(victim.request_id)
                        prefills.discard(victim.request_id)
                        drafts.pop(victim.request_id, None)
                        j = cached.req_ids.index(victim.request_id)
                        del (cached.req_ids[j], cached.new_block_ids[j],
                             cached.num_computed_tokens[j])
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
            if prefilling:
                prefills.add(request.request_id)
            if spec:
                drafts[request.request_id] = spec
                request.draft_placeholders += spec
            budget -= num_new
            i += 1
        return budget

    def _admit_waiting(self, budget: int, num_scheduled: dict[str, int],
                       new_reqs: list[NewRequestData], prefills: set[str]) -> int:
        deferred: list[Request] = []
        prefilling = {r.group_id for r in self.running
                      if r.num_computed_tokens < r.num_prompt_tokens}
        # Every admission counts as a prefill, checked before the prefix lookup (which would
        # count a query in the hit-rate stats on every step the cap holds the request back).
        while self.waiting and budget > 0 and not self._prefill_cap_reached(prefills):
            request = self.waiting[0]
            hold = self._hold(request, prefilling)
            if hold is Hold.STOP:
                break
            if hold is Hold.DEFER:
                deferred.append(self.waiting.popleft())
                continue
            if hold is Hold.FAIL:
                self._fail(self.waiting.popleft())
                continue
            admitted = self._admit(request, budget)
            if admitted is None:
                break
            new_req, num_new = admitted
            new_reqs.append(new_req)
            num_scheduled[request.request_id] = num_new
            prefills.add(request.request_id)
            if request.group_id is not None:
                prefilling.add(request.group_id)
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))
        return budget

    # ---- the pre-filter: why the request at the head of the queue is not admitted now ------
    def _hold(self, request: Request, prefilling: set[str | None]) -> Hold | None:
        """None: it may be admitted, if it fits. The first reason found wins."""
        if not self._has_seat(request):
            return Hold.STOP
        if self._unsettled.get(request.request_id, 0) > self._num_updated:
            return Hold.DEFER  # its id's old owner is in flight
        if self.connector is not None and (hold := self.connector.hold(request)) is not None:
            return hold
        return _grammar_hold(request) or _sibling_hold(request, prefilling)

    def _has_seat(self, request: Request) -> bool:
        """A seat among max_num_seqs (waiting requests holding blocks take one too)."""
        seats = len(self.running)
        if self.connector is not None:
            seats += self.connector.seats_taken(request)
        return seats < self.config.max_num_seqs

    def _fail(self, request: Request) -> None:
        """It can never run (its grammar did not compile): reported by the next update."""
        self._free(request, RequestStatus.FINISHED_ERROR)
        self._failed.append(EngineCoreOutput(request.request_id, [], finish_reason="error",
                                             error=request.structured_output.error))

    # ---- the admission ---------------------------------------------------------------------
    def _admit(self, request: Request, budget: int) -> tuple[NewRequestData, int] | None:
        """Move the request at the head of the queue to running with its prefix hit and up to
        `budget` new tokens. None, with nothing changed but the lookup's stats, when it does
        not fit."""
        hit_blocks, num_hit = self._prefix_hit(request)
        num_new = request.num_tokens - num_hit
        if self.config.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        if not self.config.enable_chunked_prefill and num_new > budget:
            return None
        num_new = min(num_new, budget)
        if self.kv.allocate_slots(request, num_new, hit_blocks) is None:
            return None
        self.waiting.popleft()
        if self.connector is not None:
            self.connector.admitted(request)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        return NewRequestData(
            req_id=request.request_id, token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params, seed=request.seed,
            num_output_tokens=request.num_output_tokens,
            block_ids=self.kv.get_block_ids(request.request_id),
            num_computed_tokens=num_hit), num_new

    def _prefix_hit(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        if (num_loaded := self._num_loaded_tokens(request)) is not None:
            return [], num_loaded  # its KV was moved here from the prefill side
        hit_blocks, num_hit = self.kv.get_computed_blocks(request)
        if getattr(request.sampling_params, "prompt_logprobs", None) is not None:
            return [], 0  # as vLLM: the prompt's logits are all needed
        return hit_blocks, num_hit

    def _v0_phase(self) -> str | None:
        """Without mixed batching a step is all prefill (whenever any is pending, as in V0) or
        all decode; None: the V1 mixed step."""
        if self.config.enable_mixed_batching:
            return None
        pending = (any(not self._waits(r) for r in self.waiting)
                   or any(_is_prefilling(r) for r in self.running))
        return "prefill" if pending else "decode"

    def _waits(self, request: Request) -> bool:
        """Nothing can be done for this waiting request now (its KV is elsewhere)."""
        return self.connector is not None and self.connector.waits(request)

    def _num_loaded_tokens(self, request: Request) -> int | None:
        return None if self.connector is None else self.connector.num_loaded_tokens(request)

    def _prefill_cap_reached(self, prefills: set[str]) -> bool:
        cap = self.config.max_num_partial_prefills
        return cap > 0 and len(prefills) >= cap

    def _can_admit(self) -> bool:
        """Whether the first waiting request could start now (a seat and its blocks)."""
        request = next((r for r in self.waiting if not self._waits(r)), None)
        if request is None or len(self.running) >= self.config.max_num_seqs:
            return False
        if self._num_loaded_tokens(request) is not None:
            return True  # its blocks are taken already
        hits, num_hit = self.kv.find_cached_prefix(request)
        return self.kv.can_allocate(request, request.num_tokens - num_hit, hits)

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        if self._phase is not None and (self._phase == "prefill") != _is_prefilling(request):
            return 0  # V0-style: a decode held back from a prefill step, or the other way
        in_flight = request.num_tokens_in_flight
        if in_flight and (request.num_output_tokens + in_flight >= request.max_tokens
                          or request.num_tokens + in_flight >= self.max_model_len):
            return 0  # the tokens in flight may be its last: wait for the update
        # A placeholder is the input of the next decode: its id comes from the device (after
        # the drafts of its step that were accepted).
        num_new = request.num_tokens + in_flight - request.num_computed_tokens
        if self.config.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        return min(num_new, budget)

    def _pick_victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            # Ties go to the most recently admitted, as under FCFS: preempting an older one
            # could let two requests evict each other forever.
            i = max(range(len(self.running)),
                    key=lambda i: (self.running[i].priority, self.running[i].arrival_time, i))
            return self.running[i]
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token in flight is dropped, then recomputed
        request.draft_placeholders.clear()
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- after the step ------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput,
                           result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs, self._failed = self._failed, []
        self._num_updated = max(self._num_updated, sched.step + 1)
        if self._unsettled:
            self._unsettled = {r: n for r, n in self._unsettled.items() if n > self._num_updated}
        logprobs = result.logprobs or [None] * len(result.req_ids)
        for req_id, tokens, lp in zip(result.req_ids, result.sampled_token_ids, logprobs):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            drafted = len(sched.scheduled_spec_decode_tokens.get(req_id, ()))
            if drafted:
                # The KV of rejected drafts is not the sequence's: computed up to the last
                # accepted token (the sampled one after it is the next input; a step launched
                # since was corrected on the device).
                request.num_computed_tokens -= drafted - (len(tokens) - 1)
                del request.draft_placeholders[:drafted]
                self.draft_policy.record(request, drafted, len(tokens) - 1, self.num_steps)
            # Every step that writes this KV has been launched (with async scheduling, the next
            # one too), so its full blocks of known tokens may now be hit by others.
            self.kv.cache_blocks(request, min(request.num_computed_tokens, request.num_tokens))
            if req_id not in sched.sampling_req_ids:
                continue  # a prefill chunk: its sampled token is not real
            request.num_output_placeholders -= 1
            outputs.append(self._append_tokens(request, tokens, lp,
                                               result.prompt_logprobs.get(req_id)))
        return outputs

    def accept_remote_token(self, output: EngineCoreOutput) -> EngineCoreOutput | None:
        """Decode side: the first token, sampled by the prefill side, applied as if sampled here
        (stop checks included). None when the request is gone (aborted meanwhile)."""
        request = self.requests.get(output.request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS \
                or request.num_output_tokens:
            return None
        request.num_cached_tokens = output.num_cached_tokens
        logprobs = output.new_logprobs[0] if output.new_logprobs else None
        return self._append_tokens(request, output.new_token_ids[:1],
                                   None if logprobs is None else [logprobs],
                                   output.prompt_logprobs)

    def _append_tokens(self, request: Request, tokens: list[int],
                       logprobs: list[Logprobs] | None,
                       prompt_logprobs: PromptLogprobs | None = None) -> EngineCoreOutput:
        """Append tokens as if each came from its own step: the first that stops the request
        is its last (one append of the kept tokens: their block hashes in one pass)."""
        status = None
        num_outputs = request.num_output_tokens
        for num_kept, token in enumerate(tokens, 1):
            status = request.stop_status(token, num_outputs + num_kept, self.max_model_len,
                                         self.eos_token_ids)
            if request.structured_output is not None and status is None:
                with self.timings.phase("mask"):
                    status = request.grammar_status(token)
            if status is not None:
                break
        kept = tokens[:num_kept]
        request.append_output_token_ids(kept)
        out = EngineCoreOutput(request.request_id, kept,
                               logprobs[:num_kept] if logprobs is not None else [],
                               prompt_logprobs=prompt_logprobs,
                               num_cached_tokens=max(request.num_cached_tokens, 0))
        if status is not None:
            (self.running if request.status == RequestStatus.RUNNING
             else self.waiting).remove(request)
            self._free(request, status)
            out.finish_reason = RequestStatus.get_finished_reason(status)
            out.stop_reason = request.stop_reason
            if status == RequestStatus.FINISHED_ERROR:
                out.error = request.structured_output.error
        return out

    def stats(self) -> SchedulerStats:
        totals = self.kv.total_stats
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage,
                              totals.queries, totals.hits, self.num_preemptions, self.num_steps,
                              self.draft_policy and self.draft_policy.stats)


def _grammar_hold(request: Request) -> Hold | None:
    so = request.structured_output
    if so is None:
        return None
    if not so.ready():
        return Hold.DEFER  # its grammar is still compiling
    return Hold.FAIL if so.error is not None else None


def _sibling_hold(request: Request, prefilling: set[str | None]) -> Hold | None:
    """A sibling (n > 1) is computing the shared prompt: wait one step, then hit its blocks in
    the prefix cache instead of computing the prompt again."""
    if request.group_id is not None and request.group_id in prefilling:
        return Hold.DEFER
    return None


def _is_prefilling(request: Request) -> bool:
    """Prompt left to compute, or more than one token (the recompute after a preemption)."""
    return (request.num_computed_tokens < request.num_prompt_tokens
            or request.num_tokens - request.num_computed_tokens > 1)
