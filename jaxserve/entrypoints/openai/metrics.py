"""Prometheus metrics for `/metrics`: engine gauges and counters read at scrape time, and
latency histograms observed as outputs stream out.

The series vLLM has are served twice: as `vllm:*` (what vLLM's dashboards read) and as
`jaxserve:*` (what scripts/bench_serving.py and existing dashboards read); the series vLLM
lacks (queue depth, hit rate, step counts and times) only as `jaxserve:*`."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxserve.core.scheduler_output import SpecDecodingStats
from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.engine.metrics_reader import ENGINE_COUNTERS, ENGINE_GAUGES
from jaxserve.outputs import RequestOutput

PREFIXES = ("vllm", "jaxserve")
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector(Collector):
    def __init__(self, llm: AsyncLLM, model_name: str):
        self.llm = llm
        self.labels = [model_name]

    def collect(self) -> Iterator[Metric]:
        s = self.llm.stats()
        e = s.engine
        shared_gauges = [(name, doc, value(e)) for name, doc, value in ENGINE_GAUGES]
        shared_counters = [(name, doc, value(e)) for name, doc, value in ENGINE_COUNTERS] + [
            ("prompt_tokens", "Prompt tokens of requests that started generating.",
             s.num_prompt_tokens),
            ("generation_tokens", "Generated tokens.", s.num_generation_tokens)]
        for prefix in PREFIXES:
            for name, doc, value in shared_gauges:
                yield self._family(GaugeMetricFamily, prefix, name, doc, value)
            for name, doc, value in shared_counters:
                yield self._family(CounterMetricFamily, prefix, name, doc, value)
        if e.spec_decoding is not None:
            yield from self._spec_decoding(e.spec_decoding)
        for name, doc, value in (
                ("num_requests_queued", "Accepted requests not running yet (server queue).",
                 s.num_queued),
                ("prefix_cache_hit_rate", "Prefix-cache hits / queries, in tokens, since start.",
                 e.prefix_cache_hit_rate)):
            yield self._family(GaugeMetricFamily, "jaxserve", name, doc, value)
        for name, doc, value in (
                ("engine_steps", "Engine steps run.", s.num_steps),
                ("engine_step_seconds", "Wall time the engine thread spent in steps.",
                 s.step_seconds)):
            yield self._family(CounterMetricFamily, "jaxserve", name, doc, value)

    def _spec_decoding(self, spec: SpecDecodingStats) -> Iterator[Metric]:
        for prefix in PREFIXES:
            for name, doc, value in (
                    ("spec_decode_num_drafts", "Request-steps that verified drafts.",
                     spec.num_drafts),
                    ("spec_decode_num_draft_tokens", "Draft tokens proposed.",
                     spec.num_draft_tokens),
                    ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                     spec.num_accepted_tokens)):
                yield self._family(CounterMetricFamily, prefix, name, doc, value)
            family = CounterMetricFamily(f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted, by position in the draft.",
                                         labels=["model_name", "position"])
            for pos, value in enumerate(spec.num_accepted_tokens_per_pos):
                family.add_metric([*self.labels, str(pos)], value)
            yield family

    def _family(self, cls: type, prefix: str, name: str, doc: str, value: float) -> Metric:
        family = cls(f"{prefix}:{name}", doc, labels=["model_name"])
        family.add_metric(self.labels, value)
        return family


class _Histograms:
    """One latency histogram under each prefix, observed together."""

    def __init__(self, registry: CollectorRegistry, model_name: str, name: str, doc: str):
        self.series = [Histogram(f"{prefix}:{name}", doc, ["model_name"],
                                 buckets=_LATENCY_BUCKETS, registry=registry).labels(model_name)
                       for prefix in PREFIXES]

    def observe(self, seconds: float) -> None:
        for series in self.series:
            series.observe(seconds)


class ServerMetrics:
    def __init__(self, llm: AsyncLLM, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(llm, model_name))

        def histograms(name: str, doc: str) -> _Histograms:
            return _Histograms(self.registry, model_name, name, doc)

        self.ttft = histograms("time_to_first_token_seconds", "Time to first token.")
        self.itl = histograms("inter_token_latency_seconds",
                              "Time between two outputs of one request.")
        self.e2e = histograms("e2e_request_latency_seconds", "Arrival to last token.")
        self._finished = [Counter(f"{prefix}:request_success", "Finished requests by reason.",
                                  ["model_name", "finished_reason"], registry=self.registry)
                          for prefix in PREFIXES]
        self.model_name = model_name

    def tracker(self, n: int) -> "RequestTracker":
        return RequestTracker(self, n)

    def count_finished(self, reason: str, num_samples: int = 1) -> None:
        for counter in self._finished:
            counter.labels(self.model_name, reason).inc(num_samples)

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
