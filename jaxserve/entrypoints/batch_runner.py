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

import fcntl
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from jaxserve.engine.logprobs import top_logprobs
from jaxserve.entrypoints.batch_spec import BatchRunSpec, InputRow, RowError, read_rows

logger = logging.getLogger(__name__)


# ---- the output file ----------------------------------------------------------------------
def cut_torn_line(path: Path) -> bytes:
    """The whole lines of `path`, a torn last line (no newline: the process died in the middle
    of the write) cut off the file."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    return data[:end]


def recover_output(path: Path) -> set[str]:
    """The ids already written to `path`; a torn last line is cut off, so its row runs again."""
    if not path.exists():
        return set()
    done: set[str] = set()
    for lineno, line in enumerate(cut_torn_line(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            done.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"output {path} line {lineno} is not a result record ({e}); "
                             "refusing to append to it") from e
    return done


def open_output(path: Path) -> IO[str]:
    """The output, opened for appending and locked for this run (two runs on one output would
    each run every row); an unwritable path is a ValueError, before any engine starts."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a", encoding="utf-8")
    except OSError as e:
        raise ValueError(f"output: cannot write {path}: {e.strerror or e}") from None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ValueError(f"output: {path} is in use by another run") from None
    return f


def _append_records(f: IO[str], records: list[dict[str, Any]]) -> None:
    if not records:
        return
    f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    f.flush()
    os.fsync(f.fileno())


def _completion_record(c: Any, num_top: int) -> dict[str, Any]:  # c: CompletionOutput
    record = {"index": c.index, "text": c.text, "token_ids": c.token_ids,
              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    if c.logprobs is not None:
        record["cumulative_logprob"] = c.cumulative_logprob
        record["logprobs"] = [{"token_id": t, "logprob": entry[t].logprob,
                               "top": [list(top) for top in top_logprobs(entry, num_top)]}
                              for t, entry in zip(c.token_ids, c.logprobs)]
    return record


def result_record(row: InputRow, out: Any) -> dict[str, Any]:  # out: RequestOutput
    m = out.metrics
    return {
        "id": row.id,
        "outputs": [_completion_record(c, row.params.logprobs or 0) for c in out.outputs],
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
        return {"prompt_token_ids": tokenizer.apply_chat_template(
            row.prompt, add_generation_prompt=True)}
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

    rows, row_errors = read_rows(spec.input, spec.sampling)
    if spec.summary_output is not None:
        try:
            spec.summary_output.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"summary_output: cannot write {spec.summary_output}: "
                             f"{e.strerror or e}") from None
    with open_output(spec.output) as f:
        done = recover_output(spec.output)
        todo = [r for r in rows if r.key not in done]
        bad = _bad_rows(row_errors, done)
        start = time.perf_counter()
        engine = engine if engine is not None else build_engine(spec)
        init_s = time.perf_counter() - start
        _check_chat_support(todo, engine.tokenizer, spec)
        before = engine.stats()
        max_in_flight = spec.max_in_flight or 2 * engine.config.scheduler.max_num_seqs

        finished: list[Any] = []
        in_flight: dict[str, InputRow] = {}
        num_failed, output_tokens = len(bad), 0
        queue = iter(todo)
        bar = tqdm(total=len(todo), desc="requests", unit="req", disable=not progress)
        start = time.perf_counter()
        _append_records(f, [{"id": e.id, "error": e.message} for e in bad if e.id is not None])
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
        try:
            spec.summary_output.write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
        except OSError as e:
            raise ValueError(f"summary_output: cannot write {spec.summary_output}: "
                             f"{e.strerror or e}") from None
    return summary


def _bad_rows(errors: list[RowError], done: set[str]) -> list[RowError]:
    """The invalid rows not already recorded; those without an id are logged (the output is
    keyed by id), the others are written as error records."""
    for e in errors:
        if e.id is None:
            logger.warning("input row skipped: %s", e.message)
    return [e for e in errors if e.id is None or e.key not in done]


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
