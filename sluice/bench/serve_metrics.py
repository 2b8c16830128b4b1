"""Serving metrics from per-request client timings, and the result block `vllm bench serve` prints.

All times in a `RequestTiming` are seconds on the client's monotonic clock; every figure that is
reported is in milliseconds, as vLLM reports it. Definitions (vLLM's):

- TTFT: request sent -> first content chunk.
- ITL: the gaps between consecutive content chunks, pooled over all requests.
- TPOT: (E2E latency - TTFT) / (output tokens - 1), one value per request with > 1 output token;
  it excludes the first token, so a long prefill does not hide in it.
- E2EL: request sent -> last content chunk.
- Goodput: completed requests per second that meet every SLO given (a request with <= 1 output
  token has TPOT 0 for this purpose).
Failed requests count in `failed` and in nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SLO_NAMES = ("ttft", "tpot", "e2el")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")

# metric key -> (short name, section header), in the order vLLM prints them.
_SECTIONS: dict[str, tuple[str, str]] = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
_WIDTH = 50


@dataclass(slots=True)
class RequestTiming:
    """What the client measured for one request."""

    success: bool = False
    prompt_len: int = 0
    # completion_tokens from the server's usage; 0 when the server sent none.
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    # When the request was sent, seconds since the benchmark started.
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""


@dataclass(frozen=True, slots=True)
class MetricStats:
    """One latency metric in ms: mean, median, std and the selected percentiles."""

    mean: float
    median: float
    std: float
    percentiles: tuple[tuple[float, float], ...]  # (p, value)

    @classmethod
    def of(cls, values_s: Sequence[float], percentiles: Sequence[float]) -> MetricStats:
        # vLLM's convention: an empty list reports zeros rather than NaN.
        ms = np.asarray(values_s, dtype=np.float64) * 1000.0 if values_s else np.zeros(1)
        return cls(mean=float(np.mean(ms)), median=float(np.median(ms)), std=float(np.std(ms)),
                   percentiles=tuple((float(p), float(np.percentile(ms, p)))
                                     for p in percentiles))


@dataclass(frozen=True, slots=True)
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    ttft_ms: MetricStats
    tpot_ms: MetricStats
    itl_ms: MetricStats
    e2el_ms: MetricStats
    output_lens: tuple[int, ...]  # per request, 0 for failed ones

    def stats(self, metric: str) -> MetricStats:
        return {"ttft": self.ttft_ms, "tpot": self.tpot_ms, "itl": self.itl_ms,
                "e2el": self.e2el_ms}[metric]


def parse_goodput(pairs: Sequence[str]) -> dict[str, float]:
    """["ttft:200", "tpot:50"] -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"--goodput takes KEY:MS pairs with KEY in {list(SLO_NAMES)}, "
                             f"got {pair!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput value of {name} must be a number of ms, "
                             f"got {value!r}") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {name} must be >= 0 ms, got {slos[name]}")
    return slos


def output_len_of(timing: RequestTiming, count_tokens: Callable[[str], int] | None) -> int:
    """Output tokens: the server's usage, else the tokenizer's count, else one per chunk."""
    if timing.output_tokens:
        return timing.output_tokens
    if count_tokens is not None:
        return count_tokens(timing.generated_text)
    return len(timing.itl) + 1


def peak_output_throughput(timings: Sequence[RequestTiming]) -> tuple[float, int]:
    """(most content chunks in one 1-second bucket, peak number of requests in flight)."""
    if not timings:
        return 0.0, 0
    t0 = min(t.start_time for t in timings)
    t1 = max(t.start_time + t.latency for t in timings)
    tokens_per_s = np.zeros(int(math.ceil(t1 - t0)) + 1)
    for t in timings:
        # Chunk arrival times: the first at TTFT, each later one an ITL after the previous.
        arrivals = t.start_time + t.ttft + np.concatenate(([0.0], np.cumsum(t.itl)))
        buckets = np.clip((arrivals - t0).astype(np.int64), 0, len(tokens_per_s) - 1)
        np.add.at(tokens_per_s, buckets, 1)
    # Sweep over half-open [start, end) intervals; an end sorts before a start at the same time.
    events = sorted([(t.start_time, 1) for t in timings]
                    + [(t.start_time + t.latency, -1) for t in timings])
    in_flight = peak = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    return float(tokens_per_s.max()), peak


