"""The batch runner's spec (YAML) and input rows (JSONL), validated; see batch_runner.py."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

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


@dataclass
class RowError:
    """An input row that cannot run; `id` is None when the row has no usable id (it is
    reported but not written: the output is keyed by id)."""
    id: str | int | None
    message: str

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
def _row_id(obj: Any, where: str) -> str | int:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a row must be a JSON object")
    row_id = obj.get("id")
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)) or row_id == "":
        raise ValueError(f"{where}: 'id' must be a non-empty string or an integer, got {row_id!r}")
    return row_id


def _parse_row(obj: dict[str, Any], row_id: str | int, where: str,
               defaults: dict[str, Any]) -> InputRow:
    for key in obj:
        if key not in ROW_KEYS:
            raise ValueError(f"{where}: unknown key {key!r}; expected {list(ROW_KEYS)}")
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


def read_rows(path: Path, defaults: dict[str, Any]) -> tuple[list[InputRow], list[RowError]]:
    """The input JSONL's valid rows, and what is wrong with the others (one bad row does not
    stop the rest); blank lines are skipped, ids must be unique."""
    rows: list[InputRow] = []
    errors: list[RowError] = []
    seen: dict[str, int] = {}
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"input: cannot read {path}: {e}") from e
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        row_id = None
        try:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON: {e}") from e
            row_id = _row_id(obj, where)
            if str(row_id) in seen:
                first, row_id = seen[str(row_id)], None  # the first one keeps the id
                raise ValueError(f"{where}: duplicate id {obj['id']!r} (first on line {first})")
            seen[str(row_id)] = lineno
            rows.append(_parse_row(obj, row_id, where, defaults))
        except ValueError as e:
            errors.append(RowError(row_id, str(e)))
    return rows, errors
