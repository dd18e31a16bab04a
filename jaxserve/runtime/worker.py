"""Worker: owns one device mesh, places the weights on it by the sharding rules, sizes the KV
cache, builds the model runner."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.config import EngineConfig
from jaxserve.layers.attention import (
    AttentionBackend,
    get_attention_backend,
    validate_backend,
)
from jaxserve.models.checkpoint_io import load_converted, read_converted_config
from jaxserve.models.hf_loader import ParamParts
from jaxserve.models.llama import init_kv_cache, kv_cache_bytes_per_block
from jaxserve.models.llama_config import LlamaConfig
from jaxserve.models.loaded_model import CONVERTED_CONFIG_FILE, LoadedModel
from jaxserve.models.loader import LoadingModel, start_loading, with_hf_overrides
from jaxserve.models.registry import family_of
from jaxserve.models.tokenizer import Tokenizer
from jaxserve.placement import device_memory
from jaxserve.placement.host_memory import CPU_KV_MEMORY_FRACTION, available_host_bytes
from jaxserve.placement.huge_pages import place_zeroed_on_huge_pages
from jaxserve.placement.parked import (LeafPath, Parked, device_bytes, leaves_by_path, park,
                                       tree_of, unpark, written)
from jaxserve.placement.mesh import rank_meshes
from jaxserve.programs.resolved import ResolvedPlan, resolve_plan
from jaxserve.placement.sharding import (
    AXIS,
    kv_cache_sharding,
    param_sharding,
    placed_layout,
    shard_params,
    validate_tensor_parallel,
    with_device_kernels,
    with_expert_parallel,
)
from jaxserve.programs.draft_model import FIELD as DRAFT_FIELD, load_draft, place_draft
from jaxserve.programs.step_program import (ModelParts, kv_blocks_for, largest_step_bytes,
                                            token_cache_shape)
from jaxserve.programs.step_shapes import ngram_lookup
from jaxserve.runtime import compiled_dir
from jaxserve.runtime.compiled_dir import KV_INIT
from jaxserve.runtime.model_runner import ModelRunner
from jaxserve.runtime.program_order import first_programs, planned_programs

logger = logging.getLogger(__name__)

SLEEP_TAGS = ("weights", "kv_cache")  # vLLM's names of what sleep() frees and wake_up() restores


def enable_compilation_cache(cache_dir: str | None) -> None:
    if cache_dir == "":
        return
    cache_dir = cache_dir or os.environ.get("JAXSERVE_CACHE_DIR") or str(
        Path.home() / ".cache" / "jaxserve" / "xla")
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def restores_sharded(config: EngineConfig) -> bool:
    """An orbax checkpoint whose layout needs no change for this TP size is restored shard by
    shard onto the devices; anything else is read on the host and then placed."""
    m, tp = config.model, config.parallel.tensor_parallel_size
    if m.load_format not in ("orbax", "auto") or not (
            Path(m.model) / CONVERTED_CONFIG_FILE).is_file():
        return False
    cfg = read_converted_config(m.model)
    return tp <= cfg.num_kv_heads and cfg.vocab_size % tp == 0


def converted_config(config: EngineConfig) -> LlamaConfig:
    """An orbax checkpoint's model config, with the engine's hf_overrides."""
    cfg = read_converted_config(config.model.model)
    return cfg.with_hf_overrides(config.model.hf_overrides) if config.model.hf_overrides else cfg


def check_float16(dtype: Any, backend: AttentionBackend, platform: str) -> None:
    """float16 where the backend computes in it: GPU, and XLA's attention on CPU."""
    if jnp.dtype(dtype) != jnp.float16:
        return
    if platform == "tpu":
        raise ValueError("dtype 'float16' is not supported on TPU (it has no float16 "
                         "arithmetic); use dtype='bfloat16' (the same size) or 'float32'")
    if backend.name == "cpu":
        raise ValueError("dtype 'float16': the cpu attention backend (attention_backend="
                         "'auto' on CPU) takes float32 or bfloat16; use dtype='bfloat16' or "
                         "'float32', or attention_backend='xla' to compute in float16")


