"""Engine arguments on the command line, generated from the config dataclasses (vLLM's names)."""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import MISSING, fields
from typing import Any

from jaxserve.config import CacheConfig, ModelConfig, ParallelConfig, RunnerConfig, SchedulerConfig

_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, RunnerConfig, ParallelConfig)


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _arg_type(hint: Any) -> tuple[Any, dict[str, Any]]:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) and len(args) == 1:
        hint = args[0]
    if hint is bool:
        return _parse_bool, {"nargs": "?", "const": True}
    if typing.get_origin(hint) is list:
        return _int_list, {"metavar": "N,N,..."}
    return (hint if hint in (int, float, str) else str), {}


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group("engine arguments")
    for cls in _CONFIGS:
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.name in skip:
                continue
            conv, extra = _arg_type(hints[f.name])
            default = f.default if f.default is not MISSING else None
            group.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=conv,
                               default=argparse.SUPPRESS, help=f"default: {default}", **extra)


def engine_kwargs(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    names = {f.name for cls in _CONFIGS for f in fields(cls)} - set(skip)
    return {name: getattr(args, name) for name in names if hasattr(args, name)}
