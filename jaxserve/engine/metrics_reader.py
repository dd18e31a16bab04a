"""The engine's metric series under vLLM's names, for `LLM.get_metrics()` (vLLM's
`vllm.v1.metrics.reader` objects) and the server's `/metrics`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jaxserve.engine.stats import EngineStats


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


# (name without prefix, help, value): the series vLLM also has, read from EngineStats.
ENGINE_GAUGES: tuple[tuple[str, str, Callable[[EngineStats], float]], ...] = (
    ("num_requests_running", "Requests in the running batch.", lambda e: e.num_running),
    ("num_requests_waiting", "Requests waiting in the scheduler.", lambda e: e.num_waiting),
    ("kv_cache_usage_perc", "Share of KV-cache blocks in use (1 = full).",
     lambda e: e.kv_cache_usage))
ENGINE_COUNTERS: tuple[tuple[str, str, Callable[[EngineStats], int]], ...] = (
    ("num_preemptions", "Requests preempted (recomputed later).", lambda e: e.num_preemptions),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     lambda e: e.prefix_cache_queries),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
     lambda e: e.prefix_cache_hits))


def engine_metrics(stats: EngineStats, labels: dict[str, str]) -> list[Metric]:
    """vLLM-named gauges and counters (counters end in `_total`, as Prometheus shows them)."""
    gauges: list[Metric] = [Gauge(f"vllm:{name}", dict(labels), value(stats))
                            for name, _, value in ENGINE_GAUGES]
    return gauges + [Counter(f"vllm:{name}_total", dict(labels), value(stats))
                     for name, _, value in ENGINE_COUNTERS]
