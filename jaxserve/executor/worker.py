"""Worker: owns the device mesh, loads the weights onto it, sizes the KV cache, builds the runner."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.config import EngineConfig
from jaxserve.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.executor.model_runner import ModelRunner, dtype_of
from jaxserve.layers.attention import get_attention_backend, validate_backend
from jaxserve.models.llama import Llama, init_kv_cache, kv_cache_bytes_per_block
from jaxserve.models.loader import LoadedModel, load_model

logger = logging.getLogger(__name__)


def enable_compilation_cache(cache_dir: str | None) -> None:
    if cache_dir == "":
        return
    cache_dir = cache_dir or os.environ.get("JAXSERVE_CACHE_DIR") or str(
        Path.home() / ".cache" / "jaxserve" / "xla")
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class Worker:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        enable_compilation_cache(config.runner.compilation_cache_dir)
        m = config.model
        self.loaded = loaded or load_model(m.model, m.load_format, seed=m.seed)
        self.model_config = self.loaded.config
        self.max_model_len = m.max_model_len or self.model_config.max_position_embeddings
        self.mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
        self.dtype = dtype_of(m.dtype)
        self.model = Llama(self.model_config, self.loaded.params, self.dtype)
        self.num_blocks = self._num_kv_blocks()
        k_cache, v_cache = init_kv_cache(self.model_config, self.num_blocks,
                                         config.cache.block_size, self.dtype)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        k_cache, v_cache = jax.device_put((k_cache, v_cache), replicated)
        platform = jax.default_backend()
        backend = get_attention_backend(config.runner.attention_backend, platform)
        cfg = self.model_config
        validate_backend(backend, platform=platform, num_q_heads=cfg.num_heads,
                         num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                         block_size=config.cache.block_size,
                         max_num_seqs=config.scheduler.max_num_seqs,
                         pages_per_seq=-(-self.max_model_len // config.cache.block_size),
                         max_num_tokens=config.scheduler.max_num_batched_tokens,
                         dtype=jnp.dtype(self.dtype).name)
        self.runner = ModelRunner(config, self.model, k_cache, v_cache, backend,
                                  self.max_model_len, self.model_config.eos_token_ids)

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        per_block = kv_cache_bytes_per_block(self.model_config, cache.block_size, self.dtype)
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" in stats:
            budget = stats["bytes_limit"] * cache.gpu_memory_utilization - stats.get(
                "bytes_in_use", 0)
        else:
            budget = cache.cpu_kv_cache_space_gib * 2**30
        num_blocks = int(budget // per_block)
        blocks_per_seq = -(-self.max_model_len // cache.block_size)
        if num_blocks < blocks_per_seq + 1:
            raise ValueError(f"KV cache budget holds {num_blocks} blocks of {per_block} bytes, "
                             f"fewer than one max_model_len sequence needs ({blocks_per_seq} + 1); "
                             "lower max_model_len or raise the memory budget")
        return num_blocks

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(sched)
