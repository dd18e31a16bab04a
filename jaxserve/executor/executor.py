"""Executor: the engine core's handle on its workers (one in-process worker today)."""

from __future__ import annotations

from jaxserve.config import EngineConfig
from jaxserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.executor.worker import Worker
from jaxserve.models.loader import LoadedModel


class UniProcExecutor:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.worker = Worker(config, loaded)

    @property
    def num_kv_blocks(self) -> int:
        return self.worker.num_blocks

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def warm_up(self) -> float:
        return self.worker.runner.warm_up()
