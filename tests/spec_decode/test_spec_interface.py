"""Speculative decoding as users reach it: `--speculative-config JSON` on every engine command
(a bad value is a usage error naming the flag, never a traceback), the config surviving the JSON
trip to the engine-core process however it was given, the counters in SchedulerStats (on the
wire, in the log line), and `LLM.get_spec_decoding_stats()` beside greedy outputs that equal
those of an engine without speculation."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any

import msgspec
import pytest

from sluice import LLM, SamplingParams
from sluice.channel import Encoder
from sluice.core.outputs import SpecDecodingStats
from sluice.engine.arg_utils import EngineArgs
from sluice.engine.async_llm import core_process_args
from sluice.engine.core_proc import make_scheduler_stats
from sluice.engine.flags import engine_args_from
from sluice.engine.stats import IterationStats, SchedulerStats, StatsLogger
from sluice.engine.wire import EngineCoreOutputs, ResponseDecoder, UtilityReply
from sluice.entrypoints.cli import build_parser, main
from sluice.spec_decode.config import SpeculativeConfig

# Drafting on at every batch size and acceptance (the drafting policy out of the way).
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "disable_by_batch_size": None,
         "min_accepted_tokens_per_step": 0}
NGRAM_CONFIG = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                                 prompt_lookup_max=3, disable_by_batch_size=None,
                                 min_accepted_tokens_per_step=0)
ENGINE_KWARGS: dict[str, Any] = dict(dtype="float32", max_model_len=512, block_size=8, seed=0,
                                     device="cpu")
# A prompt that repeats itself, so that n-gram lookup finds drafts from the first step.
REPEATING_PROMPTS = [list(range(100, 116)) * 4, [7, 8, 9, 10, 11] * 6, list(range(300, 310)) * 3]


# ---- the CLI -------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["generate"], ["serve"], ["bench", "throughput"],
                                     ["bench", "latency"], ["bench", "profile"]])
def test_speculative_config_flag_reaches_engine_args_on_every_engine_command(
        command: list[str]) -> None:
    ns = build_parser().parse_args([*command, "--speculative-config", json.dumps(NGRAM)])
    engine_args = engine_args_from(ns)
    assert engine_args.speculative_config == dataclasses.asdict(NGRAM_CONFIG)
    assert SpeculativeConfig.from_dict(engine_args.speculative_config) == NGRAM_CONFIG


def test_speculative_config_flag_fills_in_defaults_and_null_or_absent_means_off() -> None:
    parser = build_parser()
    ns = parser.parse_args(["generate", "--speculative-config",
                            '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert ns.speculative_config == {"method": "ngram", "num_speculative_tokens": 2,
                                     "model": None, "prompt_lookup_min": 5,
                                     "prompt_lookup_max": 5, "disable_by_batch_size": 2,
                                     "min_accepted_tokens_per_step": 1.25,
                                     "probe_interval": 2}
    assert parser.parse_args(["generate", "--speculative-config", "null"]).speculative_config \
        is None
    assert parser.parse_args(["generate"]).speculative_config is None


@pytest.mark.parametrize(("value", "message"), [
    ('{"method": "ngram", "num_speculative_tokens": 3', "speculative_config is not valid JSON"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "k": 1}',
     "speculative_config has unknown key(s) 'k'; allowed keys: 'method'"),
    ('{"method": "medusa", "num_speculative_tokens": 3}',
     "speculative_config.method must be one of 'ngram', 'draft_model', 'eagle', got 'medusa'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}',
     "speculative_config.num_speculative_tokens"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}',
     "speculative_config.model is required for method 'draft_model'"),
    ("[1, 2]", "speculative_config must be a dict, a JSON object string or None, got list"),
])
def test_bad_speculative_config_is_a_usage_error_naming_the_flag(
        value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    for command in (["generate"], ["serve"]):
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args([*command, "--speculative-config", value])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert f"sluice {command[0]}: error: argument --speculative-config: {message}" in err
        assert "Traceback" not in err


def test_speculation_runs_with_async_scheduling(
        qwen3_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Steps without drafts overlap; steps with drafts run synchronously (no refusal)."""
    status = main(["generate", "--model", qwen3_dir, "--device", "cpu", "--async-scheduling",
                   "--speculative-config", json.dumps(NGRAM), "--max-tokens", "4"])
    assert status == 0
    assert "Traceback" not in capsys.readouterr().err
    config = EngineArgs(model=qwen3_dir, async_scheduling=True, speculative_config=NGRAM,
                        **ENGINE_KWARGS).create_engine_config()
    assert config.scheduler_config.async_scheduling
    assert config.scheduler_config.speculative_config == NGRAM_CONFIG


