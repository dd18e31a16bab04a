"""`jaxserve run SPEC.yaml`: a resumable batch job, JSONL in and JSONL out, with a summary.

The spec (paths are relative to the current directory):

    engine_preset: configs/engine/cpu-stories260k.yaml   # optional engine YAML
    engine: {max_num_seqs: 32}       # engine arguments, over the preset's
    input: prompts.jsonl             # rows: id + prompt | prompt_token_ids | messages
    output: results.jsonl            # one line per finished row, appended as it finishes
    sampling: {max_tokens: 64}       # default SamplingParams; a row's "sampling" overrides them
    summary_output: summary.json     # optional
    max_in_flight: 128               # optional: rows in the engine at once (2 x max_num_seqs)

A rerun skips the rows whose id is already in the output, so a crash or `kill -9` loses nothing
finished and duplicates nothing; a torn last line (a write cut by the kill) is cut off first.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any

import numpy as np
import yaml

from jaxserve.config import check_engine_args  # also imported from here by scripts/sweep.py
from jaxserve.sampling_params import SamplingParams

SPEC_KEYS = ("engine_preset", "engine", "input", "output", "sampling", "summary_output",
             "max_in_flight")
ROW_PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")
ROW_KEYS = ("id", "sampling", *ROW_PROMPT_KEYS)
SAMPLING_KEYS = tuple(f.name for f in fields(SamplingParams))


@dataclass
class BatchRunSpec:
    engine: dict[str, Any]
    input: Path
    output: Path
    sampling: dict[str, Any] = field(default_factory=dict)
    summary_output: Path | None = None
    max_in_flight: int | None = None


@dataclass
class InputRow:
    id: str | int
    prompt: str | list[int] | list[dict[str, Any]]
    kind: str  # "prompt" | "prompt_token_ids" | "messages"
    params: SamplingParams

    @property
    def key(self) -> str:
        return str(self.id)


# ---- the spec -----------------------------------------------------------------------------
def read_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"{what}: {path} is not valid YAML: {e}") from e
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"{what}: {path} must hold a mapping, got {type(data).__name__}")
    return data


def check_sampling(overrides: Any, where: str) -> SamplingParams:
    if not isinstance(overrides, dict):
        raise ValueError(f"{where} must be a mapping of sampling parameters, got {overrides!r}")
    for name in overrides:
        if name not in SAMPLING_KEYS:
            raise ValueError(f"{where}.{name}: unknown sampling parameter")
    try:
        return SamplingParams(**overrides)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def load_spec(path: str | Path) -> BatchRunSpec:
    path = Path(path)
    data = read_yaml_mapping(path, "batch spec")
    for key in data:
        if key not in SPEC_KEYS:
            raise ValueError(f"{path}: unknown key {key!r}; expected one of {list(SPEC_KEYS)}")
    for key in ("input", "output"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ValueError(f"{path}: {key!r} must name a JSONL file, got {data.get(key)!r}")
    engine: dict[str, Any] = {}
    preset = data.get("engine_preset")
    if preset is not None:
        if not isinstance(preset, str):
            raise ValueError(f"{path}: 'engine_preset' must be a path, got {preset!r}")
        engine = read_yaml_mapping(Path(preset), "engine_preset")
        check_engine_args(engine, f"engine_preset {preset}: engine")
    overrides = data.get("engine") or {}
    if not isinstance(overrides, dict):
        raise ValueError(f"{path}: 'engine' must be a mapping, got {overrides!r}")
    check_engine_args(overrides, "engine")
    engine |= overrides
    if "model" not in engine:
        raise ValueError(f"{path}: 'engine.model' is required (or an engine_preset that sets it)")
    sampling = data.get("sampling") or {}
    check_sampling(sampling, "sampling")
    in_flight = data.get("max_in_flight")
    if in_flight is not None and (not isinstance(in_flight, int) or isinstance(in_flight, bool)
                                  or in_flight < 1):
        raise ValueError(f"{path}: 'max_in_flight' must be a positive integer, got {in_flight!r}")
    summary = data.get("summary_output")
    if summary is not None and not isinstance(summary, str):
        raise ValueError(f"{path}: 'summary_output' must be a path, got {summary!r}")
    return BatchRunSpec(engine=engine, input=Path(data["input"]), output=Path(data["output"]),
                        sampling=sampling, summary_output=Path(summary) if summary else None,
                        max_in_flight=in_flight)


# ---- input rows ---------------------------------------------------------------------------
def _parse_row(obj: Any, where: str, defaults: dict[str, Any]) -> InputRow:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a row must be a JSON object")
    for key in obj:
        if key not in ROW_KEYS:
            raise ValueError(f"{where}: unknown key {key!r}; expected {list(ROW_KEYS)}")
    row_id = obj.get("id")
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)) or row_id == "":
        raise ValueError(f"{where}: 'id' must be a non-empty string or an integer, got {row_id!r}")
    kinds = [k for k in ROW_PROMPT_KEYS if k in obj]
    if len(kinds) != 1:
        raise ValueError(f"{where}: a row needs exactly one of {list(ROW_PROMPT_KEYS)}, "
                         f"got {kinds}")
    kind, prompt = kinds[0], obj[kinds[0]]
    if kind == "prompt" and not isinstance(prompt, str):
        raise ValueError(f"{where}: 'prompt' must be a string")
    if kind == "prompt_token_ids" and (not isinstance(prompt, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        raise ValueError(f"{where}: 'prompt_token_ids' must be a list of integers")
    if kind == "messages" and (not isinstance(prompt, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in prompt)):
        raise ValueError(f"{where}: 'messages' must be a list of {{role, content}} objects")
    overrides = obj.get("sampling", {})
    if not isinstance(overrides, dict):
        raise ValueError(f"{where}: 'sampling' must be a mapping, got {overrides!r}")
    return InputRow(row_id, prompt, kind, check_sampling(defaults | overrides,
                                                         f"{where}: sampling"))


def read_rows(path: Path, defaults: dict[str, Any]) -> list[InputRow]:
    """Every row of the input JSONL, validated; blank lines are skipped, ids must be unique."""
    rows: list[InputRow] = []
    seen: dict[str, int] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"input: cannot read {path}: {e}") from e
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON: {e}") from e
        row = _parse_row(obj, where, defaults)
        if row.key in seen:
            raise ValueError(f"{where}: duplicate id {row.id!r} (first on line {seen[row.key]})")
        seen[row.key] = lineno
        rows.append(row)
    return rows


# ---- the output file ----------------------------------------------------------------------
def recover_output(path: Path) -> set[str]:
    """The ids already written to `path`. A torn last line (no newline: the process died in
    the middle of the write) is cut off, so its row runs again."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    done: set[str] = set()
    for lineno, line in enumerate(data[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            done.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"output {path} line {lineno} is not a result record ({e}); "
                             "refusing to append to it") from e
    return done


def _append_records(f: IO[str], records: list[dict[str, Any]]) -> None:
    if not records:
        return
    f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    f.flush()
    os.fsync(f.fileno())


def _completion_record(c: Any) -> dict[str, Any]:  # c: CompletionOutput
    record = {"index": c.index, "text": c.text, "token_ids": c.token_ids,
              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    if c.logprobs is not None:
        record["cumulative_logprob"] = c.cumulative_logprob
        record["logprobs"] = [{"token_id": lp.token_id, "logprob": lp.logprob,
                               "top": [list(t) for t in lp.top]} for lp in c.logprobs]
    return record


def result_record(row: InputRow, out: Any) -> dict[str, Any]:  # out: RequestOutput
    m = out.metrics
    return {
        "id": row.id,
        "outputs": [_completion_record(c) for c in out.outputs],
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        "ttft_s": m.time_to_first_token,
        "e2e_s": None if m.finished_time is None else m.finished_time - m.arrival_time,
    }


# ---- the summary --------------------------------------------------------------------------
@dataclass
class BatchSummary:
    num_requests: int  # finished in this run
    num_skipped: int  # already in the output
    num_failed: int  # rejected by the engine (written with an "error")
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    engine_init_s: float
    request_throughput: float
    output_throughput: float  # output tokens/s
    total_throughput: float  # (prompt + output) tokens/s
    ttft_ms: dict[str, float]  # p50/p90/p99/mean
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    prefix_cache_hit_rate: float
    num_preemptions: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        def pct(d: dict[str, float]) -> str:
            return "  ".join(f"{k} {v:.1f}" for k, v in d.items()) if d else "n/a"

        return "\n".join([
            f"requests      {self.num_requests} done, {self.num_skipped} skipped (already in "
            f"output), {self.num_failed} failed",
            f"tokens        {self.prompt_tokens} prompt, {self.output_tokens} output",
            f"time          {self.elapsed_s:.2f} s (+ {self.engine_init_s:.2f} s engine start)",
            f"throughput    {self.request_throughput:.2f} req/s, {self.output_throughput:.1f} "
            f"output tok/s, {self.total_throughput:.1f} total tok/s",
            f"TTFT ms       {pct(self.ttft_ms)}",
            f"ITL ms        {pct(self.itl_ms)}",
            f"latency ms    {pct(self.e2e_ms)}",
            f"prefix cache  {100 * self.prefix_cache_hit_rate:.1f}% of prompt tokens hit",
            f"preemptions   {self.num_preemptions}",
        ])


def percentiles_ms(values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {}
    a = np.asarray(values_s) * 1e3
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max()), "mean": float(a.mean())}


def inter_token_latencies(outputs: list[Any]) -> list[float]:
    """Gaps between consecutive output tokens of single-sample requests (the token times of
    n > 1 samples interleave, so their gaps say nothing about one stream)."""
    gaps: list[float] = []
    for out in outputs:
        if len(out.outputs) == 1:
            gaps.extend(np.diff(out.metrics.token_times).tolist())
    return gaps


# ---- the job ------------------------------------------------------------------------------
def build_engine(spec: BatchRunSpec) -> Any:  # LLMEngine
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig.from_kwargs(**spec.engine))


