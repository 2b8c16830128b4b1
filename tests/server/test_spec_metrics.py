"""Speculative decoding in `sluice serve`: the Prometheus exporter turns the core's cumulative
counters into counters and gauges (checked on hand-made SchedulerStats), and a server started
with `--speculative-config` (n-gram, k = 3, the default drafting policy) answers greedy
completions exactly as an engine without speculation does, while /metrics counts drafts and
accepted tokens that balance, and the steps the drafting policy drafted or not."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice import LLM, SamplingParams
from sluice.engine.stats import IterationStats, SchedulerStats
from sluice.entrypoints.openai.metrics import PrometheusStatsListener
from tests.server.conftest import ServerProcess, launch_server

pytestmark = pytest.mark.serial

MODEL = "tiny-spec"
K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
SPEC = "sluice:spec_decode_"
# Prompts that repeat themselves, so that n-gram lookup finds drafts from the first step.
REPEATING_PROMPTS = [list(range(100, 116)) * 4, [7, 8, 9, 10, 11] * 6, list(range(300, 310)) * 3]


def samples_of(text: str, model_name: str) -> dict[str, float]:
    """sample name{label=value,...} -> value, labels sorted, model_name left out."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels.pop("model_name") == model_name
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def per_pos(samples: dict[str, float]) -> list[float]:
    """The per-position accepted counter, position 0 first (every position shown)."""
    values = {}
    prefix = f"{SPEC}num_accepted_tokens_per_pos_total{{position="
    for name, value in samples.items():
        if name.startswith(prefix):
            values[int(name[len(prefix):-1])] = value
    assert sorted(values) == list(range(len(values)))
    return [values[i] for i in range(len(values))]


def steps_by_decision(samples: dict[str, float]) -> dict[str, float]:
    """The drafting policy's step counter by its `drafting` label."""
    prefix = f"{SPEC}num_steps_total{{drafting="
    return {name[len(prefix):-1]: value for name, value in samples.items()
            if name.startswith(prefix)}


# ---- the exporter on hand-made stats -------------------------------------------------------


def test_exporter_adds_increases_of_the_cores_totals_and_sets_the_rates() -> None:
    listener = PrometheusStatsListener("m", num_speculative_tokens=K)
    start = samples_of(listener.render().decode(), "m")
    for name in ("num_drafts_total", "num_draft_tokens_total", "num_accepted_tokens_total",
                 "acceptance_rate", "mean_acceptance_length"):
        assert start[f"{SPEC}{name}"] == 0.0
    assert per_pos(start) == [0.0] * K  # every position shown before any draft
    assert steps_by_decision(start) == {"on": 0, "off_batch_size": 0, "off_acceptance": 0}

    step = IterationStats(timestamp=0.0)
    listener(step, SchedulerStats(spec_num_drafts=4, spec_num_draft_tokens=12,
                                  spec_num_accepted_tokens=6,
                                  spec_num_accepted_tokens_per_pos=(3, 2, 1),
                                  spec_num_steps_drafting=4, spec_num_steps_off_acceptance=2))
    listener(step, None)  # a batch without stats changes nothing
    listener(step, SchedulerStats(spec_num_drafts=10, spec_num_draft_tokens=28,
                                  spec_num_accepted_tokens=14,
                                  spec_num_accepted_tokens_per_pos=(7, 5, 2),
                                  spec_num_steps_drafting=9, spec_num_steps_off_batch_size=5,
                                  spec_num_steps_off_acceptance=2))
    end = samples_of(listener.render().decode(), "m")
    assert steps_by_decision(end) == {"on": 9, "off_batch_size": 5, "off_acceptance": 2}
    assert end[f"{SPEC}num_drafts_total"] == 10
    assert end[f"{SPEC}num_draft_tokens_total"] == 28
    assert end[f"{SPEC}num_accepted_tokens_total"] == 14
    assert per_pos(end) == [7, 5, 2]
    assert end[f"{SPEC}acceptance_rate"] == pytest.approx(14 / 28)
    assert end[f"{SPEC}mean_acceptance_length"] == pytest.approx(1 + 14 / 10)