# ---- engine arguments on their way to the engine-core process ------------------------------


@pytest.mark.parametrize("given", [NGRAM, json.dumps(NGRAM), NGRAM_CONFIG],
                         ids=["dict", "json-string", "config-object"])
def test_speculative_config_survives_the_json_trip_to_the_core_process(
        qwen3_dir: str, given: dict | str | SpeculativeConfig) -> None:
    engine_args = EngineArgs(model=qwen3_dir, speculative_config=given, **ENGINE_KWARGS)
    config = engine_args.create_engine_config()
    core_args = core_process_args(engine_args, config)
    # What launch_engine_core sends: JSON only (a SpeculativeConfig object would not encode).
    sent = json.loads(json.dumps(core_args))
    assert sent["speculative_config"] == dataclasses.asdict(NGRAM_CONFIG)
    rebuilt = EngineArgs(**sent).create_engine_config()
    assert rebuilt.scheduler_config.speculative_config == NGRAM_CONFIG
    assert rebuilt == config


def test_no_speculation_travels_as_null(qwen3_dir: str) -> None:
    engine_args = EngineArgs(model=qwen3_dir, **ENGINE_KWARGS)
    config = engine_args.create_engine_config()
    sent = json.loads(json.dumps(core_process_args(engine_args, config)))
    assert sent["speculative_config"] is None
    assert EngineArgs(**sent).create_engine_config() == config


# ---- SchedulerStats: the wire and the log line ---------------------------------------------

SPEC_STATS = SchedulerStats(num_running=1, num_blocks=40, num_free_blocks=30,
                            spec_num_drafts=10, spec_num_draft_tokens=30,
                            spec_num_accepted_tokens=12,
                            spec_num_accepted_tokens_per_pos=(6, 4, 2),
                            spec_num_steps_drafting=7, spec_num_steps_off_batch_size=3,
                            spec_num_steps_off_acceptance=1)


def test_spec_counters_survive_the_wire_and_derive_rates() -> None:
    for message in (EngineCoreOutputs(outputs=[], scheduler_stats=SPEC_STATS),
                    UtilityReply(call_id=3, result=SPEC_STATS)):
        back = ResponseDecoder().decode(Encoder().encode(message))
        stats = back.scheduler_stats if isinstance(back, EngineCoreOutputs) else back.result
        assert stats == SPEC_STATS
        assert stats.spec_num_accepted_tokens_per_pos == (6, 4, 2)
        assert (stats.spec_num_steps_drafting, stats.spec_num_steps_off_batch_size,
                stats.spec_num_steps_off_acceptance) == (7, 3, 1)
    assert SPEC_STATS.spec_acceptance_rate == pytest.approx(12 / 30)
    assert SPEC_STATS.spec_mean_acceptance_length == pytest.approx(1 + 12 / 10)
    off = SchedulerStats()
    assert (off.spec_num_drafts, off.spec_num_accepted_tokens_per_pos) == (0, ())
    assert off.spec_acceptance_rate == 0.0 and off.spec_mean_acceptance_length == 0.0


