"""Prometheus metrics for `/metrics`: engine gauges and counters read at scrape time, and
latency histograms observed as outputs stream out (vLLM's metric names, `jaxserve:` prefix)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector(Collector):
    def __init__(self, llm: AsyncLLM, model_name: str):
        self.llm = llm
        self.labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        s = self.llm.stats()
        e = s.engine
        for name, doc, value in (
                ("num_requests_running", "Requests in the running batch.", e.num_running),
                ("num_requests_waiting", "Requests waiting in the scheduler.", e.num_waiting),
                ("num_requests_queued", "Accepted requests not running yet (server queue).",
                 s.num_queued),
                ("kv_cache_usage_perc", "Share of KV-cache blocks in use (1 = full).",
                 e.kv_cache_usage),
                ("prefix_cache_hit_rate", "Prefix-cache hits / queries, in tokens, since start.",
                 e.prefix_cache_hit_rate)):
            yield self._family(GaugeMetricFamily, name, doc, value)
        for name, doc, value in (
                ("num_preemptions", "Requests preempted (recomputed later).", e.num_preemptions),
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 e.prefix_cache_queries),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 e.prefix_cache_hits),
                ("prompt_tokens", "Prompt tokens of requests that started generating.",
                 s.num_prompt_tokens),
                ("generation_tokens", "Generated tokens.", s.num_generation_tokens),
                ("engine_steps", "Engine steps run.", s.num_steps),
                ("engine_step_seconds", "Wall time the engine thread spent in steps.",
                 s.step_seconds)):
            yield self._family(CounterMetricFamily, name, doc, value)

    def _family(self, cls: type, name: str, doc: str, value: float) -> Metric:
        family = cls(f"jaxserve:{name}", doc, labels=["model_name"])
        family.add_metric(self.labels, value)
        return family


class ServerMetrics:
    def __init__(self, llm: AsyncLLM, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(llm, model_name))

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"jaxserve:{name}", doc, ["model_name"], buckets=_LATENCY_BUCKETS,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds",
                             "Time between two outputs of one request.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.")
        self._finished = Counter("jaxserve:request_success", "Finished requests by reason.",
                                 ["model_name", "finished_reason"], registry=self.registry)
        self.model_name = model_name

    def tracker(self, n: int) -> "RequestTracker":
        return RequestTracker(self, n)

    def count_finished(self, reason: str, num_samples: int = 1) -> None:
        self._finished.labels(self.model_name, reason).inc(num_samples)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Observes one request's stream of delta outputs (engine wall times, not HTTP times);
    `close` counts the samples that never finished (the client went away) as aborted."""

    def __init__(self, metrics: ServerMetrics, n: int):
        self.metrics = metrics
        self.last_token_time: float | None = None
        self.unfinished = n

    def observe(self, out: RequestOutput) -> None:
        m = out.metrics
        if any(c.token_ids for c in out.outputs) and m.last_token_time is not None:
            if self.last_token_time is None:
                self.metrics.ttft.observe(max(0.0, m.last_token_time - m.arrival_time))
            elif m.last_token_time > self.last_token_time:
                self.metrics.itl.observe(m.last_token_time - self.last_token_time)
            self.last_token_time = m.last_token_time
        for comp in out.outputs:  # a delta carries each sample's finish_reason once
            if comp.finish_reason is not None:
                self._count(comp.finish_reason)
        if out.finished:
            end = m.finished_time or m.last_token_time
            if end is not None:
                self.metrics.e2e.observe(max(0.0, end - m.arrival_time))

    def close(self) -> None:
        if self.unfinished > 0:
            self.metrics.count_finished("abort", self.unfinished)
            self.unfinished = 0

    def _count(self, reason: str) -> None:
        self.unfinished -= 1
        self.metrics.count_finished(reason)
