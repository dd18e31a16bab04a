"""DisaggregatedEngineCore: EngineCore's interface over a prefill engine and a decode engine.

A request is prefilled on the prefill side, which samples its first token (same seed, same step
index as the unified engine) and parks it. The decode side then reserves blocks for the prompt
plus one token, the connector moves the prompt's KV into them, and the request joins the decode
batch with `num_computed_tokens = len(prompt)`, exactly like a prefix-cache hit: its next step
computes the first token's KV and samples the second token at step index 1. A decode side
without room leaves requests parked (back-pressure); too many parked ones pause the prefills.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import jax

from jaxserve.config import EngineConfig
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import EngineCoreOutput
from jaxserve.engine.disagg.connector import InProcessConnector, KVConnector, TransferredKV
from jaxserve.disaggregation_config import side_config
from jaxserve.engine.core import EngineCore, EngineStats
from jaxserve.models.loaded_model import LoadedModel
from jaxserve.models.loader import load_model
from jaxserve.core.request import Request, RequestStatus

MAX_TIMING_SAMPLES = 10_000


@dataclass(slots=True)
class TTFTSplit:
    """Seconds from arrival to the second token: prefill (arrival -> first token, which is
    also the user's TTFT), transfer (first token -> KV in decode blocks and the request
    admitted, including any wait for decode room), first decode (admitted -> second token)."""
    prefill: float
    transfer: float
    first_decode: float


@dataclass(slots=True)
class _Timing:
    arrival: float
    first_token: float = 0.0
    admitted: float = 0.0


@dataclass(slots=True)
class DisaggEngineStats(EngineStats):
    prefill: EngineStats
    decode: EngineStats
    num_prefilling: int  # sent to the prefill side, first token not out yet
    num_parked: int  # first token out, waiting for decode room (the back-pressure queue)
    num_transferring: int  # decode blocks reserved, KV on its way (socket connector)
    num_transfers: int
    transfer_bytes: int
    transfer_seconds: float  # summed over transfers whose duration is known
    mean_ttft_split: TTFTSplit | None


class DisaggregatedEngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        settings = config.parallel.disaggregation
        if settings is None:
            raise ValueError("disaggregation must be set for a DisaggregatedEngineCore")
        self.config = config
        self.settings = settings
        if settings["connector"] == "inprocess":
            _check_device_count(settings)
        m = config.model
        loaded = loaded or load_model(m.model, m.load_format, seed=m.seed)
        try:  # EngineCore refuses a pool that cannot hold one sequence: say which side's
            self.decode = EngineCore(side_config(config, settings, "decode"), loaded)
        except ValueError as exc:
            raise ValueError(f"disaggregation.decode: {exc}") from exc
        self.executor = self.decode.executor  # the local engine: tokenizer, model config
        self.model_config = self.decode.model_config
        self.max_model_len = self.decode.max_model_len
        self.block_size = config.cache.block_size
        self.connector = self._make_connector(config, settings, loaded)
        self.root_hash = self.connector.root_hash
        self.prefilling: dict[str, Request] = {}
        self.parked: OrderedDict[str, Request] = OrderedDict()  # decode-side requests
        self.transferring: dict[str, tuple[int, list[int]]] = {}  # id -> (rank, block ids)
        self._copies: list[tuple[float, jax.Array]] = []  # in-process copies still landing
        self._timings: dict[str, _Timing] = {}
        self.ttft_splits: deque[TTFTSplit] = deque(maxlen=MAX_TIMING_SAMPLES)
        self.num_transfers = self.transfer_bytes = 0
        self.transfer_seconds = 0.0
        self.num_steps = 0
        self.timings = self.decode.timings  # output processing is timed with the decode side
        self.warm_up_seconds = self.decode.warm_up_seconds
        if config.runner.precompile:
            start = time.perf_counter()
            self.warm_up_seconds += self.connector.warm_up()
            for worker in self.decode.executor.workers:
                worker.runner.warm_up_blocks(None, write=True)
            self.warm_up_seconds += time.perf_counter() - start

    def _make_connector(self, config: EngineConfig, settings: dict,
                        loaded: LoadedModel) -> KVConnector:
        prefill_config = side_config(config, settings, "prefill")
        if settings["connector"] == "inprocess":
            return InProcessConnector(prefill_config, loaded, self.decode,
                                      settings["max_pending_transfers"])
        from jaxserve.engine.disagg.socket_connector import SocketConnector

        return SocketConnector(prefill_config, settings, loaded, self.decode)

    @property
    def schedulers(self) -> list[Scheduler]:
        """The decode side's schedulers (the prefill side's may live in another process)."""
        return self.decode.schedulers

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.prefilling[request.request_id] = request
        self._timings[request.request_id] = _Timing(request.arrival_time)
        self.connector.add_request(request)

    def abort_requests(self, request_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        on_prefill = [r for r in request_ids if r in self.prefilling or r in self.parked]
        for req_id in request_ids:
            self.prefilling.pop(req_id, None)
            self.parked.pop(req_id, None)
            self._timings.pop(req_id, None)
            if req_id in self.transferring:  # blocks reserved, KV not arrived: unreserve
                rank, _ = self.transferring.pop(req_id)
                self.decode.schedulers[rank].cancel_reservation(req_id)
                self.decode.router.forget(req_id)
        if on_prefill:
            self.connector.abort_requests(on_prefill, status)
        self.decode.abort_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return (bool(self.prefilling or self.parked or self.transferring)
                or self.decode.has_unfinished_requests())

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        decode = self.decode
        self.connector.start_step()  # the prefill step and the decode step run side by side
        scheds = [s.schedule() for s in decode.schedulers]
        pending = decode.executor.dispatch(scheds)
        events = self.connector.finish_step(idle=all(p is None for p in pending))
        results = decode.executor.collect(pending)
        now = time.time()
        outputs: list[EngineCoreOutput] = []
        for scheduler, sched, result in zip(decode.schedulers, scheds, results):
            for out in scheduler.update_from_output(sched, result):
                if out.finish_reason is not None:
                    decode.router.forget(out.request_id)
                self._record_second_token(out.request_id, now)
                outputs.append(out)
        decode.num_steps += 1
        for out in events.outputs:
            request = self.prefilling.pop(out.request_id, None)
            if request is None:
                continue  # aborted while its first token was on the way (socket)
            outputs.append(out)
            if out.finish_reason is None:
                self.parked[out.request_id] = self._decode_request(request, out)
                self._timings[out.request_id].first_token = now
            else:
                self._timings.pop(out.request_id, None)
        for kv in events.arrived:
            if kv.request_id in self.transferring:  # else aborted meanwhile: drop it
                rank, block_ids = self.transferring.pop(kv.request_id)
                self._write_and_admit(rank, block_ids, kv)
        self._admit_parked()
        self._poll_copies()  # right away too: on CPU a copy often lands during its dispatch
        self.num_steps += 1
        return outputs

    def _decode_request(self, request: Request, first: EngineCoreOutput) -> Request:
        decode_request = Request(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params, arrival_time=request.arrival_time,
            block_size=self.block_size, hash_seed=self.decode.root_hash,
            priority=request.priority, cache_salt=request.cache_salt,
            lora_name=request.lora_name, output_token_ids=list(first.new_token_ids),
            max_tokens=request.max_tokens, seed=request.seed, group_id=request.group_id)
        decode_request.num_cached_tokens = first.num_cached_tokens
        return decode_request

    def _admit_parked(self) -> None:
        """Reserve decode blocks for parked requests in arrival order and pull their KV; stop
        at the first that does not fit (it and the rest stay parked: back-pressure)."""
        decode = self.decode
        while self.parked:
            req_id, request = next(iter(self.parked.items()))
            rank = decode.router.route(request)
            block_ids = decode.schedulers[rank].reserve_transfer(request)
            if block_ids is None:
                decode.router.forget(req_id)
                return
            del self.parked[req_id]
            block_ids = block_ids[:-(-request.num_prompt_tokens // self.block_size)]
            started = time.perf_counter()
            kv = self.connector.pull(req_id, rank)
            if kv is None:
                self.transferring[req_id] = (rank, block_ids)
            else:
                self._write_and_admit(rank, block_ids, kv, started)

    def _write_and_admit(self, rank: int, block_ids: list[int], kv: TransferredKV,
                         started: float | None = None) -> None:
        if kv.num_blocks != len(block_ids):
            raise RuntimeError(f"request {kv.request_id}: {kv.num_blocks} KV blocks arrived "
                               f"for {len(block_ids)} reserved")
        write_started = time.perf_counter()
        runner = self.decode.executor.workers[rank].runner
        runner.write_blocks(block_ids, kv.k, kv.v)
        self.decode.schedulers[rank].admit_transferred(kv.request_id)
        self.num_transfers += 1
        self.transfer_bytes += kv.num_bytes
        if kv.seconds is not None:  # arrived on the host: its wire time, plus the write
            self.transfer_seconds += kv.seconds + time.perf_counter() - write_started
        else:  # moving device to device: timed once the copy is seen landed
            self._copies.append((write_started if started is None else started, kv.k))
        timing = self._timings.get(kv.request_id)
        if timing is not None:
            timing.admitted = time.time()

    def _poll_copies(self) -> None:
        """Device-to-device copies are asynchronous: timed from the pull to when they are seen
        landed, checked after every step (so at most a step late)."""
        now = time.perf_counter()
        still = []
        for started, array in self._copies:
            if array.is_ready():
                self.transfer_seconds += now - started
            else:
                still.append((started, array))
        self._copies = still

    def _record_second_token(self, req_id: str, now: float) -> None:
        timing = self._timings.pop(req_id, None)
        if timing is not None and timing.admitted:
            self.ttft_splits.append(TTFTSplit(timing.first_token - timing.arrival,
                                              timing.admitted - timing.first_token,
                                              now - timing.admitted))

    # ---- stats ---------------------------------------------------------------------------
    def stats(self) -> DisaggEngineStats:
        p, d = self.connector.stats(), self.decode.stats()
        splits = list(self.ttft_splits)
        mean = (TTFTSplit(*(sum(getattr(s, f) for s in splits) / len(splits)
                            for f in ("prefill", "transfer", "first_decode")))
                if splits else None)
        return DisaggEngineStats(
            num_running=p.num_running + d.num_running + len(self.transferring),
            num_waiting=p.num_waiting + d.num_waiting,
            kv_cache_usage=d.kv_cache_usage, num_kv_blocks=d.num_kv_blocks,
            prefix_cache_queries=p.prefix_cache_queries, prefix_cache_hits=p.prefix_cache_hits,
            num_preemptions=p.num_preemptions + d.num_preemptions, num_steps=self.num_steps,
            num_compilations=p.num_compilations + d.num_compilations,
            warm_up_seconds=self.warm_up_seconds,
            step_seconds={k: p.step_seconds[k] + v for k, v in d.step_seconds.items()},
            prefill=p, decode=d,
            num_prefilling=len(self.prefilling), num_parked=len(self.parked),
            num_transferring=len(self.transferring), num_transfers=self.num_transfers,
            transfer_bytes=self.transfer_bytes, transfer_seconds=self.transfer_seconds,
            mean_ttft_split=mean)

    def close(self) -> None:
        self.connector.close()


def _check_device_count(settings: dict) -> None:
    used = settings["prefill"]["devices"] + settings["decode"]["devices"]
    if max(used) >= jax.device_count():
        raise ValueError(f"disaggregation needs devices {sorted(used)} (prefill "
                         f"{settings['prefill']['devices']}, decode "
                         f"{settings['decode']['devices']}), but only {jax.device_count()} "
                         "are present")
