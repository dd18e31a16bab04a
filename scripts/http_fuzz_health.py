"""The full HTTP fuzz of issue 21: schemathesis over every operation (200 valid and 200 invalid
examples per operation by default, integers unbounded) against `jaxserve serve`, while another
process (the fuzzer's own work must not delay it) probes /health every 50 ms. Writes the
counts and the /health latencies as a table.

    python scripts/http_fuzz_health.py [--examples 200]

The CI test (tests/server/test_http_fuzz.py) runs the same fuzz with 10 examples.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "tests" / "server"))
from bench_serving import REPO, default_model, start_server  # noqa: E402
from test_http_fuzz import fuzz_operations  # noqa: E402

SERVER_ARGS = ("--max-model-len 128 --max-num-seqs 16 --max-num-batched-tokens 128 "
               "--token-buckets 128 --request-buckets 16 "
               "--compilation-cache-dir /tmp/jaxserve_bench_xla")
KEY = "fuzz-key"


def probe(base: str, stop: "multiprocessing.synchronize.Event",
          results: "multiprocessing.Queue") -> None:
    latencies: list[float] = []
    failures: list[str] = []
    with httpx.Client(timeout=10) as client:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                status = client.get(f"{base}/health").status_code
                if status != 200:
                    failures.append(f"/health answered {status}")
            except httpx.HTTPError as exc:
                failures.append(f"/health: {exc!r}")
            latencies.append(time.perf_counter() - start)
            time.sleep(0.05)
    results.put((latencies, failures))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--out", default=str(REPO / "results" / "issue21" / "http_fuzz.md"))
    args = ap.parse_args()
    os.environ["JAXSERVE_API_KEY"] = KEY
    model = default_model()
    proc, base = start_server(model, Path(model).stem, SERVER_ARGS)
    stop, results = multiprocessing.Event(), multiprocessing.Queue()
    prober = multiprocessing.Process(target=probe, args=(base, stop, results), daemon=True)
    prober.start()
    start = time.perf_counter()
    error = ""
    try:
        counts = fuzz_operations(base, {"Authorization": f"Bearer {KEY}"}, args.examples)
    except BaseException as exc:  # noqa: BLE001 (reported in the table)
        counts, error = {}, f"{type(exc).__name__}: {str(exc)[:2000]}"
    finally:
        elapsed = time.perf_counter() - start
        stop.set()
        latencies, failures = results.get(timeout=60)
        prober.join(30)
        alive = proc.poll() is None
        proc.terminate()
        proc.wait(30)
    lines = [f"## HTTP fuzz: schemathesis, {args.examples} examples per operation and mode "
             "(issue 21)", "",
             f"- {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, {elapsed:.0f} s; "
             f"model {Path(model).name}; checks: not_a_server_error, status_code_conformance, "
             "content_type_conformance, response_headers_conformance, "
             "response_schema_conformance", "",
             "| operation, mode | examples run |", "|---|---|"]
    lines += [f"| {label} | {n} |" for label, n in counts.items()]
    lines += ["", f"- failing checks: {error or 'none'}",
              f"- /health: {len(latencies)} probes, median "
              f"{1000 * statistics.median(latencies):.1f} ms, max {1000 * max(latencies):.1f} ms, "
              f"over 100 ms: {sum(t > 0.1 for t in latencies)}; failed probes: "
              f"{len(failures)}{' (' + failures[0] + ')' if failures else ''}",
             f"- server still up at the end: {alive}"]
    text = "\n".join(lines) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0 if not error and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
