"""The prefill side: an ordinary EngineCore whose requests (KVTransfer.SEND, one output token)
stop after their first token and keep their blocks until the decode side reads them: each
rank's scheduler has a KVProducer (core/scheduler_kv_connector.py), which holds them.

A read dispatches a copy of the blocks and frees them at once: they stay in the prefix cache
for later prompts. Requests holding blocks count as running in the stats, and at most
`max_pending_transfers` may hold them on a rank: then it admits no prefill (back-pressure: the
decode side is full).
"""

from __future__ import annotations

from typing import Any

import jax

from jaxserve.config import EngineConfig
from jaxserve.core.scheduler_kv_connector import KVProducer
from jaxserve.core.scheduler_output import EngineCoreOutput
from jaxserve.engine.core import EngineCore
from jaxserve.engine.kv_connector import prefill_request
from jaxserve.engine.stats import EngineStats
from jaxserve.models.loaded_model import LoadedModel


class PrefillEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None,
                 max_pending_transfers: int):
        self.core = EngineCore(config, loaded,
                               producer=lambda: KVProducer(max_sending=max_pending_transfers))
        self.producers: list[KVProducer] = [s.connector for s in self.core.schedulers]
        self.block_size = config.cache.block_size

    @property
    def root_hash(self) -> bytes:
        return self.core.root_hash

    def add_request(self, fields: dict[str, Any]) -> None:
        self.core.add_request(prefill_request(fields, self.block_size, self.core.root_hash))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Drop requests still prefilling, or free the blocks of those that are done."""
        self.core.abort_requests(request_ids)
        for req_id in request_ids:
            for producer in self.producers:
                producer.release(req_id)

    def step(self) -> list[EngineCoreOutput]:
        """One step when there is work (first tokens out; their requests now hold blocks)."""
        return self.core.step() if self.core.has_unfinished_requests() else []

    def read_kv(self, request_id: str, heads: tuple[int, ...], first_block: int,
                num_blocks: int) -> tuple[jax.Array, jax.Array]:
        """Dispatch a copy of a finished request's prompt blocks first_block.. (in the decode
        side's head layout, padded to a block bucket) and free them."""
        rank = next(rank for rank, p in enumerate(self.producers) if request_id in p.sending)
        producer = self.producers[rank]
        block_ids = producer.block_ids(request_id)[first_block:first_block + num_blocks]
        if len(block_ids) != num_blocks:
            raise RuntimeError(f"request {request_id}: {num_blocks} blocks asked from block "
                               f"{first_block}, {len(block_ids)} held")
        k, v = self.core.executor.read_blocks(rank, block_ids, heads)
        # Freeing before the copy has run is safe: the copy already holds the cache by value,
        # and the next step that may overwrite these blocks donates that cache, which the
        # runtime hands over only after the copy's read is done.
        producer.release(request_id)
        return k, v

    def stats(self) -> EngineStats:
        stats = self.core.stats()
        stats.num_running += self.num_holding
        return stats

    @property
    def num_holding(self) -> int:
        return sum(len(p.sending) for p in self.producers)

    def warm_up_reads(self, heads: tuple[int, ...]) -> float:
        self.core.executor.warm_up_blocks(heads, write=False)
        return self.core.warm_up_seconds

    def state(self) -> dict[str, Any]:
        """What tests and diagnostics check: nothing left behind once everything is done."""
        schedulers = self.core.schedulers
        return {"num_holding": self.num_holding,
                "num_free_blocks": [s.kv.num_free_blocks for s in schedulers],
                "num_blocks": [s.kv.num_blocks for s in schedulers],
                "num_requests": sum(len(s.requests) for s in schedulers),
                "num_block_owners": sum(len(s.kv.req_to_blocks) for s in schedulers)}
