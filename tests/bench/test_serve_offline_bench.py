"""`sluice bench serve-vs-offline` on the CPU with the tiny model: the same prompts through
LLM.generate and through a real `sluice serve` (here with two API-server processes, given by
--server-args), every request completed, the served runs' throughput reported as a fraction of
the offline run's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.one_worker


def test_bench_serve_vs_offline_reports_each_served_run_against_offline(
        qwen3_dir: str, tmp_path: Path) -> None:
    output = tmp_path / "serve-vs-offline.json"
    run = subprocess.run(
        [sys.executable, "-m", "sluice", "bench", "serve-vs-offline", "--model", qwen3_dir,
         "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
         "--num-prompts", "6", "--random-input-len", "24", "--random-output-len", "8",
         "--random-range-ratio", "0.5", "--max-concurrency", "inf,2", "--num-clients", "1",
         "--num-warmups", "0", "--server-args", "--api-server-count 2",
         "--output", str(output)],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads(output.read_text())
    assert record["schema"] == "sluice.bench/1" and record["bench"] == "serve-vs-offline"
    result = record["results"]
    offline, served = result["offline"], result["served"]
    # Each prompt generates its own output length (ignore_eos), offline and served alike.
    assert [(s["max_concurrency"], s["num_clients"]) for s in served] == [(None, 1), (2, 1)]
    for s in served:
        assert s["completed"] == 6
        assert s["total_output_tokens"] == offline["output_tokens"]
        assert s["fraction_of_offline"] == pytest.approx(
            s["output_throughput"] / offline["output_throughput"])
    assert "/offline" in run.stdout
    assert record["command"][:3] == ["sluice", "bench", "serve-vs-offline"]
    assert result["server_args"] == "--api-server-count 2"


def test_bench_serve_vs_offline_refuses_bad_lists() -> None:
    from sluice.bench.serve_offline import _parse_clients, _parse_concurrencies

    assert _parse_concurrencies("inf,32") == [None, 32]
    with pytest.raises(ValueError, match="--max-concurrency.*'0'"):
        _parse_concurrencies("inf,0")
    with pytest.raises(ValueError, match="--num-clients"):
        _parse_clients("1,x")
