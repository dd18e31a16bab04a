"""Engine configuration: flat vLLM-style engine arguments in, validated nested configs out."""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
import secrets
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import yaml

from jaxserve.config.disaggregation import SIDES, DisaggregationConfig, normalize_disaggregation
from jaxserve.config.download_dir import local_model_path
from jaxserve.config.speculative import SpeculativeConfig, normalize_speculative
from jaxserve.config.vllm_args import accept_vllm_args
from jaxserve.default_model import default_model_path

logger = logging.getLogger(__name__)

# Where a checkpoint's weights come from (models/loader.py dispatches on it).
LOAD_FORMATS = ("auto", "hf", "gguf", "llama2c", "orbax", "dummy")
RUNNERS = ("auto", "generate", "pooling")


@dataclass
class ModelConfig:
    model: str | None = None  # None: the small model that ships in the package
    tokenizer: str | None = None
    # vLLM's: where a model named by its hub id is found (config/download_dir.py); nothing
    # is fetched
    download_dir: str | None = None
    load_format: str = "auto"  # one of LOAD_FORMATS
    # auto (float32 on CPU, bfloat16 elsewhere) | float32 | bfloat16 | float16 (GPU, or the
    # xla attention backend on CPU)
    dtype: str = "auto"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int | None = 0  # None: a random seed, drawn once at start
    # vLLM's: config.json entries to replace (a mapping, or JSON text), e.g.
    # {"max_position_embeddings": 4096}; the checkpoint's weights must still fit
    hf_overrides: dict[str, Any] | str | None = None
    # vLLM's: "auto" takes the checkpoint's sampling defaults (generation_config.json, a GGUF's
    # general.sampling.*) for requests that do not set them; "vllm" takes none.
    generation_config: str = "auto"
    # Limits on one request (a larger value is a 400 at the server).
    max_logprobs: int = 20  # -1 (vLLM's): no cap, a request may ask for the whole vocabulary
    max_n: int = 64  # samples per request: each costs a sequence's compute and KV blocks
    # vLLM's: "pooling" runs the decoder checkpoint as an embedding model (LLM.embed,
    # /v1/embeddings: its last token's final hidden state); "auto" and "generate" generate text
    runner: str = "auto"
    convert: str = "auto"  # vLLM's: how a pooling runner converts the model: "auto" or "embed"

    @property
    def pooling(self) -> bool:
        return self.runner == "pooling"

    def logprobs_cap(self, vocab_size: int) -> int:
        """The most logprobs a request may ask for: max_logprobs, resolved."""
        return num_logprobs(self.max_logprobs, vocab_size)


def num_logprobs(asked: int | None, vocab_size: int) -> int | None:
    """A count of logprobs as vLLM takes it (max_logprobs, a request's logprobs or
    prompt_logprobs), -1 (the whole vocabulary) resolved."""
    return vocab_size if asked == -1 else asked


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit pool size (block 0 included); else from memory
    gpu_memory_utilization: float = 0.9  # share of accelerator memory for weights + KV
    # KV budget on CPU (where devices report no memory); None: a share of the host's available
    # memory (placement/host_memory.py)
    cpu_kv_cache_space_gib: float | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_seed: int | None = None  # default: the engine seed


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    long_prefill_token_threshold: int = 0
    # At most this many requests get prefill tokens in one step (0: no cap); decodes never wait
    max_num_partial_prefills: int = 0
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # fcfs | priority
    # False: V0-style steps of prefills only or decodes only (for comparison; V1 mixes them)
    enable_mixed_batching: bool = True
    # Schedule and launch step N+1 while step N runs; its decode inputs come from N's sampled
    # ids on the device. Tokens are the same either way (docs in jaxserve/engine/core.py).
    async_scheduling: bool = True
    # vLLM's: every layer keeps every token's KV, sliding-window layers too (for comparison)
    disable_hybrid_kv_cache_manager: bool = False
    # Speculative decoding (vLLM's): a mapping or JSON text, validated into a
    # SpeculativeConfig. With async scheduling the next step runs ahead of a drafting step as
    # if it accepts every draft, and the device corrects it (programs/spec_verify.py).
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None


