"""`jaxserve bench throughput` and `jaxserve bench latency`: vLLM's printed lines, and numbers
that agree with what was run."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from jaxserve.entrypoints.cli.main import main


def _flags(engine_args: dict[str, Any]) -> list[str]:
    return [f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in engine_args.items()]


def test_bench_throughput_counts_what_it_ran(engine_args, tmp_path, capsys):
    path = tmp_path / "throughput.json"
    assert main(["bench", "throughput", *_flags(engine_args), "--num-prompts", "5",
                 "--input-len", "8", "--output-len", "4", "--output-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Throughput: ") and "requests/s" in out and "output tokens/s" in out
    record = json.loads(path.read_text())
    assert (record["num_requests"], record["total_num_tokens"]) == (5, 5 * (8 + 4))
    assert record["output_tokens_per_second"] == pytest.approx(
        20 / record["elapsed_time"])


def test_bench_latency_reports_the_runs_and_their_percentiles(engine_args, tmp_path, capsys):
    path = tmp_path / "latency.json"
    assert main(["bench", "latency", *_flags(engine_args), "--batch-size", "2",
                 "--input-len", "8", "--output-len", "3", "--num-iters-warmup", "1",
                 "--num-iters", "3", "--output-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Avg latency: " in out and "99% percentile latency: " in out
    record = json.loads(path.read_text())
    assert len(record["latencies"]) == 3
    assert record["avg_latency"] == pytest.approx(np.mean(record["latencies"]))
    values = [record["percentiles"][q] for q in ("10", "50", "99")]
    assert values == sorted(values) and min(record["latencies"]) <= values[0]
