"""The `jaxserve` command: generate, convert, serve, run, run-batch, compile, compile-check,
bench (serve, throughput, latency), chat and complete."""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from jaxserve.entrypoints.cli.args import (add_config_arg, add_engine_args, engine_kwargs,
                                           parse_with_config)

# The CLI's own defaults: greedy, 64 tokens. The checkpoint's sampling defaults
# (generation_config="auto") come over them, and the flags given over both.
_CLI_DEFAULTS = {"temperature": 0.0, "max_tokens": 64}


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling (default: greedy, 64 tokens, or the checkpoint's "
                                  "generation config)")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--max-tokens", type=int, default=None)
    g.add_argument("--sampling-seed", dest="sampling_seed", type=int, default=None,
                   help="per-request seed")
    g.add_argument("--n", type=int, default=None)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--ignore-eos", action="store_true", default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=None)
    g.add_argument("--frequency-penalty", type=float, default=None)


_SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "n", "stop",
                   "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty")


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.sampling_params import SamplingParams

    llm = LLM(args.model, **engine_kwargs(args, skip=("model",)))
    given = {name: getattr(args, name) for name in _SAMPLING_FLAGS
             if getattr(args, name) is not None}
    params = SamplingParams(**_CLI_DEFAULTS | llm.engine.sampling_defaults | given,
                            seed=args.sampling_seed)
    start = time.perf_counter()
    if args.chat:  # each prompt a user message, through the model's chat template
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params,
                           use_tqdm=False)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_tokens = 0
    for prompt, out in zip(args.prompts, outputs):
        for comp in out.outputs:
            num_tokens += len(comp.token_ids)
            print(f"{prompt}\n{comp.text}" if args.chat else f"{prompt}{comp.text}")
            print("-" * 40)
    print(f"{num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tok/s)",
          file=sys.stderr)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from jaxserve.models.checkpoint_io import save_converted
    from jaxserve.models.loader import load_model

    dst = save_converted(load_model(args.src, args.load_format), args.dst)
    print(f"wrote {dst}")
    return 0


# Other subcommands live beside their job and register themselves: module -> `register(sub)`.
SUBCOMMAND_MODULES = ("jaxserve.entrypoints.cli.serve", "jaxserve.entrypoints.cli.run",
                      "jaxserve.entrypoints.cli.compile", "jaxserve.entrypoints.cli.bench",
                      "jaxserve.entrypoints.cli.client")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"jaxserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--chat", action="store_true",
                     help="send each prompt as a user message through the chat template")
    gen.add_argument("--model", default=None, help="checkpoint: HF dir, .gguf, llama2.c .bin, "
                     "converted dir (default: the small model shipped with jaxserve)")
    add_engine_args(gen, skip=("model",))
    add_config_arg(gen)
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    conv = sub.add_parser("convert", help="convert a checkpoint to jaxserve's orbax format")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--load-format", default="auto")
    conv.set_defaults(func=cmd_convert)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxserve")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_with_config(build_parser(), argv)
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
