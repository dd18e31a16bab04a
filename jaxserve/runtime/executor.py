"""Executor: the engine core's handle on its workers, one per data-parallel rank, each on its
own sub-mesh. A worker sets its rank up (weights, KV caches, programs); steps go straight to its
model runner. A step launches every rank before waiting for any, so ranks run concurrently."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import jax
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.models.hf_loader import hf_param_parts
from jaxserve.models.loaded_model import LoadedModel
from jaxserve.models.loader import LoadingModel, load_configured, start_loading
from jaxserve.placement.device_memory import set_allocator_fraction
from jaxserve.placement.mesh import initialize_distributed, rank_meshes
from jaxserve.programs.draft_model import load_draft
from jaxserve.runtime.model_runner import PendingStep, UnexpectedCompilationError
from jaxserve.runtime.worker import SLEEP_TAGS, BuiltWorker, Worker, restores_sharded

T = TypeVar("T")


class Executor:
    def __init__(self, config: EngineConfig,
                 loaded: LoadedModel | LoadingModel | None = None):
        set_allocator_fraction(config.cache.gpu_memory_utilization)  # before JAX's GPU client
        initialize_distributed(config.parallel)
        self.config = config
        # Sleep level 2 drops the weights and reads them again from the checkpoint
        self.weights_from_checkpoint = loaded is None
        m = config.model
        if loaded is None and not restores_sharded(config):
            loaded = start_loading(m)  # the weights are read while workers ready the rest
        draft = load_draft(config)
        self.workers = [Worker(config, loaded, mesh, draft) for mesh in rank_meshes(
            config.parallel, select_devices(config.parallel.devices))]

    @property
    def worker(self) -> Worker:
        return self.workers[0]

    @property
    def built(self) -> list[BuiltWorker]:
        """What each rank's worker built: its KV blocks, max_model_len, model config."""
        return [w.built for w in self.workers]

    def dispatch(self, scheds: list[SchedulerOutput]) -> list[PendingStep | None]:
        """Launch every rank's step without waiting (another engine's step can run meanwhile)."""
        return [w.runner.dispatch(s) for w, s in zip(self.workers, scheds)]

    def collect(self, pending: list[PendingStep | None]) -> list[ModelRunnerOutput]:
        return [w.runner.collect(p) for w, p in zip(self.workers, pending)]

    # ---- whole KV blocks in and out (disaggregated prefill/decode) ------------------------
    def read_blocks(self, rank: int, block_ids: list[int], heads: tuple[int, ...],
                    ) -> tuple[jax.Array, jax.Array]:
        return self.workers[rank].read_blocks(block_ids, heads)

    def write_blocks(self, rank: int, block_ids: list[int], k: jax.Array | np.ndarray,
                     v: jax.Array | np.ndarray) -> None:
        self.workers[rank].write_blocks(block_ids, k, v)

    def kv_sharding(self, rank: int) -> jax.sharding.Sharding:
        return self.workers[rank].kv_sharding

    def kv_cache_geometry(self) -> tuple[int, int, int, int, int, int]:
        """(layers, KV heads, blocks, block size, head dim, bytes per element) of rank 0's cache."""
        cache = self.worker.runner.k_cache
        return (*cache.shape, cache.dtype.itemsize)

    def warm_up_blocks(self, heads: tuple[int, ...] | None, write: bool) -> None:
        for w in self.workers:
            w.warm_up_blocks(heads, write)

    def device_state_lost(self) -> bool:
        """Whether a worker's KV cache or last sampled ids are gone or hold an error (a failed
        device computation poisons its outputs and may have consumed its donated inputs)."""
        for w in self.workers:
            for array in (w.runner.k_cache, w.runner.v_cache, *w.runner.drafter_cache,
                          *w.runner.prev):
                try:
                    if array.is_deleted():
                        return True
                    array.block_until_ready()
                except Exception:  # noqa: BLE001 (any failure to read it back means lost)
                    return True
        return False

    def warm_up(self) -> float:
        return sum(w.runner.warm_up() for w in self.workers)

    # ---- sleep mode and weight updates (vLLM's) ------------------------------------------
    @property
    def asleep(self) -> frozenset[str]:
        """The parts asleep, of SLEEP_TAGS (equal on every rank)."""
        return self.worker.asleep

    @property
    def sleep_level(self) -> int:
        return self.worker.sleep_level

    def held_bytes(self) -> dict[str, int]:
        """Device bytes of the weights and of the KV cache, summed over ranks."""
        return {tag: sum(w.held_bytes[tag] for w in self.workers) for tag in SLEEP_TAGS}

    def sleep(self, level: int) -> None:
        if level == 2 and not self.weights_from_checkpoint:
            raise ValueError("level 2 drops the weights and reads them again from the "
                             "checkpoint, but this engine's were given in memory; use level 1")
        for w in self.workers:
            w.sleep(level)

    def wake_up(self, tags: frozenset[str]) -> None:
        reload = "weights" in tags & self.asleep and self.sleep_level == 2
        checkpoint = load_configured(self.config.model) if reload else None
        for w in self.workers:
            w.wake_up(tags, checkpoint)

    def update_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """HF-named weights written over the model's, all checked before any is written."""
        parts = hf_param_parts(self.worker.loaded.config, weights)
        for w in self.workers:
            w.update_weights(parts)

    def collective_rpc(self, method: str | Callable[..., T], args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> list[T]:
        """vLLM's: `method` called on every rank's worker, a Worker method by name or a
        function taking the worker first; their results in rank order."""
        if isinstance(method, str):
            if method.startswith("_") or not callable(getattr(Worker, method, None)):
                raise ValueError(f"method: the worker has no public method {method!r}")
            return [getattr(w, method)(*args, **kwargs) for w in self.workers]
        if not callable(method):
            raise ValueError(f"method must be a worker method's name or a callable, got "
                             f"{method!r}")
        return [method(w, *args, **kwargs) for w in self.workers]


__all__ = ["SLEEP_TAGS", "Executor", "PendingStep", "UnexpectedCompilationError",
           "select_devices"]


def select_devices(ids: list[int] | None) -> list[Any] | None:
    """The devices with these indices in `jax.devices()` (None: all of them, in order)."""
    if ids is None:
        return None
    devices = jax.devices()
    bad = [i for i in ids if not 0 <= i < len(devices)]
    if bad:
        raise ValueError(f"devices: index {bad[0]} is out of range; {len(devices)} devices "
                         "are present")
    return [devices[i] for i in ids]