@dataclass(frozen=True)
class BuiltWorker:
    """What a worker built, which the engine sizes its scheduler by."""
    plan: ResolvedPlan
    model_config: LlamaConfig  # as placed (KV heads expanded for TP)
    tokenizer: Tokenizer | None  # the checkpoint's
    generation_config: dict[str, Any]  # the checkpoint's (LoadedModel.generation_config)


class Worker:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | LoadingModel | None = None,
                 mesh: Mesh | None = None, draft: LoadedModel | None = None):
        """`loaded`, `draft`: the target's and the draft model's host weights, read once for
        every rank (by default read here)."""
        self.config = config
        enable_compilation_cache(config.runner.compilation_cache_dir)
        m = config.model
        self.mesh = mesh or rank_meshes(config.parallel)[0]
        restored = loaded is None and restores_sharded(config)
        device = self.mesh.devices.flat[0]
        platform = device.platform
        host_placed = self.mesh.size == 1 and device.process_index == jax.process_index()
        loading = None if restored else loaded or start_loading(m)
        checkpoint = converted_config(config) if restored else loading.config
        # The pool is sized once the weights are placed (`_sized_plan`).
        self.plan = resolve_plan(config, checkpoint, platform, self.mesh)
        if restored:  # the params already on their devices
            loading = self._restore_sharded(m.model, checkpoint)
        programs = (None if config.runner.compiled_dir is None  # loading beside the weights
                    else self._read_compiled(config.runner.compiled_dir, checkpoint))
        self.loaded = loading.result() if isinstance(loading, LoadingModel) else loading
        cfg = with_device_kernels(with_expert_parallel(
            self.loaded.config, config.parallel.enable_expert_parallel, self.mesh.shape[AXIS]),
            self.mesh.devices.flat[0])
        if restored or host_placed:
            # Host arrays: the model slices and places them on this process's one device
            # itself (under default_device below), with no jax operation to compile at start.
            placed = self.loaded.params
        else:
            cfg, placed = shard_params(cfg, self.loaded.params, self.mesh, self.plan.dtype)
        self.model_config = cfg
        backend = get_attention_backend(config.runner.attention_backend, platform, self.mesh,
                                        decode_rows=1 + self.plan.num_speculative_tokens)
        check_float16(self.plan.dtype, backend, platform)
        # As before the native matmul went (issue 48): the `cpu` backend on one device reads
        # its rotary angles from a table; the other paths compute them.
        rotary_lookup = backend.name == "cpu" and self.mesh.size == 1
        with jax.default_device(device) if host_placed else contextlib.nullcontext():
            self.model = family_of(cfg).model(
                cfg, placed, self.plan.dtype, scan_layers=config.runner.scans_layers(platform),
                rotary_lookup=rotary_lookup, max_positions=self.plan.max_model_len)
        if host_placed:  # the mesh's sharding, as the sharded path's (no copy: one device)
            nnx.update(self.model, jax.device_put(nnx.state(self.model),
                                                  NamedSharding(self.mesh, PartitionSpec())))
        # The model holds the arrays it needs. The loader's stay out of reach: on CPU they would
        # be a second copy of every weight for as long as the engine runs.
        self.loaded = dataclasses.replace(self.loaded, params={})
        draft = draft or load_draft(config)
        self.draft = None if draft is None else place_draft(
            draft, cfg, self.plan.max_model_len, self.mesh, self.plan.dtype,
            config.runner.scans_layers(platform), rotary_lookup)
        self._validate_backend(backend, platform, cfg)
        if self.draft is not None:
            try:
                self._validate_backend(backend, platform, self.draft.cfg)
            except ValueError as e:
                raise ValueError(f"{DRAFT_FIELD}: {e}") from None
        self.plan = self._sized_plan(backend)
        self.kv_sharding = kv_cache_sharding(self.mesh)
        executables = self._check_compiled(programs)
        self._init_kv_pool = executables.pop(KV_INIT, None) or self.kv_init  # kept for wake_up
        k_cache, v_cache, *drafter_cache = self._zeroed_kv_pool()
        self.runner = ModelRunner(config, self.model, k_cache, v_cache, backend, self.mesh,
                                  self.plan, cfg.eos_token_ids, self.draft,
                                  tuple(drafter_cache))
        self.runner.executables = executables
        # Sleep mode: the parts asleep (of SLEEP_TAGS), the level, the weights taken off
        self.asleep: frozenset[str] = frozenset()
        self.sleep_level = 0
        self._parked: tuple[Parked, Parked] | None = None  # the target's, the draft's
        self.held_bytes = self._device_bytes()

    def _validate_backend(self, backend: AttentionBackend, platform: str,
                          cfg: LlamaConfig) -> None:
        tp, c, p = self.mesh.shape[AXIS], self.config, self.plan
        validate_backend(backend, platform=platform, num_q_heads=cfg.num_heads // tp,
                         num_kv_heads=cfg.num_kv_heads // tp, head_dim=cfg.head_dim,
                         block_size=p.block_size, max_num_seqs=c.scheduler.max_num_seqs,
                         pages_per_seq=p.blocks_per_seq,
                         max_num_tokens=c.scheduler.max_num_batched_tokens,
                         dtype=p.dtype.name)

    @property
    def model_configs(self) -> list[LlamaConfig]:
        """The configs (as placed) of the models whose KV caches share the pool's blocks: the
        target's, then the draft model's."""
        return [self.model_config] + ([] if self.draft is None else [self.draft.cfg])

    @property
    def built(self) -> BuiltWorker:
        return BuiltWorker(self.plan, self.model_config,
                           self.loaded.tokenizer, self.loaded.generation_config)

    @property
    def kv_init(self) -> Any:
        """The jitted program that allocates the zeroed KV pool on the mesh: (k, v) of the
        target, then of the draft model, or n-gram speculation's token cache."""
        cfgs, bs, num_blocks = self.model_configs, self.plan.block_size, self.plan.num_kv_blocks
        tokens = ([token_cache_shape(num_blocks, bs, self.mesh)]
                  if ngram_lookup(self.config) is not None else [])

        def init() -> tuple[jax.Array, ...]:
            return tuple(cache for cfg in cfgs
                         for cache in init_kv_cache(cfg, num_blocks, bs, self.plan.dtype)
                         ) + tuple(jnp.zeros(t.shape, t.dtype) for t in tokens)

        return jax.jit(init, out_shardings=(self.kv_sharding,) * (2 * len(cfgs))
                       + tuple(t.sharding for t in tokens))

    def fingerprint(self) -> dict[str, Any]:
        """What programs compiled for this worker depend on (see compiled_dir)."""
        return compiled_dir.fingerprint(
            self.config, self.model_config, self.plan,
            device_kind=self.mesh.devices.flat[0].device_kind,
            draft=None if self.draft is None else self.draft.cfg)

    def _read_compiled(self, directory: str, cfg: LlamaConfig,
                       ) -> compiled_dir.LoadedPrograms | None:
        """The directory's programs, those a starting engine needs first loading on a
        background thread (program_order.py); None when a file is damaged (strict: the
        error)."""
        try:
            programs = compiled_dir.read_programs(directory, list(self.mesh.devices.flat))
        except compiled_dir.CompiledDirError as e:
            if self.config.runner.strict_compile:
                raise
            logger.warning("%s; compiling instead", e)
            return None
        programs.load_in_background(first_programs(
            planned_programs(cfg, self.plan)))
        return programs

    def _check_compiled(self, programs: compiled_dir.LoadedPrograms | None,
                        ) -> compiled_dir.LoadedPrograms | dict[Any, Any]:
        """The programs, if built for exactly this engine; else an error in strict mode, or a
        warning and a normal compile."""
        if programs is None:
            return {}
        try:
            programs.check(self.fingerprint(), self.config.runner.compiled_dir or "")
        except compiled_dir.CompiledDirError as e:
            if self.config.runner.strict_compile:
                raise
            logger.warning("%s; compiling instead", e)
            return {}
        return programs

    def _restore_sharded(self, path: str, cfg: LlamaConfig) -> LoadedModel:
        """orbax reads each device's shard straight onto it: no full copy on any device.
        `cfg`: the checkpoint's (`converted_config`)."""
        tp = self.mesh.shape[AXIS]
        validate_tensor_parallel(cfg, tp)
        held = with_expert_parallel(cfg, self.config.parallel.enable_expert_parallel, tp)
        target = {name: jax.ShapeDtypeStruct(shape, self.plan.dtype,
                                             sharding=param_sharding(self.mesh, name, shape, held))
                  for name, shape in family_of(cfg).param_shapes(cfg).items()}
        return with_hf_overrides(load_converted(path, target), self.config.model.hf_overrides)

    def _sized_plan(self, backend: AttentionBackend) -> ResolvedPlan:
        """The plan with its KV pool sized. On TPU/GPU: the memory share left after the
        weights (in use now) and the largest step's temporaries, as the compiler reports them.
        On CPU: cpu_kv_cache_space_gib, or CPU_KV_MEMORY_FRACTION of the host memory available
        now (the weights are placed), rounded down to a power of two of blocks, at most what
        max_num_seqs sequences of max_model_len hold. A block's bytes are both caches' with a
        draft model."""
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return self.plan  # resolved with the configured pool
        saved = self.config.runner.compiled_dir
        if saved is not None and (Path(saved) / compiled_dir.MANIFEST).is_file():
            try:  # the pool the programs were built for (sized for that target's memory)
                saved_blocks = int(compiled_dir.read_manifest(saved)["fingerprint"]["plan"][
                    "num_kv_blocks"])
            except (compiled_dir.CompiledDirError, KeyError, TypeError, ValueError):
                pass  # refused with its reason when the programs are loaded
            else:
                return self.plan.with_pool(saved_blocks)
        tp = self.mesh.shape[AXIS]
        per_block = sum(kv_cache_bytes_per_block(cfg, self.plan.block_size, self.plan.dtype)
                        for cfg in self.model_configs) // tp  # per device: its KV heads
        device = self.mesh.devices.flat[0]
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:  # one extra compile at start, like vLLM's profile run
            step = largest_step_bytes(
                ModelParts.of(self.model), self.config, backend, self.plan,
                None if self.draft is None else ModelParts.of(self.draft))
            num_blocks = kv_blocks_for(
                device_memory.plan(device.platform, stats["bytes_limit"],
                                   cache.gpu_memory_utilization),
                stats.get("bytes_in_use", 0), step, per_block)
        elif cache.cpu_kv_cache_space_gib is not None:
            num_blocks = int(cache.cpu_kv_cache_space_gib * 2**30 // per_block)
        else:
            share = int(CPU_KV_MEMORY_FRACTION * available_host_bytes() // per_block)
            # A power of two: the step programs take the pool's shape, and one that moved with
            # the free memory would miss the persistent compilation cache at every start.
            share = 1 << (share.bit_length() - 1) if share else 0
            num_blocks = min(share, self.config.scheduler.max_num_seqs
                             * self.plan.blocks_per_seq + 1)
        return self.plan.with_pool(num_blocks, per_block)

    def _zeroed_kv_pool(self) -> tuple[jax.Array, ...]:
        caches = self._init_kv_pool()
        place_zeroed_on_huge_pages(caches)  # CPU (huge_pages.py)
        return caches

    # ---- sleep mode and weight updates (vLLM's) -------------------------------------------
    def sleep(self, level: int) -> None:
        """Free the KV cache and take the weights off the devices: to the host (level 1); at
        level 2 the checkpoint's weights are dropped (`wake_up` is given them again) and only
        what the model computes itself (a rotary table) and a draft model's go to the host."""
        runner = self.runner
        caches = (runner.k_cache, runner.v_cache, *runner.drafter_cache)
        jax.block_until_ready(caches)  # the last step's: when they are in, no step reads more
        # The model's Params are the checkpoint's weights; its other variables it computes.
        params = leaves_by_path(nnx.to_pure_dict(nnx.state(self.model, nnx.Param)))[0]
        self._parked = (park(runner.params, lambda path: level == 1 or path not in params),
                        park(runner.drafter_weights, lambda path: True))
        for cache in caches:
            cache.delete()
        self.asleep, self.sleep_level = frozenset(SLEEP_TAGS), level
        self.held_bytes = self._device_bytes()

    def wake_up(self, tags: frozenset[str], checkpoint: LoadedModel | None) -> None:
        """Put back the parts named by `tags` that are asleep, each array of the shape, dtype
        and sharding it had: the weights as they were (after level 2: `checkpoint`'s), the KV
        cache zeroed."""
        runner = self.runner
        if "weights" in tags & self.asleep:
            target, draft = self._parked
            dropped = {} if checkpoint is None else self._written(
                target.specs, {name: [((), value)] for name, value in checkpoint.params.items()})
            self._set_weights(unpark(target, dropped), unpark(draft, {}))
            self._parked = None
        if "kv_cache" in tags & self.asleep:
            k_cache, v_cache, *drafter_cache = self._zeroed_kv_pool()
            runner.k_cache, runner.v_cache = k_cache, v_cache
            runner.drafter_cache = tuple(drafter_cache)
        self.asleep -= tags
        self.sleep_level = self.sleep_level if self.asleep else 0
        self.held_bytes = self._device_bytes()

    def update_weights(self, parts: ParamParts) -> None:
        """Write these parts of the target's params (`hf_param_parts`) over its weights."""
        leaves, treedef = leaves_by_path(self.runner.params)
        new = {path: jax.device_put(host, leaves[path].sharding)
               for path, host in self._written(leaves, parts).items()}
        self._set_weights(tree_of(treedef, leaves | new), self.runner.drafter_weights)

    def _written(self, leaves: dict[LeafPath, Any], parts: ParamParts,
                 ) -> dict[LeafPath, np.ndarray]:
        """The target's weight arrays that `parts` fall in (`leaves`: the arrays, or their
        specs, by path) as host arrays with the parts written over them, in the layout and
        dtype the devices hold."""
        tp = self.mesh.shape[AXIS]
        by_leaf: dict[LeafPath, list[tuple[tuple[int, ...], np.ndarray]]] = {}
        for param, param_parts in parts.items():
            for index, value in param_parts:
                placed = placed_layout(self.loaded.config, {param: value}, tp)[1][param]
                for path, at, part in self.model.held_parts(param, index, placed):
                    by_leaf.setdefault(path, []).append((at, part))
        return {path: written(leaves[path], leaf_parts) for path, leaf_parts in by_leaf.items()}

    def _set_weights(self, params: dict[str, Any], drafter_weights: dict[str, Any]) -> None:
        """The steps' weights; the models get them too, so that no old array outlives them."""
        self.runner.params, self.runner.drafter_weights = params, drafter_weights
        nnx.update(self.model, params)
        if self.draft is not None:
            nnx.update(self.draft, drafter_weights)

    def _device_bytes(self) -> dict[str, int]:
        """Device bytes the weights and the KV cache hold, by SLEEP_TAGS' names."""
        runner = self.runner
        return {"weights": device_bytes((runner.params, runner.drafter_weights)),
                "kv_cache": device_bytes((runner.k_cache, runner.v_cache, runner.drafter_cache))}

    def read_blocks(self, block_ids: list[int], heads: tuple[int, ...],
                    ) -> tuple[jax.Array, jax.Array]:
        return self.runner.read_blocks(block_ids, heads)

    def write_blocks(self, block_ids: list[int], k: jax.Array | np.ndarray,
                     v: jax.Array | np.ndarray) -> None:
        self.runner.write_blocks(block_ids, k, v)

    def warm_up_blocks(self, heads: tuple[int, ...] | None, write: bool) -> None:
        self.runner.warm_up_blocks(heads, write)