def _engine_prompt(row: InputRow, tokenizer: Any) -> Any:
    if row.kind == "prompt_token_ids":
        return {"prompt_token_ids": row.prompt}
    if row.kind == "messages":
        return {"prompt_token_ids": tokenizer.apply_chat_template(row.prompt)}
    return row.prompt


def _check_chat_support(rows: list[InputRow], tokenizer: Any, spec: BatchRunSpec) -> None:
    """Fail before the run, not once per row: rejected rows count as done on a rerun."""
    first = next((r for r in rows if r.kind == "messages"), None)
    if first is None:
        return
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{spec.input}: row {first.id!r} has 'messages' but the model "
                         f"{spec.engine['model']!r} has no tokenizer with a chat template")


def run_batch(spec: BatchRunSpec, engine: Any = None, progress: bool = True) -> BatchSummary:
    """Run every row of `spec.input` not yet in `spec.output`, appending each result (flushed
    and fsynced) as it finishes. `engine`: an LLMEngine to reuse (else one is built)."""
    from tqdm.auto import tqdm

    rows = read_rows(spec.input, spec.sampling)
    spec.output.parent.mkdir(parents=True, exist_ok=True)
    done = recover_output(spec.output)
    todo = [r for r in rows if r.key not in done]
    start = time.perf_counter()
    engine = engine if engine is not None else build_engine(spec)
    init_s = time.perf_counter() - start
    _check_chat_support(todo, engine.tokenizer, spec)
    before = engine.stats()
    max_in_flight = spec.max_in_flight or 2 * engine.config.scheduler.max_num_seqs

    finished: list[Any] = []
    in_flight: dict[str, InputRow] = {}
    num_failed = output_tokens = 0
    queue = iter(todo)
    bar = tqdm(total=len(todo), desc="requests", unit="req", disable=not progress)
    start = time.perf_counter()
    with open(spec.output, "a", encoding="utf-8") as f:
        while True:
            records: list[dict[str, Any]] = []
            while len(in_flight) < max_in_flight and (row := next(queue, None)) is not None:
                try:
                    engine.add_request(row.key, _engine_prompt(row, engine.tokenizer), row.params)
                    in_flight[row.key] = row
                except ValueError as e:
                    records.append({"id": row.id, "error": str(e)})
                    num_failed += 1
                    bar.update(1)
            if not in_flight:
                _append_records(f, records)
                break
            for out in engine.step():
                if not out.finished:
                    continue
                records.append(result_record(in_flight.pop(out.request_id), out))
                finished.append(out)
                output_tokens += sum(len(c.token_ids) for c in out.outputs)
                bar.update(1)
            _append_records(f, records)
            if records:
                rate = output_tokens / max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"{rate:.1f} output tok/s", refresh=False)
    bar.close()
    elapsed = time.perf_counter() - start
    after = engine.stats()
    summary = _summarise(finished, num_failed, len(done), elapsed, init_s, before, after)
    if spec.summary_output is not None:
        spec.summary_output.parent.mkdir(parents=True, exist_ok=True)
        spec.summary_output.write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    return summary


def _summarise(outputs: list[Any], num_failed: int, num_skipped: int, elapsed: float,
               init_s: float, before: Any, after: Any) -> BatchSummary:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    ttfts = [o.metrics.time_to_first_token for o in outputs
             if o.metrics.time_to_first_token is not None]
    e2e = [o.metrics.finished_time - o.metrics.arrival_time for o in outputs
           if o.metrics.finished_time is not None]
    per_s = 1 / elapsed if elapsed > 0 else 0.0
    return BatchSummary(
        num_requests=len(outputs), num_skipped=num_skipped, num_failed=num_failed,
        prompt_tokens=prompt_tokens, output_tokens=output_tokens, elapsed_s=elapsed,
        engine_init_s=init_s, request_throughput=len(outputs) * per_s,
        output_throughput=output_tokens * per_s,
        total_throughput=(prompt_tokens + output_tokens) * per_s,
        ttft_ms=percentiles_ms(ttfts), itl_ms=percentiles_ms(inter_token_latencies(outputs)),
        e2e_ms=percentiles_ms(e2e), prefix_cache_hit_rate=hits / queries if queries else 0.0,
        num_preemptions=after.num_preemptions - before.num_preemptions)
