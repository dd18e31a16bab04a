"""`jaxserve chat` and `jaxserve complete`: talk to a running server from the terminal, as
`vllm chat` / `vllm complete` do. Each line read is one turn (chat keeps the conversation) or
one prompt; the reply streams to stdout. `-q MESSAGE` sends one and exits."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from typing import Any


def _client(args: argparse.Namespace) -> Any:  # httpx.Client
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=None)


def _model_name(client: Any, args: argparse.Namespace) -> str:
    if args.model_name:
        return args.model_name
    resp = client.get("/models")
    if resp.status_code != 200:
        raise ValueError(f"GET {args.url}/models: HTTP {resp.status_code}: {resp.text}")
    return resp.json()["data"][0]["id"]


def stream_text(client: Any, path: str, body: dict[str, Any]) -> Iterator[str]:
    """The text deltas of one streamed request; an HTTP error is a ValueError with the
    server's message."""
    with client.stream("POST", path, json={**body, "stream": True}) as resp:
        if resp.status_code != 200:
            raise ValueError(f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')}")
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise ValueError(chunk["error"].get("message", str(chunk["error"])))
            for choice in chunk.get("choices", []):
                text = choice.get("text") if "text" in choice else (
                    choice.get("delta") or {}).get("content")
                if text:
                    yield text


def _turns(args: argparse.Namespace) -> Iterator[str]:
    if args.quick is not None:
        yield args.quick
        return
    while True:
        if sys.stdin.isatty():
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        yield line.rstrip("\n")


def _print_reply(parts: Iterator[str]) -> str:
    text = ""
    for part in parts:
        text += part
        print(part, end="", flush=True)
    print()
    return text


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in (("max_tokens", args.max_tokens),
                              ("temperature", args.temperature)) if v is not None}


def cmd_chat(args: argparse.Namespace) -> int:
    return _reaching(args, _chat)


def cmd_complete(args: argparse.Namespace) -> int:
    return _reaching(args, _complete)


def _reaching(args: argparse.Namespace, talk: Any) -> int:
    import httpx

    try:
        with _client(args) as client:
            talk(client, args)
    except httpx.TransportError as exc:
        raise ValueError(f"cannot reach the server at {args.url}: {exc}") from None
    return 0


def _chat(client: Any, args: argparse.Namespace) -> None:
    model = _model_name(client, args)
    messages = [] if args.system_prompt is None else [
        {"role": "system", "content": args.system_prompt}]
    for turn in _turns(args):
        messages.append({"role": "user", "content": turn})
        reply = _print_reply(stream_text(client, "/chat/completions", {
            "model": model, "messages": messages, **_sampling(args)}))
        messages.append({"role": "assistant", "content": reply})


def _complete(client: Any, args: argparse.Namespace) -> None:
    model = _model_name(client, args)
    for prompt in _turns(args):
        _print_reply(stream_text(client, "/completions", {
            "model": model, "prompt": prompt, **_sampling(args)}))


def register(subparsers: argparse._SubParsersAction) -> None:
    for name, func, what in (("chat", cmd_chat, "chat with a running server"),
                             ("complete", cmd_complete, "complete prompts on a running server")):
        p = subparsers.add_parser(name, help=f"{what} (as `vllm {name}`)")
        p.add_argument("--url", default="http://localhost:8000/v1",
                       help="the server's OpenAI API base")
        p.add_argument("--model-name", default=None,
                       help="served model name (default: the first of /models)")
        p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                       help="sent as a bearer token (default: $OPENAI_API_KEY)")
        p.add_argument("-q", "--quick", default=None, metavar="MESSAGE",
                       help="send this one message, print the reply, exit")
        p.add_argument("--max-tokens", type=int, default=None,
                       help="most tokens per reply (default: the server's)")
        p.add_argument("--temperature", type=float, default=None,
                       help="sampling temperature (default: the server's)")
        if name == "chat":
            p.add_argument("--system-prompt", default=None, help="the conversation's system "
                           "message")
        p.set_defaults(func=func)
