"""`sluice bench kv-pool-serve` on the CPU with the tiny model and a real redis-server, as the
smoke test of issue 15's serving measurement: two instances without a pool, then two on one
pool, the same shared-prefix load spread over both; every request completes, and with the pool
an instance loads prefixes the other computed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kv_transfer.conftest import require

pytestmark = pytest.mark.serial


def test_bench_kv_pool_serve_compares_two_instances_with_and_without_a_pool(
        qwen3_dir: str, tmp_path: Path) -> None:
    require("redis")
    output = tmp_path / "kv-pool-serve.json"
    run = subprocess.run(
        [sys.executable, "-m", "sluice", "bench", "kv-pool-serve", "--model", qwen3_dir,
         "--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--backend", "redis",
         "--load-policy", "always",  # the tiny model recomputes faster than Redis loads
         "--num-prompts", "10", "--shared-prefix-len", "96", "--shared-prefix-groups", "2",
         "--suffix-len", "16", "--output-len", "4", "--request-rate", "8",
         "--pool-bytes", str(64 << 20), "--staging-bytes", str(4 << 20),
         "--output", str(output)],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "pool/no" in run.stdout
    record = json.loads(output.read_text())
    assert record["schema"] == "sluice.bench/1" and record["bench"] == "kv-pool-serve"
    result = record["results"]
    assert result["no_pool"]["completed"] == result["pool"]["completed"] == 10
    assert all(not i["kv_connector"] for i in result["no_pool"]["instances"])
    pooled = [i["kv_connector"] for i in result["pool"]["instances"]]
    assert all(c["pool_lookups"] > 0 for c in pooled)
    # Ten requests of two prefixes at random over two instances, 125 ms apart: some instance
    # meets a prefix first computed (and saved) by the other.
    assert sum(c["pool_hit_blocks"] for c in pooled) > 0
    computed = [sum(i["num_scheduled_tokens_total"] for i in result[s]["instances"])
                for s in ("no_pool", "pool")]
    assert computed[1] < computed[0]
    assert "TTFT ms by prefix reuse" in run.stdout
    for setting in ("no_pool", "pool"):
        classes = result[setting]["ttft_by_reuse"]
        assert classes["first"]["count"] == 2  # one per prefix group
        assert sum(c["count"] for c in classes.values()) == 10


def test_ttft_by_reuse_classes_each_request_by_what_its_prefix_met_before() -> None:
    from sluice.bench.shared_prefix_load import ttft_by_reuse

    # Arrival order: group 0 on instance 0, again there, then on 1; group 1 on 1, failed on 0.
    result = {"prefix_groups": [0, 0, 0, 1, 1], "targets": [0, 0, 1, 1, 0],
              "ttfts": [0.100, 0.010, 0.040, 0.120, 0.0], "errors": ["", "", "", "", "boom"]}
    classes = ttft_by_reuse(result)
    assert {name: row["count"] for name, row in classes.items()} == {
        "first": 2, "same_instance": 1, "other_instance": 1}  # (the failed one left out)
    assert classes["first"]["mean_ms"] == pytest.approx(110.0)
    assert classes["first"]["max_ms"] == pytest.approx(120.0)
    assert classes["other_instance"]["median_ms"] == pytest.approx(40.0)
    assert ttft_by_reuse({"prefix_groups": [None], "targets": [0], "ttfts": [0.1],
                          "errors": [""]}) == {}
