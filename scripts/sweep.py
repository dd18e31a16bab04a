"""Throughput sweep: a grid over engine settings x workloads, one CSV row per point (+ PNG plots).

    python scripts/sweep.py configs/sweeps/cpu-dummy-30m.yaml --csv results/sweep.csv [--plots DIR]

The sweep YAML:

    engine: {model: configs/models/dummy-30m, load_format: dummy, ...}   # fixed engine args
    engine_preset: configs/engine/cpu-dummy-30m.yaml                    # optional, under engine
    grid:                        # engine args -> values; every combination is one point
      max_num_seqs: [16, 64]
      enable_prefix_caching: [true, false]
    workloads:
      - {name: mixed, num_requests: 32, prompt_len: [16, 256], output_len: [16, 256],
         shared_prefix: 0.0, seed: 0}

Resumable: points already in the CSV (same workload and grid values) are skipped, and each row
is appended and flushed as soon as its point finishes. A point needing more devices than there
are (tensor_parallel_size x data_parallel_size_local) is recorded as skipped.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import Workload, make_workload, pct_ms, run_engine  # noqa: E402

WORKLOAD_KEYS = ("name", "num_requests", "prompt_len", "output_len", "shared_prefix", "seed")
SWEEP_KEYS = ("engine", "engine_preset", "grid", "workloads")
METRICS = ("status", "num_requests", "prompt_tokens", "output_tokens", "elapsed_s",
           "request_throughput", "output_throughput", "total_throughput", "ttft_p50_ms",
           "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "prefix_hit_rate",
           "num_preemptions", "num_steps", "num_compilations", "warm_up_s")


def load_sweep(path: str | Path) -> dict[str, Any]:
    from jaxserve.entrypoints.batch_spec import read_yaml_mapping, check_engine_args

    data = read_yaml_mapping(Path(path), "sweep")
    for key in data:
        if key not in SWEEP_KEYS:
            raise ValueError(f"{path}: unknown key {key!r}; expected one of {list(SWEEP_KEYS)}")
    engine: dict[str, Any] = {}
    if data.get("engine_preset"):
        engine = read_yaml_mapping(Path(data["engine_preset"]), "engine_preset")
        check_engine_args(engine, f"engine_preset {data['engine_preset']}: engine")
    check_engine_args(data.get("engine") or {}, "engine")
    engine |= data.get("engine") or {}
    grid = data.get("grid") or {}
    if not isinstance(grid, dict):
        raise ValueError(f"{path}: 'grid' must map engine arguments to lists of values")
    for name, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"grid.{name} must be a non-empty list, got {values!r}")
        for v in values:
            check_engine_args({name: v}, "grid")
    workloads = data.get("workloads") or []
    if not workloads:
        raise ValueError(f"{path}: 'workloads' must list at least one workload")
    for i, w in enumerate(workloads):
        if not isinstance(w, dict) or "name" not in w:
            raise ValueError(f"workloads[{i}] must be a mapping with a 'name'")
        for key in w:
            if key not in WORKLOAD_KEYS:
                raise ValueError(f"workloads[{i}].{key}: unknown workload key; expected "
                                 f"{list(WORKLOAD_KEYS)}")
    return {"engine": engine, "grid": grid, "workloads": workloads}


def grid_points(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    names = list(grid)
    return [dict(zip(names, values)) for values in itertools.product(*grid.values())]


def build_workload(spec: dict[str, Any], vocab_size: int) -> Workload:
    return make_workload(spec["name"], int(spec.get("num_requests", 16)),
                         tuple(spec.get("prompt_len", (16, 256))),
                         tuple(spec.get("output_len", (16, 256))), vocab_size,
                         int(spec.get("seed", 0)), float(spec.get("shared_prefix", 0.0)))


def point_engine_args(base: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    """Base + point; explicit bucket lists are clipped to (and extended up to) the point's
    max_num_batched_tokens / max_num_seqs, so a grid over those stays valid."""
    args = base | point
    for buckets, limit in (("token_buckets", "max_num_batched_tokens"),
                           ("request_buckets", "max_num_seqs")):
        if args.get(buckets) and limit in args and buckets not in point:
            args[buckets] = [b for b in args[buckets] if b < args[limit]] + [args[limit]]
    return args


def point_key(workload: str, point: dict[str, Any]) -> tuple[str, ...]:
    return (workload, *(str(v) for v in point.values()))


def read_done(csv_path: Path, columns: list[str]) -> set[tuple[str, ...]]:
    """Keys of the points in the CSV; a torn last row (killed mid-write) is cut off."""
    if not csv_path.exists() or csv_path.stat().st_size == 0:
        return set()
    from jaxserve.entrypoints.batch_runner import cut_torn_line

    cut_torn_line(csv_path)
    with open(csv_path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header != columns:
            raise ValueError(f"{csv_path}: its columns {header} are not this sweep's {columns}; "
                             "use another --csv")
        key_len = columns.index("status")  # workload + grid values
        return {tuple(row[:key_len]) for row in reader if len(row) == len(columns)}


def run_point(engine_args: dict[str, Any], workload_spec: dict[str, Any]) -> dict[str, Any]:
    import jax

    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import LLMEngine

    devices = (engine_args.get("tensor_parallel_size", 1)
               * engine_args.get("data_parallel_size_local", 1))
    if devices > jax.device_count():
        return {"status": f"skipped: needs {devices} devices, have {jax.device_count()}"}
    engine = LLMEngine(EngineConfig.from_kwargs(**({"precompile": True} | engine_args)))
    w = build_workload(workload_spec, engine.core.model_config.vocab_size)
    r = run_engine(engine, w)
    return {"status": "ok", "num_requests": len(w.prompts), "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens, "elapsed_s": r.elapsed_s,
            "request_throughput": len(w.prompts) / r.elapsed_s,
            "output_throughput": r.output_throughput, "total_throughput": r.total_throughput,
            "ttft_p50_ms": pct_ms(r.ttft_s, 50), "ttft_p99_ms": pct_ms(r.ttft_s, 99),
            "itl_p50_ms": pct_ms(r.itl_s, 50), "itl_p99_ms": pct_ms(r.itl_s, 99),
            "e2e_p50_ms": pct_ms(r.e2e_s, 50), "prefix_hit_rate": r.prefix_hit_rate,
            "num_preemptions": r.num_preemptions, "num_steps": r.num_steps,
            "num_compilations": r.num_compilations,
            "warm_up_s": engine.stats().warm_up_seconds}


def run_sweep(sweep: dict[str, Any], csv_path: Path, log: Any = print) -> int:
    """Runs every point not yet in `csv_path`; returns how many it ran."""
    points = grid_points(sweep["grid"])
    columns = ["workload", *sweep["grid"], *METRICS]
    done = read_done(csv_path, columns)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    new_file = not csv_path.exists() or csv_path.stat().st_size == 0
    ran = 0
    with open(csv_path, "a", newline="") as f:
        writer = csv.writer(f)
        if new_file:
            writer.writerow(columns)
            f.flush()
        for w in sweep["workloads"]:
            for point in points:
                key = point_key(w["name"], point)
                if key in done:
                    continue
                log(f"[{w['name']}] {point}")
                result = run_point(point_engine_args(sweep["engine"], point), w)
                writer.writerow([w["name"], *point.values(),
                                 *(_fmt(result.get(m, "")) for m in METRICS)])
                f.flush()
                ran += 1
    return ran


def _fmt(v: Any) -> Any:
    return f"{v:.6g}" if isinstance(v, float) else v


def plot(csv_path: Path, out_dir: Path) -> list[Path]:
    """Per workload: output tok/s of every point (bars), and tok/s against p99 TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["status"] == "ok"]
    if not rows:
        return []
    grid_cols = list(rows[0])[1:list(rows[0]).index("status")]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for workload in sorted({r["workload"] for r in rows}):
        sel = [r for r in rows if r["workload"] == workload]
        labels = [f"#{i} " + ", ".join(f"{c}={r[c]}" for c in grid_cols)
                  for i, r in enumerate(sel)]
        tput = [float(r["output_throughput"]) for r in sel]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, max(4.0, 0.35 * len(sel) + 1.5)),
                                       gridspec_kw={"width_ratios": [3, 2]})
        ax1.barh(range(len(sel)), tput)
        ax1.set_yticks(range(len(sel)), labels, fontsize=7)
        ax1.invert_yaxis()
        ax1.set_xlabel("output tokens/s")
        ax1.set_title(f"{workload}: throughput per grid point")
        ax2.scatter([float(r["ttft_p99_ms"]) for r in sel], tput)
        for i, r in enumerate(sel):
            ax2.annotate(f"#{i}", (float(r["ttft_p99_ms"]), tput[i]), fontsize=8)
        ax2.set_xlabel("p99 TTFT (ms)")
        ax2.set_ylabel("output tokens/s")
        ax2.set_title("throughput vs p99 TTFT")
        fig.tight_layout()
        path = out_dir / f"sweep-{workload}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweep", help="sweep YAML (engine, grid, workloads)")
    p.add_argument("--csv", default="results/sweep.csv")
    p.add_argument("--plots", default=None, help="folder for PNG plots (default: beside the CSV)")
    args = p.parse_args(argv)
    csv_path = Path(args.csv)
    try:
        ran = run_sweep(load_sweep(args.sweep), csv_path)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"ran {ran} new points; {csv_path}")
    for path in plot(csv_path, Path(args.plots) if args.plots else csv_path.parent):
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
