"""The per-request choice between loading a pool hit and recomputing it (rates.py): the rate
model on given rates, the setting, and whole engines where the pool is measured slower than
recomputing (a stalled Mooncake segment owner: its values arrive, late) and the next hit is
recomputed, counted, with the greedy output unchanged."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from sluice import LLM
from sluice.kv_transfer.pool.rates import PROBE_EVERY, LoadOrRecompute
from sluice.worker.step_handle import StepHandle
from tests.kv_transfer.conftest import require
from tests.kv_transfer.test_pool_connector import (
    ENGINE,
    FULL,
    assert_all_blocks_back,
    greedy,
    pool_config,
    prompts,
    scheduler_half,
    settings,
    stats,
    token_ids,
    wait_for_saves,
)

pytestmark = pytest.mark.serial

BLOCK = ENGINE["block_size"]


@pytest.fixture(scope="module")
def reference(qwen3_dir: str) -> LLM:
    return LLM(model=qwen3_dir, **ENGINE)


# ---- the rate model ----


def measured(load_s_per_block: float, recompute_s_per_token: float,
             policy: str = "auto") -> LoadOrRecompute:
    rates = LoadOrRecompute(policy, block_size=BLOCK)
    rates.step_done(recompute_s_per_token * 1000, 1000, had_loads=False)
    rates.load_done(load_s_per_block * 10, 10)
    return rates


def test_a_hit_is_loaded_only_when_loading_is_expected_faster() -> None:
    # Recomputing a block: 16 x 1 ms. Loading it: 10 ms (load) or 20 ms (recompute).
    assert measured(0.010, 0.001).should_load(9)
    slow = measured(0.020, 0.001)
    assert not slow.should_load(9)
    assert slow.expected_seconds(9) == pytest.approx((0.180, 0.144))
    assert slow.num_skipped == 1


def test_before_both_rates_exist_a_hit_is_loaded() -> None:
    rates = LoadOrRecompute("auto", block_size=BLOCK)
    assert rates.should_load(4) and rates.expected_seconds(4) is None
    rates.step_done(1.0, 1000, had_loads=False)  # a prefill rate, no load rate yet
    assert rates.should_load(4)
    rates = LoadOrRecompute("auto", block_size=BLOCK)
    rates.load_done(1.0, 1)  # a (very slow) load rate, no prefill rate yet
    assert rates.should_load(4)


def test_steps_that_load_and_loads_of_nothing_are_not_samples() -> None:
    rates = LoadOrRecompute("auto", block_size=BLOCK)
    rates.step_done(1.0, 1000, had_loads=True)  # its time is partly the load's
    rates.load_done(1.0, 0)  # nothing loaded
    assert rates.seconds_per_token is None and rates.seconds_per_block is None
    assert rates.should_load(1)


def test_a_steps_fixed_cost_is_not_counted_into_the_cost_of_a_token() -> None:
    rates = LoadOrRecompute("auto", block_size=BLOCK)
    for tokens in (100, 1000, 500, 1):  # 20 ms a step, 1 ms a token
        rates.step_done(0.020 + 0.001 * tokens, tokens, had_loads=False)
    assert rates.seconds_per_token == pytest.approx(0.001)
    one = LoadOrRecompute("auto", block_size=BLOCK)
    one.step_done(1.02, 1000, had_loads=False)  # one size only: through the origin
    assert one.seconds_per_token == pytest.approx(0.00102)
    falling = LoadOrRecompute("auto", block_size=BLOCK)
    for tokens, seconds in ((100, 0.5), (1000, 0.1)):  # no sense as a line: the ratio
        falling.step_done(seconds, tokens, had_loads=False)
    # (the older sample weighs 0.9)
    assert falling.seconds_per_token == pytest.approx((0.9 * 0.5 + 0.1) / (0.9 * 100 + 1000))


def test_a_loads_fixed_cost_skips_short_hits_and_loads_long_ones() -> None:
    rates = LoadOrRecompute("auto", block_size=BLOCK)
    for tokens in (100, 1000):
        rates.step_done(0.001 * tokens, tokens, had_loads=False)  # 16 ms a block
    for blocks in (2, 20, 8):  # 50 ms a load, 10 ms a block
        rates.load_done(0.050 + 0.010 * blocks, blocks)
    assert rates.expected_seconds(2) == pytest.approx((0.070, 0.032))
    assert not rates.should_load(2)
    assert rates.expected_seconds(20) == pytest.approx((0.250, 0.320))
    assert rates.should_load(20)


def test_a_step_overlapping_the_one_before_counts_from_that_ones_result() -> None:
    rates = LoadOrRecompute("auto", block_size=BLOCK)
    assert rates.step_seconds(planned_at=1.0, now=3.0) == pytest.approx(2.0)
    # Planned at 2.5 (async scheduling) while the step before ran until 3.0.
    assert rates.step_seconds(planned_at=2.5, now=4.0) == pytest.approx(1.0)


def test_skipping_loads_probes_the_pool_again_now_and_then() -> None:
    rates = measured(0.020, 0.001)
    decisions = [rates.should_load(9) for _ in range(2 * PROBE_EVERY)]
    assert decisions.count(True) == 2 and decisions[PROBE_EVERY - 1]
    assert rates.num_skipped == 2 * PROBE_EVERY - 2


def test_the_policy_overrides_the_rates() -> None:
    assert measured(0.020, 0.001, "always").should_load(9)
    assert not measured(0.001, 0.001, "never").should_load(9)
    assert not LoadOrRecompute("never", BLOCK).should_load(1)
    with pytest.raises(ValueError, match="load_policy must be one of .* got 'sometimes'"):
        settings(load_policy="sometimes")
    assert settings(load_policy="never").load_policy == "never"
    assert settings().load_policy == "auto"


# ---- whole engines ----


def test_a_steps_time_runs_to_its_result_when_its_report_comes_at_launch(
        qwen3_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With async scheduling an in-process step's connector report is applied at its launch
    (StepHandle.take_connector_output), before the device has run it: the recompute rate still
    times each step to its result. Each result here waits `delay` more (a slow device)."""
    delay = 0.2
    result = StepHandle.result

    def slow_result(self: StepHandle) -> Any:
        if not self._done:
            time.sleep(delay)
        return result(self)

    llm = LLM(model=qwen3_dir, kv_transfer_config=pool_config("local"), async_scheduling=True,
              **ENGINE)
    try:
        monkeypatch.setattr(StepHandle, "result", slow_result)
        llm.generate(prompts(seed=23, count=1), greedy(max_tokens=3), use_tqdm=False)
        monkeypatch.undo()
        connector = scheduler_half(llm)
        assert connector._worker_stats.get("pool_save_blocks", 0) > 0  # reports were applied
        steps = connector.rates.steps
        assert steps.weight >= 2
        # The samples' weighted mean time: each step took at least `delay` to its result.
        assert steps.sum_y / steps.weight >= 0.9 * delay, (steps.sum_y, steps.weight)
    finally:
        wait_for_saves(llm)
        assert_all_blocks_back(llm)
        llm.llm_engine.engine_core.shutdown()


