"""The engine's real model step compiled for a TPU or GPU target on a host without the chips.

Abstract weights (shapes and shardings only) go through the same jitted model step the model
runner calls, with the same TP sharding rules and attention backend, and the target's own
compiler (libtpu for TPU topologies, the CUDA compile-only plugin for GPU descriptions) builds
it. What the compiler reports is deterministic: per-device memory, the ops that copy or
transpose a buffer as large as a layer of the KV cache or an array of a weight's shape (a whole
stack, or one layer's slice: a relaid-out weight is read and written again every step), and the
program itself, whose time on the chip step_cost.py models for the batches a bucket is judged
on (step_floor.py), beside the floor no program can beat.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from dataclasses import dataclass
from collections.abc import Collection
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.compilation import hlo_text
from jaxserve.compilation.compile_report import BucketReport, CompileReport, ScenarioCost
from jaxserve.compilation.step_cost import step_cost
from jaxserve.compilation.step_floor import bucket_scenarios, step_floor
from jaxserve.config import EngineConfig
from jaxserve.layers.attention import get_attention_backend
from jaxserve.models.llama import kv_cache_bytes_per_block
from jaxserve.models.llama_config import LlamaConfig
from jaxserve.models.registry import family_of
from jaxserve.placement.device_memory import (GPU_PLANNING_FRACTION, allocator_fraction,
                                              planning_fraction)
from jaxserve.placement.mesh import tp_mesh
from jaxserve.programs.resolved import ResolvedPlan, resolve_plan
from jaxserve.placement.sharding import (AXIS, padded_vocab_size,
                                           param_sharding, validate_tensor_parallel,
                                           with_device_kernels, with_expert_parallel)
from jaxserve.placement.targets import Chip, Target
from jaxserve.programs.draft_model import FIELD as DRAFT_FIELD, check_draft, read_draft_config
from jaxserve.programs.step_program import (ModelParts, StepProgram, kv_blocks_for,
                                            largest_step_bytes, step_program)
from jaxserve.programs.step_shapes import step_variants

# ---- the abstract model --------------------------------------------------------------------
def device_model_config(cfg: LlamaConfig, tp: int, expert_parallel: bool,
                        device: Any = None) -> LlamaConfig:
    """The model as the devices hold it: KV heads duplicated when TP exceeds their count,
    whole experts split over the devices under expert parallelism; and as `device` runs it."""
    validate_tensor_parallel(cfg, tp)
    cfg = with_expert_parallel(cfg, expert_parallel, tp)
    if device is not None:
        cfg = with_device_kernels(cfg, device)
    return cfg.replace(num_kv_heads=tp) if tp > cfg.num_kv_heads else cfg


def abstract_model(cfg: LlamaConfig, mesh: Mesh, dtype: Any,
                   scan_layers: bool) -> tuple[nnx.GraphDef, Any]:
    """The model's graph and its state as sharded ShapeDtypeStructs: no weights."""
    tp = mesh.shape[AXIS]
    shapes = family_of(cfg).param_shapes(cfg)
    vocab = padded_vocab_size(cfg.vocab_size, tp)
    for name in ("embed", "lm_head"):
        if name in shapes:
            shapes[name] = (vocab, cfg.hidden_size)
    model = nnx.eval_shape(lambda: family_of(cfg).model(
        cfg, {name: jnp.zeros(shape, dtype) for name, shape in shapes.items()}, dtype,
        scan_layers=scan_layers))
    graphdef, state = nnx.split(model)

    def placed(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        name = next(n for n in reversed(names) if isinstance(n, str) and n != "value")
        one_layer = "layers" in names and not scan_layers  # a slice of a stacked weight
        spec = param_sharding(mesh, name, (1, *leaf.shape) if one_layer else leaf.shape,
                              cfg).spec
        spec = P(*spec[1:]) if one_layer else spec
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

    return graphdef, nnx.to_pure_dict(jax.tree_util.tree_map_with_path(placed, state))


def device_draft_config(config: EngineConfig, target: LlamaConfig,
                        max_model_len: int) -> LlamaConfig | None:
    """The draft model's config (speculative draft_model) as the devices hold it, read from
    its config file and checked against the target's; None without one."""
    draft = read_draft_config(config)
    if draft is None:
        return None
    check_draft(draft, target, max_model_len)
    try:
        # a draft's experts, if it has any, split by width: EP is the target's
        return device_model_config(draft, config.parallel.tensor_parallel_size, False)
    except ValueError as e:
        raise ValueError(f"{DRAFT_FIELD}: {e}") from None


def per_device_bytes(tree: Any) -> int:
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def weight_dims(state: Any, scan_layers: bool) -> set[tuple[int, ...]]:
    """Dims of each stacked layer weight as a device holds it, and of one layer's slice of it
    ([1, ...]), for those of at least 1 MiB (norms and biases are left out). Empty where layers
    are unrolled: a layer's weight then shares its dims with activations (a [T, D] residual
    at T = a weight's rows), so dims alone cannot tell a relaid-out weight."""
    out: set[tuple[int, ...]] = set()
    if not scan_layers:
        return out
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        dims = tuple(x.sharding.shard_shape(x.shape))
        if ("layers" in (getattr(k, "key", None) for k in path)
                and np.prod(dims) * jnp.dtype(x.dtype).itemsize >= MIN_WEIGHT_COPY_BYTES):
            out |= {dims, (1, *dims[1:])}
    return out


@dataclass(frozen=True)
class CostContext:
    """What the cost model needs beside the compiled program."""
    chip: Chip
    cfg: LlamaConfig  # as the devices hold it
    tensor_parallel_size: int
    weight_bytes: int
    itemsize: int
    vocab_size: int  # padded for TP
    max_model_len: int
    token_buckets: tuple[int, ...]


# ---- one compile ---------------------------------------------------------------------------
_COPY_OPS = ("copy", "copy-start", "transpose")
MIN_WEIGHT_COPY_BYTES = 1 << 20


def copied_arrays(hlo: str, ops: tuple[str, ...] = _COPY_OPS,
                  ) -> list[tuple[tuple[int, ...], int]]:
    """Dims and bytes of what each of `ops` in compiled HLO writes (a copy-start: its
    destination)."""
    return [(i.array.dims, i.array.logical_bytes)
            for comp in hlo_text.parse(hlo).computations.values() for i in comp.instructions
            if i.opcode in ops and i.arrays]


def count_large_copies(hlo: str, min_bytes: int,
                       weights: Collection[tuple[int, ...]] = ()) -> int:
    """Ops in compiled HLO that copy or transpose a buffer of at least min_bytes, other than
    arrays of a weight's dims (`weights`: count_weight_copies counts those)."""
    return sum(size >= min_bytes and d not in weights for d, size in copied_arrays(hlo))


def count_weight_copies(hlo: str, dims: set[tuple[int, ...]]) -> int:
    """Ops in compiled HLO that relay out an array of a weight's dims. A `copy-start` is left
    out: TPU uses it to prefetch a buffer into on-chip memory as it is laid out."""
    return sum(d in dims and size >= MIN_WEIGHT_COPY_BYTES
               for d, size in copied_arrays(hlo, ("copy", "transpose")))


def _first_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def scenario_costs(hlo: str, num_tokens: int, num_reqs: int,
                   context: CostContext) -> list[ScenarioCost]:
    """The compiled step's modelled cost for each batch the bucket is judged on."""
    module = hlo_text.parse(hlo)
    tp = context.tensor_parallel_size
    out = []
    for scenario in bucket_scenarios(num_tokens, num_reqs, context.max_model_len,
                                     context.token_buckets):
        cost = step_cost(module, context.chip, scenario.batch, tp)
        floor = step_floor(context.cfg, tp, context.weight_bytes, context.itemsize,
                           scenario.batch, context.vocab_size, context.chip)
        out.append(ScenarioCost(
            scenario.label, cost.weights, cost.kv_read, cost.kv_write, cost.activations,
            cost.in_kernels, cost.collective_bytes, int(cost.collectives), cost.flops,
            cost.compute_seconds, cost.collective_seconds, floor.hbm_bytes, floor.flops,
            floor.seconds, floor.sequential_seconds))
    return out


def compile_bucket(program: StepProgram, num_tokens: int, num_reqs: int,
                   layer_kv_bytes: int, weights: set[tuple[int, ...]],
                   context: CostContext | None = None, num_sample_rows: int | None = None,
                   device_drafts: bool = False, dump_hlo: str | None = None) -> BucketReport:
    report = BucketReport(num_tokens, num_reqs, num_sample_rows or num_reqs, device_drafts)
    start = time.perf_counter()
    try:
        compiled = program.compile(num_tokens, num_reqs, num_sample_rows, device_drafts)
    except Exception as e:  # noqa: BLE001 - the compiler's refusal is the report
        report.error = _first_line(e)
        return report
    report.compile_seconds = time.perf_counter() - start
    report.compiled = True
    mem = compiled.memory_analysis()
    report.temp_bytes = int(mem.temp_size_in_bytes)
    report.total_bytes = int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                             - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
    hlo = compiled.as_text()
    if dump_hlo is not None:
        name = f"T{num_tokens}_R{num_reqs}_S{report.num_sample_rows}"
        Path(dump_hlo).mkdir(parents=True, exist_ok=True)
        (Path(dump_hlo) / f"{name}{'_drafting' if device_drafts else ''}.hlo").write_text(hlo)
    report.cache_copies = count_large_copies(hlo, layer_kv_bytes, weights)
    report.weight_copies = count_weight_copies(hlo, weights) if weights else None
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) and cost else cost
    if isinstance(cost, dict) and "bytes accessed" in cost:
        report.bytes_accessed = float(cost["bytes accessed"])
    if context is not None and not device_drafts:
        try:
            report.costs = scenario_costs(hlo, num_tokens, num_reqs, context)
        except ValueError as e:  # e.g. a loop whose trip count the program does not show
            report.cost_error = f"cost model: {e}"
    return report


