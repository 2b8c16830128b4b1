"""`sluice bench pd` on the CPU with the tiny model, as the smoke test of the GPU benchmark of
issue 16: a colocated instance, then a prefill, a decode and a router, the same load on both,
and the KV transfer measured; every request completes and the JSON holds the comparison."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.serial


def test_bench_pd_runs_the_whole_comparison_on_the_cpu(qwen3_dir: str, tmp_path: Path) -> None:
    output = tmp_path / "pd.json"
    run = subprocess.run(
        [sys.executable, "-m", "sluice", "bench", "pd", "--model", qwen3_dir, "--device", "cpu",
         "--dtype", "float32", "--max-model-len", "1024", "--backend", "fake",
         "--workload", "48:8", "--request-rates", "inf", "--num-prompts", "4",
         "--num-warmups", "0", "--transfer-prompt-lens", "200", "--transfer-repeats", "1",
         "--goodput", "ttft:5000", "--prefill-device", "cpu", "--decode-device", "cpu",
         "--output", str(output)],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "PD/coloc" in run.stdout and "transfer 200 tokens" in run.stdout
    record = json.loads(output.read_text())
    assert record["schema"] == "sluice.bench/1" and record["bench"] == "pd"
    result = record["results"]
    assert result["prefill_device"] == result["decode_device"] == "cpu"
    for side in ("colocated", "pd"):
        assert result[side]["48:8@inf"]["completed"] == 4
    transfer = result["transfer"]["200"]
    # 200 tokens in blocks of 16: 13 blocks of K and V, 2 layers, 2 heads of 16 floats.
    assert transfer["kv_bytes"] == 13 * 2 * 2 * 16 * 2 * 16 * 4
    assert 0 < transfer["share_of_ttft"] < 1 and transfer["exposed_transfer_s"] <= transfer[
        "transfer_s"]
    # The same prompts, one at a time, on the colocated instance: the no-load comparison.
    assert result["colocated_single"]["200"]["ttft_s"] > 0
    assert "single fresh 200-token prompts: TTFT PD" in run.stdout
    assert result["decode_counters"]["worker_rooms_received"] >= 5
