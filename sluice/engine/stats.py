"""Engine statistics for metrics and logs, with no knowledge of Prometheus.

Two kinds: `SchedulerStats`, a snapshot the engine core sends with every step (gauges and
cumulative counters of the scheduler and the KV cache), and per-request timings kept by the front
end (`RequestStatsTracker`). Each batch of engine-core outputs becomes one `IterationStats`
(tokens counted, TTFT and inter-token latencies observed, requests finished), handed with the
latest `SchedulerStats` to every listener added with `add_listener`. A Prometheus exporter is one
such listener; `StatsLogger` (a line in the "sluice" log every few seconds while busy) is another.

All times are `time.time()` seconds; the front end stamps token times when it receives them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

logger = logging.getLogger("sluice")


class SchedulerStats(msgspec.Struct, frozen=True):
    """The scheduler and KV cache after one engine-core step. Counters are cumulative since the
    engine core started; `num_blocks` counts the usable blocks (the null block left out), so
    an idle engine has `num_free_blocks == num_blocks`."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of the usable blocks in use
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions_total: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 0
    # The most blocks in use at once, and held by one request, since the start; blocks freed
    # behind a sliding window while their requests ran (sluice.core.kv_cache_manager).
    peak_blocks_in_use: int = 0
    peak_blocks_per_request: int = 0
    num_window_freed_blocks: int = 0
    # Speculative decoding (all zero / empty when it is off), cumulative like
    # sluice.core.outputs.SpecDecodingStats: verified rows with >= 1 draft, draft tokens
    # verified, of those accepted, and [k] accepted drafts at each draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # Scheduled steps by the drafting policy's decision: drafting on, off for the batch size,
    # off for low acceptance (sluice/spec_decode/policy.py).
    spec_num_steps_drafting: int = 0
    spec_num_steps_off_batch_size: int = 0
    spec_num_steps_off_acceptance: int = 0
    # Tokens run through the model (prompt tokens not served from a cache, outputs, drafts).
    num_scheduled_tokens_total: int = 0
    # The KV connector's cumulative counters (KVConnectorScheduler.get_stats), if one is on;
    # the global pool's are named pool_* (sluice/kv_transfer/pool/connector.py).
    kv_connector: dict[str, float] = msgspec.field(default_factory=dict)

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries

    @property
    def kv_pool_hit_rate(self) -> float:
        """Blocks found in the global KV pool / blocks looked up there (0 before a lookup)."""
        stats = self.kv_connector
        asked = stats.get("pool_lookup_blocks", 0.0)
        return stats.get("pool_hit_blocks", 0.0) / asked if asked else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / drafted tokens since the engine core started (0 before any draft)."""
        return spec_acceptance_rate(self.spec_num_draft_tokens, self.spec_num_accepted_tokens)

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens emitted per verified draft since the engine core started: 1 (the target's
        own token) + accepted drafts (0 before any draft)."""
        return spec_mean_acceptance_length(self.spec_num_drafts, self.spec_num_accepted_tokens)


def spec_acceptance_rate(num_draft_tokens: int, num_accepted_tokens: int) -> float:
    return num_accepted_tokens / num_draft_tokens if num_draft_tokens else 0.0


def spec_mean_acceptance_length(num_drafts: int, num_accepted_tokens: int) -> float:
    return 1 + num_accepted_tokens / num_drafts if num_drafts else 0.0


@dataclass(slots=True)
class RequestTimings:
    """One front-end request (all `n` samples together) as it goes."""

    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int | None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(slots=True, frozen=True)
class FinishedRequestStats:
    request_id: str
    finish_reason: str  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    max_tokens: int | None
    e2e_latency: float  # arrival -> finished
    queued_time: float  # arrival -> first scheduled (0 if never scheduled)
    prefill_time: float  # first scheduled -> first token
    decode_time: float  # first token -> finished
    inference_time: float  # first scheduled -> finished
    # Decode time per output token after the first (0 with fewer than two tokens).
    mean_time_per_output_token: float


@dataclass(slots=True)
class IterationStats:
    """What one batch of engine-core outputs brought to the front end."""

    timestamp: float
    num_prompt_tokens: int = 0  # prompts of requests whose first token came in this batch
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


# Called on the event loop after each batch of outputs, and after aborts from the front end
# (then with SchedulerStats None). Keep it quick: it runs on the output path.
StatsListener = Callable[[IterationStats, SchedulerStats | None], None]