# ---- the whole check -----------------------------------------------------------------------
def prepare(target: Target, cfg: LlamaConfig, config: EngineConfig, kv_write: str = "kernel",
            attention_tiles: dict[str, int] | None = None,
            ) -> tuple[StepProgram, CompileReport, ResolvedPlan]:
    """The abstract step on the target's first TP devices, with the KV pool sized from the
    device's memory unless `num_kv_blocks` is set, an empty report and the engine's plan.
    `kv_write="scatter"` puts XLA's scatter beside the attention kernel, the write that copied
    the cache on TPU; `attention_tiles`: the kernel's tile arguments instead of its defaults."""
    tp = config.parallel.tensor_parallel_size
    if tp > len(target.devices):
        raise ValueError(f"tensor_parallel_size {tp} needs {tp} devices; {target.name} has "
                         f"{len(target.devices)}")
    cfg = device_model_config(cfg, tp, config.parallel.enable_expert_parallel, target.devices[0])
    mesh = tp_mesh(list(target.devices[:tp]))
    plan = resolve_plan(config, cfg, target.platform, mesh)
    bs, dtype = plan.block_size, plan.dtype
    backend = get_attention_backend(config.runner.attention_backend, target.platform, mesh,
                                    decode_rows=1 + plan.num_speculative_tokens)
    if kv_write == "scatter":
        backend = dataclasses.replace(backend, fused=None)
    if attention_tiles:
        backend = dataclasses.replace(
            backend, kernel=functools.partial(backend.kernel, **attention_tiles),
            fused=backend.fused and functools.partial(backend.fused, **attention_tiles))
    scan = config.runner.scans_layers(target.platform)
    draft_cfg = device_draft_config(config, cfg, plan.max_model_len)
    cfgs = [cfg] + ([] if draft_cfg is None else [draft_cfg])
    model = ModelParts(*abstract_model(cfg, mesh, dtype, scan), cfg)
    draft = None if draft_cfg is None else ModelParts(
        *abstract_model(draft_cfg, mesh, dtype, scan), draft_cfg)
    block_bytes = sum(kv_cache_bytes_per_block(c, bs, dtype) for c in cfgs) // tp
    weight_bytes = per_device_bytes(model.state) + per_device_bytes(draft and draft.state)
    utilization = config.cache.gpu_memory_utilization
    allocator = allocator_fraction(default=utilization)  # the fraction the engine will set
    if config.cache.num_kv_blocks is None:  # profile the largest step, then size the pool
        try:
            step = largest_step_bytes(model, config, backend, plan, draft)
        except Exception as e:  # noqa: BLE001 - the compiler's refusal is the answer
            raise ValueError(f"the largest step does not compile on {target.name}: "
                             f"{_first_line(e)}") from None
        planned = target.hbm_bytes * planning_fraction(target.platform, utilization, allocator)
        plan = plan.with_pool(max(plan.min_kv_blocks, kv_blocks_for(
            int(planned), weight_bytes, step, block_bytes)), block_bytes)
    program = step_program(model, config, backend, plan, draft)
    num_blocks = plan.num_kv_blocks
    layer_kv_bytes = min(kv_cache_bytes_per_block(c, bs, dtype) * num_blocks
                         // (2 * c.num_layers * tp) for c in cfgs)
    gpu = target.platform == "gpu"
    report = CompileReport(target.name, target.device_kind, target.hbm_bytes, cfg.num_layers,
                           tp, dtype.name, bs, num_blocks, weight_bytes,
                           num_blocks * block_bytes, layer_kv_bytes,
                           int((allocator if gpu else 1.0) * target.hbm_bytes),
                           int((GPU_PLANNING_FRACTION if gpu else 1.0) * target.hbm_bytes),
                           0 if draft_cfg is None else draft_cfg.num_layers)
    report.weight_dims = weight_dims(model.state, scan) | (
        set() if draft is None else weight_dims(draft.state, scan))
    return program, report, plan


def check(target: Target, cfg: LlamaConfig, config: EngineConfig,
          buckets: list[tuple[int, int]] | None = None, kv_write: str = "kernel",
          dump_hlo: str | None = None, attention_tiles: dict[str, int] | None = None,
          ) -> CompileReport:
    """Compile the model step for every bucket (or the given ones) on the target, in each of
    its variants with speculative decoding on (more sample rows; the drafting program).
    `dump_hlo`: a directory to write each compiled program's HLO text to."""
    program, report, plan = prepare(target, cfg, config, kv_write, attention_tiles)
    tp = config.parallel.tensor_parallel_size
    context = CostContext(target.chip, device_model_config(
        cfg, tp, config.parallel.enable_expert_parallel), tp, report.weight_bytes,
                          plan.dtype.itemsize, padded_vocab_size(cfg.vocab_size, tp),
                          plan.max_model_len, plan.token_buckets)
    for T, R in buckets or plan.bucket_pairs:
        for S, drafting in step_variants(T, R, plan.num_speculative_tokens):
            report.buckets.append(compile_bucket(program, T, R, report.layer_kv_bytes,
                                                 report.weight_dims, context, S, drafting,
                                                 dump_hlo))
    return report
