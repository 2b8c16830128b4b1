"""Prometheus metrics for GET /metrics, with vLLM's names under a `sluice:` prefix.

`PrometheusStatsListener` is an AsyncLLM stats listener: each batch of engine outputs brings
`IterationStats` (tokens, TTFTs, inter-token latencies, finished requests) and the latest
`SchedulerStats`. Gauges take the scheduler's values as they are; the scheduler's own counters
(prefix-cache queries and hits, preemptions) arrive as totals since the engine core started, so
they are exported as counters by adding each increase. Each listener has its own registry, so
several servers (or tests) in one process never share a metric.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sluice.engine.stats import IterationStats, SchedulerStats

__all__ = ["CONTENT_TYPE", "PrometheusStatsListener"]

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


class PrometheusStatsListener:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        registry, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"sluice:{name}", doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"sluice:{name}", doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"sluice:{name}", doc, labels, buckets=buckets,
                             registry=registry).labels(model_name)

        self.num_requests_running = gauge("num_requests_running",
                                          "Requests in the engine's running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting",
                                          "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc",
                                    "Fraction of KV cache blocks in use (1 = full).")
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted by the engine.")
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        success = Counter("sluice:request_success", "Finished requests, by finish reason.",
                          ["model_name", "finished_reason"], registry=registry)
        self.request_success = {reason: success.labels(model_name, reason)
                                for reason in FINISH_REASONS}
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Time to the first token.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Time between two tokens of a request.",
                                             _ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Arrival to finish of a request.", _REQUEST_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Arrival to first scheduling of a request.",
                                            _REQUEST_BUCKETS)
        self._last_scheduler_stats = SchedulerStats()

    def __call__(self, iteration: IterationStats, scheduler_stats: SchedulerStats | None) -> None:
        if scheduler_stats is not None:
            self._record_scheduler(scheduler_stats)
        self.prompt_tokens.inc(iteration.num_prompt_tokens)
        self.generation_tokens.inc(iteration.num_generation_tokens)
        for ttft in iteration.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for itl in iteration.inter_token_latencies:
            self.inter_token_latency.observe(itl)
        for finished in iteration.finished_requests:
            reason = finished.finish_reason
            if reason not in self.request_success:
                reason = "abort"
            self.request_success[reason].inc()
            self.e2e_request_latency.observe(finished.e2e_latency)
            self.request_queue_time.observe(finished.queued_time)

    def _record_scheduler(self, stats: SchedulerStats) -> None:
        last = self._last_scheduler_stats
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        # max(0, ...): totals only grow while one engine core lives.
        self.prefix_cache_queries.inc(max(0, stats.prefix_cache_queries
                                          - last.prefix_cache_queries))
        self.prefix_cache_hits.inc(max(0, stats.prefix_cache_hits - last.prefix_cache_hits))
        self.num_preemptions.inc(max(0, stats.num_preemptions_total
                                     - last.num_preemptions_total))
        self._last_scheduler_stats = stats

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
