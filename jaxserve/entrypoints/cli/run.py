"""`jaxserve run SPEC.yaml`: the batch runner on the command line; `jaxserve run-batch -i IN -o
OUT`: OpenAI's batch-file format (vLLM's run-batch)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from jaxserve.entrypoints.cli.args import add_config_arg, add_engine_args, engine_kwargs


def cmd_run(args: argparse.Namespace) -> int:
    from jaxserve.entrypoints.batch_runner import run_batch
    from jaxserve.entrypoints.batch_spec import load_spec

    spec = load_spec(args.spec)
    changes: dict[str, Any] = {}
    if args.input is not None:
        changes["input"] = Path(args.input)
    if args.output is not None:
        changes["output"] = Path(args.output)
    if args.summary_output is not None:
        changes["summary_output"] = Path(args.summary_output)
    spec = dataclasses.replace(spec, **changes)
    summary = run_batch(spec, progress=not args.no_progress)
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))
    else:
        print(summary.format())
    print(f"results: {spec.output}", file=sys.stderr)
    return 0


def cmd_run_batch(args: argparse.Namespace) -> int:
    import asyncio

    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.entrypoints.openai.run_batch import run_batch_lines

    lines = Path(args.input_file).read_text().splitlines()
    llm = AsyncLLM(**engine_kwargs(args))
    try:
        outputs = asyncio.run(run_batch_lines(
            llm, args.served_model_name or [args.model or "jaxserve-default"], lines,
            args.max_concurrency))
    finally:
        llm.shutdown()
    Path(args.output_file).write_text("".join(json.dumps(o) + "\n" for o in outputs))
    failed = sum(o["error"] is not None for o in outputs)
    print(f"{len(outputs) - failed} of {len(outputs)} requests answered with 200; results: "
          f"{args.output_file}", file=sys.stderr)
    return 0


def register(subparsers: Any) -> None:  # argparse._SubParsersAction
    run = subparsers.add_parser(
        "run", help="run a batch job from a YAML spec (JSONL in, JSONL out, resumable)",
        description="Run every row of the spec's input JSONL that is not yet in its output "
                    "JSONL; results are appended as each request finishes.")
    run.add_argument("spec", help="batch-run YAML (engine, input, output, sampling, ...)")
    run.add_argument("--input", default=None, help="override the spec's input JSONL")
    run.add_argument("--output", default=None, help="override the spec's output JSONL")
    run.add_argument("--summary-output", default=None, help="also write the summary as JSON")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--json", action="store_true", help="print the summary as JSON")
    run.set_defaults(func=cmd_run)

    batch = subparsers.add_parser(
        "run-batch", help="answer an OpenAI batch file (JSONL of {custom_id, method, url, "
        "body}) as the server would", description="Each input line's request goes through "
        "the OpenAI server's handlers in this process; the output has one line per request, "
        "{id, custom_id, response: {status_code, request_id, body}, error}, in input order.")
    batch.add_argument("-i", "--input-file", required=True, help="batch file (JSONL)")
    batch.add_argument("-o", "--output-file", required=True, help="results (JSONL)")
    batch.add_argument("--served-model-name", nargs="+", default=None,
                       help="name(s) the lines' body.model may use (default: --model)")
    batch.add_argument("--max-concurrency", type=int, default=256,
                       help="requests in the engine at once")
    add_engine_args(batch)
    add_config_arg(batch)
    batch.set_defaults(func=cmd_run_batch)
