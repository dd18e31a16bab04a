"""Engine arguments on the command line, generated from the config dataclasses (vLLM's names,
`--x/--no-x` booleans, `-tp`), vLLM's no-effect flags, and `--config` (a YAML of flags)."""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import yaml

from jaxserve.config import CacheConfig, ModelConfig, ParallelConfig, RunnerConfig, SchedulerConfig
from jaxserve.config.vllm_args import NO_EFFECT, ONLY_DEFAULT

_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, RunnerConfig, ParallelConfig)
SHORT_FLAGS = {"tensor_parallel_size": "-tp", "data_parallel_size": "-dp",
               "pipeline_parallel_size": "-pp"}
HELP = {
    "model": "checkpoint: an HF directory, a .gguf file, a llama2.c .bin, or a directory "
             "written by `jaxserve convert`",
    "tokenizer": "an HF tokenizer directory to use instead of the checkpoint's own",
    "download_dir": "a local directory a model named by its hub id (ORG/NAME) is found in, "
                    "laid out as HF's hub cache or as DIR/ORG/NAME; nothing is fetched",
    "load_format": "how to read the weights: auto (from the path), hf, gguf, llama2c, orbax, "
                   "or dummy (random weights of the checkpoint's shapes)",
    "dtype": "weights and activations: auto (float32 on CPU, bfloat16 elsewhere), float32, "
             "bfloat16, or float16/half (GPU; on CPU with --attention-backend xla)",
    "max_model_len": "longest sequence (prompt + output) a request may have; at most the "
                     "model's context",
    "seed": "engine seed: for sampling without a per-request seed, and the prefix-cache hash",
    "hf_overrides": "config.json entries to replace, as JSON: {\"max_position_embeddings\": "
                    "4096}",
    "generation_config": "auto: requests that do not set temperature, top_p, top_k, min_p, "
                         "repetition_penalty or max_tokens take the checkpoint's "
                         "(generation_config.json, a GGUF's general.sampling.*); vllm: they "
                         "take vLLM's defaults",
    "max_logprobs": "largest logprobs / prompt_logprobs a request may ask for (-1: no cap)",
    "max_n": "most samples (n) one request may ask for",
    "runner": "generate (text) or pooling (an embedding model: LLM.embed, /v1/embeddings, "
              "the last token's final hidden state); auto: generate",
    "convert": "how a pooling runner converts the checkpoint: auto or embed",
    "task": "vLLM's older name for the runner: generate, or embed (runner pooling)",
    "block_size": "tokens per KV-cache block (a power of two)",
    "num_kv_blocks": "KV-cache blocks in the pool, instead of sizing it from device memory",
    "gpu_memory_utilization": "share of accelerator memory for the weights and the KV cache",
    "cpu_kv_cache_space_gib": "GiB of KV cache on CPU (default: 10% of the host memory "
                              "available at start, rounded down to a power of two of blocks, "
                              "at most what max_num_seqs sequences of max_model_len hold)",
    "enable_prefix_caching": "reuse the KV blocks of prompt prefixes already computed",
    "prefix_caching_hash_seed": "seed of the block hashes (default: the engine seed)",
    "max_num_seqs": "most requests running in one step",
    "max_num_batched_tokens": "token budget of one step (prefill chunks and decodes together)",
    "long_prefill_token_threshold": "prompts longer than this get at most this many tokens "
                                    "a step (0: no limit)",
    "max_num_partial_prefills": "most requests with prefill tokens in one step (0: no cap)",
    "enable_chunked_prefill": "split a long prompt's prefill over several steps",
    "scheduling_policy": "fcfs (arrival order) or priority (lower priority values first)",
    "enable_mixed_batching": "put prefills and decodes in one step (off: V0-style steps of "
                             "one kind)",
    "async_scheduling": "schedule and launch step N+1 while step N runs",
    "disable_hybrid_kv_cache_manager": "keep every token's KV in sliding-window layers too "
                                       "(default: the blocks a window has passed are freed "
                                       "where every layer has the same window)",
    "speculative_config": "speculative decoding, as JSON: {\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 5}, "
                          "{\"method\": \"layer_skip\", \"num_speculative_tokens\": 3, "
                          "\"num_layers\": 2} or {\"method\": \"draft_model\", "
                          "\"model\": \"PATH\", \"num_speculative_tokens\": 3} "
                          "(default: off)",
    "attention_backend": "attention implementation: auto (pallas on TPU/GPU; on CPU, cpu "
                         "where its native kernels build, else xla), xla, cpu (native paged "
                         "attention and, for float32 on one device, dense layers), pallas, "
                         "or pallas_interpret",
    "scan_layers": "run the layers as one lax.scan (default: on TPU; CPU and GPU unroll them)",
    "token_buckets": "padded step sizes to compile, in tokens (default: powers of two from 1 "
                     "to max_num_batched_tokens)",
    "request_buckets": "padded request counts to compile (default: powers of two from 8 to "
                       "max_num_seqs; a step of T < 8 tokens pads to T requests)",
    "precompile": "compile every step shape before serving",
    "strict_compile": "fail a step that needs a compilation after warm-up",
    "compilation_cache_dir": "JAX's persistent compilation cache ('' turns it off)",
    "compiled_dir": "executables written by `jaxserve compile`: nothing is compiled",
    "collective_matmul_min_tokens": "with tensor parallelism, steps of at least this many "
                                    "tokens overlap their collectives with the matmuls, the "
                                    "residual sharded by rows (default: on TPU/GPU, from where "
                                    "that is faster on the chip; off on CPU)",
    "tensor_parallel_size": "devices each model is sharded over",
    "enable_expert_parallel": "split a mixture of experts' experts whole over the tensor-"
                              "parallel devices (expert parallelism) instead of each "
                              "expert's width",
    "data_parallel_size_local": "model replicas in this process",
    "data_parallel_size": "model replicas (vLLM's name; here all run in this process)",
    "coordinator_address": "multi-host: host:port of process 0 (jax.distributed)",
    "num_processes": "multi-host: number of processes",
    "process_id": "multi-host: this process's index",
    "distributed_timeout_s": "multi-host: seconds to wait for the other processes",
    "devices": "indices into jax.devices() to run on (default: all)",
    "disaggregation": "separate prefill and decode engines: a YAML file, or JSON/YAML text "
                      "(docs/disaggregation.md)",
}
# vLLM's flags that jaxserve takes for its scripts' sake (jaxserve/config/vllm_args.py says what
# each does here), with their types on the command line.
VLLM_FLAG_TYPES: dict[str, type] = {
    "enforce_eager": bool, "trust_remote_code": bool, "disable_log_stats": bool,
    "disable_log_requests": bool, "swap_space": float, "compilation_config": str,
    "max_seq_len_to_capture": int, "disable_custom_all_reduce": bool,
    "distributed_executor_backend": str, "tokenizer_mode": str, "revision": str,
    "code_revision": str, "tokenizer_revision": str, "quantization": str,
    "kv_cache_dtype": str, "pipeline_parallel_size": int, "cpu_offload_gb": float,
    "data_parallel_size": int, "task": str,
}


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _arg_type(hint: Any) -> dict[str, Any]:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) and len(args) == 1:
        hint = args[0]
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(hint) is list:
        return {"type": _int_list, "metavar": "N,N,..."}
    return {"type": hint if hint in (int, float, str) else str}


