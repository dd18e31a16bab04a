"""KVConnector: the decode engine's handle on the prefill engine and on the path its KV takes.

The disaggregated core drives a connector once per step: `start_step` (launch prefill work),
`finish_step` (first tokens out, KV of earlier pulls in), and `pull` for each request the decode
side has reserved blocks for. The in-process connector below runs the prefill engine on other
devices of this process and moves KV device to device; `socket_connector` runs it in another
process and moves host bytes over loopback.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.core.scheduler_output import EngineCoreOutput
from jaxserve.engine.disagg.prefill import PendingPrefill, PrefillSide
from jaxserve.engine.core import EngineCore, EngineStats
from jaxserve.executor.kv_blocks import transfer_heads
from jaxserve.models.loaded_model import LoadedModel
from jaxserve.core.request import Request, RequestStatus


@dataclass(slots=True)
class TransferredKV:
    """One request's prompt KV in the decode side's head layout, `[L, H, n(_padded), BS, D]`:
    device arrays already on the decode rank's sharding, or host arrays of exactly n blocks."""
    request_id: str
    k: jax.Array | np.ndarray
    v: jax.Array | np.ndarray
    num_blocks: int
    num_bytes: int  # of the n real blocks, K and V
    seconds: float | None  # pull to arrival, when known on arrival (else measured later)


@dataclass(slots=True)
class PrefillEvents:
    outputs: list[EngineCoreOutput] = field(default_factory=list)  # first tokens
    arrived: list[TransferredKV] = field(default_factory=list)  # KV of earlier pulls


class KVConnector(ABC):
    root_hash: bytes  # the prefill side's: requests are built against it

    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Drop requests still prefilling or parked on the prefill side (unknown ids: no-op)."""

    @abstractmethod
    def start_step(self) -> None: ...

    @abstractmethod
    def finish_step(self, idle: bool) -> PrefillEvents:
        """`idle`: the decode side has nothing to run, so the connector may wait a little."""

    @abstractmethod
    def pull(self, request_id: str, rank: int) -> TransferredKV | None:
        """Start moving a parked request's KV to decode rank `rank`. Returns it when it is
        already there (device arrays, dispatched), else None: it arrives in `finish_step`."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """The prefill side's latest stats (parked requests count as running)."""

    def warm_up(self) -> float:
        return 0.0

    def close(self) -> None:
        pass


def kv_nbytes(decode: EngineCore, heads: tuple[int, ...], num_blocks: int) -> int:
    cache = decode.executor.worker.runner.k_cache
    L, _, _, BS, D = cache.shape
    return 2 * L * len(heads) * num_blocks * BS * D * cache.dtype.itemsize


class InProcessConnector(KVConnector):
    def __init__(self, prefill_config: EngineConfig, loaded: LoadedModel, decode: EngineCore,
                 max_parked: int):
        self.prefill = PrefillSide(EngineCore(prefill_config, loaded), max_parked)
        self.decode = decode
        self.root_hash = self.prefill.core.root_hash
        self.heads = transfer_heads(loaded.config.num_kv_heads,
                                    prefill_config.parallel.tensor_parallel_size,
                                    decode.config.parallel.tensor_parallel_size)
        self._pending: PendingPrefill | None = None

    def add_request(self, request: Request) -> None:
        self.prefill.add_request(request)

    def abort_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        self.prefill.abort_requests(request_ids, status)

    def start_step(self) -> None:
        self._pending = self.prefill.dispatch()

    def finish_step(self, idle: bool) -> PrefillEvents:
        pending, self._pending = self._pending, None
        return PrefillEvents(self.prefill.collect(pending))

    def pull(self, request_id: str, rank: int) -> TransferredKV:
        k, v, n = self.prefill.read_kv(request_id, self.heads)
        sharding = self.decode.executor.workers[rank].runner.kv_sharding
        k, v = jax.device_put((k, v), sharding)  # device to device, dispatched
        return TransferredKV(request_id, k, v, n, kv_nbytes(self.decode, self.heads, n), None)

    def stats(self) -> EngineStats:
        return self.prefill.stats()

    def warm_up(self) -> float:
        self.prefill.warm_up_reads(self.heads)
        return self.prefill.core.warm_up_seconds
