"""Overload benchmark (issue 21, item 2): a normal request's time to first token on an idle
server, side by side with the same while a 50 MB body and 20 concurrent 1 MB prompts arrive;
how fast the 50 MB body is refused (413); /health latency during the burst; the server's RSS
before, at its peak and after.

    python scripts/bench_overload.py        # starts `jaxserve serve` on stories260K

The client runs on the same machine as the server (it builds and sends ~70 MB of bodies), so
on a 2-core box part of the slow-down measured is the client's own work.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import DEFAULT_SERVER_ARGS, REPO, default_model, start_server  # noqa: E402

NORMAL = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": True}


async def ttft(client: httpx.AsyncClient, base: str) -> float:
    start = time.perf_counter()
    async with client.stream("POST", f"{base}/v1/completions", json=NORMAL) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    raise RuntimeError("no token came back")


async def post_status(client: httpx.AsyncClient, url: str, **kwargs: object) -> tuple[int, float]:
    start = time.perf_counter()
    try:
        status = (await client.post(url, **kwargs)).status_code
    except httpx.HTTPError as exc:  # the server may close while the body is still going out
        status = -1 if not isinstance(exc, httpx.RemoteProtocolError) else 413
    return status, time.perf_counter() - start


async def watch(base: str, pid: int, stop: asyncio.Event, health: list[float],
                rss: list[int]) -> None:
    proc = psutil.Process(pid)
    async with httpx.AsyncClient(timeout=30) as client:
        while not stop.is_set():
            start = time.perf_counter()
            await client.get(f"{base}/health")
            health.append(time.perf_counter() - start)
            rss.append(proc.memory_info().rss)
            await asyncio.sleep(0.05)


async def measure(base: str, pid: int) -> dict[str, object]:
    proc = psutil.Process(pid)
    async with httpx.AsyncClient(timeout=300) as client:
        for _ in range(3):
            await ttft(client, base)  # warm up
        idle = [await ttft(client, base) for _ in range(15)]
        rss_before = proc.memory_info().rss
        big = b'{"prompt": "' + b"a" * (50 * 10**6) + b'"}'
        mb = "robot " * (10**6 // 6)
        stop, health, rss = asyncio.Event(), [], []
        watcher = asyncio.create_task(watch(base, pid, stop, health, rss))
        start = time.perf_counter()
        burst = [asyncio.create_task(post_status(
            client, f"{base}/v1/completions", content=big,
            headers={"Content-Type": "application/json"}))] + [
            asyncio.create_task(post_status(client, f"{base}/v1/completions",
                                            json={"prompt": mb, "max_tokens": 4}))
            for _ in range(20)]
        loaded = []
        while not all(t.done() for t in burst) or len(loaded) < 15:
            loaded.append(await ttft(client, base))
        results = await asyncio.gather(*burst)
        burst_s = time.perf_counter() - start
        stop.set()
        await watcher
        await asyncio.sleep(3)
        rss_after = proc.memory_info().rss
    return dict(idle=idle, loaded=loaded, big=results[0], mb=results[1:], burst_s=burst_s,
                health=health, rss_before=rss_before, rss_peak=max(rss), rss_after=rss_after)


def write_table(m: dict, out: Path) -> str:
    ms = lambda v: f"{1000 * v:.1f}"  # noqa: E731
    idle, loaded = statistics.median(m["idle"]), statistics.median(m["loaded"])
    mb_status = sorted({s for s, _ in m["mb"]})
    lines = [
        "## Overload: one 50 MB body and 20 concurrent 1 MB prompts (issue 21, item 2)", "",
        f"- {platform.node()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
        "stories260K served by `jaxserve serve` in its own process; client on the same machine",
        "",
        "| measure | idle server | during the burst |", "|---|---|---|",
        f"| normal request TTFT, median (ms) | {ms(idle)} | {ms(loaded)} "
        f"({loaded / idle:.2f}x) |",
        f"| normal request TTFT, max (ms) | {ms(max(m['idle']))} | {ms(max(m['loaded']))} |",
        f"| normal requests measured | {len(m['idle'])} | {len(m['loaded'])} |",
        f"| /health latency, median / max (ms) | | {ms(statistics.median(m['health']))} / "
        f"{ms(max(m['health']))} ({len(m['health'])} probes) |",
        f"| 50 MB body: status, time to answer (ms) | | {m['big'][0]}, {ms(m['big'][1])} |",
        f"| 1 MB prompts: statuses, slowest answer (ms) | | {mb_status}, "
        f"{ms(max(t for _, t in m['mb']))} |",
        f"| server RSS (MiB) | {m['rss_before'] / 2**20:.0f} | peak "
        f"{m['rss_peak'] / 2**20:.0f}, 3 s after {m['rss_after'] / 2**20:.0f} "
        f"({(m['rss_after'] - m['rss_before']) / m['rss_before']:+.1%}) |",
    ]
    text = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--server-args", default=DEFAULT_SERVER_ARGS)
    ap.add_argument("--out", default=str(REPO / "results" / "issue21" / "bench_overload.md"))
    args = ap.parse_args()
    model = args.model or default_model()
    proc, base = start_server(model, Path(model).stem, args.server_args)
    try:
        print(write_table(asyncio.run(measure(base, proc.pid)), Path(args.out)))
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
