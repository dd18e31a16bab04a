"""scripts/sweep.py: one CSV row per (workload, grid point), resumable, bad grids named."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

import sweep

# Equal step shapes at every point: the compiled step is shared, the test stays fast.
GRID = {"long_prefill_token_threshold": [0, 16], "enable_prefix_caching": [True, False]}


@pytest.fixture(scope="module")
def sweep_spec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sweep")
    model = folder / "model"
    model.mkdir()
    # The batch-runner tests' model and step shapes: in one session, compiled steps are shared.
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
        "bos_token_id": 0, "eos_token_id": 1}))
    spec = {
        "engine": {"model": str(model), "load_format": "dummy", "max_model_len": 128,
                   "num_kv_blocks": 64, "block_size": 16, "max_num_batched_tokens": 64,
                   "max_num_seqs": 4,
                   "token_buckets": [16, 64], "request_buckets": [4], "precompile": False,
                   "compilation_cache_dir": str(folder / "xla")},
        "grid": GRID,
        "workloads": [{"name": "tiny", "num_requests": 5, "prompt_len": [40, 60],
                       "output_len": [2, 6], "shared_prefix": 0.8, "seed": 3}],
    }
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_sweep_writes_one_row_per_point_and_resumes(sweep_spec, tmp_path):
    out = tmp_path / "sweep.csv"
    spec = sweep.load_sweep(sweep_spec)
    workload = sweep.build_workload(spec["workloads"][0], 320)
    assert sweep.run_sweep(spec, out, log=lambda _: None) == 4

    rows = read_csv(out)
    assert list(rows[0]) == ["workload", *GRID, *sweep.METRICS]
    assert sorted((r["long_prefill_token_threshold"], r["enable_prefix_caching"]) for r in rows
                  ) == sorted((str(t), str(c)) for t in GRID["long_prefill_token_threshold"]
                              for c in GRID["enable_prefix_caching"])
    for r in rows:
        assert r["status"] == "ok" and r["workload"] == "tiny"
        assert int(r["output_tokens"]) == workload.num_output_tokens
        assert int(r["prompt_tokens"]) == sum(map(len, workload.prompts))
        assert float(r["output_throughput"]) > 0 and float(r["ttft_p99_ms"]) > 0
    hit = {r["enable_prefix_caching"]: float(r["prefix_hit_rate"]) for r in rows}
    assert hit["False"] == 0.0 and hit["True"] > 0.0  # 80% of every prompt is shared

    # A rerun has nothing to do; a lost last row (torn by a kill) is run again, once.
    before = out.read_text()
    assert sweep.run_sweep(spec, out, log=lambda _: None) == 0
    assert out.read_text() == before
    lines = before.splitlines(keepends=True)
    out.write_text("".join(lines[:-1]) + lines[-1][:10])
    assert sweep.run_sweep(spec, out, log=lambda _: None) == 1
    again = read_csv(out)
    assert len(again) == 4
    key = ("long_prefill_token_threshold", "enable_prefix_caching")
    assert [[r[k] for k in key] for r in again] == [[r[k] for k in key] for r in rows]


def test_points_needing_more_devices_are_recorded_as_skipped(sweep_spec, tmp_path):
    spec = sweep.load_sweep(sweep_spec)
    spec["grid"] = {"tensor_parallel_size": [1024]}
    out = tmp_path / "tp.csv"
    assert sweep.run_sweep(spec, out, log=lambda _: None) == 1
    (row,) = read_csv(out)
    assert row["status"].startswith("skipped: needs 1024 devices")


def test_a_csv_from_another_grid_is_refused(sweep_spec, tmp_path):
    out = tmp_path / "other.csv"
    out.write_text("workload,block_size,status\n")
    with pytest.raises(ValueError, match="columns"):
        sweep.run_sweep(sweep.load_sweep(sweep_spec), out, log=lambda _: None)


@pytest.mark.parametrize("change, match", [
    ({"grid": {"max_num_seq": [2]}}, "grid.max_num_seq"),
    ({"grid": {"max_num_seqs": []}}, "grid.max_num_seqs"),
    ({"grid": {"enable_prefix_caching": ["no"]}}, "grid.enable_prefix_caching"),
    ({"workloads": [{"name": "w", "prompt_lens": [1, 2]}]}, r"workloads\[0\].prompt_lens"),
    ({"grids": {}}, "'grids'"),
])
def test_bad_sweep_yaml_names_the_key(sweep_spec, tmp_path, change, match):
    spec = yaml.safe_load(sweep_spec.read_text()) | change
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    with pytest.raises(ValueError, match=match):
        sweep.load_sweep(path)


def test_plots_are_written_per_workload(sweep_spec, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "sweep.csv"
    cols = ["workload", "max_num_seqs", *sweep.METRICS]
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for i, seqs in enumerate((2, 4)):
            metrics = {m: 1.0 + i for m in sweep.METRICS} | {"status": "ok"}
            w.writerow(["tiny", seqs, *(metrics[m] for m in sweep.METRICS)])
    (png,) = sweep.plot(out, tmp_path / "plots")
    assert png.name == "sweep-tiny.png" and png.read_bytes()[:4] == b"\x89PNG"
