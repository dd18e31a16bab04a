"""What an engine reports about itself: its EngineStats snapshot and, on a disaggregated
decode side, the KV connector's transfer stats (which hold the prefill side's EngineStats)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.core.scheduler_output import SpecDecodingStats


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # mean over ranks
    num_kv_blocks: int  # per rank
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    num_compilations: int
    warm_up_seconds: float
    # Wall seconds per step phase since start, summed over ranks (see core/step_timing.py).
    step_seconds: dict[str, float]
    # Device bytes held now, summed over ranks (a replicated array once per device): 0 for a
    # part put to sleep
    weight_bytes: int
    kv_cache_bytes: int
    sleep_level: int  # 0: awake; else sleep()'s level, until wake_up has woken every part
    kv_transfer: KVTransferStats | None = None  # disaggregated decode: prefill side, KV moved
    spec_decoding: SpecDecodingStats | None = None  # summed over ranks, with speculation on

    @property
    def prefix_cache_hit_rate(self) -> float:
        queries = self.prefix_cache_queries
        return self.prefix_cache_hits / queries if queries else 0.0


@dataclass(slots=True)
class TTFTSplit:
    """Seconds from arrival to the second token: prefill (arrival -> first token, which is
    also the user's TTFT), transfer (first token -> KV in decode blocks, including any wait for
    decode room), first decode (KV landed -> second token)."""
    prefill: float
    transfer: float
    first_decode: float


@dataclass(slots=True)
class KVTransferStats:
    prefill: EngineStats  # the prefill side's (requests holding blocks count as running)
    num_prefilling: int  # sent to the prefill side, first token not here yet
    num_parked: int  # first token here, waiting for decode blocks (the back-pressure queue)
    num_transferring: int  # decode blocks allocated, KV on its way
    num_transfers: int
    num_blocks_moved: int  # prompt blocks hit in the decode side's prefix cache are not moved
    transfer_bytes: int
    transfer_seconds: float  # summed over transfers whose duration is known
    mean_ttft_split: TTFTSplit | None
