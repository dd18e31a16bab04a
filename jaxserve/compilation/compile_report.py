"""What the compile check found, per target and bucket, and its gates: the report the CLI
prints and writes as JSON (compilation/compile_check.py fills it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

MAX_TEMP_FRACTION = 0.05  # the gate: a step's temporaries must stay under 5% of HBM
MAX_FLOOR_RATIO = 1.25  # the gate: a step's modelled time within 1.25x of its floor


@dataclass
class ScenarioCost:
    """One judged batch of a bucket: the modelled step beside its floor (bytes per device)."""
    label: str
    weights: float
    kv_read: float
    kv_write: float
    activations: float
    in_kernels: float  # of those bytes, what the Pallas kernels move
    collective_bytes: float
    collectives: int
    flops: float
    compute_seconds: float
    collective_seconds: float  # not hidden by other ops
    floor_bytes: float
    floor_flops: float
    floor_seconds: float
    sequential_floor_seconds: float  # attention and the dense matmuls taking turns

    @property
    def modelled_seconds(self) -> float:
        return self.compute_seconds + self.collective_seconds

    @property
    def ratio(self) -> float:
        return self.modelled_seconds / self.floor_seconds



@dataclass
class BucketReport:
    num_tokens: int
    num_reqs: int
    num_sample_rows: int = 0  # S: more than num_reqs in a speculative step's variant
    device_drafts: bool = False  # the drafting program (layer skip, draft model)
    compiled: bool = False
    error: str | None = None
    compile_seconds: float = 0.0
    temp_bytes: int = 0
    total_bytes: int = 0  # arguments + outputs - aliased + temporaries, per device
    cache_copies: int = 0  # copy/transpose ops of >= one layer of the KV cache, not weights
    # copy/transpose ops of a stacked weight's dims (>= 1 MiB); None: layers unrolled, unchecked
    weight_copies: int | None = None
    bytes_accessed: float | None = None  # XLA's count: loop bodies once, kernels left out
    costs: list[ScenarioCost] = field(default_factory=list)  # plain programs only
    cost_error: str | None = None  # the cost model could not read the program


@dataclass
class CompileReport:
    target: str
    device_kind: str
    hbm_bytes: int
    num_layers: int
    tensor_parallel_size: int
    dtype: str
    block_size: int
    num_blocks: int
    weight_bytes: int  # per device (the draft model's included)
    kv_bytes: int  # per device (the draft model's cache included)
    layer_kv_bytes: int  # per device: the smaller of the caches' layers, the copy gate's size
    # per device: what the engine's allocator holds (GPU: gpu_memory_utilization of it), and
    # what weights, pool and step fit in for the compiler to plan the step (GPU: XLA's 80%)
    allocator_bytes: int
    planned_bytes: int
    draft_num_layers: int = 0  # speculative draft_model: the draft's layers
    buckets: list[BucketReport] = field(default_factory=list)
    # per device: each stacked layer weight's dims and one layer's slice of it (>= 1 MiB)
    weight_dims: set[tuple[int, ...]] = field(default_factory=set, repr=False)

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def failures(self, max_temp_fraction: float = MAX_TEMP_FRACTION) -> list[str]:
        out = []
        for b in self.buckets:
            where = f"T={b.num_tokens} R={b.num_reqs} S={b.num_sample_rows}" + (
                " drafting" if b.device_drafts else "")
            if not b.compiled:
                out.append(f"{where}: {b.error}")
                continue
            if b.cost_error:
                out.append(f"{where}: {b.cost_error}")
            if b.cache_copies:
                out.append(f"{where}: {b.cache_copies} copies of the KV cache")
            if b.weight_copies:
                out.append(f"{where}: {b.weight_copies} copies of weights")
            if b.temp_bytes > max_temp_fraction * self.hbm_bytes:
                out.append(f"{where}: temporaries {b.temp_bytes / 2**30:.2f} GiB over "
                           f"{max_temp_fraction:.0%} of HBM")
            limit = min(self.allocator_bytes, self.planned_bytes)
            if b.total_bytes > limit:
                out.append(f"{where}: {b.total_bytes / 2**30:.2f} GiB over the "
                           f"{limit / 2**30:.2f} GiB the engine's allocator holds and the "
                           "compiler plans against")
            out += [f"{where} {c.label}: modelled {c.modelled_seconds * 1e3:.2f} ms is "
                    f"{c.ratio:.2f}x its floor {c.floor_seconds * 1e3:.2f} ms (gate "
                    f"{MAX_FLOOR_RATIO}x)" for c in b.costs if c.ratio > MAX_FLOOR_RATIO]
            out += [f"{where} {c.label}: modelled {c.modelled_seconds * 1e3:.2f} ms is under "
                    f"its floor {c.floor_seconds * 1e3:.2f} ms: the cost model misses what the "
                    "step moves or computes" for c in b.costs if c.ratio < 1 - 1e-9]
        return out

    def to_json(self) -> dict[str, Any]:
        out = asdict(self) | {"kv_tokens": self.kv_tokens, "failures": self.failures()}
        del out["weight_dims"]
        for bucket, report in zip(out["buckets"], self.buckets):
            for cost, scenario in zip(bucket["costs"], report.costs):
                cost |= {"modelled_seconds": scenario.modelled_seconds, "ratio": scenario.ratio}
        return out


def format_report(report: CompileReport) -> str:
    gib = 2**30
    draft = (f" + a draft model of {report.draft_num_layers} layers"
             if report.draft_num_layers else "")
    head = (f"{report.target} ({report.device_kind}, {report.hbm_bytes / gib:.1f} GiB HBM per "
            f"device), {report.num_layers} layers{draft}, TP {report.tensor_parallel_size}, "
            f"{report.dtype}: weights {report.weight_bytes / gib:.2f} GiB + KV "
            f"{report.kv_bytes / gib:.2f} GiB per device = {report.num_blocks} blocks of "
            f"{report.block_size} ({report.kv_tokens} tokens)")
    rows = ["| T | R | S | compiled | seconds | temporaries GiB | total GiB / HBM | cache copies "
            "| weight copies | GB accessed outside kernels | / weight bytes |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in report.buckets:
        rows_sampled = f"{b.num_sample_rows}{' drafting' if b.device_drafts else ''}"
        if not b.compiled:
            rows.append(f"| {b.num_tokens} | {b.num_reqs} | {rows_sampled} | no: {b.error} "
                        "| | | | | | | |")
            continue
        accessed = ("n/a", "n/a") if b.bytes_accessed is None else (
            f"{b.bytes_accessed / 1e9:.2f}", f"{b.bytes_accessed / report.weight_bytes:.2f}")
        rows.append(f"| {b.num_tokens} | {b.num_reqs} | {rows_sampled} | yes | "
                    f"{b.compile_seconds:.1f} | "
                    f"{b.temp_bytes / gib:.3f} | {b.total_bytes / gib:.2f} / "
                    f"{report.hbm_bytes / gib:.1f} | {b.cache_copies} | "
                    f"{'n/a' if b.weight_copies is None else b.weight_copies} | "
                    f"{accessed[0]} | {accessed[1]} |")
    failures = report.failures()
    verdict = "PASS" if not failures else "FAIL\n" + "\n".join(f"- {f}" for f in failures)
    return "\n".join([head, "", *rows, "", *format_costs(report), "",
                      f"compile-check: {verdict}"])


def format_costs(report: CompileReport) -> list[str]:
    """The modelled step beside its floor, per bucket and judged batch (GB and ms per device)."""
    rows = ["Modelled step per device (the HLO op by op, loops times their trip counts, "
            "kernels by their DMAs) beside its floor (weights, visible KV and logits once, or "
            f"the flops at peak); gate {MAX_FLOOR_RATIO}x:", "",
            "| T | R | batch | weights GB | KV read GB | KV write GB | activations GB | "
            "of which in kernels GB | collectives (GB sent) | TFLOP | floor ms | sequential "
            "floor ms | modelled ms (collectives exposed) | ratio |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for b in report.buckets:
        for c in b.costs:
            rows.append(
                f"| {b.num_tokens} | {b.num_reqs} | {c.label} | {c.weights / 1e9:.2f} | "
                f"{c.kv_read / 1e9:.2f} | {c.kv_write / 1e9:.3f} | {c.activations / 1e9:.2f} | "
                f"{c.in_kernels / 1e9:.2f} | {c.collectives} ({c.collective_bytes / 1e9:.2f}) "
                f"| {c.flops / 1e12:.2f} | {c.floor_seconds * 1e3:.2f} | "
                f"{c.sequential_floor_seconds * 1e3:.2f} | {c.modelled_seconds * 1e3:.2f} "
                f"({c.collective_seconds * 1e3:.2f}) | "
                f"{c.ratio:.2f} |")
    return rows
