"""The 8-bit cache's decode kernel as the GPU runs it, checked without a GPU: compiled for sm90
(Triton's bundled ptxas), its V tile is read from shared memory with ldmatrix, not a byte at a
time. Triton moves a plain `.to()` conversion of V after V's staging for the dot, where the
transposed 8-bit operand has no ldmatrix (common.fp8_to_fp16); the check below sees that
too, so a Triton that stops doing it shows here as a failure to look at, not as a silent
slowdown or a stale workaround."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_fp8_decode_kernel_reads_v_with_ldmatrix_not_byte_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "kernels" / "ptx_probe.py")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in counts:
        pytest.skip(counts["skip"])
    for cache in ("fp8e4nv", "fp8e5"):  # e4m3 and e5m2
        converted_first, plain = counts[f"{cache} True"], counts[f"{cache} False"]
        assert converted_first["ld_shared_b8"] == 0 and converted_first["ldmatrix"] > 0, counts
        # The premise: without the early conversion, V comes back byte by byte.
        assert plain["ld_shared_b8"] > 0, counts
