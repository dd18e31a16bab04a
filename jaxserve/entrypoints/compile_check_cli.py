"""`jaxserve compile-check MODEL --target T`: the engine's step compiled for a TPU/GPU target on
a host without the chips (see jaxserve/executor/compile_check.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml


def _buckets(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(t), int(r)) for t, r in (pair.split(":") for pair in text.split(",") if pair)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected T:R,T:R,..., got {text!r}") from None


def cmd_compile_check(args: argparse.Namespace) -> int:
    from jaxserve.config import EngineConfig
    from jaxserve.entrypoints.cli_args import engine_kwargs
    from jaxserve.executor import compile_check
    from jaxserve.executor.targets import resolve_target
    from jaxserve.models.hf_loader import read_hf_config

    model = Path(args.model)
    cfg = read_hf_config(model.parent if model.is_file() else model)
    if args.num_layers is not None:
        cfg = cfg.replace(num_layers=args.num_layers)
    preset: dict[str, Any] = yaml.safe_load(Path(args.config).read_text()) if args.config else {}
    kwargs = (preset or {}) | engine_kwargs(args) | {"model": str(model)}
    config = EngineConfig.from_kwargs(**kwargs)
    report = compile_check.check(resolve_target(args.target), cfg, config, args.buckets,
                                 args.kv_write)
    print(compile_check.format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2))
    return 1 if report.failures() else 0


def register(subparsers: Any) -> None:  # argparse._SubParsersAction
    from jaxserve.entrypoints.cli_args import add_engine_args

    p = subparsers.add_parser(
        "compile-check", help="compile the serving step for a TPU/GPU target without the chips",
        description="Build the engine's model step for every bucket over abstract weights and "
                    "compile it with the target's real compiler (libtpu for TPU topologies, "
                    "the CUDA compile-only plugin for GPU descriptions). Reports memory, KV "
                    "capacity, KV-cache copies and bytes accessed per bucket; exits 1 if any "
                    "bucket fails to compile, copies the cache, or needs temporaries over 5%% "
                    "of HBM.")
    p.add_argument("model", help="HF checkpoint directory or config.json (no weights needed)")
    p.add_argument("--target", required=True,
                   help="TPU topology (v5e:2x2, v6e:2x2, v5p:2x2x1, tpu7x:2x2x1) or a GPU "
                        "description file (GpuTargetConfigProto text)")
    p.add_argument("--config", default=None, help="engine preset YAML (configs/engine/)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="compile a shallower model of the same width")
    p.add_argument("--buckets", type=_buckets, default=None, metavar="T:R,...",
                   help="only these (tokens, requests) buckets")
    p.add_argument("--kv-write", choices=("kernel", "scatter"), default="kernel",
                   help="scatter: XLA's scatter beside the kernel (shows the copies it costs)")
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    add_engine_args(p, skip=("model",))
    p.set_defaults(func=cmd_compile_check)
