"""`jaxserve compile`: build every program the engine's warm-up would, ahead of time, and save
them as a compiled directory (see compiled_dir): on this host for its own devices, or deviceless
for a TPU topology or GPU description (the compile check's abstract step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jaxserve.compilation.compile_check import device_draft_config, device_model_config, prepare
from jaxserve.config import EngineConfig
from jaxserve.layers.sampler import SamplingMetadata
from jaxserve.models.llama_config import LlamaConfig
from jaxserve.placement.targets import Target
from jaxserve.programs.device_step import ProgramKey, step_key
from jaxserve.programs.input_batch import StepArrays, pack
from jaxserve.runtime import compiled_dir
from jaxserve.runtime.program_order import planned_programs


class ProgramCompiler(Protocol):
    def compile_step(self, arrays: StepArrays) -> Any: ...
    def compile_sampler(self, sampling: SamplingMetadata,
                        logits: jax.ShapeDtypeStruct) -> Any: ...


def compile_all(compiler: ProgramCompiler,
                warm_ups: list[tuple[StepArrays, SamplingMetadata]],
                ) -> tuple[dict[ProgramKey, Any], dict[ProgramKey, str]]:
    """Every warm-up program once, and those that failed to compile with why. XLA:GPU needs
    the device for some (the sampler's top-k over logprobs at 64+ rows); the engine's warm-up
    compiles whatever a directory lacks."""
    programs: dict[ProgramKey, Any] = {}
    left: dict[ProgramKey, str] = {}
    for arrays, sampling in warm_ups:
        key = step_key(arrays)
        if key not in programs:
            programs[key] = compiler.compile_step(arrays)
        sample_key = ("sample", pack(sampling)[1])
        if sample_key not in programs and sample_key not in left:
            try:
                programs[sample_key] = compiler.compile_sampler(
                    sampling, programs[key].out_info.logits)
            except Exception as e:  # noqa: BLE001 - reported; the device compiles it at start
                left[sample_key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return programs, left


def build_on_host(config: EngineConfig, out: str | Path) -> tuple[Path, int]:
    """Compile for this host's devices with the real weights loaded (what the engine runs)."""
    from jaxserve.runtime.worker import Worker

    worker = Worker(config)
    programs, left = compile_all(worker.runner, worker.runner.warm_up_programs())
    programs[compiled_dir.KV_INIT] = worker.kv_init.trace().lower().compile()
    return compiled_dir.save(out, programs, worker.fingerprint(), left), len(programs)


def build_for_target(target: Target, cfg: LlamaConfig, config: EngineConfig,
                     out: str | Path) -> tuple[Path, int]:
    """Compile deviceless for the target; weights are abstract, so a model config suffices."""
    program, _, plan = prepare(target, cfg, config)
    programs, left = compile_all(program, planned_programs(cfg, plan))
    caches = [program.kv, program.kv, *program.drafter_cache]
    programs[compiled_dir.KV_INIT] = jax.jit(
        lambda: tuple(jnp.zeros(kv.shape, kv.dtype) for kv in caches),
        out_shardings=tuple(kv.sharding for kv in caches)).trace().lower().compile()
    fp = compiled_dir.fingerprint(
        config, device_model_config(cfg, config.parallel.tensor_parallel_size,
                                    config.parallel.enable_expert_parallel, target.devices[0]),
        plan,
        device_kind=target.device_kind,
        draft=device_draft_config(config, cfg, plan.max_model_len))
    return compiled_dir.save(out, programs, fp, left), len(programs)
