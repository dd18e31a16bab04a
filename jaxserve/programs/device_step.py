"""The model step as jitted pure functions, and their static arguments: the model program
`(weights, KV caches, inputs) -> (KV caches, logits, the sampler's rows)`, with the caches
donated and their layout pinned, and the sampler program. Both read what the step before
sampled on the device (`PrevSamples`): a step scheduled while it ran takes its sampled ids as
inputs and its accepted drafts as the correction of its positions (spec_verify.py). This is
the plain step; a speculative engine's steps compose its pieces with a drafter
(programs/spec_step.py). The model runner calls these; the abstract step program (compile
check, KV pool sizing) lowers them."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.config import EngineConfig
from jaxserve.layers.attention import AttentionBackend, AttentionMetadata
from jaxserve.layers.axes import AXIS
from jaxserve.layers.collective_matmul import CollectiveMatmul
from jaxserve.layers.sampler import SamplerOutput, TokenLogprobs, sample, token_logprobs
from jaxserve.models.llama import DENSE_PARAMS, Llama
from jaxserve.models.llama_config import LlamaConfig, param_shapes
from jaxserve.models.moe import MoeConfig
from jaxserve.placement.targets import Chip
from jaxserve.programs.input_batch import PackedLayout, StepArrays, pack, unpack
from jaxserve.programs.spec_verify import accepted_drafts, resolve_previous_step, sample_rows

ProgramKey = tuple[str, PackedLayout | None]  # (kind, the packed inputs' layout)


class PrevSamples(NamedTuple):
    """What the last launched step samples, as the next step's inputs read it on the device
    (sample-row order)."""
    sampled: jax.Array  # i32[max sample rows]  the sampled ids
    accepted: jax.Array  # i32[max sample rows]  the drafts each row's request accepted


def sample_rows_shape(num_rows: int) -> jax.ShapeDtypeStruct:
    """The model step's `rows` output, i32[3, S], as the sampler program takes it."""
    return jax.ShapeDtypeStruct((3, num_rows), jnp.int32)


