"""The scheduler's side of a KV connector (engine/ and engine/disagg/ move the KV), in one of two
roles, as vLLM V1's KVConnector on the scheduler with a producer and a consumer.

The scheduler calls its connector at fixed points: a request's arrival (`add_request`), its
admission (`hold`, `seats_taken`, `num_loaded_tokens`, `admitted`), each step's loads
(`take_loads`) and its end (`request_finished`, which may keep its blocks).

Producer (prefill side): a finished request marked KVTransfer.SEND keeps its blocks until the
decode side has read them (`release`); while `max_sending` requests wait so, nothing is admitted.
Consumer (decode side): a KVTransfer.RECEIVE request waits for its first token, then takes blocks
for its prompt; the prompt blocks its prefix cache lacks become a KVLoad of the next step, and
`finish_loading` lets it be admitted like a prefix hit.
"""

from __future__ import annotations

from enum import Enum

from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import KVTransfer, Request, RequestStatus
from jaxserve.core.scheduler_output import KVLoad


class Hold(Enum):
    """Why a waiting request is not admitted this step."""
    DEFER = "defer"  # set aside: back at the front of the queue after this step
    STOP = "stop"  # nothing behind it is admitted either (first come first served)
    FAIL = "fail"  # it can never run: finished with its error


class SchedulerKVConnector:
    """The hooks the scheduler calls; each role overrides the ones it acts on."""
    kv: KVCacheManager  # set by `bind` when the scheduler is built

    def bind(self, kv: KVCacheManager) -> None:
        """The KV pool of the scheduler this connector serves."""
        self.kv = kv

    def add_request(self, request: Request) -> None:
        """A request arrives (before it is queued)."""

    def hold(self, request: Request) -> Hold | None:
        """Admission: why the request at the head of the queue is not admitted now (None: no
        reason of this connector's)."""
        return None

    def waits(self, request: Request) -> bool:
        """Nothing can be done for this waiting request now (its KV is elsewhere)."""
        return False

    def seats_taken(self, request: Request) -> int:
        """Seats among max_num_seqs taken by waiting requests holding blocks, not counting
        `request`."""
        return 0

    def num_loaded_tokens(self, request: Request) -> int | None:
        """Admission: tokens of a waiting request already in its blocks (its prefix hit), or
        None when it holds no blocks."""
        return None

    def admitted(self, request: Request) -> None:
        """The request now runs."""

    def take_loads(self) -> list[KVLoad]:
        """The loads this step starts."""
        return []

    def request_finished(self, request: Request) -> bool:
        """The request finished (its status says how); True: the connector keeps its blocks
        and frees them later, else the scheduler frees them now."""
        return False


class KVProducer(SchedulerKVConnector):
    """Prefill side: finished requests' blocks wait to be read by the decode side."""

    def __init__(self, max_sending: int = 0):
        self.max_sending = max_sending  # > 0: admit nothing while this many requests wait
        self.sending: dict[str, Request] = {}

    def hold(self, request: Request) -> Hold | None:
        return Hold.STOP if 0 < self.max_sending <= len(self.sending) else None

    def request_finished(self, request: Request) -> bool:
        if request.kv_transfer is not KVTransfer.SEND or request.status not in (
                RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
            return False
        self.sending[request.request_id] = request
        return True

    def block_ids(self, request_id: str) -> list[int]:
        """The blocks of a request in `sending`, to be read."""
        return self.kv.get_block_ids(request_id)

    def release(self, request_id: str) -> None:
        """Free a finished request's blocks once read (or no longer wanted); they stay in the
        prefix cache."""
        request = self.sending.pop(request_id, None)
        if request is not None:
            self.kv.free(request)


class KVConsumer(SchedulerKVConnector):
    """Decode side: requests wait for their first token, then for their prompt's KV."""

    def __init__(self) -> None:
        self.receiving: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KVS
        # Waiting requests holding blocks (their KV on its way, or arrived): they take seats.
        self._holding: set[str] = set()
        self._loads: list[KVLoad] = []

    def add_request(self, request: Request) -> None:
        if request.kv_transfer is KVTransfer.RECEIVE:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.receiving[request.request_id] = request

    def hold(self, request: Request) -> Hold | None:
        """Skipped, taking its blocks first if its first token is here (or stop here, first
        come first served, when the pool is full)."""
        if request.request_id not in self.receiving:
            return None
        if not self.waits(request) and not self._allocate_for_load(request):
            return Hold.STOP
        return Hold.DEFER

    def waits(self, request: Request) -> bool:
        """No first token yet, or its KV on the way."""
        return request.request_id in self.receiving and (
            not request.num_output_tokens or request.request_id in self._holding)

    def seats_taken(self, request: Request) -> int:
        return len(self._holding) - (request.request_id in self._holding)

    def num_loaded_tokens(self, request: Request) -> int | None:
        return request.num_computed_tokens if request.request_id in self._holding else None

    def admitted(self, request: Request) -> None:
        self._holding.discard(request.request_id)

    def take_loads(self) -> list[KVLoad]:
        loads, self._loads = self._loads, []
        return loads

    def request_finished(self, request: Request) -> bool:
        self.receiving.pop(request.request_id, None)
        self._holding.discard(request.request_id)
        return False

    def finish_loading(self, request_id: str) -> None:
        """A request's prompt KV is in its blocks (or its write is dispatched ahead of the next
        step): it is admitted like a prefix hit of all but its last token."""
        request = self.receiving.pop(request_id, None)
        if request is None:
            return  # aborted while its KV was on the way
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = request.num_tokens - 1

    def _allocate_for_load(self, request: Request) -> bool:
        """Blocks for a request whose first token came from the prefill side (prompt + that
        token), hitting this side's prefix cache first; the prompt blocks past the hit become
        a KVLoad of this step. False, with nothing changed, when the pool is full (the lookup
        counts in the stats once it succeeds: it is retried every step)."""
        hits, num_hit = self.kv.find_cached_prefix(request)
        if self.kv.allocate_slots(request, request.num_tokens - num_hit, hits) is None:
            return False
        self.kv.record_query(request, num_hit)
        self._holding.add(request.request_id)
        request.num_computed_tokens = num_hit
        # The prompt past the hit (the first token's KV is computed here: the next input).
        first, block_ids = self.kv.get_block_span(request.request_id, num_hit,
                                                  request.num_tokens - 1)
        if block_ids:
            self._loads.append(KVLoad(request.request_id, block_ids, first))
        else:  # the whole prompt was a hit here: nothing to move
            self.finish_loading(request.request_id)
        return True
