"""`sluice bench serve` without a server: metrics from synthetic timings (values computed by
hand), the printed block and JSON keys, the arrival schedule's statistics, the datasets' lengths."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sluice.bench.datasets import length_range, sample_random, sample_shared_prefix
from sluice.bench.serve import arrival_times, command_line, config_from_args
from sluice.bench.serve_metrics import (
    RequestTiming,
    compute_metrics,
    format_result_block,
    parse_goodput,
    peak_output_throughput,
    result_dict,
)

pytestmark = pytest.mark.one_worker

# A: 4 tokens, TTFT 100 ms, ITLs 20/30/50 ms, E2E 200 ms -> TPOT (200-100)/3 = 33.33 ms.
# B: 1 token, TTFT = E2E = 300 ms -> no TPOT (needs > 1 token), no ITL.
# C: failed; its prompt and timings must count nowhere.
A = RequestTiming(success=True, prompt_len=10, output_tokens=4, ttft=0.1, itl=[0.02, 0.03, 0.05],
                  latency=0.2, start_time=0.0, generated_text="abcd")
B = RequestTiming(success=True, prompt_len=20, output_tokens=1, ttft=0.3, latency=0.3,
                  start_time=0.15, generated_text="e")
C = RequestTiming(success=False, prompt_len=99, ttft=5.0, latency=9.0, error="HTTP 500: boom")


def test_metrics_match_hand_computed_values_and_exclude_failed_requests() -> None:
    m = compute_metrics([A, B, C], duration_s=2.0, percentiles=[50, 99])
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input, m.total_output) == (30, 5)
    assert m.output_lens == (4, 1, 0)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(2.5)
    assert m.total_token_throughput == pytest.approx(17.5)
    # TTFT over A and B only: [100, 300] ms; numpy's linear percentile: 100 + 0.99 * 200.
    assert m.ttft_ms.mean == pytest.approx(200.0)
    assert m.ttft_ms.median == pytest.approx(200.0)
    assert m.ttft_ms.std == pytest.approx(100.0)
    assert [p for p, _ in m.ttft_ms.percentiles] == [50, 99]
    assert [v for _, v in m.ttft_ms.percentiles] == pytest.approx([200.0, 298.0])
    # TPOT excludes the first token and requests with a single token.
    assert m.tpot_ms.mean == pytest.approx(100.0 / 3)
    assert m.tpot_ms.percentiles[1][1] == pytest.approx(100.0 / 3)
    # ITL pools the gaps of all requests: [20, 30, 50]; p99 = 30 + 0.98 * 20.
    assert m.itl_ms.mean == pytest.approx(100.0 / 3)
    assert m.itl_ms.median == pytest.approx(30.0)
    assert m.itl_ms.percentiles[1][1] == pytest.approx(49.6)
    assert m.e2el_ms.mean == pytest.approx(250.0)
    # Chunks of A at 0.10, 0.12, 0.15, 0.20 s and of B at 0.45 s: 5 in the first second;
    # A [0, 0.2) and B [0.15, 0.45) overlap.
    assert m.max_output_tokens_per_s == 5.0
    assert m.max_concurrent_requests == 2
    assert m.request_goodput == 0.0


@pytest.mark.parametrize(("slos", "num_good"), [
    ({"ttft": 250}, 1),                         # A only
    ({"ttft": 250, "tpot": 30}, 0),             # A's TPOT 33.3 ms misses
    ({"ttft": 400, "tpot": 40, "e2el": 250}, 1),  # B's E2E 300 ms misses
    ({"ttft": 400, "tpot": 0}, 1),              # B has one token: TPOT 0 meets any SLO
    ({"ttft": 1000, "tpot": 1000, "e2el": 1000}, 2),
])
def test_goodput_counts_only_requests_meeting_every_slo(slos: dict[str, float],
                                                        num_good: int) -> None:
    m = compute_metrics([A, B, C], duration_s=4.0, percentiles=[99], goodput_slos_ms=slos)
    assert m.request_goodput == pytest.approx(num_good / 4.0)


def test_output_tokens_fall_back_to_the_tokenizer_then_to_chunk_count() -> None:
    no_usage = RequestTiming(success=True, prompt_len=3, ttft=0.1, itl=[0.1, 0.1], latency=0.3,
                             generated_text="one two three four five")
    counted = compute_metrics([no_usage], 1.0, [99], count_tokens=lambda t: len(t.split()))
    assert counted.total_output == 5
    # TPOT uses the counted tokens: (0.3 - 0.1) / (5 - 1) = 50 ms.
    assert counted.tpot_ms.mean == pytest.approx(50.0)
    assert compute_metrics([no_usage], 1.0, [99]).total_output == 3


def test_peak_concurrency_treats_intervals_as_half_open() -> None:
    first = RequestTiming(success=True, ttft=0.5, latency=1.0, start_time=0.0)
    second = RequestTiming(success=True, ttft=0.5, itl=[1.0], latency=1.5, start_time=1.0)
    # Chunks at 0.5 s, 1.5 s and 2.5 s: one per second; the second starts as the first ends.
    assert peak_output_throughput([first, second]) == (1.0, 1)


def test_no_successful_request_reports_zeros() -> None:
    m = compute_metrics([C], 1.0, [99])
    assert (m.completed, m.failed, m.total_output, m.ttft_ms.mean) == (0, 1, 0, 0.0)
    with pytest.raises(ValueError, match="duration"):
        compute_metrics([A], 0.0, [99])


def test_parse_goodput_accepts_vllm_pairs_and_names_bad_ones() -> None:
    assert parse_goodput(["ttft:200", "tpot:50.5", "e2el:3000"]) == {
        "ttft": 200.0, "tpot": 50.5, "e2el": 3000.0}
    for bad, word in [("itl:5", "itl:5"), ("ttft=5", "ttft=5"), ("ttft:x", "'x'"),
                      ("tpot:-1", "-1")]:
        with pytest.raises(ValueError, match=word):
            parse_goodput([bad])


def test_result_block_has_vllm_layout() -> None:
    m = compute_metrics([A, B, C], 2.0, [99], goodput_slos_ms={"ttft": 250})
    block = format_result_block(m, 2.0, request_rate=4.0, max_concurrency=8, goodput=True,
                                percentile_metrics=["ttft", "tpot", "itl"]).splitlines()
    assert block[0] == "============ Serving Benchmark Result ============"
    assert block[-1] == "=" * 50
    assert block[1] == f"{'Successful requests:':<40} {'2':<10}"
    assert block[2] == "Failed requests:                         1         "
    labels = [line[:40].rstrip() for line in block[1:-1] if not line.startswith("-")]
    assert labels[:13] == [
        "Successful requests:", "Failed requests:", "Maximum request concurrency:",
        "Request rate configured (RPS):", "Benchmark duration (s):", "Total input tokens:",
        "Total generated tokens:", "Request throughput (req/s):", "Request goodput (req/s):",
        "Output token throughput (tok/s):", "Peak output token throughput (tok/s):",
        "Peak concurrent requests:", "Total Token throughput (tok/s):"]
    assert "Request goodput (req/s):                 0.50      " in block
    assert "---------------Time to First Token----------------" in block
    assert "-----Time per Output Token (excl. 1st token)------" in block
    assert "---------------Inter-token Latency----------------" in block
    assert "P99 TTFT (ms):                           298.00    " in block
    assert "Median ITL (ms):                         30.00     " in block
    assert not any("E2EL" in line for line in block)

    plain = format_result_block(m, 2.0, request_rate=float("inf"), max_concurrency=None,
                                goodput=False, percentile_metrics=["e2el"]).splitlines()
    assert not any(line.startswith(("Maximum request", "Request rate", "Request goodput"))
                   for line in plain)
    assert "----------------End-to-end Latency----------------" in plain
    assert "Mean E2EL (ms):                          250.00    " in plain
    assert not any("TTFT" in line for line in plain)


def test_result_json_has_vllm_keys() -> None:
    m = compute_metrics([A, B, C], 2.0, [50, 99.9])
    result = result_dict(m, [A, B, C], 2.0, goodput=False, percentile_metrics=["ttft", "itl"])
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p99.9_ttft_ms",
                "mean_itl_ms", "input_lens", "output_lens", "ttfts", "itls", "generated_texts",
                "errors", "max_output_tokens_per_s"):
        assert key in result, key
    assert "mean_tpot_ms" not in result and result["request_goodput"] is None
    assert result["output_lens"] == [4, 1, 0]
    assert result["errors"] == ["", "", "HTTP 500: boom"]
    assert result["itls"][0] == [0.02, 0.03, 0.05]


def _intervals(offsets: np.ndarray) -> np.ndarray:
    return np.diff(np.concatenate(([0.0], offsets)))


def test_poisson_arrivals_have_the_configured_mean_and_exponential_spread() -> None:
    offsets = arrival_times(20000, request_rate=5.0, burstiness=1.0,
                            rng=np.random.default_rng(0))
    gaps = _intervals(offsets)
    assert np.all(gaps >= 0) and gaps[0] > 0
    assert offsets[-1] == pytest.approx(20000 / 5.0)
    assert gaps.mean() == pytest.approx(0.2, rel=1e-9)
    # Exponential intervals: std == mean (coefficient of variation 1), P(gap < mean) = 1 - 1/e.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)
    assert np.mean(gaps < 0.2) == pytest.approx(1 - np.exp(-1), abs=0.02)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_sets_the_spread_of_gamma_arrivals(burstiness: float) -> None:
    gaps = _intervals(arrival_times(20000, 10.0, burstiness, np.random.default_rng(1)))
    assert gaps.mean() == pytest.approx(0.1, rel=1e-9)
    # gamma(k, 1/(rate k)): coefficient of variation 1/sqrt(k): 2 when bursty, 0.5 when smooth.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.06)


def test_arrival_edge_cases_and_seeding() -> None:
    rng = np.random.default_rng(0)
    assert np.array_equal(arrival_times(4, float("inf"), 1.0, rng), np.zeros(4))
    assert np.allclose(arrival_times(4, 2.0, float("inf"), rng), [0.5, 1.0, 1.5, 2.0])
    same = [arrival_times(50, 3.0, 1.0, np.random.default_rng(7)) for _ in range(2)]
    assert np.array_equal(same[0], same[1])
    assert not np.array_equal(same[0], arrival_times(50, 3.0, 1.0, np.random.default_rng(8)))
    with pytest.raises(ValueError, match="request-rate"):
        arrival_times(3, 0.0, 1.0, rng)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3, 1.0, -1.0, rng)


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tiny byte-level BPE tokenizer, and a copy that prepends a BOS like Llama's."""
    from tokenizers import Tokenizer, processors

    from sluice.model.tiny import build_tokenizer

    plain = tmp_path_factory.mktemp("tok")
    build_tokenizer(str(plain))
    bos = tmp_path_factory.mktemp("tok-bos")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(plain / name, bos / name)
    tok = Tokenizer.from_file(str(bos / "tokenizer.json"))
    bos_id = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos_id)])
    tok.save(str(bos / "tokenizer.json"))
    return {"plain": str(plain), "bos": str(bos)}


