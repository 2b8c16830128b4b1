"""`sluice bench spec` compares its two engines under the same conditions: the speed-up is not
moved by a drift of the machine's speed over a point, and both engines time the same prefix-cache
state. Run in-process on the CPU with the tiny model; the machine's drift is emulated by a clock
that each generate() call advances."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from statistics import median
from types import SimpleNamespace

import pytest

from sluice.bench import spec_decode
from sluice.bench.spec_decode import paired_speedups, run_order
from sluice.entrypoints.llm import LLM
from sluice.model.tiny import default_model_dir

pytestmark = pytest.mark.one_worker

NAMES = ("baseline", "speculative")


def bench_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    spec_decode.add_parser(parser.add_subparsers())
    return parser.parse_args(["spec", "--model", default_model_dir(), "--device", "cpu",
                              "--dtype", "float32", "--batch-sizes", "1,3", "--input-len", "24",
                              "--segment-len", "8", "--output-len", "6", *extra])


def emulate_clock(monkeypatch: pytest.MonkeyPatch,
                  seconds_per_token: Callable[[int], float]) -> None:
    """The bench's timer reads a clock that each generate() advances by its tokens times
    `seconds_per_token(n)`, n counting the calls: the same work costs either engine the same."""
    clock = SimpleNamespace(now=0.0, calls=0)
    generate = LLM.generate

    def timed_generate(self: LLM, prompts: list, params: object, **kwargs: object) -> list:
        outputs = generate(self, prompts, params, **kwargs)
        clock.now += len(prompts) * params.max_tokens * seconds_per_token(clock.calls)
        clock.calls += 1
        return outputs

    monkeypatch.setattr(LLM, "generate", timed_generate)
    monkeypatch.setattr(spec_decode, "time", SimpleNamespace(perf_counter=lambda: clock.now))


def test_a_drift_of_the_machine_over_a_point_does_not_move_the_speed_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 2% slower with every call: the engine timed later in a point would look slower.
    emulate_clock(monkeypatch, lambda call: 1e-3 * (1 + 0.02 * call))
    record = spec_decode.run_spec(bench_args("--workload", "random", "--num-iters", "5"))["results"]
    for point in record["points"]:
        assert point["num_draft_tokens"] == 0  # random prompts: both engines do the same work
        assert point["speedup"] == pytest.approx(1.0, abs=1e-9)
        assert point["speedup_min"] == pytest.approx(1.0, abs=1e-9)
        assert point["speedup_max"] == pytest.approx(1.0, abs=1e-9)


def test_both_engines_time_their_runs_over_the_same_prefix_cache_state() -> None:
    # `continue`: the baseline engine made the prompts' continuations, so its cache held them
    # before any timed run; the speculative engine's did not.
    record = spec_decode.run_spec(bench_args("--workload", "continue",
                                             "--num-iters", "2"))["results"]
    assert record["num_gpu_blocks"]["baseline"] == record["num_gpu_blocks"]["speculative"]
    for point in record["points"]:
        # 24 prompt tokens in blocks of 16: the first block is a hit, the last token never is.
        assert point["prefix_cache_hit_rate"] == pytest.approx(16 / 24)
        assert point["baseline_prefix_cache_hit_rate"] == point["prefix_cache_hit_rate"]
        assert point["tokens_equal"] == 1.0


def test_runs_alternate_so_that_consecutive_iterations_are_symmetric() -> None:
    orders = [run_order(NAMES, i) for i in range(4)]
    assert orders == [NAMES, NAMES[::-1], NAMES, NAMES[::-1]]


def test_a_change_of_speed_moves_only_the_ratios_of_the_iterations_around_it() -> None:
    # Five iterations of equal work, the machine 20% slower from the middle of the third on
    # (iteration 2 runs the baseline first: before the change, the speculative engine after).
    slow = 1.2
    baseline = [1.0, 1.0, 1.0, slow, slow]
    speculative = [1.0, 1.0, slow, slow, slow]
    ratios = paired_speedups(baseline, speculative)
    assert ratios[0] == ratios[3] == 1.0
    assert 1 / slow < ratios[1] < 1.0 and 1 / slow < ratios[2] < 1.0
    # Each engine's median alone would put the whole change on the speculative engine.
    assert median(ratios) > 0.95 > median(baseline) / median(speculative) == 1 / slow


def test_one_iteration_is_one_pair_and_runs_must_pair_up() -> None:
    assert paired_speedups([2.0], [1.0]) == [2.0]
    with pytest.raises(ValueError, match="as many runs of each engine"):
        paired_speedups([1.0, 1.0], [1.0])
