"""The engine's model step as an abstract program: weights, KV cache and inputs as sharded
ShapeDtypeStructs, lowered through the same jitted `_step` the model runner calls. The compile
check builds it for targets without chips; the worker compiles its largest step once to learn
the temporaries the KV pool must leave room for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve.config import EngineConfig
from jaxserve.executor.sharding import kv_cache_sharding
from jaxserve.executor.input_batch import StepArrays
from jaxserve.executor.model_runner import (PrevSamples, StepStatics, _sample, _step,
                                           sample_rows_shape, step_inputs)
from jaxserve.executor.step_shapes import (bucket_pairs, device_draft_statics, max_sample_rows,
                                           num_speculative_tokens, step_buckets, step_variants)
from jaxserve.executor.packing import pack
from jaxserve.layers.sampler import SamplingMetadata
from jaxserve.layers.attention import AttentionBackend
from jaxserve.models.llama_config import LlamaConfig


@dataclass(frozen=True)
class StepProgram:
    """Everything `_step` needs, abstract, for one engine configuration on one mesh."""
    statics: StepStatics
    state: Any
    kv: jax.ShapeDtypeStruct
    prev: PrevSamples  # of ShapeDtypeStructs
    max_blocks_per_seq: int
    draft_statics: StepStatics | None = None  # layer skip: the drafting program's

    @property
    def mesh(self) -> Any:
        return self.statics.kv_sharding.mesh

    def compile(self, num_tokens: int, num_reqs: int, num_sample_rows: int | None = None,
                device_drafts: bool = False) -> Any:
        return self.compile_step(StepArrays.empty(num_tokens, num_reqs, self.max_blocks_per_seq,
                                                  num_sample_rows, device_drafts))

    def compile_step(self, arrays: StepArrays) -> Any:
        inputs, layout = step_inputs(arrays)
        statics = self.draft_statics if arrays.device_drafts else self.statics
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):  # Pallas TPU lowering
            lowered = _step.trace(statics, layout, self.state, self.kv, self.kv, self.prev,
                                  self.replicated(inputs)).lower()
        return lowered.compile()

    def compile_sampler(self, sampling: SamplingMetadata, logits: jax.ShapeDtypeStruct) -> Any:
        inputs, layout = pack(sampling)
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            rows = sample_rows_shape(logits.shape[0])
            lowered = _sample.trace(layout, logits, self.prev,
                                    self.replicated(rows), self.replicated(inputs)).lower()
        return lowered.compile()

    def replicated(self, host: np.ndarray) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(host.shape, host.dtype,
                                    sharding=NamedSharding(self.mesh, P()))


def step_program(graphdef: nnx.GraphDef, state: Any, cfg: LlamaConfig, config: EngineConfig,
                 backend: AttentionBackend, num_blocks: int, max_model_len: int) -> StepProgram:
    """`state`: the model's weights, real or abstract, on the mesh the KV cache will live on."""
    mesh = jax.tree.leaves(state)[0].sharding.mesh
    kv_sharding = kv_cache_sharding(mesh)
    bs = config.cache.block_size
    kv = jax.ShapeDtypeStruct((cfg.num_layers, cfg.num_kv_heads, num_blocks, bs, cfg.head_dim),
                              jax.tree.leaves(state)[0].dtype, sharding=kv_sharding)
    rows = jax.ShapeDtypeStruct((max_sample_rows(config),), jnp.int32,
                                sharding=NamedSharding(mesh, P()))
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                         state)
    draft_layers, max_drafts = device_draft_statics(config)
    drafting = StepStatics(graphdef, backend, kv_sharding, draft_layers, max_drafts) \
        if draft_layers else None
    return StepProgram(StepStatics(graphdef, backend, kv_sharding), state, kv,
                       PrevSamples(rows, rows),
                       -(-max_model_len // bs), drafting)


def largest_step_temp_bytes(graphdef: nnx.GraphDef, state: Any, cfg: LlamaConfig,
                            config: EngineConfig, backend: AttentionBackend,
                            max_model_len: int) -> int:
    """The temporaries of the engine's largest step, compiled over a minimal KV pool (they do
    not grow with the pool: the cache is updated in place)."""
    min_blocks = -(-max_model_len // config.cache.block_size) + 1
    program = step_program(graphdef, state, cfg, config, backend, min_blocks, max_model_len)
    T, R = max(bucket_pairs(*step_buckets(config)))
    compiled = program.compile(T, R, *step_variants(
        T, R, num_speculative_tokens(config), program.draft_statics is not None)[-1])
    return int(compiled.memory_analysis().temp_size_in_bytes)


def kv_blocks_for(hbm_bytes: int, utilization: float, weight_bytes: int, temp_bytes: int,
                  block_bytes: int) -> int:
    """KV pool size on one device: what the memory share leaves after the weights and the
    step's temporaries (vLLM sizes its pool the same way, from a profile run)."""
    return max(0, int((hbm_bytes * utilization - weight_bytes - temp_bytes) // block_bytes))


