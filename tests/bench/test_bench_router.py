"""`sluice bench router` on the CPU with the tiny model, as the smoke test of issue 51's router
measurement: two replicas and a router per policy, the same shared-prefix load through each;
every request completes, the record holds each policy's hit rate, TTFT and spread, and with
replica caches too small for every prefix, cache_aware finds more of the prompts cached than
round_robin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.serial


def test_bench_router_compares_the_policies_on_shared_prefix_traffic(
        qwen3_dir: str, tmp_path: Path) -> None:
    output = tmp_path / "router.json"
    run = subprocess.run(
        [sys.executable, "-m", "sluice", "bench", "router", "--model", qwen3_dir,
         "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
         "--engine-args", "--num-gpu-blocks-override 96 --block-size 8",
         "--policies", "cache_aware", "--num-prompts", "16", "--shared-prefix-len", "96",
         "--shared-prefix-groups", "8", "--suffix-len", "8", "--output-len", "2",
         "--request-rate", "16", "--output", str(output)],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.startswith("sluice bench router --model")
    assert "machine: " in run.stdout and "hit/rr" in run.stdout
    record = json.loads(output.read_text())
    assert record["schema"] == "sluice.bench/1" and record["bench"] == "router"
    result = record["results"]
    policies = result["policies"]
    assert list(policies) == ["round_robin", "cache_aware"]  # the baseline added, first
    assert [r["request_success"] for r in policies["round_robin"]["replicas"]] == [8, 8]
    for row in policies.values():
        assert row["completed"] == 16
        assert row["mean_ttft_ms"] > 0 and row["p99_ttft_ms"] >= row["median_ttft_ms"]
        assert sum(r["request_success"] for r in row["replicas"]) == 16
        assert 0 <= row["prefix_hit_rate"] < 1
    # Round robin: the two requests of a prefix meet on one replica only by chance; cache aware:
    # the second always finds the first's prefix (96 blocks hold a replica's 4 prefixes).
    assert policies["cache_aware"]["prefix_hit_rate"] > policies["round_robin"]["prefix_hit_rate"]
    ratios = result["vs_round_robin"]
    assert ratios["round_robin"] == {"prefix_hit_rate": 1.0, "mean_ttft_ms": 1.0,
                                     "p99_ttft_ms": 1.0}
    assert ratios["cache_aware"]["prefix_hit_rate"] > 1
