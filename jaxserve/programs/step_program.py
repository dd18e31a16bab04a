"""The engine's model step as an abstract program: weights, KV caches (and with speculation the
drafter's weights and cache: the draft model's KV, or n-gram's token cache) and inputs as
sharded ShapeDtypeStructs, lowered through the same jitted step the model runner calls. The
compile check builds it for targets without chips; the worker compiles its largest step once
to learn the temporaries the KV pool must leave room for."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve.config import EngineConfig
from jaxserve.layers.attention import AttentionBackend
from jaxserve.layers.sampler import SamplingMetadata
from jaxserve.models.llama import Llama
from jaxserve.models.llama_config import LlamaConfig
from jaxserve.programs.resolved import ResolvedPlan
from jaxserve.placement.sharding import kv_cache_sharding
from jaxserve.placement.targets import chip_of
from jaxserve.programs.device_step import (PrevSamples, StepStatics, _sample,
                                           sample_rows_shape, split_model, step_inputs,
                                           step_statics)
from jaxserve.programs.drafter import make_drafter
from jaxserve.programs.input_batch import StepArrays, pack
from jaxserve.programs.spec_step import SpecStatics, engine_statics, model_step
from jaxserve.programs.step_shapes import ngram_lookup, step_variants


class ModelParts(NamedTuple):
    """A model's graph, its weights (real or abstract) on the mesh, and its config as placed."""
    graphdef: nnx.GraphDef
    state: Any
    cfg: LlamaConfig

    @staticmethod
    def of(model: Llama) -> "ModelParts":
        return ModelParts(*split_model(model), model.cfg)


@dataclass(frozen=True)
class StepProgram:
    """Everything the model step needs, abstract, for one engine configuration on one mesh."""
    statics: tuple[StepStatics | SpecStatics, ...]  # spec_step.engine_statics
    state: Any
    kv: jax.ShapeDtypeStruct
    prev: PrevSamples  # of ShapeDtypeStructs
    max_blocks_per_seq: int
    drafter_weights: Any = None  # with speculation: the draft model's weights ({}: none)
    drafter_cache: tuple[jax.ShapeDtypeStruct, ...] = ()  # with speculation: the drafter's

    @property
    def mesh(self) -> Any:
        return self.kv.sharding.mesh

    @property
    def arrays(self) -> tuple[Any, ...]:
        """The step's leading array arguments (as the model runner's)."""
        target = (self.state, self.kv, self.kv)
        return target if self.drafter_weights is None else (*target, self.drafter_weights,
                                                            self.drafter_cache)

    def compile(self, num_tokens: int, num_reqs: int, num_sample_rows: int | None = None,
                device_drafts: bool = False) -> Any:
        return self.compile_step(StepArrays.empty(num_tokens, num_reqs, self.max_blocks_per_seq,
                                                  num_sample_rows, device_drafts))

    def compile_step(self, arrays: StepArrays) -> Any:
        inputs, layout = step_inputs(arrays)
        statics = self.statics[arrays.device_drafts]
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):  # Pallas TPU lowering
            lowered = model_step(statics).trace(statics, layout, *self.arrays, self.prev,
                                                self.replicated(inputs)).lower()
        return lowered.compile()

    def compile_sampler(self, sampling: SamplingMetadata, logits: jax.ShapeDtypeStruct) -> Any:
        inputs, layout = pack(sampling)
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            rows = sample_rows_shape(logits.shape[0])
            lowered = _sample.trace(layout, logits, self.prev, self.replicated(rows),
                                    self.replicated(inputs)).lower()
        return lowered.compile()

    def replicated(self, host: np.ndarray) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(host.shape, host.dtype,
                                    sharding=NamedSharding(self.mesh, P()))


def _abstract(state: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)


def _kv(model: ModelParts, num_blocks: int, block_size: int,
        sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    """One of the model's caches, [L, Hkv, NB, BS, D], in its weights' dtype."""
    cfg = model.cfg
    return jax.ShapeDtypeStruct((cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size,
                                 cfg.head_dim), jax.tree.leaves(model.state)[0].dtype,
                                sharding=sharding)


def step_program(target: ModelParts, config: EngineConfig, backend: AttentionBackend,
                 plan: ResolvedPlan, draft: ModelParts | None = None) -> StepProgram:
    """`target` (and `draft`, the draft model): weights, real or abstract, on the mesh the KV
    caches will live on (its devices' kind picks the chip figures the step is planned by); the
    KV pool and the shapes: `plan`'s."""
    mesh = jax.tree.leaves(target.state)[0].sharding.mesh
    kv_sharding = kv_cache_sharding(mesh)
    num_blocks, bs = plan.num_kv_blocks, plan.block_size
    rows = jax.ShapeDtypeStruct((plan.max_sample_rows,), jnp.int32,
                                sharding=NamedSharding(mesh, P()))
    chip = chip_of(mesh.devices.flat[0].device_kind)
    itemsize = jax.tree.leaves(target.state)[0].dtype.itemsize
    plain, verifying = step_statics(config, target.graphdef, backend, kv_sharding, chip,
                                    target.cfg, itemsize)
    drafter = make_drafter(config, None if draft is None else draft.graphdef)
    program = StepProgram(engine_statics(plain, verifying, drafter), _abstract(target.state),
                          _kv(target, num_blocks, bs, kv_sharding), PrevSamples(rows, rows),
                          plan.blocks_per_seq)
    if drafter is None:
        return program
    if draft is not None:
        return replace(program, drafter_weights=_abstract(draft.state),
                       drafter_cache=(_kv(draft, num_blocks, bs, kv_sharding),) * 2)
    tokens = () if ngram_lookup(config) is None else (token_cache_shape(num_blocks, bs, mesh),)
    return replace(program, drafter_weights={}, drafter_cache=tokens)


def token_cache_shape(num_blocks: int, block_size: int, mesh: Any) -> jax.ShapeDtypeStruct:
    """n-gram speculation's token cache: the token id at every KV slot, replicated."""
    return jax.ShapeDtypeStruct((num_blocks, block_size), jnp.int32,
                                sharding=NamedSharding(mesh, P()))


def largest_step_bytes(target: ModelParts, config: EngineConfig, backend: AttentionBackend,
                       plan: ResolvedPlan, draft: ModelParts | None = None) -> int:
    """What the engine's largest step needs per device beside the weights and the KV pool:
    its temporaries, inputs and outputs (the draft model's passes included), compiled over a
    minimal KV pool (they do not grow with the pool: the caches are updated in place)."""
    program = step_program(target, config, backend, plan.with_pool(plan.min_kv_blocks), draft)
    T, R = max(plan.bucket_pairs)
    compiled = program.compile(T, R, *step_variants(T, R, plan.num_speculative_tokens)[-1])
    mem = compiled.memory_analysis()
    held = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
               for x in jax.tree.leaves(program.arrays))
    return int(mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
               + mem.temp_size_in_bytes) - held


def kv_blocks_for(planned_bytes: int, weight_bytes: int, step_bytes: int,
                  block_bytes: int) -> int:
    """KV pool size on one device: what the memory it plans into (placement/device_memory.py)
    leaves after the weights and the largest step's own bytes (vLLM sizes its pool the same
    way, from a profile run)."""
    return max(0, int((planned_bytes - weight_bytes - step_bytes) // block_bytes))
