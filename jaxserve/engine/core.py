"""EngineCore: schedule -> execute -> update, one step at a time, for every data-parallel rank
(one scheduler and one share of the KV pool per rank; requests routed by prefix hit, then load).

With async scheduling (the default) a call schedules and launches step N+1 and only then waits
for step N and applies its tokens, so the host's work overlaps the device's. The scheduler
counts the ids in flight as placeholders: a decode is scheduled again before its last token is
known, and the model runner feeds it that token from the device. A request that stops on a
token sampled at N has already had one more token computed at N+1, which is dropped. Requests
with penalties or a grammar need their whole history on the host, so while one runs the core
waits for N before scheduling N+1. Speculative decoding runs ahead too: N+1 is scheduled as if
N accepted all its drafts, the step corrects its positions on the device from N's accepted
counts (programs/spec_verify.py), and it proposes its drafts there, from the tokens N really
accepted (programs/device_drafts.py).

A step that raises while it is prepared, launched or read back fails the requests it carried
(finish reason "error", blocks freed) and the engine goes on, unless the device state is lost
(the KV cache or the last sampled ids can no longer be read): then `DeviceStateLostError`.
A compilation that strict_compile forbids is raised as it is.

Disaggregated prefill/decode is this same core on each side, each rank's scheduler with a
scheduler-side KV connector (core/scheduler_kv_connector.py). On the prefill side, a KVProducer:
requests (KVTransfer.SEND, one output token) keep their blocks after the first token until the
decode side has read them. The decode side has a KV connector and a KVConsumer: its requests
wait for their first token and prompt KV from the prefill side (received before each schedule,
like vLLM's WAITING_FOR_REMOTE_KVS), and then run on as if that prompt had been a prefix-cache
hit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jaxserve.config import EngineConfig
from jaxserve.core.request import KVTransfer, Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_kv_connector import KVConsumer, KVProducer
from jaxserve.core.scheduler_output import EngineCoreOutput, SchedulerOutput, SpecDecodingStats
from jaxserve.core.step_timing import StepTimings
from jaxserve.engine.dp_router import DPRouter
from jaxserve.engine.kv_connector import KVConnector
from jaxserve.engine.spec_switch import SpeculationSwitch
from jaxserve.engine.stats import EngineStats
from jaxserve.models.llama_config import LlamaConfig
from jaxserve.models.loaded_model import LoadedModel
from jaxserve.runtime.executor import (SLEEP_TAGS, Executor, PendingStep,
                                       UnexpectedCompilationError)

logger = logging.getLogger(__name__)


def freed_window(config: EngineConfig, model: LlamaConfig) -> int | None:
    """The attention window over which KV blocks are freed as requests move on: every layer's
    (Mistral, Phi-3; not Gemma's mix of local and global layers), unless a draft model's
    layers may see further, disaggregated prefill/decode moves blocks whole, or
    disable_hybrid_kv_cache_manager keeps them."""
    windows = {kind.sliding_window for kind in model.layer_kinds}
    spec = config.scheduler.speculative_config
    if len(windows) != 1 or config.parallel.disaggregation is not None or (
            spec is not None and spec.method == "draft_model") or \
            config.scheduler.disable_hybrid_kv_cache_manager:
        return None
    return windows.pop()


class DeviceStateLostError(RuntimeError):
    """A step failed and took the device state with it: the engine cannot go on."""


class EngineDeadError(RuntimeError):
    """The engine has stopped (shut down, or a step lost the device state or compiled when
    strict_compile forbade it); start a new one."""


@dataclass(slots=True)
class InFlight:
    """A launched step: every rank's schedule and pending device work (or what failed)."""
    scheds: list[SchedulerOutput]
    pending: list[PendingStep | None]
    failed: list[EngineCoreOutput] = field(default_factory=list)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 connector: KVConnector | None = None,
                 producer: Callable[[], KVProducer] | None = None):
        """`connector`: this is a disaggregated decode side (each rank's scheduler gets a
        KVConsumer). `producer`: this is a disaggregated prefill side; it makes each rank's
        scheduler its KVProducer."""
        self.config = config
        self.executor = Executor(config, loaded)
        built = self.executor.built
        self.model_config = built[0].model_config
        self.max_model_len = built[0].plan.max_model_len
        self.tokenizer = built[0].tokenizer
        self.generation_config = built[0].generation_config
        if config.model.max_logprobs > self.model_config.vocab_size:
            raise ValueError(f"max_logprobs must be <= the vocabulary size "
                             f"({self.model_config.vocab_size}), got {config.model.max_logprobs}")
        spec = config.scheduler.speculative_config
        if spec is not None and spec.method == "layer_skip" \
                and spec.num_layers >= self.model_config.num_layers:
            raise ValueError(f"speculative_config.num_layers ({spec.num_layers}) must be below "
                             f"the model's {self.model_config.num_layers} layers")
        hash_seed = config.cache.prefix_caching_hash_seed
        role = KVConsumer if connector is not None else producer
        self.schedulers = [
            Scheduler(config.scheduler, config.cache, b.plan.num_kv_blocks, b.plan.max_model_len,
                      self.model_config.eos_token_ids,
                      hash_seed=config.model.seed if hash_seed is None else hash_seed,
                      connector=None if role is None else role(),
                      # a side of disaggregated prefill/decode sends or receives blocks whole
                      sliding_window=None if role is not None
                      else freed_window(config, self.model_config))
            for b in built]
        # One rank has nothing to route: its requests are the ones its scheduler holds.
        self.router = DPRouter(self.schedulers) if len(self.schedulers) > 1 else None
        self.spec_switch = SpeculationSwitch() if spec is not None and spec.adaptive else None
        self._last_step_end: float | None = None
        self._launched_prefill = False  # the last step launched computed prompt tokens
        self.num_steps = 0
        # What stopped the engine: its requests are stranded mid-step, so it takes no more work.
        self.stopped_by: Exception | None = None
        self.timings = StepTimings()  # schedule and update; the runners time their phases
        self._in_flight: InFlight | None = None
        warm = config.runner.precompile or config.runner.compiled_dir is not None
        self.warm_up_seconds = self.executor.warm_up() if warm else 0.0
        self.connector = connector
        if connector is not None:
            self.warm_up_seconds += connector.bind(self.executor, self.root_hash,
                                                   warm=config.runner.precompile)

    @property
    def scheduler(self) -> Scheduler:
        return self.schedulers[0]

    @property
    def root_hash(self) -> bytes:
        return self.schedulers[0].kv.root_hash  # equal on every rank: one hash seed

    def add_request(self, request: Request) -> None:
        self._check_alive()
        if self.connector is not None:
            request.kv_transfer = KVTransfer.RECEIVE
        self.schedulers[self.router.route(request) if self.router else 0].add_request(request)
        if self.connector is not None:
            self.connector.add_request(request)

    def abort_requests(self, request_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        for req_id in request_ids:
            rank = self._rank_of(req_id)
            if rank is not None:
                self.schedulers[rank].finish_requests([req_id], status)
                self._forget(req_id)
        if self.connector is not None:
            self.connector.abort_requests(request_ids)

    def _rank_of(self, request_id: str) -> int | None:
        """The rank holding a live request (None: finished, aborted or unknown)."""
        if self.router is not None:
            return self.router.rank_of(request_id)
        return 0 if request_id in self.scheduler.requests else None

    def _forget(self, request_id: str) -> None:
        if self.router is not None:
            self.router.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(s.has_unfinished_requests() for s in self.schedulers)

    def step(self) -> list[EngineCoreOutput]:
        """Launch a step and return the tokens of the step before it (with async scheduling) or
        of this one."""
        self._check_alive()
        if self.spec_switch is None:
            return self._step()
        # Wall time from the end of the step before (the caller's work on its outputs
        # included: with async scheduling the device runs meanwhile), or from now after idling.
        start = time.perf_counter() if self._last_step_end is None else self._last_step_end
        outputs = self._step()
        end = time.perf_counter()
        if not self._launched_prefill:  # prompt work costs the same either way: not counted
            counts = [len(o.new_token_ids) for o in outputs if o.new_token_ids]
            drafting = self.spec_switch.record(sum(counts), len(counts), end - start)
            for scheduler in self.schedulers:
                scheduler.draft_policy.enabled = drafting
        self._last_step_end = end if self.has_unfinished_requests() else None
        return outputs

    def _step(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        if self._in_flight is not None and self._needs_host_history():
            outputs += self.finish(self._in_flight)
            self._in_flight = None
        if self.connector is not None:
            outputs += self._receive()
        launched = self.launch()
        outputs += launched.failed  # now, not a step later: its requests are finished already
        previous, self._in_flight = self._in_flight, None if launched.failed else launched
        if previous is not None:
            outputs += self.finish(previous)
        if not self.config.scheduler.async_scheduling and self._in_flight is not None:
            outputs += self.finish(self._in_flight)
            self._in_flight = None
        self.num_steps += 1
        return outputs

    def launch(self) -> InFlight:
        """Schedule every rank and launch its step without waiting for the device."""
        with self.timings.phase("schedule"):
            scheds = [s.schedule() for s in self.schedulers]
        self._launched_prefill = any(_has_prefill(sched) for sched in scheds)
        if self.connector is not None:
            for rank, sched in enumerate(scheds):
                if sched.kv_loads:
                    self.connector.start_loads(rank, sched.kv_loads)
        try:
            in_flight = InFlight(scheds, self.executor.dispatch(scheds))
        except Exception as exc:  # noqa: BLE001 (fails this step's requests, or re-raised)
            in_flight = InFlight(scheds, [], self._fail_step(scheds, exc))
        if self.connector is not None:
            self.connector.start_step()  # an in-process prefill side steps while ours runs
        return in_flight

    def finish(self, in_flight: InFlight) -> list[EngineCoreOutput]:
        """Wait for a launched step and apply its tokens."""
        if in_flight.failed:
            return in_flight.failed
        try:
            results = self.executor.collect(in_flight.pending)
        except Exception as exc:  # noqa: BLE001 (fails this step's requests, or re-raised)
            return self._fail_step(in_flight.scheds, exc)
        outputs: list[EngineCoreOutput] = []
        with self.timings.phase("update"):
            for scheduler, sched, result in zip(self.schedulers, in_flight.scheds, results):
                for out in scheduler.update_from_output(sched, result):
                    out.pooled = result.pooled.get(out.request_id)
                    if out.finish_reason is not None:
                        self._forget(out.request_id)
                    outputs.append(out)
        if self.connector is not None:
            self.connector.record_outputs(outputs)
        return outputs

    def _receive(self) -> list[EngineCoreOutput]:
        """Disaggregated decode, before scheduling: first tokens from the prefill side (applied
        as if sampled here) and the requests whose prompt KV has landed in their blocks."""
        events = self.connector.poll(idle=not any(s.running for s in self.schedulers))
        outputs: list[EngineCoreOutput] = []
        with self.timings.phase("update"):
            for first in events.first_tokens:
                rank = self._rank_of(first.request_id)
                if rank is None:
                    continue  # aborted while its first token was on the way
                if not first.new_token_ids:  # the prefill step failed: so does the request
                    self.schedulers[rank].finish_requests([first.request_id],
                                                          RequestStatus.FINISHED_ERROR)
                    self._forget(first.request_id)
                    self.connector.release([first.request_id])
                    outputs.append(first)
                    continue
                out = self.schedulers[rank].accept_remote_token(first)
                if out is None:
                    continue
                if out.finish_reason is not None:
                    self._forget(out.request_id)
                    self.connector.release([out.request_id])
                outputs.append(out)
            for rank, req_id in events.loaded:
                self.schedulers[rank].connector.finish_loading(req_id)
        return outputs

    def _fail_step(self, scheds: list[SchedulerOutput], exc: Exception,
                   ) -> list[EngineCoreOutput]:
        if isinstance(exc, UnexpectedCompilationError):
            self.stopped_by = exc  # strict_compile: the deployment, not a request, is at fault
            raise exc
        if self.executor.device_state_lost():
            self.stopped_by = DeviceStateLostError(f"a step failed and the device state is "
                                                   f"lost: {type(exc).__name__}: {exc}")
            raise self.stopped_by from exc
        logger.exception("an engine step failed; its requests are failed, the engine goes on")
        error = f"the engine step failed: {type(exc).__name__}: {exc}"
        outputs = []
        for scheduler, sched in zip(self.schedulers, scheds):
            ids = [r for r in sched.num_scheduled_tokens if r in scheduler.requests]
            scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
            for req_id in ids:
                self._forget(req_id)
                outputs.append(EngineCoreOutput(req_id, [], finish_reason="error", error=error))
        return outputs

    def _check_alive(self) -> None:
        if self.stopped_by is not None:
            raise EngineDeadError(f"the engine has stopped after {type(self.stopped_by).__name__}"
                                  f": {self.stopped_by}; start a new one")

    def _needs_host_history(self) -> bool:
        """Whether a request with tokens in flight needs its history on the host (penalties,
        a grammar's mask)."""
        return any(r.num_output_placeholders and r.sampling_params.needs_host_history
                   for s in self.schedulers for r in s.running)

    # ---- sleep mode and weight updates (vLLM's) ------------------------------------------
    def sleep(self, level: int) -> None:
        """Free the device: the KV cache (and with it the prefix cache) and the weights (level
        1: kept on the host; 2: dropped, read again from the checkpoint at wake-up). As vLLM's:
        no request may be unfinished, and a second sleep does nothing."""
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        self._check_idle("sleep")
        if self.executor.asleep:
            logger.warning("sleep: the engine is asleep already")
            return
        self.executor.sleep(level)
        self.reset_prefix_cache()  # idle: nothing holds a block, so it forgets every one

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Put back what `tags` names (of SLEEP_TAGS; None: all) as before the sleep; the
        programs compiled for it run on as they were."""
        wanted = SLEEP_TAGS if tags is None else tags
        if isinstance(tags, str) or not set(wanted) <= set(SLEEP_TAGS):
            raise ValueError(f"tags must be a list of {list(SLEEP_TAGS)} or None, got {tags!r}")
        self.executor.wake_up(frozenset(wanted))

    def is_sleeping(self) -> bool:
        """Whether a part is asleep (until wake_up has woken every part)."""
        return bool(self.executor.asleep)

    def update_weights(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        """Write HF-named weights (as a checkpoint names them) over the model's, all checked
        before any is written; the cached prefixes, computed by the old weights, are forgotten."""
        self._check_idle("update_weights")
        if "weights" in self.executor.asleep:
            raise ValueError("update_weights: the weights are asleep; call "
                             "wake_up(tags=['weights']) first")
        self.executor.update_weights(weights.items() if isinstance(weights, Mapping)
                                     else weights)
        self.reset_prefix_cache()  # idle: nothing holds a block, so it forgets every one

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                       ) -> list[Any]:
        """vLLM's: `method` (a Worker method's name, or a function taking the worker first)
        run on every rank's worker, between two steps; the results in rank order."""
        if timeout is not None:
            raise ValueError("timeout: the workers run in this process and are called "
                             "synchronously; a timeout is not supported (pass None)")
        return self.executor.collective_rpc(method, tuple(args), dict(kwargs or {}))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing reset) while a request holds blocks."""
        return all([s.kv.reset_prefix_cache() for s in self.schedulers])

    def _check_idle(self, verb: str) -> None:
        """No request may be unfinished, and the engine must be whole: a disaggregated prefill
        side holds blocks after its requests end, and computes KV with weights of its own."""
        if self.config.parallel.disaggregation is not None:
            raise ValueError(f"{verb} is not supported with disaggregated prefill/decode")
        num_requests = sum(len(s.requests) for s in self.schedulers)
        if num_requests:
            raise ValueError(f"{verb}: {num_requests} requests are unfinished; let them finish "
                             "or abort them first")

    def stats(self) -> EngineStats:
        per_rank = [s.stats() for s in self.schedulers]
        held = self.executor.held_bytes()
        return EngineStats(
            num_running=sum(s.num_running for s in per_rank),
            num_waiting=sum(s.num_waiting for s in per_rank),
            kv_cache_usage=sum(s.kv_cache_usage for s in per_rank) / len(per_rank),
            num_kv_blocks=self.schedulers[0].kv.num_blocks,
            prefix_cache_queries=sum(s.prefix_cache_queries for s in per_rank),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in per_rank),
            num_preemptions=sum(s.num_preemptions for s in per_rank),
            num_steps=self.num_steps,
            num_compilations=sum(w.runner.num_compilations for w in self.executor.workers),
            warm_up_seconds=self.warm_up_seconds,
            step_seconds=self.timings.merged(
                *(w.runner.timings for w in self.executor.workers),
                *(s.timings for s in self.schedulers)).seconds,
            weight_bytes=held["weights"],
            kv_cache_bytes=held["kv_cache"],
            sleep_level=self.executor.sleep_level,
            kv_transfer=None if self.connector is None else self.connector.stats(),
            spec_decoding=_sum_spec_stats([s.spec_decoding for s in per_rank]))

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()


def _has_prefill(sched: SchedulerOutput) -> bool:
    """Whether a step computes more than one token a request beyond its drafts."""
    num_drafts = sum(map(len, sched.scheduled_spec_decode_tokens.values()))
    return sched.total_num_scheduled_tokens > len(sched.num_scheduled_tokens) + num_drafts


def _sum_spec_stats(per_rank: list[SpecDecodingStats | None]) -> SpecDecodingStats | None:
    if per_rank[0] is None:
        return None
    total = SpecDecodingStats()
    for stats in per_rank:
        total.add(stats)
    return total