def compute_metrics(timings: Sequence[RequestTiming], duration_s: float,
                    percentiles: Sequence[float], goodput_slos_ms: dict[str, float] | None = None,
                    count_tokens: Callable[[str], int] | None = None) -> BenchmarkMetrics:
    if duration_s <= 0:
        raise ValueError(f"benchmark duration must be > 0 s, got {duration_s}")
    done = [t for t in timings if t.success]
    output_lens = [output_len_of(t, count_tokens) if t.success else 0 for t in timings]
    done_lens = [n for t, n in zip(timings, output_lens) if t.success]
    ttfts = [t.ttft for t in done]
    e2els = [t.latency for t in done]
    itls = [gap for t in done for gap in t.itl]
    # TPOT per request; 0.0 stands in for requests with <= 1 token when judging goodput only.
    tpot_or_zero = [(t.latency - t.ttft) / (n - 1) if n > 1 else 0.0
                    for t, n in zip(done, done_lens)]
    tpots = [v for v, n in zip(tpot_or_zero, done_lens) if n > 1]

    good = 0
    if goodput_slos_ms:
        per_metric = {"ttft": ttfts, "tpot": tpot_or_zero, "e2el": e2els}
        for i in range(len(done)):
            if all(per_metric[name][i] * 1000.0 <= slo for name, slo in goodput_slos_ms.items()):
                good += 1

    total_input = sum(t.prompt_len for t in done)
    total_output = sum(done_lens)
    peak_tok_s, peak_in_flight = peak_output_throughput(done)
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(timings) - len(done),
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(done) / duration_s,
        request_goodput=good / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        max_output_tokens_per_s=peak_tok_s,
        max_concurrent_requests=peak_in_flight,
        ttft_ms=MetricStats.of(ttfts, percentiles),
        tpot_ms=MetricStats.of(tpots, percentiles),
        itl_ms=MetricStats.of(itls, percentiles),
        e2el_ms=MetricStats.of(e2els, percentiles),
        output_lens=tuple(output_lens),
    )


def _percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def format_result_block(metrics: BenchmarkMetrics, duration_s: float, request_rate: float,
                        max_concurrency: int | None, goodput: bool,
                        percentile_metrics: Sequence[str]) -> str:
    """The block `vllm bench serve` prints, line for line in its format."""
    lines = [" Serving Benchmark Result ".center(_WIDTH, "=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", metrics.completed)
    row("Failed requests:", metrics.failed)
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency)
    if not math.isinf(request_rate):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", duration_s, ".2f")
    row("Total input tokens:", metrics.total_input)
    row("Total generated tokens:", metrics.total_output)
    row("Request throughput (req/s):", metrics.request_throughput, ".2f")
    if goodput:
        row("Request goodput (req/s):", metrics.request_goodput, ".2f")
    row("Output token throughput (tok/s):", metrics.output_throughput, ".2f")
    row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s, ".2f")
    row("Peak concurrent requests:", float(metrics.max_concurrent_requests), ".2f")
    row("Total Token throughput (tok/s):", metrics.total_token_throughput, ".2f")
    for key, (name, header) in _SECTIONS.items():
        if key not in percentile_metrics:
            continue
        stats = metrics.stats(key)
        lines.append(header.center(_WIDTH, "-"))
        row(f"Mean {name} (ms):", stats.mean, ".2f")
        row(f"Median {name} (ms):", stats.median, ".2f")
        for p, value in stats.percentiles:
            row(f"P{_percentile_word(p)} {name} (ms):", value, ".2f")
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def result_dict(metrics: BenchmarkMetrics, timings: Sequence[RequestTiming], duration_s: float,
                goodput: bool, percentile_metrics: Sequence[str]) -> dict[str, Any]:
    """The measured part of the saved JSON, with `vllm bench serve`'s keys."""
    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput if goodput else None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
    }
    for key in PERCENTILE_METRICS:
        if key not in percentile_metrics:
            continue
        stats = metrics.stats(key)
        result[f"mean_{key}_ms"] = stats.mean
        result[f"median_{key}_ms"] = stats.median
        result[f"std_{key}_ms"] = stats.std
        for p, value in stats.percentiles:
            result[f"p{_percentile_word(p)}_{key}_ms"] = value
    result.update({
        "input_lens": [t.prompt_len for t in timings],
        "output_lens": list(metrics.output_lens),
        "ttfts": [t.ttft for t in timings],
        "itls": [t.itl for t in timings],
        "latencies": [t.latency for t in timings],
        "start_times": [t.start_time for t in timings],
        "generated_texts": [t.generated_text for t in timings],
        "errors": [t.error for t in timings],
    })
    return result
