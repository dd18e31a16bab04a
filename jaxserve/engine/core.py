"""EngineCore: schedule -> execute -> update, one step at a time."""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.config import EngineConfig
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import EngineCoreOutput
from jaxserve.executor.executor import UniProcExecutor
from jaxserve.models.loader import LoadedModel
from jaxserve.request import Request, RequestStatus


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_kv_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    num_compilations: int
    warm_up_seconds: float

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        self.executor = UniProcExecutor(config, loaded)
        worker = self.executor.worker
        self.model_config = worker.model_config
        self.max_model_len = worker.max_model_len
        hash_seed = config.cache.prefix_caching_hash_seed
        self.scheduler = Scheduler(config.scheduler, config.cache, worker.num_blocks,
                                   worker.max_model_len, self.model_config.eos_token_ids,
                                   hash_seed=config.model.seed if hash_seed is None else hash_seed)
        self.warm_up_seconds = self.executor.warm_up() if config.runner.precompile else 0.0

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        result = self.executor.execute_model(sched)
        return self.scheduler.update_from_output(sched, result)

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        runner = self.executor.worker.runner
        return EngineStats(s.num_running, s.num_waiting, s.kv_cache_usage,
                           self.executor.num_kv_blocks, s.prefix_cache_queries,
                           s.prefix_cache_hits, s.num_preemptions, s.num_steps,
                           runner.num_compilations, self.warm_up_seconds)