class Statics:
    """A jitted step's static argument. jit hashes static arguments on every call, and an NNX
    GraphDef takes milliseconds to hash, so the hash of `key` is computed once here."""

    def __init__(self, key: tuple[Any, ...]):
        self._key, self._hash = key, hash(key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (type(other) is type(self) and self._hash == other._hash
                                 and self._key == other._key)


class StepStatics(Statics):
    """The model's graph and how its steps run: the attention backend, the KV caches' layout,
    and where the steps overlap their tensor-parallel collectives with the matmuls."""

    def __init__(self, graphdef: nnx.GraphDef, backend: AttentionBackend,
                 kv_sharding: NamedSharding, collective: CollectiveMatmul | None = None):
        self.graphdef, self.backend, self.kv_sharding = graphdef, backend, kv_sharding
        self.collective = collective
        super().__init__((graphdef, backend, kv_sharding, collective))


def step_statics(config: EngineConfig, graphdef: nnx.GraphDef, backend: AttentionBackend,
                 kv_sharding: NamedSharding, chip: Chip | None, cfg: LlamaConfig,
                 itemsize: int) -> tuple[StepStatics, StepStatics]:
    """The statics of steps without drafts, whose decodes are one row each, and of steps that
    verify drafts. `chip`: the device's published figures (None on CPU); `cfg`, `itemsize`:
    the target model as the devices hold it."""
    collective = collective_matmul(config, kv_sharding.mesh, chip, cfg, itemsize)
    return (StepStatics(graphdef, backend.without_drafts(), kv_sharding, collective),
            StepStatics(graphdef, backend, kv_sharding, collective))


def collective_matmul(config: EngineConfig, mesh: Mesh, chip: Chip | None, cfg: LlamaConfig,
                      itemsize: int) -> CollectiveMatmul | None:
    """Where steps overlap their collectives with the matmuls: from the configured token count,
    or from the fewest tokens for which, on this chip, a layer takes less time that way."""
    tp = mesh.shape[AXIS]
    if tp == 1 or isinstance(cfg, MoeConfig):  # a mixture's MLP is its experts' matmuls
        return None
    tokens = config.runner.collective_matmul_min_tokens
    if tokens is None and chip is not None:
        tokens = next((T for T in (2 * tp << i for i in range(20))
                       if _collective_matmul_gain(T, tp, cfg, itemsize, chip) > 0), None)
    return None if tokens is None else CollectiveMatmul(mesh, tokens)


def _collective_matmul_gain(tokens: int, tp: int, cfg: LlamaConfig, itemsize: int,
                            chip: Chip) -> float:
    """Seconds a layer of `tokens` rows saves with the collective matmuls. Plainly: its
    matmuls, then two all-reduces of [tokens, hidden]. With them, each of its four matmul
    groups (q/k/v, o, gate/up, down) runs one chunk of rows per device, each chunk reading the
    weights again, beside the transfer of the next chunk (half the rows each way, one link)."""
    shapes = param_shapes(cfg)
    weights = {name: math.prod(shapes[name][1:]) * itemsize // tp for name in DENSE_PARAMS}
    groups = [("wq", "wk", "wv"), ("wo",), ("w_gate", "w_up"), ("w_down",)]

    def matmul(rows: int, w: int) -> float:  # 2 flops per weight element and row
        return max(w / chip.hbm_bandwidth, 2 * rows * w / itemsize / chip.bf16_flops)

    row_bytes = cfg.hidden_size * itemsize
    plain = sum(matmul(tokens, w) for w in weights.values()) + 2 * chip.collective_seconds(
        2 * (tp - 1) / tp * tokens * row_bytes, 2 * (tp - 1), links=2)  # XLA's 2 rings
    transfer = chip.collective_seconds(tokens // tp // 2 * row_bytes, 1, links=1)
    overlapped = 0.0
    for group in groups:
        chunk = sum(matmul(tokens // tp, weights[name]) for name in group)
        overlapped += chunk + (tp - 1) * max(chunk, transfer)
    return plain - overlapped


class StepInputs(NamedTuple):
    """The step's inputs on the device, as the step before it turned out (spec_verify.py)."""
    input_ids: jax.Array  # i32[T]  drafts as placeholders
    md: AttentionMetadata
    logits_indices: jax.Array  # i32[S]
    draft_starts: jax.Array  # i32[R]  each request's last known token's row
    num_drafts: jax.Array  # i32[R]  its drafts (0: none)
    token_shift: jax.Array  # i32[T]  how far back each token moved


class StepOutputs(NamedTuple):
    k_cache: jax.Array  # the donated caches, written
    v_cache: jax.Array
    logits: jax.Array  # f32[S, V]
    rows: jax.Array  # i32[3, S]  spec_verify.sample_rows: the sampler's row drafts and shifts


class Forward(NamedTuple):
    """A step's pass: the merged model and its hidden states (prompt logprobs read them), and
    the step's outputs."""
    model: Llama
    hidden: jax.Array  # [T, D]
    sample_hidden: jax.Array  # [S, D]  at the sample rows (the logits')
    out: Any  # StepOutputs, or spec_step.SpecStepOutputs


def read_inputs(layout: PackedLayout, prev: PrevSamples, inputs: jax.Array,
                block_size: int) -> StepInputs:
    # inputs: i32[n], the packed (input_ids, prev_rows, AttentionMetadata, logits_indices,
    # draft_starts, num_drafts, prev_base, prev_drafts)
    (input_ids, prev_rows, md, logits_indices, draft_starts, num_drafts, prev_base,
     prev_drafts) = unpack(layout, inputs)
    input_ids, md, token_shift = resolve_previous_step(
        input_ids, prev_rows, md, prev.sampled, prev.accepted, prev_base, prev_drafts,
        block_size=block_size)
    return StepInputs(input_ids, md, logits_indices, draft_starts, num_drafts, token_shift)


def run_model(statics: StepStatics, model: Llama, input_ids: jax.Array, md: AttentionMetadata,
              k_cache: jax.Array, v_cache: jax.Array,
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(hidden [T, D], k_cache, v_cache): the target's pass, its caches pinned to their
    layout so the donated buffers come back exactly as they went in."""
    hidden, k_cache, v_cache = model(input_ids, md, k_cache, v_cache, statics.backend,
                                     collective=statics.collective)
    k_cache, v_cache = (jax.lax.with_sharding_constraint(c, statics.kv_sharding)
                        for c in (k_cache, v_cache))
    return hidden, k_cache, v_cache


def rows_of(statics: StepStatics, x: StepInputs, input_ids: jax.Array) -> jax.Array:
    """The sampler's rows (spec_verify.sample_rows) of the step's inputs (drafts in place),
    replicated as the host reads them: a step whose residual is sharded by rows (collective
    matmul) would have the compiler shard what is read off its tokens too."""
    return jax.lax.with_sharding_constraint(
        sample_rows(input_ids, x.md.query_start_loc, x.logits_indices, x.draft_starts,
                    x.num_drafts, x.token_shift), replicated(statics.kv_sharding))


def _forward(statics: StepStatics, layout: PackedLayout, state: nnx.State, k_cache: jax.Array,
             v_cache: jax.Array, prev: PrevSamples, inputs: jax.Array) -> Forward:
    x = read_inputs(layout, prev, inputs, block_size=k_cache.shape[3])
    model = nnx.merge(statics.graphdef, state)
    hidden, k_cache, v_cache = run_model(statics, model, x.input_ids, x.md, k_cache, v_cache)
    sample_hidden = hidden[x.logits_indices]
    return Forward(model, hidden, sample_hidden,
                   StepOutputs(k_cache, v_cache, model.compute_logits(sample_hidden),
                               rows_of(statics, x, x.input_ids)))


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3, 4))
def _step(statics: StepStatics, layout: PackedLayout, state: nnx.State, k_cache: jax.Array,
          v_cache: jax.Array, prev: PrevSamples, inputs: jax.Array) -> StepOutputs:
    """The plain step: inputs -> model -> the sampler's logits and rows."""
    return _forward(statics, layout, state, k_cache, v_cache, prev, inputs).out


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4, 5))
def _step_prompt_logprobs(statics: StepStatics, layout: PackedLayout, num_top: int,
                          state: nnx.State, k_cache: jax.Array, v_cache: jax.Array,
                          prev: PrevSamples, inputs: jax.Array, targets: jax.Array,
                          ) -> tuple[StepOutputs, TokenLogprobs]:
    """`_step`, plus every token row's logprob of `targets` (i32[T], the next prompt token):
    a separate program per token bucket, run only for steps where a row asks."""
    f = _forward(statics, layout, state, k_cache, v_cache, prev, inputs)
    return f.out, token_logprobs(f.model.compute_logits(f.hidden), targets, num_top)  # [T, V]


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3, 4))
def _step_pooled(statics: StepStatics, layout: PackedLayout, state: nnx.State,
                 k_cache: jax.Array, v_cache: jax.Array, prev: PrevSamples, inputs: jax.Array,
                 ) -> tuple[StepOutputs, jax.Array]:
    """`_step`, plus the final hidden state at each sample row, f32[S, D]: a pooling engine's
    step (its requests' embeddings are their last tokens')."""
    f = _forward(statics, layout, state, k_cache, v_cache, prev, inputs)
    return f.out, jax.lax.with_sharding_constraint(f.sample_hidden.astype(jnp.float32),
                                                   replicated(statics.kv_sharding))


@functools.partial(jax.jit, static_argnums=(0,))
def _sample(layout: PackedLayout, logits: jax.Array, prev: PrevSamples, rows: jax.Array,
            inputs: jax.Array) -> tuple[SamplerOutput, PrevSamples, jax.Array]:
    # inputs: i32[n], the packed SamplingMetadata; rows: i32[3, S] from the model step. Also
    # returns what the next step's inputs read (`prev` with its first S rows replaced), and
    # what the host reads back, in one array: i32[2, S], the sampled ids and the drafts each
    # row's request accepted.
    md = unpack(layout, inputs)
    # A request that moved back moves its step keys too: (seed, step) as without drafts.
    out = sample(logits, dataclasses.replace(md, steps=md.steps - rows[2]))
    S = out.sampled.shape[0]
    accepted = accepted_drafts(out.sampled, rows)
    return (out, PrevSamples(prev.sampled.at[:S].set(out.sampled),
                             prev.accepted.at[:S].set(accepted)),
            jnp.stack([out.sampled, accepted]))


def replicated(sharding: NamedSharding) -> NamedSharding:
    return NamedSharding(sharding.mesh, P())


def step_key(arrays: StepArrays, layout: PackedLayout | None = None) -> ProgramKey:
    """The model program of a step: its packed layout (given, or packed here), and whether it
    drafts on the device."""
    return ("step_drafting" if arrays.device_drafts else "step",
            layout or step_inputs(arrays)[1])


def split_model(model: Llama) -> tuple[nnx.GraphDef, dict[str, Any]]:
    """The model's graph and its weights as a plain nested dict, as the step takes them: jit
    flattens a dict in C++, an nnx.State through a Python callback per leaf (~60 us a call
    with stories260K's 47 weights)."""
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def step_inputs(arrays: StepArrays) -> tuple[np.ndarray, PackedLayout]:
    """The model step's packed host inputs."""
    md = AttentionMetadata(positions=arrays.positions, slot_mapping=arrays.slot_mapping,
                           query_start_loc=arrays.query_start_loc, seq_lens=arrays.seq_lens,
                           block_tables=arrays.block_tables)
    return pack((arrays.input_ids, arrays.prev_rows, md, arrays.logits_indices,
                 arrays.draft_starts, arrays.num_drafts, arrays.prev_base, arrays.prev_drafts))