@dataclass
class RunnerConfig:
    attention_backend: str = "auto"
    scan_layers: bool | None = None  # lax.scan over stacked layers; default: on TPU only
    token_buckets: list[int] | None = None  # default: powers of two, 1 to max_num_batched_tokens
    request_buckets: list[int] | None = None  # default: powers of two, 8 to max_num_seqs
    precompile: bool = False
    strict_compile: bool = False  # raise on a compilation after warm-up (but the sampler's
    # for a new penalty history or blocked-token width: model_runner.dispatch)
    compilation_cache_dir: str | None = None  # JAX persistent cache; "" disables
    compiled_dir: str | None = None  # executables from `jaxserve compile`: nothing compiles
    # With TP: steps of at least this many tokens shard the residual stream by rows and overlap
    # their collectives with the matmuls (layers/collective_matmul.py). Default: on TPU/GPU,
    # from where the all-reduces saved outweigh the weights read per chunk; off on CPU.
    collective_matmul_min_tokens: int | None = None

    def scans_layers(self, platform: str) -> bool:
        """lax.scan over the layers where it measured best: TPU (compile time flat in depth).
        XLA:CPU and XLA:GPU copy each scanned layer's weight slice out of the stack before its
        matmuls (on GPU three times the weight bytes a step: Llama-3-8B decode 2.0x its floor
        scanned, 1.13x unrolled, jaxserve compile-check), so they unroll."""
        return platform == "tpu" if self.scan_layers is None else self.scan_layers


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size_local: int = 1
    # Multi-host (jax.distributed): every process runs the same engine on the same requests.
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    distributed_timeout_s: int = 120
    devices: list[int] | None = None  # indices into jax.devices() to run on; default: all
    # A mixture of experts' experts split whole over the TP devices (vLLM's name), instead of
    # each expert's width
    enable_expert_parallel: bool = False
    # Separate prefill and decode engines with KV transfer (docs/disaggregation.md): a mapping,
    # or JSON/YAML text or a YAML file path (the CLI's --disaggregation); validated into a
    # DisaggregationConfig.
    disaggregation: DisaggregationConfig | dict[str, Any] | str | None = None


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from flat engine arguments (`max_num_seqs=8`, ...); unknown names and values of
        the wrong type are errors. Paths (`os.PathLike`) are accepted where a string is.
        vLLM's arguments that have no effect here are accepted (see `jaxserve.config.vllm_args`)."""
        config = cls._given(**kwargs)
        config.validate()
        return config.normalized()

    @classmethod
    def _given(cls, **kwargs: Any) -> "EngineConfig":
        """The arguments as given, their names and types checked: not validated or
        normalized yet."""
        kwargs = accept_vllm_args(kwargs)
        check_engine_args(kwargs)
        config = cls()
        for name, value in kwargs.items():
            if isinstance(value, os.PathLike):
                value = os.fspath(value)
            setattr(getattr(config, _SECTION_OF[name]), name, value)
        return config

    @classmethod
    def from_yaml(cls, path: str | Path) -> "EngineConfig":
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: engine config must be a mapping")
        return cls.from_kwargs(**data)

    def to_kwargs(self) -> dict[str, Any]:
        return {f.name: getattr(getattr(self, s), f.name) for s in _SECTIONS
                for f in fields(getattr(self, s))}

    def replace(self, **kwargs: Any) -> "EngineConfig":
        return EngineConfig.from_kwargs(**(self.to_kwargs() | kwargs))

    def normalized(self) -> "EngineConfig":
        """A copy with the defaults drawn and the settings given as text or mappings parsed:
        the shipped model's path for model=None, a seed for seed=None, hf_overrides as a
        mapping, disaggregation and speculative_config as their configs. Call on a config
        that validates."""
        m, s, p = self.model, self.scheduler, self.parallel
        seed = m.seed
        if seed is None:
            seed = secrets.randbelow(2**31)
            logger.info("seed=None: drew engine seed %d", seed)
        return EngineConfig(
            model=dataclasses.replace(
                m, model=(default_model_path() if m.model is None
                          else local_model_path("model", m.model, m.download_dir)),
                tokenizer=(None if m.tokenizer is None
                           else local_model_path("tokenizer", m.tokenizer, m.download_dir)),
                seed=seed,
                hf_overrides=_json_mapping("hf_overrides", m.hf_overrides)),
            cache=dataclasses.replace(self.cache),
            scheduler=dataclasses.replace(s, speculative_config=self._speculative_config()),
            runner=dataclasses.replace(self.runner),
            parallel=dataclasses.replace(p, disaggregation=self._disaggregation()))

    def _disaggregation(self) -> DisaggregationConfig | None:
        p = self.parallel
        if p.disaggregation is None:
            return None
        return normalize_disaggregation(p.disaggregation,
                                        coordinator_address=p.coordinator_address,
                                        devices=p.devices)

    def _speculative_config(self) -> SpeculativeConfig | None:
        return normalize_speculative(self.scheduler.speculative_config,
                                     tensor_parallel_size=self.parallel.tensor_parallel_size)

    def validate(self) -> None:
        """A ValueError naming the first field that is wrong; the config is left as it is."""
        m, c, s, r, p = self.model, self.cache, self.scheduler, self.runner, self.parallel
        _positive(c, "block_size")
        _positive(s, "max_num_seqs")
        _positive(s, "max_num_batched_tokens")
        _positive(p, "tensor_parallel_size")
        _positive(p, "data_parallel_size_local")
        _positive(p, "distributed_timeout_s")
        if c.block_size & (c.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {c.block_size}")
        if c.num_kv_blocks is not None and (not isinstance(c.num_kv_blocks, int)
                                            or c.num_kv_blocks < 2):
            raise ValueError(f"num_kv_blocks must be an integer >= 2, got {c.num_kv_blocks!r}")
        if not 0.0 < c.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{c.gpu_memory_utilization}")
        if c.cpu_kv_cache_space_gib is not None and not 0 < c.cpu_kv_cache_space_gib < math.inf:
            raise ValueError(f"cpu_kv_cache_space_gib must be a number > 0 (GiB), got "
                             f"{c.cpu_kv_cache_space_gib!r}")
        _non_negative(s, "long_prefill_token_threshold")
        _non_negative(s, "max_num_partial_prefills")
        if s.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got "
                             f"{s.scheduling_policy!r}")
        if m.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got "
                             f"{m.dtype!r}")
        _json_mapping("hf_overrides", m.hf_overrides)
        if m.seed is None and p.num_processes not in (None, 1):
            raise ValueError("seed=None draws a seed in each process; a multi-host engine "
                             "needs the same one everywhere: give seed")
        if m.generation_config not in ("auto", "vllm"):
            raise ValueError(f"generation_config must be 'auto' or 'vllm', got "
                             f"{m.generation_config!r}")
        if m.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got "
                             f"{m.load_format!r}")
        if m.max_model_len is not None:
            _positive(m, "max_model_len")
        if m.max_logprobs != -1:
            _non_negative(m, "max_logprobs")
        if m.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {m.runner!r}")
        if m.convert not in ("auto", "embed") or (m.convert == "embed" and not m.pooling):
            raise ValueError(f"convert: only 'auto', or 'embed' with runner='pooling', is "
                             f"supported (an embedding model), got {m.convert!r}")
        if m.pooling:
            _check_pooling(self)
        _positive(m, "max_n")
        if p.devices is not None and (
                not isinstance(p.devices, list) or not p.devices
                or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in p.devices)
                or len(set(p.devices)) != len(p.devices)):
            raise ValueError(f"devices must be a non-empty list of distinct device indices "
                             f"(integers >= 0), got {p.devices!r}")
        disaggregation = self._disaggregation()
        if disaggregation is not None:
            for name in SIDES:  # each side's own engine arguments must validate too
                _validated_side(self, disaggregation, name)
        if self._speculative_config() is not None and disaggregation is not None:
            raise ValueError("speculative_config: not supported with disaggregation yet")
        if r.collective_matmul_min_tokens is not None:
            _positive(r, "collective_matmul_min_tokens")
        for name in ("token_buckets", "request_buckets"):
            buckets = getattr(r, name)
            if buckets is not None and (not buckets or any(
                    not isinstance(b, int) or b <= 0 for b in buckets)):
                raise ValueError(f"{name} must be a non-empty list of positive integers, "
                                 f"got {buckets!r}")


