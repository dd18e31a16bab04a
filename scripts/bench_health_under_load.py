"""How long `/health` takes while `jaxserve serve` handles one very large request (issue 53):
3.5M stop_token_ids, a chat of 270k messages, 2M prompts, one prompt of 5M token ids; and, for
the host's own noise, none. The server runs in its own process,
as deployed (its garbage collector on); this process sends the request from a thread and asks
/health every 5 ms until the request is answered. Writes results/bench_health_under_load.md.

    python scripts/bench_health_under_load.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import httpx

from bench_common import markdown_table, write_result
from bench_serving import default_model, start_server

SERVER_ARGS = ("--max-model-len 128 --max-num-seqs 16 --max-num-batched-tokens 128 "
               "--token-buckets 128 --request-buckets 16 "
               "--compilation-cache-dir /tmp/jaxserve_bench_xla")
MESSAGE = b'{"role": "user", "content": "a"}'
BODIES = {
    "completion, 3.5M stop_token_ids": ("completions", b'{"prompt": [1, 2, 3], "max_tokens": 2, '
                                        b'"temperature": 0, "stop_token_ids": ['
                                        + b"5," * (3_500_000 - 1) + b"5]}"),
    "chat, 270k messages": ("chat/completions", b'{"max_tokens": 2, "messages": ['
                            + b", ".join([MESSAGE] * 270_000) + b"]}"),
    "completion, 2M prompts": ("completions", b'{"max_tokens": 2, "prompt": ['
                               + b"[5]," * (2_000_000 - 1) + b"[5]]}"),
    "completion, one prompt of 5M token ids": ("completions", b'{"max_tokens": 1, "prompt": ['
                                               + b"5," * (5 * 2**20 - 20) + b"5]}"),
    # The host's own noise: /health with no request in flight, for as long as one takes.
    "none (idle server, 3 s)": (None, b""),
}


def health_while(base: str, path: str | None, body: bytes) -> tuple[int | None, float, float]:
    """(the request's status, its seconds, the longest /health meanwhile)."""
    statuses: list[int | None] = []

    def send() -> None:
        if path is None:
            time.sleep(3)
            statuses.append(None)
        else:
            statuses.append(httpx.post(f"{base}/v1/{path}", content=body, timeout=300,
                                       headers={"Content-Type": "application/json"}).status_code)

    post = threading.Thread(target=send)
    worst = 0.0
    start = time.monotonic()
    post.start()
    with httpx.Client(timeout=300) as http:
        while post.is_alive():
            asked = time.monotonic()
            http.get(f"{base}/health").raise_for_status()
            worst = max(worst, time.monotonic() - asked)
            time.sleep(0.005)
    post.join()
    return statuses[0], time.monotonic() - start, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = default_model()
    proc, base = start_server(model, Path(model).stem, SERVER_ARGS)
    rows = []
    try:
        for label, (path, body) in BODIES.items():
            runs = [health_while(base, path, body) for _ in range(args.repeats)]
            worst = [w for _, _, w in runs]
            rows.append([label, f"{len(body) / 2**20:.1f}", sorted({s for s, _, _ in runs}),
                         f"{statistics.median(t for _, t, _ in runs):.2f}",
                         f"{1000 * statistics.median(worst):.0f}", f"{1000 * max(worst):.0f}"])
    finally:
        proc.terminate()
        proc.wait(30)
    body = (f"`jaxserve serve {Path(model).stem} {SERVER_ARGS}`; each request {args.repeats} "
            "times, one at a time, /health asked every 5 ms meanwhile.\n\n"
            + markdown_table(["request", "body MiB", "status", "request s (median)",
                              "worst /health ms (median)", "worst /health ms (max)"], rows))
    write_result("bench_health_under_load", "/health while one very large request is served",
                 body)


if __name__ == "__main__":
    main()