def test_stats_logger_appends_the_interval_acceptance_only_when_drafts_were_verified(
        caplog: pytest.LogCaptureFixture) -> None:
    stats_logger = StatsLogger(interval_s=3600.0)
    now = time.monotonic()
    stats_logger._last_log_time = now - 1.0
    stats_logger(IterationStats(timestamp=0.0, num_generation_tokens=10), SPEC_STATS)
    with caplog.at_level(logging.INFO, logger="sluice"):
        first = stats_logger.log(now)
        # The next interval verified 5 more drafts (10 tokens), of which 5 were accepted.
        stats_logger(IterationStats(timestamp=0.0, num_generation_tokens=10),
                     msgspec.structs.replace(SPEC_STATS, spec_num_drafts=15,
                                             spec_num_draft_tokens=40,
                                             spec_num_accepted_tokens=17,
                                             spec_num_accepted_tokens_per_pos=(9, 6, 2)))
        second = stats_logger.log(now + 1.0)
        # Still running but nothing verified since: no speculative part.
        third = stats_logger.log(now + 2.0)
    assert first is not None and first.endswith(
        "prefix cache hit rate 0.0%, spec decode acceptance rate 40.0%, "
        "mean acceptance length 2.20")
    assert second is not None and second.endswith(
        ", spec decode acceptance rate 50.0%, mean acceptance length 2.00")
    assert third is not None and third.endswith("prefix cache hit rate 0.0%")
    assert [r.getMessage() for r in caplog.records] == [first, second, third]


# ---- the offline engine with speculation ---------------------------------------------------


@pytest.fixture(scope="module")
def plain_llm(qwen3_dir: str) -> LLM:
    return LLM(model=qwen3_dir, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def ngram_llm(qwen3_dir: str) -> LLM:
    return LLM(model=qwen3_dir, speculative_config=json.dumps(NGRAM), **ENGINE_KWARGS)


def assert_spec_stats_balance(stats: SpecDecodingStats, k: int) -> None:
    """The invariants of cumulative counters: positions are accepted in order, so per-position
    counts never increase with the position and add up to the accepted tokens."""
    per_pos = stats.num_accepted_tokens_per_pos
    assert stats.num_spec_tokens == k and len(per_pos) == k
    assert 0 < stats.num_drafts <= stats.num_draft_tokens <= k * stats.num_drafts
    assert 0 <= stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(per_pos) == stats.num_accepted_tokens
    assert all(per_pos[i] >= per_pos[i + 1] for i in range(k - 1))
    assert per_pos[0] <= stats.num_drafts


def test_without_speculation_there_are_no_spec_stats(plain_llm: LLM) -> None:
    plain_llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert plain_llm.get_spec_decoding_stats() is None
    stats = make_scheduler_stats(plain_llm.llm_engine.engine_core)
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens,
            stats.spec_num_accepted_tokens_per_pos) == (0, 0, 0, ())


def test_ngram_greedy_equals_plain_greedy_and_counters_balance(plain_llm: LLM,
                                                                ngram_llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in REPEATING_PROMPTS]
    want = plain_llm.generate(prompts, params, use_tqdm=False)
    before = ngram_llm.get_spec_decoding_stats()
    assert before is not None
    got = ngram_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]

    stats = ngram_llm.get_spec_decoding_stats()
    assert stats is not None
    assert stats.num_drafts > before.num_drafts  # a copy: the earlier snapshot did not move
    assert_spec_stats_balance(stats, k=3)
    assert stats.num_accepted_tokens > 0
    assert stats.acceptance_rate == pytest.approx(stats.num_accepted_tokens
                                                  / stats.num_draft_tokens)
    assert stats.mean_acceptance_length == pytest.approx(1 + stats.num_accepted_tokens
                                                         / stats.num_drafts)
    # What the engine-core process would put on the wire is the same count.
    wire = make_scheduler_stats(ngram_llm.llm_engine.engine_core)
    assert (wire.spec_num_drafts, wire.spec_num_draft_tokens, wire.spec_num_accepted_tokens,
            list(wire.spec_num_accepted_tokens_per_pos)) == (
        stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
        stats.num_accepted_tokens_per_pos)
    assert (wire.spec_num_steps_drafting, wire.spec_num_steps_off_batch_size,
            wire.spec_num_steps_off_acceptance) == (
        stats.num_steps_drafting, stats.num_steps_off_batch_size,
        stats.num_steps_off_acceptance)
    assert stats.num_steps_drafting > 0  # the policy out of the way: every step drafts
    assert stats.num_steps_off_batch_size == stats.num_steps_off_acceptance == 0
