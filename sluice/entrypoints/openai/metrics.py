"""Prometheus metrics for GET /metrics, with vLLM's names under a `sluice:` prefix.

`PrometheusStatsListener` is an AsyncLLM stats listener: each batch of engine outputs brings
`IterationStats` (tokens, TTFTs, inter-token latencies, finished requests) and the latest
`SchedulerStats`. Gauges take the scheduler's values as they are; the scheduler's own counters
(prefix-cache queries and hits, preemptions, speculative drafts and accepted tokens) arrive as
totals since the engine core started, so they are exported as counters by adding each increase;
the speculative acceptance rate and mean acceptance length are gauges over those totals. Each
listener has its own registry, so several servers (or tests) in one process never share a metric.

Several API-server processes (`--api-server-count`) run with PROMETHEUS_MULTIPROC_DIR set (by
their parent, before prometheus_client is imported), so every process writes its values to
files there and each one's /metrics reads them all back (prometheus_client's multiprocess
mode): the request counters and histograms are summed over the processes. The engine core's
state reaches every API server, but only API server 0 records it (`record_engine`), and its
gauges are exported as the maximum over the processes (the others leave theirs at 0), so a
scrape of any of them gives the one server's metrics.
"""

from __future__ import annotations

import os

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from sluice.engine.stats import IterationStats, SchedulerStats

__all__ = ["CONTENT_TYPE", "PrometheusStatsListener"]

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's


