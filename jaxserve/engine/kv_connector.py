"""KVConnector: how a disaggregated decode side's EngineCore gets its requests' first tokens
and prompt KV from a prefill engine (vLLM's KV connector; both of its halves in one object).

Scheduler half: `add_request` hands a new request to the prefill side; `poll`, before every
schedule, returns the first tokens sampled there and the requests whose KV has landed in this
side's blocks; `release` says a first token finished its request (its blocks are not wanted).
Worker half: `start_loads` moves the prompt blocks the scheduler allocated (a step's
`kv_loads`) into this side's cache; `start_step` lets an in-process prefill engine step while
this side's step runs. Subclasses supply the transport (in-process device copies, or another
process over a socket); the bookkeeping and the stats are here. Inside each decode rank's
scheduler, its KVConsumer (core/scheduler_kv_connector.py) holds these requests' blocks.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxserve.core.request import KVTransfer, Request
from jaxserve.core.scheduler_output import EngineCoreOutput, KVLoad
from jaxserve.engine.stats import EngineStats, KVTransferStats, TTFTSplit

if TYPE_CHECKING:
    from jaxserve.runtime.executor import Executor

MAX_TIMING_SAMPLES = 10_000


@dataclass(slots=True)
class TransferredKV:
    """Prompt KV of one request in the decode side's head layout, `[L, H, n(_padded), BS, D]`:
    device arrays already on the decode rank's sharding, or host arrays of exactly n blocks."""
    request_id: str
    k: jax.Array | np.ndarray
    v: jax.Array | np.ndarray
    num_blocks: int
    seconds: float | None = None  # pull to arrival, when known on arrival (else timed later)


@dataclass(slots=True)
class RemoteEvents:
    first_tokens: list[EngineCoreOutput] = field(default_factory=list)
    loaded: list[tuple[int, str]] = field(default_factory=list)  # (rank, request id)


@dataclass(slots=True)
class _Timing:
    arrival: float
    first_token: float = 0.0
    landed: float = 0.0


def prefill_request(fields: dict[str, Any], block_size: int, hash_seed: bytes) -> Request:
    """The prefill side's copy of a request: it stops after its first token and keeps its
    blocks for the decode side (which applies the real stop conditions to that token)."""
    return Request(**fields, block_size=block_size, hash_seed=hash_seed, max_tokens=1,
                   kv_transfer=KVTransfer.SEND)


def request_fields(request: Request) -> dict[str, Any]:
    """What the prefill side needs of a request (its sampling, seed and cache keys)."""
    return {"request_id": request.request_id, "prompt_token_ids": request.prompt_token_ids,
            "sampling_params": request.sampling_params, "arrival_time": request.arrival_time,
            "priority": request.priority, "cache_salt": request.cache_salt,
            "seed": request.seed, "group_id": request.group_id}