def _check_pooling(config: EngineConfig) -> None:
    """What a pooling engine does not do (its requests prefill once and end): named."""
    for name, value, default in (
            ("speculative_config", config.scheduler.speculative_config, None),
            ("disaggregation", config.parallel.disaggregation, None),
            ("compiled_dir", config.runner.compiled_dir, None)):
        if value != default:
            raise ValueError(f"{name}: not supported with runner='pooling'")


def side_config(config: EngineConfig, settings: DisaggregationConfig,
                name: str) -> EngineConfig:
    """The engine configuration of one side: the shared arguments plus the side's own."""
    return _validated_side(config, settings, name).normalized()


def _validated_side(config: EngineConfig, settings: DisaggregationConfig,
                    name: str) -> EngineConfig:
    side = settings.side(name)
    try:
        out = EngineConfig._given(**(config.to_kwargs() | dict(
            disaggregation=None, devices=side.devices,
            tensor_parallel_size=side.tensor_parallel_size,
            data_parallel_size_local=side.data_parallel_size_local, **side.engine_args)))
        out.validate()
    except ValueError as e:
        raise ValueError(f"disaggregation.{name}: {e}") from e
    return out


_SECTIONS = ("model", "cache", "scheduler", "runner", "parallel")
_SECTION_CLASSES = (ModelConfig, CacheConfig, SchedulerConfig, RunnerConfig, ParallelConfig)
_SECTION_OF = {f.name: section for section, cls in zip(_SECTIONS, _SECTION_CLASSES)
               for f in fields(cls)}