class PrometheusStatsListener:
    def __init__(self, model_name: str, num_speculative_tokens: int = 0,
                 kv_pool: bool = False, record_engine: bool = True) -> None:
        """`num_speculative_tokens` (k, 0 without speculation): the per-position counter shows
        positions 0..k-1 from the start (later positions appear when they first count).
        `kv_pool`: the global KV pool's metrics show from the start (else from its first
        counters). `record_engine`: record the engine core's state (False: another API server
        of several does; see the module doc)."""
        self.registry = CollectorRegistry()
        self.record_engine = record_engine
        registry, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            # multiprocess_mode: used only under PROMETHEUS_MULTIPROC_DIR (module doc)
            return Gauge(f"sluice:{name}", doc, labels, registry=registry,
                         multiprocess_mode="max").labels(model_name)

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
        self.scheduled_tokens = counter(
            "scheduled_tokens", "Tokens run through the model: prompt tokens not served from a "
            "cache (local or the KV pool), output tokens, draft tokens.")
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
        self.spec_num_drafts = counter("spec_decode_num_drafts",
                                       "Verified rows that carried at least one draft token.")
        self.spec_num_draft_tokens = counter("spec_decode_num_draft_tokens",
                                             "Draft tokens verified.")
        self.spec_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                "Draft tokens accepted.")
        self._spec_accepted_per_pos = Counter(
            "sluice:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0: the first draft).",
            ["model_name", "position"], registry=registry)
        self._model_name = model_name
        for pos in range(num_speculative_tokens):
            self._spec_accepted_per_pos.labels(model_name, str(pos))
        steps = Counter(
            "sluice:spec_decode_num_steps",
            "Scheduled steps by the drafting policy's decision: drafting on, off for the batch "
            "size (disable_by_batch_size), off for low acceptance (min_accepted_tokens_per_step).",
            ["model_name", "drafting"], registry=registry)
        self._spec_steps = {field: steps.labels(model_name, label)
                            for field, label in _SPEC_STEP_FIELDS.items()}
        self.spec_acceptance_rate = gauge("spec_decode_acceptance_rate",
                                          "Accepted / drafted tokens since the engine started.")
        self.spec_mean_acceptance_length = gauge(
            "spec_decode_mean_acceptance_length",
            "Tokens emitted per verified draft (1 + accepted drafts) since the engine started.")
        self._last_scheduler_stats = SchedulerStats()
        self._kv_pool = _KVPoolMetrics(registry, model_name) if kv_pool else None

    def __call__(self, iteration: IterationStats, scheduler_stats: SchedulerStats | None) -> None:
        if scheduler_stats is not None and self.record_engine:
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
        self.scheduled_tokens.inc(max(0, stats.num_scheduled_tokens_total
                                      - last.num_scheduled_tokens_total))
        if "pool_lookups" in stats.kv_connector or self._kv_pool is not None:
            if self._kv_pool is None:
                self._kv_pool = _KVPoolMetrics(self.registry, self._model_name)
            self._kv_pool.record(stats.kv_connector, last.kv_connector)
        self._record_spec_decode(stats, last)
        self._last_scheduler_stats = stats

    def _record_spec_decode(self, stats: SchedulerStats, last: SchedulerStats) -> None:
        self.spec_num_drafts.inc(max(0, stats.spec_num_drafts - last.spec_num_drafts))
        self.spec_num_draft_tokens.inc(max(0, stats.spec_num_draft_tokens
                                           - last.spec_num_draft_tokens))
        self.spec_num_accepted_tokens.inc(max(0, stats.spec_num_accepted_tokens
                                              - last.spec_num_accepted_tokens))
        last_per_pos = last.spec_num_accepted_tokens_per_pos
        for pos, total in enumerate(stats.spec_num_accepted_tokens_per_pos):
            before = last_per_pos[pos] if pos < len(last_per_pos) else 0
            self._spec_accepted_per_pos.labels(self._model_name, str(pos)).inc(
                max(0, total - before))
        for field, counter in self._spec_steps.items():
            counter.inc(max(0, getattr(stats, field) - getattr(last, field)))
        self.spec_acceptance_rate.set(stats.spec_acceptance_rate)
        self.spec_mean_acceptance_length.set(stats.spec_mean_acceptance_length)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (of every API-server process, under
        PROMETHEUS_MULTIPROC_DIR)."""
        directory = os.environ.get(MULTIPROC_DIR_ENV)
        if directory:
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=directory)
            return generate_latest(registry)
        return generate_latest(self.registry)


# SchedulerStats field -> the `drafting` label of sluice:spec_decode_num_steps_total.
_SPEC_STEP_FIELDS = {
    "spec_num_steps_drafting": "on",
    "spec_num_steps_off_batch_size": "off_batch_size",
    "spec_num_steps_off_acceptance": "off_acceptance",
}


# The global KV pool's counters (sluice/kv_transfer/pool): stats name -> (metric, help).
_KV_POOL_COUNTERS = {
    "pool_lookups": ("kv_pool_lookups", "Lookups of waiting requests' blocks in the KV pool."),
    "pool_lookup_blocks": ("kv_pool_lookup_blocks", "Blocks looked up in the KV pool."),
    "pool_hit_blocks": ("kv_pool_hit_blocks",
                        "Blocks found in the KV pool (the leading run of each lookup)."),
    "pool_lookup_seconds": ("kv_pool_lookup_seconds", "Time spent in KV pool lookups."),
    "pool_skipped_hits": ("kv_pool_skipped_hits",
                          "Lookups whose hit was recomputed: loading was expected slower."),
    "pool_skipped_hit_blocks": ("kv_pool_skipped_hit_blocks",
                                "Blocks found in the KV pool but recomputed (expected faster)."),
    "pool_loads": ("kv_pool_loads", "Steps that loaded blocks from the KV pool (per rank)."),
    "pool_load_blocks": ("kv_pool_load_blocks", "Blocks loaded from the KV pool."),
    "pool_load_bytes": ("kv_pool_load_bytes", "Bytes loaded from the KV pool."),
    "pool_load_seconds": ("kv_pool_load_seconds",
                          "Time from a step's load start to its last block in the cache."),
    "pool_saves": ("kv_pool_saves", "Steps whose blocks were put into the KV pool (per rank)."),
    "pool_save_blocks": ("kv_pool_save_blocks", "Blocks stored in the KV pool."),
    "pool_save_existing_blocks": ("kv_pool_save_existing_blocks",
                                  "Blocks not stored because the KV pool had them already."),
    "pool_save_bytes": ("kv_pool_save_bytes", "Bytes stored in the KV pool."),
    "pool_save_seconds": ("kv_pool_save_seconds",
                          "Time of the KV pool puts (existence check and put)."),
}


class _KVPoolMetrics:
    """`sluice:kv_pool_*`: the pool connector's cumulative counters as Prometheus counters
    (each increase added), errors by operation and kind, and whether the pool is reachable."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self.counters = {
            key: Counter(f"sluice:{name}", doc, labels, registry=registry).labels(model_name)
            for key, (name, doc) in _KV_POOL_COUNTERS.items()}
        self._errors = Counter("sluice:kv_pool_errors",
                               "KV pool errors by operation (lookup: calls; load, save: blocks) "
                               "and kind (unavailable, timeout, missing, failed, dropped; of "
                               "the missing, the values read and refused: wrong_size, corrupt, "
                               "other_format).",
                               ["model_name", "op", "kind"], registry=registry)
        self._model_name = model_name
        self.available = Gauge("sluice:kv_pool_available",
                               "1 while the scheduler reaches the KV pool, else 0.", labels,
                               registry=registry, multiprocess_mode="max").labels(model_name)
        self.outages = Counter("sluice:kv_pool_outages",
                               "Times the scheduler lost the KV pool.", labels,
                               registry=registry).labels(model_name)

    def record(self, stats: dict[str, float], last: dict[str, float]) -> None:
        for key, counter in self.counters.items():
            counter.inc(max(0.0, stats.get(key, 0.0) - last.get(key, 0.0)))
        for key, value in stats.items():
            if key.startswith("pool_errors."):
                _, op, kind = key.split(".", 2)
                self._errors.labels(self._model_name, op, kind).inc(
                    max(0.0, value - last.get(key, 0.0)))
        if "pool_available" in stats:
            self.available.set(stats["pool_available"])
        self.outages.inc(max(0.0, stats.get("pool_outages", 0.0)
                             - last.get("pool_outages", 0.0)))
