"""`jaxserve bench serve`: drives a running server with Poisson arrivals and prints vLLM's
summary; the summary's numbers are computed as vLLM defines them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.entrypoints.bench_serve import RequestResult, arrival_gaps, summarize
from jaxserve.entrypoints.cli.main import main
from server_helpers import API_KEY


def test_summary_follows_vllms_definitions():
    results = [RequestResult(True, 0.1, 0.5, [0.2, 0.2], 10, 3),
               RequestResult(True, 0.3, 0.3, [], 8, 1),
               RequestResult(False, error="HTTP 400")]
    s = summarize(results, 2.0, (50, 99))
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (
        2, 1, 18, 4)
    assert (s["request_throughput"], s["output_throughput"], s["total_token_throughput"]) == (
        1.0, 2.0, 11.0)
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_e2el_ms"] == pytest.approx(400)
    assert s["mean_tpot_ms"] == pytest.approx(200)  # (0.5 - 0.1) / (3 - 1); one token: none
    assert s["p99_itl_ms"] == pytest.approx(200) and s["p50_ttft_ms"] == pytest.approx(200)


def test_arrivals_are_poisson_at_the_rate():
    gaps = arrival_gaps(20000, 8.0, 1.0, np.random.default_rng(0))
    assert gaps.mean() == pytest.approx(1 / 8, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 8, rel=0.05)  # exponential: std == mean
    assert not arrival_gaps(5, float("inf"), 1.0, np.random.default_rng(0)).any()
    with pytest.raises(ValueError, match="request_rate"):
        arrival_gaps(5, 0.0, 1.0, np.random.default_rng(0))


def test_bench_serve_drives_a_running_server_and_prints_vllms_summary(served, tmp_path, capsys):
    path = tmp_path / "result.json"
    code = main(["bench", "serve", "--base-url", served.url, "--api-key", API_KEY,
                 "--num-prompts", "6", "--request-rate", "50", "--random-input-len", "8",
                 "--random-output-len", "4", "--metric-percentiles", "50,99",
                 "--save-result", "--result-filename", str(path)])
    out = capsys.readouterr().out
    assert code == 0
    for line in ("Serving Benchmark Result", "Successful requests:", "Mean TTFT (ms):",
                 "P99 TPOT (ms):", "Median ITL (ms):", "P50 E2EL (ms):",
                 "Request throughput (req/s):", "Output token throughput (tok/s):"):
        assert line in out, line
    result = json.loads(path.read_text())
    assert (result["completed"], result["failed"]) == (6, 0)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (48, 24)
    assert 0 < result["median_ttft_ms"] <= result["p99_ttft_ms"] <= result["p99_e2el_ms"]
    assert result["mean_tpot_ms"] > 0 and result["request_throughput"] > 0


def test_bench_serve_fails_clearly_when_the_test_request_fails(served, capsys):
    assert main(["bench", "serve", "--base-url", served.url, "--num-prompts", "2"]) == 2
    assert "/v1/models: HTTP 401" in capsys.readouterr().err  # no API key
    assert main(["bench", "serve", "--base-url", served.url, "--api-key", API_KEY,
                 "--num-prompts", "2", "--random-input-len", "1000"]) == 2
    assert "the test request failed: HTTP 400" in capsys.readouterr().err  # over the context
