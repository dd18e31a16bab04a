"""Executor: the engine core's handle on its workers, one per data-parallel rank, each on its
own sub-mesh. A step launches every rank before waiting for any, so ranks run concurrently."""

from __future__ import annotations

from jaxserve.config import EngineConfig
from jaxserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.distributed.mesh import initialize_distributed, rank_meshes
from jaxserve.executor.worker import Worker
from jaxserve.models.loader import LoadedModel, load_model


class Executor:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        initialize_distributed(config.parallel)
        m = config.model
        loaded = loaded or load_model(m.model, m.load_format, seed=m.seed)
        self.workers = [Worker(config, loaded, mesh) for mesh in rank_meshes(config.parallel)]

    @property
    def worker(self) -> Worker:
        return self.workers[0]

    def execute_model(self, scheds: list[SchedulerOutput]) -> list[ModelRunnerOutput]:
        pending = [w.runner.dispatch(s) for w, s in zip(self.workers, scheds)]
        return [w.runner.collect(p) for w, p in zip(self.workers, pending)]

    def warm_up(self) -> float:
        return sum(w.runner.warm_up() for w in self.workers)
