"""The engine's real model step compiled for a TPU or GPU target on a host without the chips.

Abstract weights (shapes and shardings only) go through the same jitted `_step` the model runner
calls, with the same TP sharding rules and attention backend, and the target's own compiler
(libtpu for TPU topologies, the CUDA compile-only plugin for GPU descriptions) builds it. What
the compiler reports is deterministic: per-device memory, the ops that copy or transpose a
buffer as large as a layer of the KV cache or an array of a weight's shape (a whole stack, or
one layer's slice: a relaid-out weight is read and written again every step), and the bytes its
cost model says the step moves outside the Pallas kernels (XLA's cost analysis does not see
inside custom calls).
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import asdict, dataclass, field
from collections.abc import Collection
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.config import EngineConfig
from jaxserve.executor.draft_model import FIELD as DRAFT_FIELD, check_draft, read_draft_config
from jaxserve.executor.sharding import (AXIS, padded_vocab_size,
                                           param_sharding, validate_tensor_parallel)
from jaxserve.executor.model_runner import dtype_of
from jaxserve.executor.step_shapes import (bucket_pairs, num_speculative_tokens, step_buckets,
                                           step_variants)
from jaxserve.executor.step_program import (ModelParts, StepProgram, kv_blocks_for,
                                            largest_step_temp_bytes, step_program)
from jaxserve.executor.targets import Target
from jaxserve.layers.attention import get_attention_backend, scatter_write
from jaxserve.layers.axes import DATA_AXIS
from jaxserve.models.llama import Llama, kv_cache_bytes_per_block
from jaxserve.models.llama_config import LlamaConfig, param_shapes

MAX_TEMP_FRACTION = 0.05  # the gate: a step's temporaries must stay under 5% of HBM


@dataclass
class BucketReport:
    num_tokens: int
    num_reqs: int
    num_sample_rows: int = 0  # S: more than num_reqs in a speculative step's variant
    device_drafts: bool = False  # the drafting program (layer skip, draft model)
    compiled: bool = False
    error: str | None = None
    compile_seconds: float = 0.0
    temp_bytes: int = 0
    total_bytes: int = 0  # arguments + outputs - aliased + temporaries, per device
    cache_copies: int = 0  # copy/transpose ops of >= one layer of the KV cache, not weights
    # copy/transpose ops of a stacked weight's dims (>= 1 MiB); None: layers unrolled, unchecked
    weight_copies: int | None = None
    bytes_accessed: float | None = None  # outside the Pallas kernels; None where not reported


@dataclass
class CompileReport:
    target: str
    device_kind: str
    hbm_bytes: int
    num_layers: int
    tensor_parallel_size: int
    dtype: str
    block_size: int
    num_blocks: int
    weight_bytes: int  # per device (the draft model's included)
    kv_bytes: int  # per device (the draft model's cache included)
    layer_kv_bytes: int  # per device: the smaller of the caches' layers, the copy gate's size
    draft_num_layers: int = 0  # speculative draft_model: the draft's layers
    buckets: list[BucketReport] = field(default_factory=list)
    # per device: each stacked layer weight's dims and one layer's slice of it (>= 1 MiB)
    weight_dims: set[tuple[int, ...]] = field(default_factory=set, repr=False)

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def failures(self, max_temp_fraction: float = MAX_TEMP_FRACTION) -> list[str]:
        out = []
        for b in self.buckets:
            where = f"T={b.num_tokens} R={b.num_reqs} S={b.num_sample_rows}" + (
                " drafting" if b.device_drafts else "")
            if not b.compiled:
                out.append(f"{where}: {b.error}")
                continue
            if b.cache_copies:
                out.append(f"{where}: {b.cache_copies} copies of the KV cache")
            if b.weight_copies:
                out.append(f"{where}: {b.weight_copies} copies of weights")
            if b.temp_bytes > max_temp_fraction * self.hbm_bytes:
                out.append(f"{where}: temporaries {b.temp_bytes / 2**30:.2f} GiB over "
                           f"{max_temp_fraction:.0%} of HBM")
            if b.total_bytes > self.hbm_bytes:
                out.append(f"{where}: {b.total_bytes / 2**30:.2f} GiB exceeds HBM")
        return out

    def to_json(self) -> dict[str, Any]:
        out = asdict(self) | {"kv_tokens": self.kv_tokens, "failures": self.failures()}
        del out["weight_dims"]
        return out


# ---- the abstract model --------------------------------------------------------------------
def device_model_config(cfg: LlamaConfig, tp: int) -> LlamaConfig:
    """The model as the devices hold it: KV heads duplicated when TP exceeds their count."""
    validate_tensor_parallel(cfg, tp)
    return cfg.replace(num_kv_heads=tp) if tp > cfg.num_kv_heads else cfg


def abstract_model(cfg: LlamaConfig, mesh: Mesh, dtype: Any,
                   scan_layers: bool) -> tuple[nnx.GraphDef, Any]:
    """The Llama module's graph and its state as sharded ShapeDtypeStructs: no weights."""
    tp = mesh.shape[AXIS]
    shapes = param_shapes(cfg)
    vocab = padded_vocab_size(cfg.vocab_size, tp)
    for name in ("embed", "lm_head"):
        if name in shapes:
            shapes[name] = (vocab, cfg.hidden_size)
    model = nnx.eval_shape(lambda: Llama(
        cfg, {name: jnp.zeros(shape, dtype) for name, shape in shapes.items()}, dtype,
        scan_layers=scan_layers))
    graphdef, state = nnx.split(model)

    def placed(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        name = next(n for n in reversed(names) if isinstance(n, str) and n != "value")
        one_layer = "layers" in names and not scan_layers  # a slice of a stacked weight
        spec = param_sharding(mesh, name, (1, *leaf.shape) if one_layer else leaf.shape).spec
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
        return device_model_config(draft, config.parallel.tensor_parallel_size)
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


# ---- one compile ---------------------------------------------------------------------------
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?\S+ = (?P<shape>.+?) (?P<op>[a-z][a-z0-9\-]*)\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_COPY_OPS = ("copy", "copy-start", "transpose")
MIN_WEIGHT_COPY_BYTES = 1 << 20


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def _array(shape_text: str) -> tuple[tuple[int, ...], int]:
    """Dims and bytes of an HLO shape's (first) array, e.g. `bf16[32,2,4096,64,128]{...}`."""
    match = _ARRAY.search(shape_text)
    if match is None:
        return (), 0
    dims = tuple(int(d) for d in match.group(2).split(",") if d)
    return dims, int(np.prod(dims)) * _ITEMSIZE.get(match.group(1), 1)


def copied_arrays(hlo_text: str, ops: tuple[str, ...] = _COPY_OPS,
                  ) -> list[tuple[tuple[int, ...], int]]:
    """Dims and bytes of what each of `ops` in compiled HLO writes."""
    return [_array(match.group("shape")) for match in map(_INSTRUCTION.match,
                                                          hlo_text.splitlines())
            if match and match.group("op") in ops]


def count_large_copies(hlo_text: str, min_bytes: int,
                       weights: Collection[tuple[int, ...]] = ()) -> int:
    """Ops in compiled HLO that copy or transpose a buffer of at least min_bytes, other than
    arrays of a weight's dims (`weights`: count_weight_copies counts those)."""
    return sum(size >= min_bytes and d not in weights for d, size in copied_arrays(hlo_text))


def count_weight_copies(hlo_text: str, dims: set[tuple[int, ...]]) -> int:
    """Ops in compiled HLO that relay out an array of a weight's dims. A `copy-start` is left
    out: TPU uses it to prefetch a buffer into on-chip memory as it is laid out."""
    return sum(d in dims and size >= MIN_WEIGHT_COPY_BYTES
               for d, size in copied_arrays(hlo_text, ("copy", "transpose")))


def _first_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def compile_bucket(program: StepProgram, num_tokens: int, num_reqs: int,
                   layer_kv_bytes: int, weights: set[tuple[int, ...]],
                   num_sample_rows: int | None = None,
                   device_drafts: bool = False) -> BucketReport:
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
    report.cache_copies = count_large_copies(hlo, layer_kv_bytes, weights)
    report.weight_copies = count_weight_copies(hlo, weights) if weights else None
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) and cost else cost
    if isinstance(cost, dict) and "bytes accessed" in cost:
        report.bytes_accessed = float(cost["bytes accessed"])
    return report


