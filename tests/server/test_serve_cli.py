"""`jaxserve serve`: engine arguments and server arguments on one command line."""

from __future__ import annotations

import pytest

from jaxserve.entrypoints.cli import build_parser
from jaxserve.entrypoints.cli_args import engine_kwargs
from jaxserve.entrypoints.serve_cli import cmd_serve


def test_serve_parses_engine_and_server_arguments():
    args = build_parser().parse_args([
        "serve", "/models/tiny", "--max-num-seqs", "8", "--token-buckets", "16,64",
        "--port", "9001", "--api-key", "k", "--served-model-name", "a", "b",
        "--max-queued-requests", "5"])
    assert args.func is cmd_serve and args.model == "/models/tiny"
    assert (args.port, args.api_key, args.served_model_name, args.max_queued_requests) == (
        9001, "k", ["a", "b"], 5)
    assert engine_kwargs(args, skip=("model",)) == {"max_num_seqs": 8, "token_buckets": [16, 64]}


def test_serve_rejects_a_bad_queue_bound_before_loading_anything():
    args = build_parser().parse_args(["serve", "/no/such/model", "--max-queued-requests", "0"])
    with pytest.raises(ValueError, match="max_queued_requests must be a positive integer"):
        cmd_serve(args)