def _load(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("kind", ["plain", "bos"])
def test_random_prompts_tokenize_to_their_length(tokenizer_dirs: dict[str, str],
                                                 kind: str) -> None:
    tok = _load(tokenizer_dirs[kind])
    exact = sample_random(30, 32, 8, 0.0, np.random.default_rng(0), tok)
    assert [len(tok.encode(r.prompt)) for r in exact] == [32] * 30
    assert all(r.prompt_len == 32 and r.expected_output_len == 8 for r in exact)
    assert len({r.prompt for r in exact}) == 30

    banded = sample_random(60, 40, 8, 0.25, np.random.default_rng(1), tok)
    lens = [len(tok.encode(r.prompt)) for r in banded]
    assert lens == [r.prompt_len for r in banded]
    assert min(lens) >= 30 and max(lens) <= 50 and len(set(lens)) > 5
    outs = [r.expected_output_len for r in banded]
    assert min(outs) >= 6 and max(outs) <= 10 and len(set(outs)) > 1


def test_random_dataset_is_fixed_by_the_seed(tokenizer_dirs: dict[str, str]) -> None:
    tok = _load(tokenizer_dirs["plain"])
    runs = [sample_random(5, 16, 4, 0.5, np.random.default_rng(3), tok) for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0] != sample_random(5, 16, 4, 0.5, np.random.default_rng(4), tok)


def test_shared_prefix_prompts_share_their_group_prefix_in_tokens(
        tokenizer_dirs: dict[str, str]) -> None:
    tok = _load(tokenizer_dirs["plain"])
    requests = sample_shared_prefix(12, num_groups=3, prefix_len=48, suffix_len=16, output_len=4,
                                    range_ratio=0.0, rng=np.random.default_rng(0), tokenizer=tok)
    ids = [tok.encode(r.prompt) for r in requests]
    assert [len(i) for i in ids] == [64] * 12 == [r.prompt_len for r in requests]
    groups: dict[tuple[int, ...], int] = {}
    for token_ids in ids:
        groups[tuple(token_ids[:48])] = groups.get(tuple(token_ids[:48]), 0) + 1
    assert sorted(groups.values()) == [4, 4, 4]
    # Each request names its group: the same group, the same prefix.
    prefix_of = {r.group: tuple(i[:48]) for r, i in zip(requests, ids)}
    assert sorted(prefix_of) == [0, 1, 2] and len(set(prefix_of.values())) == 3
    assert all(prefix_of[r.group] == tuple(i[:48]) for r, i in zip(requests, ids))
    assert len({tuple(i[48:]) for i in ids}) == 12
    # Shuffled: the groups do not come in blocks of four.
    order = [list(groups).index(tuple(i[:48])) for i in ids]
    assert order != sorted(order)


def test_dataset_arguments_are_validated(tokenizer_dirs: dict[str, str]) -> None:
    rng = np.random.default_rng(0)
    assert length_range(100, 0.1) == (90, 110)
    assert length_range(1, 0.9) == (1, 2)
    with pytest.raises(ValueError, match=r"range-ratio must be in \[0, 1\), got 1.0"):
        sample_random(4, 10, 4, 1.0, rng)
    with pytest.raises(ValueError, match="shared-prefix-groups.*got 5"):
        sample_shared_prefix(4, 5, 8, 8, 4, 0.0, rng)
    with pytest.raises(ValueError, match="num-prompts must be >= 1, got 0"):
        sample_random(0, 10, 4, 0.0, rng)


def test_without_a_tokenizer_prompts_are_words_counted_one_token_each() -> None:
    requests = sample_random(4, 20, 4, 0.0, np.random.default_rng(0))
    assert all(len(r.prompt.split()) == 20 == r.prompt_len for r in requests)
    shared = sample_shared_prefix(4, 2, 10, 5, 4, 0.0, np.random.default_rng(0))
    prefixes = {" ".join(r.prompt.split()[:10]) for r in shared}
    assert len(prefixes) == 2 and all(r.prompt_len == 15 for r in shared)


def test_cli_flags_use_vllm_names_and_defaults(tmp_path: Path) -> None:
    from sluice.entrypoints.cli import build_parser

    parser = build_parser()
    ns = parser.parse_args(["bench", "serve", "--num-prompts", "8", "--goodput", "ttft:100",
                            "tpot:20", "--endpoint", "/v1/chat/completions",
                            "--result-dir", str(tmp_path)])
    config = config_from_args(ns)
    assert config.base_url == "http://127.0.0.1:8000" and config.chat
    assert config.goodput == {"ttft": 100.0, "tpot": 20.0}
    assert config.request_rate == float("inf") and config.burstiness == 1.0
    assert config.ignore_eos and config.temperature == 0.0
    assert config.percentile_metrics == ("ttft", "tpot", "itl")
    assert config.metric_percentiles == (99.0,)
    assert config.more_base_urls == ()
    two = parser.parse_args(["bench", "serve", "--base-url", "http://a:1/",
                             "--base-url", "http://b:2"])
    assert (config_from_args(two).base_url, config_from_args(two).more_base_urls) == (
        "http://a:1", ("http://b:2",))
    assert "--base-url http://a:1/ --base-url http://b:2" in command_line(two)
    bad = parser.parse_args(["bench", "serve", "--percentile-metrics", "ttft,foo"])
    with pytest.raises(ValueError, match="foo"):
        config_from_args(bad)
