"""`jaxserve serve MODEL [engine args] [server args]`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path
from typing import Any

from jaxserve.entrypoints.cli.args import add_config_arg, add_engine_args, engine_kwargs
from jaxserve.entrypoints.openai import API_KEY_ENV


def cmd_serve(args: argparse.Namespace) -> int:
    # Imported here: FastAPI and uvicorn are the [serve] extra, and slow to import.
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.engine.input_processor import NO_TOKENIZER
    from jaxserve.entrypoints.openai.api_server import run_server
    from jaxserve.models.chat_template import load_chat_template

    options = server_options(args)  # before loading anything: a bad flag fails at once
    chat_template = None if args.chat_template is None else load_chat_template(args.chat_template)
    llm = AsyncLLM(args.model, max_queued_requests=args.max_queued_requests,
                   **engine_kwargs(args, skip=("model",)))
    if llm.tokenizer is None:  # every completion and chat would be a 400
        llm.shutdown()
        raise ValueError(f"{args.model}: {NO_TOKENIZER.removeprefix('prompt: ')}; the server "
                         "needs one to read prompts")
    limits = {name: getattr(args, name) for name in ("max_body_bytes", "read_timeout_s")
              if getattr(args, name) is not None}  # else the server's defaults
    # As vLLM's server: the startup heap (imports, engine, model) marked static, so that the
    # oldest generation's collections skip it; they hold the GIL, stalling the event loop.
    # Full collections 100x rarer than Python's default: a large request's million objects
    # brought several, 0.1-0.2 s each (/health's worst during a 270k-message chat 189 -> 64-120
    # ms, 2M prompts 216 -> 75 ms: scripts/bench_health_under_load.py). Most cycles die young
    # and go with their generation's collections.
    gc.collect()
    gc.freeze()
    gc.set_threshold(700, 10, 1000)
    return run_server(llm, args.served_model_name or [args.model or "jaxserve-default"],
                      args.host, args.port,
                      api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                      log_level=args.uvicorn_log_level, open_metrics=args.open_metrics,
                      chat_template=chat_template, **limits, **options)


def server_options(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's server flags, checked: run_server's root_path, TLS files, CORS origins, chat
    response role, tool-call parser and request logging."""
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: pass both for HTTPS")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{flag}: {path} is not a file")
    origins = None
    if args.allowed_origins is not None:
        try:
            origins = json.loads(args.allowed_origins)
        except json.JSONDecodeError:
            origins = None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise ValueError(f"--allowed-origins must be a JSON list of origins (e.g. "
                             f"'[\"https://example.com\"]'), got {args.allowed_origins!r}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    if not args.response_role.strip():
        raise ValueError("--response-role must not be blank")
    return {"root_path": args.root_path, "ssl_keyfile": args.ssl_keyfile,
            "ssl_certfile": args.ssl_certfile, "allowed_origins": origins,
            "response_role": args.response_role, "tool_call_parser": args.tool_call_parser,
            "log_requests": args.enable_log_requests, "max_log_len": args.max_log_len}


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible API")
    serve.add_argument("model", nargs="?", default=None,
                       help="checkpoint path: HF dir, .gguf, llama2.c .bin, converted dir "
                       "(default: the small model shipped with jaxserve)")
    add_engine_args(serve, skip=("model",))
    add_config_arg(serve)
    g = serve.add_argument_group("server")
    g.add_argument("--chat-template", default=None,
                   help="chat template (a file, or the template itself) for every chat "
                   "request, instead of the model's")
    g.add_argument("--host", default="0.0.0.0")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                   f"(default: ${API_KEY_ENV}, which unlike this flag is not visible in ps)")
    g.add_argument("--open-metrics", action="store_true",
                   help="serve /metrics without the API key (for a scraper without it)")
    g.add_argument("--max-request-body-bytes", dest="max_body_bytes", type=int, default=None,
                   help="larger request bodies get HTTP 413 (default: 10 MiB)")
    g.add_argument("--http-read-timeout", dest="read_timeout_s", type=float, default=None,
                   help="seconds a request's headers, and then its whole body, may take "
                   "to arrive (default: 30)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model' (default: the model argument)")
    g.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests that may wait for the engine; more get HTTP 503")
    g.add_argument("--root-path", default="",
                   help="the path prefix a proxy serves the API under (ASGI root_path)")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key file")
    g.add_argument("--ssl-certfile", default=None, help="and this certificate file")
    g.add_argument("--allowed-origins", default=None,
                   help="CORS: a JSON list of the origins browsers may call from, e.g. "
                   "'[\"*\"]' (default: no CORS headers)")
    g.add_argument("--response-role", default="assistant",
                   help="the role of chat replies to a generation prompt")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's switch for tool_choice 'auto': always on here (accepted)")
    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="read 'auto' tool calls in this format only (default: Hermes "
                   "<tool_call> tags or Llama-3 JSON, whichever the reply holds)")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request's prompt and sampling parameters (INFO)")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="characters / token ids of a logged prompt (default: all)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    serve.set_defaults(func=cmd_serve)
