"""`jaxserve bench serve | throughput | latency`, as `vllm bench`."""

from __future__ import annotations

import argparse

from jaxserve.entrypoints.bench_offline import add_offline_parsers
from jaxserve.entrypoints.bench_serve import add_serve_parser


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks, as `vllm bench`")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    add_serve_parser(kinds)
    add_offline_parsers(kinds)
