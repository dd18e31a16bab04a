"""The in-process connector: the prefill engine runs on other devices of this process, steps
while the decode side's step runs, and its KV moves device to device."""

from __future__ import annotations

from typing import Any

import jax

from jaxserve.config import EngineConfig
from jaxserve.core.scheduler_output import EngineCoreOutput
from jaxserve.engine.stats import EngineStats
from jaxserve.engine.disagg.prefill_engine import PrefillEngine
from jaxserve.engine.kv_connector import KVConnector, TransferredKV
from jaxserve.models.loaded_model import LoadedModel


class InProcessConnector(KVConnector):
    def __init__(self, prefill_config: EngineConfig, loaded: LoadedModel,
                 heads: tuple[int, ...], max_pending_transfers: int):
        super().__init__(heads)
        self.prefill = PrefillEngine(prefill_config, loaded, max_pending_transfers)
        self._first_tokens: list[EngineCoreOutput] = []

    @property
    def root_hash(self) -> bytes:
        return self.prefill.root_hash

    def _send_request(self, fields: dict[str, Any]) -> None:
        self.prefill.add_request(fields)

    def _send_abort(self, request_ids: list[str]) -> None:
        self.prefill.abort_requests(request_ids)

    def start_step(self) -> None:
        self._first_tokens += self.prefill.step()

    def _receive(self, idle: bool) -> tuple[list[EngineCoreOutput], list[TransferredKV]]:
        first, self._first_tokens = self._first_tokens, []
        return first, []

    def _pull(self, request_id: str, rank: int, first_block: int,
              num_blocks: int) -> TransferredKV:
        k, v = self.prefill.read_kv(request_id, self.heads, first_block, num_blocks)
        k, v = jax.device_put((k, v), self.executor.kv_sharding(rank))  # dispatched
        return TransferredKV(request_id, k, v, num_blocks)

    def prefill_stats(self) -> EngineStats:
        return self.prefill.stats()

    def warm_up(self) -> float:
        return self.prefill.warm_up_reads(self.heads)