class KVConnector(ABC):
    def __init__(self, heads: tuple[int, ...]):
        self.heads = heads  # for each decode-side KV head, the prefill-side head it copies
        self.executor: Executor | None = None
        self.prefilling: set[str] = set()
        self.parked: set[str] = set()
        self.transferring: dict[str, tuple[int, list[int]]] = {}  # id -> (rank, block ids)
        self._landed: list[tuple[int, str]] = []
        self._copies: list[tuple[float, jax.Array]] = []  # in-process copies still landing
        self._timings: dict[str, _Timing] = {}
        self.ttft_splits: deque[TTFTSplit] = deque(maxlen=MAX_TIMING_SAMPLES)
        self.num_transfers = self.num_blocks_moved = self.transfer_bytes = 0
        self.transfer_seconds = 0.0

    # ---- the transport (subclasses) ------------------------------------------------------
    @property
    @abstractmethod
    def root_hash(self) -> bytes:
        """The prefill side's prefix-cache root hash (must equal the decode side's)."""

    @abstractmethod
    def _send_request(self, fields: dict[str, Any]) -> None: ...

    @abstractmethod
    def _send_abort(self, request_ids: list[str]) -> None:
        """Drop these requests on the prefill side, prefilling or holding blocks."""

    @abstractmethod
    def _pull(self, request_id: str, rank: int, first_block: int,
              num_blocks: int) -> TransferredKV | None:
        """Start moving prompt blocks first_block.. of a request to decode rank `rank`: the KV
        when it is already there (device arrays, dispatched), else None (it comes in
        `_receive`). The prefill side frees the blocks once read."""

    @abstractmethod
    def _receive(self, idle: bool) -> tuple[list[EngineCoreOutput], list[TransferredKV]]:
        """First tokens and KV arrived since the last call; `idle`: the decode side has
        nothing to run, so this may wait a little for them."""

    @abstractmethod
    def prefill_stats(self) -> EngineStats: ...

    def start_step(self) -> None:
        pass

    def warm_up(self) -> float:
        return 0.0

    def close(self) -> None:
        pass

    # ---- the decode EngineCore's calls ---------------------------------------------------
    def bind(self, executor: Executor, root_hash: bytes, warm: bool) -> float:
        """Attach the decode side's executor (whose caches loads write); returns warm-up s."""
        if root_hash != self.root_hash:
            raise ValueError("disaggregation: the prefill and decode sides hash prefixes with "
                             "different seeds; give both the same prefix_caching_hash_seed")
        self.executor = executor
        if not warm:
            return 0.0
        start = time.perf_counter()
        executor.warm_up_blocks(None, write=True)
        return time.perf_counter() - start + self.warm_up()

    def add_request(self, request: Request) -> None:
        self.prefilling.add(request.request_id)
        self._timings[request.request_id] = _Timing(request.arrival_time)
        self._send_request(request_fields(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        remote = [r for r in request_ids if r in self.prefilling or r in self.parked]
        for req_id in request_ids:
            self.prefilling.discard(req_id)
            self.parked.discard(req_id)
            self.transferring.pop(req_id, None)  # its KV is dropped when it comes
            self._timings.pop(req_id, None)
        if remote:
            self._send_abort(remote)

    def release(self, request_ids: list[str]) -> None:
        for req_id in request_ids:
            self.parked.discard(req_id)
            self._timings.pop(req_id, None)
        self._send_abort(request_ids)

    def poll(self, idle: bool) -> RemoteEvents:
        first_tokens, arrived = self._receive(idle and not self._landed)
        events = RemoteEvents(loaded=self._landed)
        self._landed = []
        now = time.time()
        for out in first_tokens:
            if out.request_id in self.prefilling:  # else aborted while it was on the way
                self.prefilling.discard(out.request_id)
                self.parked.add(out.request_id)
                self._timings[out.request_id].first_token = now
                events.first_tokens.append(out)
        for kv in arrived:
            if kv.request_id in self.transferring:  # else aborted meanwhile: dropped
                rank, block_ids = self.transferring.pop(kv.request_id)
                self._write(rank, block_ids, kv, None)
                events.loaded.append((rank, kv.request_id))
        self._poll_copies()
        return events

    def start_loads(self, rank: int, loads: list[KVLoad]) -> None:
        for load in loads:
            self.parked.discard(load.req_id)
            started = time.perf_counter()
            kv = self._pull(load.req_id, rank, load.first_block, len(load.block_ids))
            if kv is None:
                self.transferring[load.req_id] = (rank, load.block_ids)
            else:
                self._write(rank, load.block_ids, kv, started)
                self._landed.append((rank, load.req_id))

    def record_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """The second token of a transferred request closes its TTFT split."""
        now = time.time()
        for out in outputs:
            timing = self._timings.get(out.request_id)
            if timing is not None and timing.landed:
                del self._timings[out.request_id]
                self.ttft_splits.append(TTFTSplit(timing.first_token - timing.arrival,
                                                  timing.landed - timing.first_token,
                                                  now - timing.landed))

    def stats(self) -> KVTransferStats:
        splits = list(self.ttft_splits)
        mean = (TTFTSplit(*(sum(getattr(s, f) for s in splits) / len(splits)
                            for f in ("prefill", "transfer", "first_decode")))
                if splits else None)
        return KVTransferStats(
            prefill=self.prefill_stats(), num_prefilling=len(self.prefilling),
            num_parked=len(self.parked), num_transferring=len(self.transferring),
            num_transfers=self.num_transfers, num_blocks_moved=self.num_blocks_moved,
            transfer_bytes=self.transfer_bytes, transfer_seconds=self.transfer_seconds,
            mean_ttft_split=mean)

    # ---- helpers -------------------------------------------------------------------------
    def _write(self, rank: int, block_ids: list[int], kv: TransferredKV,
               started: float | None) -> None:
        if kv.num_blocks != len(block_ids):
            raise RuntimeError(f"request {kv.request_id}: {kv.num_blocks} KV blocks arrived "
                               f"for {len(block_ids)} allocated")
        write_started = time.perf_counter()
        self.executor.write_blocks(rank, block_ids, kv.k, kv.v)
        self.num_transfers += 1
        self.num_blocks_moved += kv.num_blocks
        self.transfer_bytes += self.block_nbytes() * kv.num_blocks
        if kv.seconds is not None:  # arrived on the host: its wire time, plus the write
            self.transfer_seconds += kv.seconds + time.perf_counter() - write_started
        else:  # moving device to device: timed once the copy is seen landed
            self._copies.append((write_started if started is None else started, kv.k))
        timing = self._timings.get(kv.request_id)
        if timing is not None:
            timing.landed = time.time()

    def block_nbytes(self) -> int:
        """K and V of one block in the moved head layout."""
        L, _, _, BS, D, itemsize = self.executor.kv_cache_geometry()
        return 2 * L * len(self.heads) * BS * D * itemsize

    def _poll_copies(self) -> None:
        """Device-to-device copies are asynchronous: timed from the pull to when they are seen
        landed, checked at every poll (so at most a step late)."""
        now = time.perf_counter()
        still = []
        for started, array in self._copies:
            if array.is_ready():
                self.transfer_seconds += now - started
            else:
                still.append((started, array))
        self._copies = still
