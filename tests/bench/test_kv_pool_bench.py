"""`sluice bench kv-pool` runs end to end on the CPU with the tiny model: each backend's pool hit
is a real hit (the benchmark checks `num_cached_tokens` and the loaded bytes), and the report
carries the command, the machine and the ratios against the recompute of the same run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.entrypoints.cli import main
from sluice.kv_transfer.disagg.shm import shm_unavailable
from sluice.testing import servers

pytestmark = pytest.mark.serial

ARGS = ["--dtype", "float32", "--device", "cpu", "--block-size", "16", "--max-model-len", "256",
        "--prompt-lens", "48,96", "--num-iters", "1", "--staging-bytes", str(1 << 20)]


def test_kv_pool_bench_reports_each_backend_against_recompute(
        qwen3_dir: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    backends = ["local"] + [name for name, missing in (("redis", servers.redis_missing()),
                                                        ("mooncake", servers.mooncake_missing()),
                                                        ("mooncake-dummy",
                                                         servers.mooncake_missing() or (
                                                             None if servers.mooncake_client_path()
                                                             else "no mooncake_client")),
                                                        ("shm", shm_unavailable()))
                            if missing is None]
    out = tmp_path / "kv-pool.json"
    assert main(["bench", "kv-pool", "--model", qwen3_dir, *ARGS, "--backends",
                 ",".join(backends), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("command: sluice") and "\nmachine: " in printed
    assert "pool/recomp" in printed
    record = json.loads(out.read_text())
    assert record["schema"] == "sluice.bench/1" and record["bench"] == "kv-pool"
    record = record["results"]
    assert [(r["backend"], r["prompt_len"]) for r in record["rows"]] == [
        (b, n) for b in backends for n in (48, 96)]
    for row in record["rows"]:
        full_blocks = (row["prompt_len"] - 1) // 16
        assert row["load_bytes"] == full_blocks * record["bytes_per_block"]
        assert row["load_gb_s"] > 0 and row["effective_load_gb_s"] > 0 and row["save_gb_s"] > 0
        ttft = row["ttft_ms"]
        assert row["pool_hit_vs_recompute"] == pytest.approx(ttft["pool_hit"] / ttft["recompute"])
        # The host split of a load and of the saves: every hit copied and checked values; the
        # CPU path has no DMA to wait for.
        load, save = row["load_stage_ms"], row["save_stage_ms"]
        assert load["get_copy"] > 0 and load["get_checksum"] > 0 and load["dma_wait"] == 0
        assert save["put_checksum"] > 0 and save["put_copy"] > 0
    assert "host ms: load (median) get_copy " in printed


def test_kv_pool_bench_refuses_a_connector_of_its_own(qwen3_dir: str,
                                                      capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "kv-pool", "--model", qwen3_dir, *ARGS, "--kv-offloading-size",
                 "1"]) == 2
    assert "configures the pool connector itself" in capsys.readouterr().err
    assert main(["bench", "kv-pool", "--model", qwen3_dir, *ARGS, "--backends", "memcached"]) == 2
    assert "--backends must name some of local, redis, mooncake" in capsys.readouterr().err
