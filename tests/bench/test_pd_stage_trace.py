"""benchmarks/tools/pd_stage_trace.py on the CPU with the tiny model: every process's stage
marks (sluice/stage_trace.py) reach the merged timeline, so each PD stage of a request and
each colocated one is measured, within the TTFT."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]


def test_the_stage_trace_measures_every_stage_of_pd_and_colocated(qwen3_dir: str,
                                                                   tmp_path: Path) -> None:
    output = tmp_path / "stages.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/tools/pd_stage_trace.py"), "--model", qwen3_dir,
         "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
         "--prompt-lens", "100", "--repeats", "2", "--modes", "colocated,pd",
         "--backend", "shm", "--output", str(output)],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads(output.read_text())
    assert record["bench"] == "pd-stage-trace"
    modes = record["results"]["modes"]
    colocated = modes["colocated"]["stages_ms"]["100"]
    pd = modes["pd"]["stages_ms"]["100"]
    assert set(colocated) == {"client_to_api", "api_to_core", "core_to_sched", "compute",
                              "first_to_client", "ttft"}
    assert set(pd) == {"router_hop", "decode_ask", "hold", "compute", "send_plan",
                       "room_write", "status_to_first", "first_to_client", "ttft"}
    # Colocated's stages follow one another; PD's may overlap (the decode's ask runs while
    # the prefill holds the request), each within the TTFT.
    assert all(v >= 0 for v in colocated.values()), colocated
    assert sum(v for k, v in colocated.items() if k != "ttft") <= colocated["ttft"] + 1e-6
    assert all(0 <= v <= pd["ttft"] + 1e-6 for v in pd.values()), pd
    # Every process marked: the router, both PD instances and the client.
    processes = {mark[1] for mark in modes["pd"]["marks"]}
    assert {"router", "prefill0", "decode0", "client"} <= processes