# ---- the whole check -----------------------------------------------------------------------
def accelerator_dtype(config: EngineConfig) -> Any:
    return jnp.bfloat16 if config.model.dtype == "auto" else dtype_of(config.model.dtype)


def prepare(target: Target, cfg: LlamaConfig, config: EngineConfig, kv_write: str = "kernel",
            ) -> tuple[StepProgram, CompileReport]:
    """The abstract step on the target's first TP devices, with the KV pool sized from the
    device's memory unless `num_kv_blocks` is set, and an empty report. `kv_write="scatter"`
    puts XLA's scatter beside the attention kernel, the write that copied the cache on TPU."""
    tp = config.parallel.tensor_parallel_size
    if tp > len(target.devices):
        raise ValueError(f"tensor_parallel_size {tp} needs {tp} devices; {target.name} has "
                         f"{len(target.devices)}")
    cfg = device_model_config(cfg, tp)
    mesh = Mesh(np.array(target.devices[:tp]).reshape(1, tp), (DATA_AXIS, AXIS))
    max_model_len = config.model.max_model_len or cfg.max_position_embeddings
    bs = config.cache.block_size
    min_blocks = -(-max_model_len // bs) + 1
    dtype = accelerator_dtype(config)
    backend = get_attention_backend(config.runner.attention_backend, target.platform, mesh,
                                    decode_rows=1 + num_speculative_tokens(config))
    if kv_write == "scatter":
        backend = dataclasses.replace(backend, writer=scatter_write, fused=None)
    scan = config.runner.scans_layers(target.platform)
    draft_cfg = device_draft_config(config, cfg, max_model_len)
    cfgs = [cfg] + ([] if draft_cfg is None else [draft_cfg])
    model = ModelParts(*abstract_model(cfg, mesh, dtype, scan), cfg)
    draft = None if draft_cfg is None else ModelParts(
        *abstract_model(draft_cfg, mesh, dtype, scan), draft_cfg)
    block_bytes = sum(kv_cache_bytes_per_block(c, bs, dtype) for c in cfgs) // tp
    weight_bytes = per_device_bytes(model.state) + per_device_bytes(draft and draft.state)
    num_blocks = config.cache.num_kv_blocks
    if num_blocks is None:  # profile the largest step on a minimal pool, then size the pool
        try:
            temp = largest_step_temp_bytes(model, config, backend, max_model_len, draft)
        except Exception as e:  # noqa: BLE001 - the compiler's refusal is the answer
            raise ValueError(f"the largest step does not compile on {target.name}: "
                             f"{_first_line(e)}") from None
        num_blocks = max(min_blocks, kv_blocks_for(
            target.hbm_bytes, config.cache.gpu_memory_utilization, weight_bytes, temp,
            block_bytes))
    program = step_program(model, config, backend, num_blocks, max_model_len, draft)
    layer_kv_bytes = min(kv_cache_bytes_per_block(c, bs, dtype) * num_blocks
                         // (2 * c.num_layers * tp) for c in cfgs)
    report = CompileReport(target.name, target.device_kind, target.hbm_bytes, cfg.num_layers,
                           tp, jnp.dtype(dtype).name, bs, num_blocks, weight_bytes,
                           num_blocks * block_bytes, layer_kv_bytes,
                           0 if draft_cfg is None else draft_cfg.num_layers)
    report.weight_dims = weight_dims(model.state, scan) | (
        set() if draft is None else weight_dims(draft.state, scan))
    return program, report


def check(target: Target, cfg: LlamaConfig, config: EngineConfig,
          buckets: list[tuple[int, int]] | None = None, kv_write: str = "kernel",
          ) -> CompileReport:
    """Compile the model step for every bucket (or the given ones) on the target, in each of
    its variants with speculative decoding on (more sample rows; the drafting program)."""
    program, report = prepare(target, cfg, config, kv_write)
    k = num_speculative_tokens(config)
    for T, R in buckets or bucket_pairs(*step_buckets(config)):
        for S, drafting in step_variants(T, R, k):
            report.buckets.append(compile_bucket(program, T, R, report.layer_kv_bytes,
                                                 report.weight_dims, S, drafting))
    return report


def format_report(report: CompileReport) -> str:
    gib = 2**30
    draft = (f" + a draft model of {report.draft_num_layers} layers"
             if report.draft_num_layers else "")
    head = (f"{report.target} ({report.device_kind}, {report.hbm_bytes / gib:.1f} GiB HBM per "
            f"device), {report.num_layers} layers{draft}, TP {report.tensor_parallel_size}, "
            f"{report.dtype}: weights {report.weight_bytes / gib:.2f} GiB + KV "
            f"{report.kv_bytes / gib:.2f} GiB per device = {report.num_blocks} blocks of "
            f"{report.block_size} ({report.kv_tokens} tokens)")
    rows = ["| T | R | S | compiled | seconds | temporaries GiB | total GiB / HBM | cache copies "
            "| weight copies | GB accessed outside kernels | / weight bytes |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in report.buckets:
        rows_sampled = f"{b.num_sample_rows}{' drafting' if b.device_drafts else ''}"
        if not b.compiled:
            rows.append(f"| {b.num_tokens} | {b.num_reqs} | {rows_sampled} | no: {b.error} "
                        "| | | | | | | |")
            continue
        accessed = ("n/a", "n/a") if b.bytes_accessed is None else (
            f"{b.bytes_accessed / 1e9:.2f}", f"{b.bytes_accessed / report.weight_bytes:.2f}")
        rows.append(f"| {b.num_tokens} | {b.num_reqs} | {rows_sampled} | yes | "
                    f"{b.compile_seconds:.1f} | "
                    f"{b.temp_bytes / gib:.3f} | {b.total_bytes / gib:.2f} / "
                    f"{report.hbm_bytes / gib:.1f} | {b.cache_copies} | "
                    f"{'n/a' if b.weight_copies is None else b.weight_copies} | "
                    f"{accessed[0]} | {accessed[1]} |")
    failures = report.failures()
    verdict = "PASS" if not failures else "FAIL\n" + "\n".join(f"- {f}" for f in failures)
    return "\n".join([head, "", *rows, "", f"compile-check: {verdict}"])