class RequestStatsTracker:
    """Per-request timings in the front end, turned into `IterationStats` for the listeners."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestTimings] = {}
        self._listeners: list[StatsListener] = []

    def add_listener(self, listener: StatsListener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: StatsListener) -> None:
        self._listeners.remove(listener)

    def add_request(self, request_id: str, arrival_time: float, num_prompt_tokens: int,
                    max_tokens: int | None) -> None:
        self.requests[request_id] = RequestTimings(arrival_time, num_prompt_tokens, max_tokens)

    def observe_tokens(self, iteration: IterationStats, request_id: str, num_new_tokens: int,
                       first_scheduled_time: float | None, num_cached_tokens: int) -> None:
        """One request got `num_new_tokens` (over all its samples) in this batch."""
        timings = self.requests.get(request_id)
        if timings is None:
            return
        if timings.first_scheduled_time is None:
            timings.first_scheduled_time = first_scheduled_time
        timings.num_cached_tokens = num_cached_tokens
        if num_new_tokens == 0:
            return
        now = iteration.timestamp
        if timings.first_token_time is None:
            timings.first_token_time = now
            iteration.time_to_first_tokens.append(now - timings.arrival_time)
            iteration.num_prompt_tokens += timings.num_prompt_tokens
        elif timings.last_token_time is not None and now > timings.last_token_time:
            iteration.inter_token_latencies.append(now - timings.last_token_time)
        timings.last_token_time = now
        timings.num_generation_tokens += num_new_tokens
        iteration.num_generation_tokens += num_new_tokens

    def finish_request(self, iteration: IterationStats, request_id: str,
                       finish_reason: str) -> None:
        timings = self.requests.pop(request_id, None)
        if timings is None:
            return
        now = iteration.timestamp
        timings.finished_time = now
        scheduled = timings.first_scheduled_time
        first_token = timings.first_token_time
        decode_time = now - first_token if first_token is not None else 0.0
        iteration.finished_requests.append(FinishedRequestStats(
            request_id=request_id,
            finish_reason=finish_reason,
            num_prompt_tokens=timings.num_prompt_tokens,
            num_generation_tokens=timings.num_generation_tokens,
            num_cached_tokens=timings.num_cached_tokens,
            max_tokens=timings.max_tokens,
            e2e_latency=now - timings.arrival_time,
            queued_time=scheduled - timings.arrival_time if scheduled is not None else 0.0,
            prefill_time=(first_token - scheduled
                          if first_token is not None and scheduled is not None else 0.0),
            decode_time=decode_time,
            inference_time=now - scheduled if scheduled is not None else 0.0,
            mean_time_per_output_token=(decode_time / (timings.num_generation_tokens - 1)
                                        if timings.num_generation_tokens > 1 else 0.0),
        ))

    def record(self, iteration: IterationStats, scheduler_stats: SchedulerStats | None) -> None:
        """Hand one batch to every listener. A failing listener is logged, never raised: the
        output path must not break over a metrics bug."""
        for listener in list(self._listeners):
            try:
                listener(iteration, scheduler_stats)
            except Exception:
                logger.exception("stats listener %r failed", listener)


class StatsLogger:
    """A stats listener that logs throughput and scheduler state every `interval_s` seconds,
    and only while there is something to report. With speculative decoding, the line ends with
    the acceptance rate and mean acceptance length of the drafts verified in the interval."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self._last_log_time = time.monotonic()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._scheduler_stats: SchedulerStats | None = None
        self._logged_stats = SchedulerStats()  # the cumulative counters at the last log

    def __call__(self, iteration: IterationStats, scheduler_stats: SchedulerStats | None) -> None:
        self._num_prompt_tokens += iteration.num_prompt_tokens
        self._num_generation_tokens += iteration.num_generation_tokens
        if scheduler_stats is not None:
            self._scheduler_stats = scheduler_stats
        now = time.monotonic()
        if now - self._last_log_time >= self.interval_s:
            self.log(now)

    def log(self, now: float | None = None) -> str | None:
        """Log and reset the interval; returns the line (None when idle and nothing happened)."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._last_log_time, 1e-9)
        stats = self._scheduler_stats or SchedulerStats()
        busy = stats.num_running or stats.num_waiting
        line = None
        if busy or self._num_prompt_tokens or self._num_generation_tokens:
            line = (f"Engine: prompt throughput {self._num_prompt_tokens / elapsed:.1f} tok/s, "
                    f"generation throughput {self._num_generation_tokens / elapsed:.1f} tok/s, "
                    f"running {stats.num_running} reqs, waiting {stats.num_waiting} reqs, "
                    f"KV cache usage {100 * stats.kv_cache_usage:.1f}%, "
                    f"prefix cache hit rate {100 * stats.prefix_cache_hit_rate:.1f}%")
            line += self._kv_pool_text(stats)
            line += self._spec_decode_text(stats)
            logger.info(line)
        self._logged_stats = stats
        self._last_log_time = now
        self._num_prompt_tokens = self._num_generation_tokens = 0
        return line

    def _kv_pool_text(self, stats: SchedulerStats) -> str:
        """", KV pool hit rate X%" over the interval's lookups; empty without any."""
        now, last = stats.kv_connector, self._logged_stats.kv_connector
        asked = now.get("pool_lookup_blocks", 0.0) - last.get("pool_lookup_blocks", 0.0)
        if asked <= 0:
            return ""
        found = now.get("pool_hit_blocks", 0.0) - last.get("pool_hit_blocks", 0.0)
        return f", KV pool hit rate {100 * found / asked:.1f}%"

    def _spec_decode_text(self, stats: SchedulerStats) -> str:
        """", spec decode acceptance rate X%, mean acceptance length Y" over the interval;
        empty when no draft was verified in it."""
        last = self._logged_stats
        num_drafts = stats.spec_num_drafts - last.spec_num_drafts
        if num_drafts <= 0:
            return ""
        num_accepted = stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens
        rate = spec_acceptance_rate(stats.spec_num_draft_tokens - last.spec_num_draft_tokens,
                                    num_accepted)
        length = spec_mean_acceptance_length(num_drafts, num_accepted)
        return (f", spec decode acceptance rate {100 * rate:.1f}%, "
                f"mean acceptance length {length:.2f}")
