"""GET /metrics of a fresh `sluice serve` (a KV cache small enough to force preemptions): every
metric is there under its vLLM name with the `sluice:` prefix, and after known requests the
counters equal what the requests did (tokens, finishes, prefix hits, preemptions), the
histograms saw each request once, and the gauges return to idle."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import ServerProcess, launch_server

pytestmark = pytest.mark.serial

MODEL = "tiny-metrics"
# 140 blocks of 8 tokens: four requests of 100 + 300 tokens (1600) cannot all fit.
NUM_BLOCKS = 140


@pytest.fixture(scope="module")
def server(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    started = launch_server(qwen3_dir, tmp_path_factory.mktemp("metrics") / "server.log",
                            "--served-model-name", MODEL, "--num-gpu-blocks-override",
                            str(NUM_BLOCKS), "--max-num-seqs", "8")
    yield started
    assert started.stop() == 0


def scrape(server: ServerProcess) -> dict[str, float]:
    """sample name{label=value,...} -> value, labels sorted, model_name left out."""
    response = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            assert sample.labels.pop("model_name") == MODEL
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
COUNTERS = ("prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
            "generation_tokens_total", "num_preemptions_total")
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds")


def test_every_metric_is_exported_and_starts_at_zero(server: ServerProcess) -> None:
    metrics = scrape(server)
    for name in GAUGES + COUNTERS:
        assert metrics[f"sluice:{name}"] == 0.0
    for reason in ("stop", "length", "abort"):
        assert metrics[f"sluice:request_success_total{{finished_reason={reason}}}"] == 0.0
    for name in HISTOGRAMS:
        assert metrics[f"sluice:{name}_count"] == 0.0
        assert metrics[f"sluice:{name}_bucket{{le=+Inf}}"] == 0.0


def test_counters_and_histograms_match_the_requests(server: ServerProcess) -> None:
    c = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                      timeout=120)
    before = scrape(server)
    shared_prompt = list(range(100, 140))  # 40 tokens: 4 full blocks of 8 can be cached
    usages = []
    for _ in range(2):
        usages.append(c.completions.create(model=MODEL, prompt=shared_prompt, max_tokens=10,
                                           temperature=0, extra_body={"ignore_eos": True}).usage)
    after_shared = scrape(server)
    # The second request found the first's 4 full prompt blocks (the last token is always
    # computed, so 39 cacheable tokens give 4 blocks).
    assert after_shared["sluice:prefix_cache_hits_total"] - \
        before["sluice:prefix_cache_hits_total"] == 32
    assert after_shared["sluice:prefix_cache_queries_total"] - \
        before["sluice:prefix_cache_queries_total"] >= 80

    # Four long requests at once overflow the 140-block cache: preemptions, and on the way
    # the gauges show a busy engine.
    seen = {"running": 0.0, "kv": 0.0}

    def run(i: int) -> None:
        usages.append(c.completions.create(
            model=MODEL, prompt=[200 + i] * 100, max_tokens=300, temperature=0,
            extra_body={"ignore_eos": True}).usage)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        now = scrape(server)
        seen["running"] = max(seen["running"], now["sluice:num_requests_running"])
        seen["kv"] = max(seen["kv"], now["sluice:kv_cache_usage_perc"])
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert len(usages) == 6 and all(u.completion_tokens in (10, 300) for u in usages)
    assert seen["running"] >= 1 and 0.0 < seen["kv"] <= 1.0

    after = scrape(server)

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("sluice:num_preemptions_total") > 0
    assert delta("sluice:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("sluice:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("sluice:request_success_total{finished_reason=length}") == 6
    assert delta("sluice:request_success_total{finished_reason=stop}") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert delta(f"sluice:{name}_count") == 6
        assert delta(f"sluice:{name}_bucket{{le=+Inf}}") == 6
    num_gaps = sum(u.completion_tokens - 1 for u in usages)
    assert num_gaps / 2 < delta("sluice:inter_token_latency_seconds_count") <= num_gaps
    ttft_sum = delta("sluice:time_to_first_token_seconds_sum")
    e2e_sum = delta("sluice:e2e_request_latency_seconds_sum")
    assert 0 < ttft_sum < e2e_sum < 6 * 120
    assert delta("sluice:inter_token_latency_seconds_sum") < e2e_sum
    for name in GAUGES:
        assert after[f"sluice:{name}"] == 0.0