def _vllm_help(name: str) -> str:
    if name in NO_EFFECT:
        return f"accepted for vLLM's sake; no effect: {NO_EFFECT[name]}"
    if name in ONLY_DEFAULT:
        return f"vLLM's; only {ONLY_DEFAULT[name]!r} is supported"
    return HELP[name]


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group("engine arguments")
    for cls in _CONFIGS:
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.name in skip:
                continue
            default = f.default if f.default is not MISSING else None
            text = HELP[f.name] if "default" in HELP[f.name] else \
                f"{HELP[f.name]} (default: {default})"
            _add(group, f.name, text, _arg_type(hints[f.name]))
    vllm = parser.add_argument_group("vLLM engine arguments")
    for name, kind in VLLM_FLAG_TYPES.items():
        _add(vllm, name, _vllm_help(name), _arg_type(kind))


def _add(group: argparse._ArgumentGroup, name: str, help_text: str,
         kind: dict[str, Any]) -> None:
    flags = [f"--{name.replace('_', '-')}"] + ([SHORT_FLAGS[name]] if name in SHORT_FLAGS
                                               else [])
    # argparse formats help with %: a literal one ("10% of the host memory") must be doubled
    group.add_argument(*flags, dest=name, default=argparse.SUPPRESS,
                       help=help_text.replace("%", "%%"), **kind)


def engine_kwargs(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    names = ({f.name for cls in _CONFIGS for f in fields(cls)} | set(VLLM_FLAG_TYPES)) - set(skip)
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    """vLLM's `--config FILE.yaml`: flags as a mapping (`max-num-seqs: 8` or `max_num_seqs`);
    the command line's own flags win. Read by `parse_with_config`."""
    parser.add_argument("--config", default=None, help="YAML file of flags (a mapping of "
                        "flag names to values); flags on the command line override it")
    parser.set_defaults(_parser=parser)


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str] | None,
                      ) -> argparse.Namespace:
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if path is None or not hasattr(args, "_parser"):
        return args
    try:
        values = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: must be a mapping of flag names to values")
    sub = args._parser
    dests = {a.dest for a in sub._actions}
    values = {str(k).replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(values) - dests - {"config"})
    if unknown:
        raise ValueError(f"--config {path}: {unknown[0]!r} is not a flag of this command")
    sub.set_defaults(**values)
    return parser.parse_args(argv)
