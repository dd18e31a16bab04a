"""`jaxserve run`: resume after a crash loses and duplicates nothing; bad specs name the key."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import re

import numpy as np
import pytest
import yaml
from batch_helpers import write_tiny_model

from jaxserve.entrypoints.batch_runner import build_engine, recover_output, run_batch
from jaxserve.entrypoints.batch_spec import BatchRunSpec, load_spec
from jaxserve.entrypoints.cli.main import main as cli_main

NUM_ROWS = 10


def token_rows(n: int = NUM_ROWS, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [{"id": f"r{i}", "prompt_token_ids": rng.integers(2, 320, int(rng.integers(3, 40))
                                                             ).tolist()} for i in range(n)]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_spec(folder: Path, engine: dict[str, Any], rows: list[dict[str, Any]],
               **extra: Any) -> Path:
    spec = {"engine": engine, "input": str(write_jsonl(folder / "in.jsonl", rows)),
            "output": str(folder / "out.jsonl"),
            "sampling": {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}} | extra
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def engine(engine_args: dict[str, Any]):  # noqa: ANN201 (LLMEngine)
    return build_engine(BatchRunSpec(engine=engine_args, input=Path("-"), output=Path("-")))


# ---- resume ---------------------------------------------------------------------------------
def test_rerun_after_a_torn_last_line_loses_and_duplicates_nothing(tmp_path, engine_args,
                                                                   engine):
    spec = load_spec(write_spec(tmp_path, engine_args, token_rows()))
    full = run_batch(spec, engine, progress=False)
    assert full.num_requests == NUM_ROWS
    reference = {r["id"]: r["outputs"] for r in read_records(spec.output)}
    assert len(reference) == NUM_ROWS

    # A kill -9 in the middle of a write: 4 whole lines, then half of the fifth.
    lines = spec.output.read_text().splitlines(keepends=True)
    spec.output.write_text("".join(lines[:4]) + lines[4][:len(lines[4]) // 2])
    again = run_batch(spec, engine, progress=False)

    records = read_records(spec.output)
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted(reference), "every row exactly once"
    assert again.num_skipped == 4 and again.num_requests == NUM_ROWS - 4
    assert {r["id"]: r["outputs"] for r in records} == reference  # greedy: same tokens
    # A third run has nothing left to do and leaves the file alone.
    before = spec.output.read_bytes()
    third = run_batch(spec, engine, progress=False)
    assert third.num_requests == 0 and third.num_skipped == NUM_ROWS
    assert spec.output.read_bytes() == before


def test_a_corrupt_complete_line_is_refused_not_overwritten(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "a", "outputs": []}\nnot json\n{"id": "b", "outputs": []}\n')
    with pytest.raises(ValueError, match="line 2"):
        recover_output(out)


def test_kill_9_mid_run_then_rerun_finishes_every_row_once(tmp_path, engine_args):
    rows = token_rows(8, seed=1)
    # One row at a time and long outputs, so the kill lands between two finished rows.
    spec = write_spec(tmp_path, engine_args, rows, max_in_flight=1,
                      sampling={"temperature": 0.0, "max_tokens": 60, "ignore_eos": True})
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli.main", "run", str(spec), "--no-progress"]
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 2:
            break
        time.sleep(0.02)
    if proc.poll() is not None:
        pytest.fail(f"the run ended before it could be killed: {proc.stderr.read().decode()}")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_at_kill = len(recover_output(out))
    assert 2 <= done_at_kill < len(rows), "the kill landed mid-run"

    rerun = subprocess.run(cmd + ["--json"], env=env, capture_output=True, text=True, timeout=180)
    assert rerun.returncode == 0, rerun.stderr
    summary = json.loads(rerun.stdout)
    assert summary["num_skipped"] == done_at_kill
    assert summary["num_requests"] == len(rows) - done_at_kill
    ids = [r["id"] for r in read_records(out)]
    assert sorted(ids) == sorted(r["id"] for r in rows)
    assert all(len(r["outputs"][0]["token_ids"]) == 60 for r in read_records(out))


# ---- rows -----------------------------------------------------------------------------------
def test_per_row_sampling_overrides_apply(tmp_path, engine_args, engine):
    prompt = token_rows(1)[0]["prompt_token_ids"]
    rows = [{"id": "default", "prompt_token_ids": prompt},
            {"id": "short", "prompt_token_ids": prompt, "sampling": {"max_tokens": 2}},
            {"id": "n2", "prompt_token_ids": prompt,
             "sampling": {"n": 2, "temperature": 1.0, "seed": 5}},
            {"id": 7, "prompt_token_ids": prompt, "sampling": {"logprobs": 3}}]
    spec = load_spec(write_spec(tmp_path, engine_args, rows))
    run_batch(spec, engine, progress=False)
    got = {r["id"]: r for r in read_records(spec.output)}
    assert set(got) == {"default", "short", "n2", 7}  # ids keep their JSON type
    assert len(got["default"]["outputs"][0]["token_ids"]) == 6  # the spec's default
    assert got["short"]["outputs"][0]["token_ids"] == got["default"]["outputs"][0]["token_ids"][:2]
    assert len(got["n2"]["outputs"]) == 2
    assert "logprobs" not in got["default"]["outputs"][0]
    lps = got[7]["outputs"][0]["logprobs"]
    assert len(lps) == 6 and all(len(lp["top"]) == 3 for lp in lps)
    assert [lp["token_id"] for lp in lps] == got[7]["outputs"][0]["token_ids"]


def test_messages_rows_go_through_the_chat_template(tmp_path, engine_args, engine):
    messages = [{"role": "user", "content": "Hello robot"}]
    rows = [{"id": "chat", "messages": messages}, {"id": "text", "prompt": "Hello robot"}]
    spec = load_spec(write_spec(tmp_path, engine_args, rows))
    run_batch(spec, engine, progress=False)
    got = {r["id"]: r for r in read_records(spec.output)}
    expected = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert got["chat"]["num_prompt_tokens"] == len(expected)
    assert got["text"]["num_prompt_tokens"] == len(engine.tokenizer.encode("Hello robot"))
    assert len(expected) > got["text"]["num_prompt_tokens"]


def test_a_rejected_row_is_recorded_and_the_others_finish(tmp_path, engine_args, engine):
    rows = token_rows(3) + [{"id": "bad", "prompt_token_ids": [5, 9999]}]
    spec = load_spec(write_spec(tmp_path, engine_args, rows))
    summary = run_batch(spec, engine, progress=False)
    got = {r["id"]: r for r in read_records(spec.output)}
    assert summary.num_failed == 1 and summary.num_requests == 3
    assert "9999" in got["bad"]["error"] and "outputs" not in got["bad"]
    assert all("outputs" in got[r["id"]] for r in rows[:3])
    assert summary.output_tokens == 3 * 6
    assert summary.ttft_ms["p50"] > 0 and summary.itl_ms["p50"] >= 0


def test_summary_is_written_and_counts_tokens(tmp_path, engine_args, engine):
    spec = load_spec(write_spec(tmp_path, engine_args, token_rows(4),
                                summary_output=str(tmp_path / "summary.json")))
    summary = run_batch(spec, engine, progress=False)
    written = json.loads((tmp_path / "summary.json").read_text())
    records = read_records(spec.output)
    assert written["num_requests"] == 4
    assert written["output_tokens"] == sum(len(r["outputs"][0]["token_ids"]) for r in records)
    assert written["prompt_tokens"] == sum(r["num_prompt_tokens"] for r in records)
    assert "TTFT" in summary.format() and "preemptions" in summary.format()


# ---- bad specs and rows ---------------------------------------------------------------------
@pytest.mark.parametrize("extra, match", [
    ({"outptu": "x.jsonl"}, "'outptu'"),
    ({"engine": {"max_num_seq": 4}}, "engine.max_num_seq"),
    ({"engine": {"max_num_seqs": "four"}}, "engine.max_num_seqs"),
    ({"engine": {"enable_prefix_caching": "yes"}}, "engine.enable_prefix_caching"),
    ({"sampling": {"temprature": 0.5}}, "sampling.temprature"),
    ({"sampling": {"top_p": 1.5}}, "top_p"),
    ({"max_in_flight": 0}, "max_in_flight"),
])
def test_bad_spec_is_a_value_error_naming_the_key(tmp_path, engine_args, extra, match):
    engine = engine_args | extra.pop("engine", {})
    with pytest.raises(ValueError, match=match):
        load_spec(write_spec(tmp_path, engine, token_rows(1), **extra))


def test_engine_preset_is_merged_under_the_engine_mapping(tmp_path, engine_args):
    preset = tmp_path / "preset.yaml"
    preset.write_text(yaml.safe_dump(engine_args))
    spec_path = write_spec(tmp_path, {"max_num_seqs": 2}, token_rows(1),
                           engine_preset=str(preset))
    spec = load_spec(spec_path)
    assert spec.engine == engine_args | {"max_num_seqs": 2}
    preset.write_text(yaml.safe_dump(engine_args | {"blok_size": 16}))
    with pytest.raises(ValueError, match="blok_size"):
        load_spec(spec_path)


@pytest.mark.parametrize("row, match", [
    ({"id": "a", "prompt": "x", "temperature": 0}, "line 1: unknown key 'temperature'"),
    ({"prompt": "x"}, "line 1: 'id'"),
    ({"id": "a"}, "exactly one of"),
    ({"id": "a", "prompt": "x", "prompt_token_ids": [1]}, "exactly one of"),
    ({"id": "a", "prompt_token_ids": [1, "2"]}, "prompt_token_ids"),
    ({"id": "a", "prompt": "x", "sampling": {"max_tokns": 3}}, "sampling.max_tokns"),
    ({"id": "a", "prompt": "x", "sampling": {"max_tokens": 0}}, "max_tokens"),
])
def test_a_bad_input_row_is_reported_naming_line_and_key_and_the_others_run(
        tmp_path, engine_args, engine, row, match, caplog):
    rows = token_rows(2)
    spec = load_spec(write_spec(tmp_path, engine_args, [row] + rows))
    summary = run_batch(spec, engine, progress=False)  # one bad row used to refuse the run
    assert summary.num_requests == 2 and summary.num_failed == 1
    records = read_records(spec.output)
    assert {r["id"] for r in records if "outputs" in r} == {"r0", "r1"}
    errors = [r["error"] for r in records if "error" in r] or [caplog.text]  # no id: logged
    assert len(errors) == 1 and re.search(match, errors[0])
    assert run_batch(spec, engine, progress=False).num_requests == 0  # nothing runs twice


def test_duplicate_ids_run_once(tmp_path, engine_args, engine, caplog):
    rows = [{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"}]
    spec = load_spec(write_spec(tmp_path, engine_args, rows))
    summary = run_batch(spec, engine, progress=False)
    assert summary.num_requests == 2 and summary.num_failed == 1
    assert sorted(r["id"] for r in read_records(spec.output)) == ["a", "b"]
    assert "line 3: duplicate id 'a'" in caplog.text


def test_two_runs_on_one_output_are_refused(tmp_path, engine_args, engine):
    import fcntl

    spec = load_spec(write_spec(tmp_path, engine_args, token_rows(2)))
    with open(spec.output, "a") as held:  # what a running `jaxserve run` holds
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(ValueError, match="in use by another run"):
            run_batch(spec, engine, progress=False)
    assert run_batch(spec, engine, progress=False).num_requests == 2
    assert len(read_records(spec.output)) == 2


def test_an_unwritable_output_is_an_error_before_the_engine_starts(tmp_path, engine_args,
                                                                   capsys):
    (tmp_path / "file").write_text("")
    spec = write_spec(tmp_path, engine_args | {"model": "/no/such/model"}, token_rows(1),
                      output=str(tmp_path / "file" / "out.jsonl"))
    assert cli_main(["run", str(spec), "--no-progress"]) == 2  # not a traceback
    err = capsys.readouterr().err
    assert "output: cannot write" in err and "no/such/model" not in err


def test_messages_without_a_chat_template_fail_before_any_row_runs(tmp_path, engine_args):
    model = write_tiny_model(tmp_path / "plain", chat_template=False)
    rows = token_rows(2) + [{"id": "chat", "messages": [{"role": "user", "content": "hi"}]}]
    spec = load_spec(write_spec(tmp_path, engine_args | {"model": str(model)}, rows))
    with pytest.raises(ValueError, match="'chat'.*chat template"):
        run_batch(spec, progress=False)
    assert not spec.output.exists() or not read_records(spec.output)


def test_cli_run_prints_the_summary_and_reports_bad_specs(tmp_path, engine_args, capsys):
    spec = write_spec(tmp_path, engine_args, token_rows(2))
    assert cli_main(["run", str(spec), "--no-progress"]) == 0
    assert "requests      2 done" in capsys.readouterr().out
    assert len(read_records(tmp_path / "out.jsonl")) == 2
    bad = write_spec(tmp_path, engine_args, token_rows(2), ouput="x")
    assert cli_main(["run", str(bad)]) == 2
    assert "'ouput'" in capsys.readouterr().err