ENGINE_ARGS = tuple(_SECTION_OF)
_TYPE_OF = {f.name: str(f.type) for cls in _SECTION_CLASSES for f in fields(cls)}  # "int | None"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Checks per type annotation; an annotation not listed here (a mapping) is left to `validate`.
_TYPE_CHECKS = {
    "None": lambda v: v is None,
    "bool": lambda v: isinstance(v, bool),
    "int": _is_int,
    "float": lambda v: _is_int(v) or isinstance(v, float),
    "str": lambda v: isinstance(v, (str, os.PathLike)),
    "list[int]": lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
}


def check_engine_args(args: Mapping[str, Any], where: str = "") -> None:
    """Unknown names and values of the wrong type are a ValueError naming the argument, as
    `where.name` when `where` is given (`engine.max_num_seqs` in a batch spec)."""
    for name, value in args.items():
        label = f"{where}.{name}" if where else name
        hint = _TYPE_OF.get(name)
        if hint is None:
            close = difflib.get_close_matches(name, ENGINE_ARGS, n=1)
            maybe = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{label}: unknown engine argument{maybe}")
        options = hint.split(" | ")
        if any(o not in _TYPE_CHECKS for o in options):
            continue
        if not any(_TYPE_CHECKS[o](value) for o in options):
            raise ValueError(f"{label} must be {hint}, got {value!r} "
                             f"({type(value).__name__})")


def _json_mapping(name: str, value: Any) -> dict[str, Any] | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name} must be a mapping (or JSON object text), got {value!r}")
    return value or None


def _positive(section: Any, name: str) -> None:
    value = getattr(section, name)
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _non_negative(section: Any, name: str) -> None:
    value = getattr(section, name)
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def power_of_two_buckets(smallest: int, largest: int) -> list[int]:
    buckets, b = [], smallest
    while b < largest:
        buckets.append(b)
        b *= 2
    return buckets + [largest]


__all__ = ["EngineConfig", "ModelConfig", "CacheConfig", "SchedulerConfig", "RunnerConfig",
           "ParallelConfig", "ENGINE_ARGS", "check_engine_args", "power_of_two_buckets"]
