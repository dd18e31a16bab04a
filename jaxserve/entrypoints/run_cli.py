"""`jaxserve run SPEC.yaml`: the batch runner on the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any


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
