"""`python -m sluice.bench.pool_backends` runs end to end and reports each backend against local."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice.bench import pool_backends
from tests.kv_transfer.conftest import require

pytestmark = pytest.mark.one_worker


def test_pool_bench_reports_every_backend_against_local(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    require("redis")
    require("shm")
    out = tmp_path / "pool.json"
    assert pool_backends.main(["--num-values", "16", "--value-size", "4096", "--repeats", "1",
                               "--backends", "redis,shm", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "command: python" in printed and "machine: cpu" in printed
    record = json.loads(out.read_text())
    assert record["schema"] == "sluice.bench/1" and record["bench"] == "pool-backends"
    assert record["machine"]["cpus"] and "load_1min" in record["machine"]
    backends = record["results"]["backends"]
    assert [r["backend"] for r in backends] == ["local", "redis", "shm"]  # local first
    local, redis, shm = backends
    assert shm["get_gb_s"] > 0 and shm["put_gb_s"] > 0
    assert local["vs_local"] == {"put": 1.0, "put_again": 1.0, "exists": 1.0, "get": 1.0}
    assert redis["get_gb_s"] > 0 and redis["exists_keys_s"] > 0
    assert redis["vs_local"]["get"] == pytest.approx(redis["get_gb_s"] / local["get_gb_s"])


def test_pool_bench_rejects_unknown_backends() -> None:
    with pytest.raises(SystemExit):
        pool_backends.main(["--backends", "memcached"])