def test_exporter_without_speculation_shows_zeros_and_no_positions() -> None:
    listener = PrometheusStatsListener("m")
    listener(IterationStats(timestamp=0.0, num_generation_tokens=5),
             SchedulerStats(num_running=1))
    samples = samples_of(listener.render().decode(), "m")
    assert samples[f"{SPEC}num_drafts_total"] == 0.0
    assert samples[f"{SPEC}acceptance_rate"] == 0.0
    assert per_pos(samples) == []
    assert samples["sluice:generation_tokens_total"] == 5


# ---- a server with n-gram speculation ------------------------------------------------------


@pytest.fixture(scope="module")
def spec_server(qwen3_dir: str,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    started = launch_server(qwen3_dir, tmp_path_factory.mktemp("spec") / "server.log",
                            "--served-model-name", MODEL,
                            "--speculative-config", json.dumps(NGRAM))
    yield started
    assert started.stop() == 0, started.log()[-4000:]


def scrape(server: ServerProcess) -> dict[str, float]:
    response = httpx.get(f"{server.base_url}/metrics", timeout=10)
    assert response.status_code == 200
    return samples_of(response.text, MODEL)


def test_spec_server_starts_with_zero_counters_for_every_position(
        spec_server: ServerProcess) -> None:
    metrics = scrape(spec_server)
    assert metrics[f"{SPEC}num_drafts_total"] == 0.0
    assert metrics[f"{SPEC}num_accepted_tokens_total"] == 0.0
    assert per_pos(metrics) == [0.0] * K


def test_spec_server_greedy_equals_plain_engine_and_metrics_balance(
        spec_server: ServerProcess, reference: LLM) -> None:
    client = openai.OpenAI(base_url=f"{spec_server.base_url}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    before = scrape(spec_server)
    want = reference.generate([{"prompt_token_ids": p} for p in REPEATING_PROMPTS],
                              SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
                              use_tqdm=False)
    for prompt, expected in zip(REPEATING_PROMPTS, want):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=48,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == expected.outputs[0].text
        assert got.usage.completion_tokens == len(expected.outputs[0].token_ids) == 48

    after = scrape(spec_server)
    drafts = after[f"{SPEC}num_drafts_total"] - before[f"{SPEC}num_drafts_total"]
    draft_tokens = (after[f"{SPEC}num_draft_tokens_total"]
                    - before[f"{SPEC}num_draft_tokens_total"])
    accepted = (after[f"{SPEC}num_accepted_tokens_total"]
                - before[f"{SPEC}num_accepted_tokens_total"])
    accepted_per_pos = [a - b for a, b in zip(per_pos(after), per_pos(before))]
    assert 0 < drafts <= draft_tokens <= K * drafts
    assert 0 < accepted <= draft_tokens
    assert len(accepted_per_pos) == K and sum(accepted_per_pos) == accepted
    assert all(accepted_per_pos[i] >= accepted_per_pos[i + 1] for i in range(K - 1))
    total_accepted = after[f"{SPEC}num_accepted_tokens_total"]
    assert after[f"{SPEC}acceptance_rate"] == pytest.approx(
        total_accepted / after[f"{SPEC}num_draft_tokens_total"])
    assert after[f"{SPEC}mean_acceptance_length"] == pytest.approx(
        1 + total_accepted / after[f"{SPEC}num_drafts_total"])

    # The core's own counters (asked now, the server idle) are what /metrics shows.
    scheduler = spec_server.engine_info()["scheduler"]
    assert scheduler["spec_num_drafts"] == after[f"{SPEC}num_drafts_total"]
    assert scheduler["spec_num_draft_tokens"] == after[f"{SPEC}num_draft_tokens_total"]
    assert scheduler["spec_num_accepted_tokens"] == total_accepted
    assert scheduler["spec_num_accepted_tokens_per_pos"] == per_pos(after)
    # One request at a time: never off for the batch size; on, at least once, for repeats.
    steps = steps_by_decision(after)
    assert steps == {"on": scheduler["spec_num_steps_drafting"],
                     "off_batch_size": scheduler["spec_num_steps_off_batch_size"],
                     "off_acceptance": scheduler["spec_num_steps_off_acceptance"]}
    assert steps["on"] > 0 and steps["off_batch_size"] == 0
