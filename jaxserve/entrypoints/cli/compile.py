"""`jaxserve compile-check MODEL --target T`: the engine's step compiled for a TPU/GPU target on a
host without the chips (jaxserve/compilation/compile_check.py); `jaxserve compile MODEL --out DIR`:
every program the engine needs, built ahead of time (jaxserve/compilation/aot.py)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml


def _buckets(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(t), int(r)) for t, r in (pair.split(":") for pair in text.split(",") if pair)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected T:R,T:R,..., got {text!r}") from None


def _tiles(text: str) -> dict[str, int]:
    try:
        return {key: int(value) for key, value in (pair.split("=") for pair in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=N,NAME=N,..., got {text!r}") from None


def _model_path(args: argparse.Namespace) -> Path:
    model = Path(args.model)
    return model.parent if model.name == "config.json" else model


def _engine_config(args: argparse.Namespace) -> Any:
    """The engine config: the preset's arguments, then the command line's."""
    from jaxserve.config import EngineConfig
    from jaxserve.entrypoints.cli.args import engine_kwargs

    preset = yaml.safe_load(Path(args.config).read_text()) if args.config else None
    kwargs = (preset or {}) | engine_kwargs(args, skip=("model",)) | {
        "model": str(_model_path(args))}
    return EngineConfig.from_kwargs(**kwargs)


def _model_config(args: argparse.Namespace) -> Any:
    """The model's config, no weights read (an HF directory or a GGUF)."""
    from jaxserve.models.loader import read_model_config

    cfg = read_model_config(_model_path(args))
    return cfg if args.num_layers is None else cfg.replace(num_layers=args.num_layers)


def cmd_compile_check(args: argparse.Namespace) -> int:
    from jaxserve.compilation import compile_check
    from jaxserve.compilation.compile_report import format_report
    from jaxserve.placement.targets import resolve_target

    cfg, config = _model_config(args), _engine_config(args)
    report = compile_check.check(resolve_target(args.target), cfg, config, args.buckets,
                                 args.kv_write, args.dump_hlo, args.attention_tiles)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2))
    return 1 if report.failures() else 0


def cmd_compile(args: argparse.Namespace) -> int:
    from jaxserve.compilation import aot
    from jaxserve.placement.targets import resolve_target
    from jaxserve.runtime.compiled_dir import read_manifest

    config = _engine_config(args)
    start = time.perf_counter()
    if args.target is None:
        if args.num_layers is not None:
            raise ValueError("--num-layers is for deviceless targets; the host build loads the "
                             "checkpoint as it is")
        out, n = aot.build_on_host(config, args.out)
    else:
        out, n = aot.build_for_target(resolve_target(args.target), _model_config(args), config,
                                      args.out)
    left = read_manifest(out)["left_for_the_device"]
    print(f"wrote {n} programs to {out} in {time.perf_counter() - start:.1f} s; serve with "
          f"--compiled-dir {out}", file=sys.stderr)
    if left:
        print(f"{len(left)} programs need the device to compile and are left to the engine's "
              f"warm-up: {left[0]['kind']}: {left[0]['why']}", file=sys.stderr)
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    from jaxserve.entrypoints.cli.args import add_engine_args

    p.add_argument("model", help="checkpoint: an HF directory or its config.json, or a GGUF "
                                 "(compile-check and deviceless targets read no weights); the "
                                 "host build takes any the engine loads")
    p.add_argument("--config", default=None, help="engine preset YAML (configs/engine/)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="a shallower model of the same width (deviceless targets only)")
    add_engine_args(p, skip=("model",))


def register(subparsers: Any) -> None:  # argparse._SubParsersAction
    target_help = ("TPU topology (v5e:2x2, v6e:2x2, v5p:2x2x1, tpu7x:2x2x1) or a GPU "
                   "description file (GpuTargetConfigProto text)")
    p = subparsers.add_parser(
        "compile-check", help="compile the serving step for a TPU/GPU target without the chips",
        description="Build the engine's model step for every bucket over abstract weights and "
                    "compile it with the target's real compiler (libtpu for TPU topologies, "
                    "the CUDA compile-only plugin for GPU descriptions). Reports memory, KV "
                    "capacity and KV-cache copies per bucket, and the step's time on the chip "
                    "modelled from the compiled program (bytes by kind, flops, collectives) "
                    "beside its floor, for decode and mixed batches; exits 1 if any bucket "
                    "fails to compile, copies the cache, needs temporaries over 5%% of HBM or "
                    "more memory than the engine plans into, or is modelled over 1.25x its "
                    "floor.")
    _common(p)
    p.add_argument("--target", required=True, help=target_help)
    p.add_argument("--buckets", type=_buckets, default=None, metavar="T:R,...",
                   help="only these (tokens, requests) buckets")
    p.add_argument("--kv-write", choices=("kernel", "scatter"), default="kernel",
                   help="scatter: XLA's scatter beside the kernel (shows the copies it costs)")
    p.add_argument("--attention-tiles", type=_tiles, default=None, metavar="NAME=N,...",
                   help="the attention kernel's tile arguments instead of its defaults, to see "
                        "what another tiling costs (e.g. num_queries_per_block=16 on GPU, "
                        "sub_rows=128,num_kv_pages_per_block=2 on TPU)")
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    p.add_argument("--dump-hlo", default=None, metavar="DIR",
                   help="write each bucket's compiled HLO text here (T<t>_R<r>_S<s>.hlo)")
    p.set_defaults(func=cmd_compile_check)

    c = subparsers.add_parser(
        "compile", help="build every program the engine needs ahead of time",
        description="Compile the model step for every bucket and the sampler's variants, and "
                    "save them with a fingerprint of what they depend on. An engine started "
                    "with --compiled-dir DIR loads them and compiles nothing.")
    _common(c)
    c.add_argument("--out", required=True, help="directory to write")
    c.add_argument("--target", default=None,
                   help=f"build deviceless for this target: {target_help}; default: this host")
    c.set_defaults(func=cmd_compile)