def test_never_recomputes_every_hit_and_counts_it(qwen3_dir: str, reference: LLM) -> None:
    batch = prompts(seed=21, count=1)
    expected = token_ids(reference.generate(batch, greedy(), use_tqdm=False))
    config = pool_config("local")
    writer = LLM(model=qwen3_dir, kv_transfer_config=config, **ENGINE)
    assert token_ids(writer.generate(batch, greedy(), use_tqdm=False)) == expected
    wait_for_saves(writer)
    never = dict(config, kv_connector_extra_config={
        **config["kv_connector_extra_config"], "load_policy": "never"})
    reader = LLM(model=qwen3_dir, kv_transfer_config=never, **ENGINE)
    outputs = reader.generate(batch, greedy(), use_tqdm=False)
    assert token_ids(outputs) == expected and outputs[0].num_cached_tokens == 0
    counters = stats(reader)
    assert counters["pool_hit_blocks"] == FULL // BLOCK  # found...
    assert counters["pool_skipped_hit_blocks"] == FULL // BLOCK  # ...and recomputed
    assert counters["pool_skipped_hits"] == 1 and "pool_load_blocks" not in counters
    for llm in (writer, reader):
        assert_all_blocks_back(llm)
        llm.llm_engine.engine_core.shutdown()


def test_a_pool_measured_slower_than_recomputing_is_skipped_with_the_same_output(
        qwen3_dir: str, reference: LLM, request: pytest.FixtureRequest) -> None:
    """The reader's first hit loads (no load rate yet) from a Mooncake segment owner stalled for
    `stall_s` (SIGSTOP: the master answers the lookup, the values arrive when it resumes), so its
    measured load rate is slow; its next hit is recomputed, counted, and nothing is loaded."""
    require("mooncake")
    # Well above what a busy 2-core box measures for recomputing the prompt (1.5 s once).
    stall_s = 3.0
    batch = prompts(seed=22, count=3)
    expected = token_ids(reference.generate(batch, greedy(), use_tqdm=False))
    config = pool_config("mooncake", request, timeout_s=3 * stall_s)
    writer = LLM(model=qwen3_dir, kv_transfer_config=config, **ENGINE)
    auto = dict(config, kv_connector_extra_config={
        **config["kv_connector_extra_config"], "load_policy": "auto"})
    reader = LLM(model=qwen3_dir, kv_transfer_config=auto, **ENGINE)
    try:
        # The reader measures its prefill rate on a prompt of its own (a miss).
        assert token_ids(reader.generate(batch[:1], greedy(), use_tqdm=False)) == expected[:1]
        rates = scheduler_half(reader).rates
        assert rates.seconds_per_token is not None and rates.seconds_per_block is None
        assert token_ids(writer.generate(batch[1:], greedy(), use_tqdm=False)) == expected[1:]
        wait_for_saves(writer)

        owner = request.getfixturevalue("mooncake_segment_owner")
        owner.pause()
        resume = threading.Timer(stall_s, owner.resume)
        resume.start()
        try:
            slow = reader.generate(batch[1:2], greedy(), use_tqdm=False)
        finally:
            resume.join()
        assert token_ids(slow) == expected[1:2] and slow[0].num_cached_tokens == FULL
        loading, recomputing = rates.expected_seconds(FULL // BLOCK)
        assert loading > stall_s * 0.9 and loading > recomputing, (loading, recomputing)
        loaded = stats(reader)["pool_load_blocks"]

        skipped = reader.generate(batch[2:], greedy(), use_tqdm=False)
        assert token_ids(skipped) == expected[2:] and skipped[0].num_cached_tokens == 0
        counters: dict[str, Any] = stats(reader)
        assert counters["pool_skipped_hits"] == 1
        assert counters["pool_skipped_hit_blocks"] == FULL // BLOCK
        assert counters["pool_load_blocks"] == loaded
        assert counters["pool_load_seconds_per_block"] == pytest.approx(rates.seconds_per_block)
    finally:
        for llm in (writer, reader):
            assert_all_blocks_back(llm)
            llm.llm_engine.engine_core.shutdown()
