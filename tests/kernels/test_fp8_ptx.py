"""The 8-bit cache's decode kernel as the GPU runs it, checked without a GPU: compiled for sm90
(Triton's bundled ptxas), its V tile is read from shared memory with ldmatrix, not a byte at a
time, and its main loop converts nothing to bfloat16 (the float16 dots). Triton moves a plain
`.to()` conversion of V after V's staging for the dot, where the transposed 8-bit operand has
no ldmatrix (common.fp8_to_fp16); the check below sees that too, so a Triton that stops doing
it shows here as a failure to look at, not as a silent slowdown or a stale workaround."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    """A process that compiles for sm90 (not the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


def test_the_fp8_decode_kernel_reads_v_with_ldmatrix_and_dots_in_fp16() -> None:
    run = _run(str(ROOT / "tests" / "kernels" / "ptx_probe.py"))
    assert run.returncode == 0, run.stderr[-3000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in counts:
        pytest.skip(counts["skip"])
    for cache in ("fp8e4nv", "fp8e5"):  # e4m3 and e5m2
        fp16_dots, plain = counts[f"{cache} True"], counts[f"{cache} False"]
        assert fp16_dots["ld_shared_b8"] == 0 and fp16_dots["ldmatrix"] > 0, counts
        assert fp16_dots["loop_to_bf16"] == 0, counts
        # The premises: with plain conversions V comes back byte by byte, and K and V are
        # converted to the model's bfloat16 in the loop.
        assert plain["ld_shared_b8"] > 0 and plain["loop_to_bf16"] > 0, counts


def test_the_decode_ptx_report_describes_a_kernel_and_refuses_bad_tiles() -> None:
    run = _run("-m", "sluice.bench.decode_ptx", "--caches", "fp8e4nv", "--tiles", "64x4x5")
    if run.returncode != 0 and "ptxas" in run.stderr and "No such file" in run.stderr:
        pytest.skip("no ptxas bundled with this Triton")
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = [json.loads(line) for line in run.stdout.splitlines()]
    assert row["cache"] == "fp8e4nv" and row["tiles"] == [64, 4, 5] and row["fp16_dots"]
    assert row["registers"] > 0 and row["shared_bytes"] > 0 and row["ld_shared_b8"] == 0
    assert row["loop_instructions"] == round(row["loop_instructions_a_key"] * 64)
    assert any(op.startswith("mma.sync") and "f16.f16" in op for op in row["top_opcodes"])
    bad = _run("-m", "sluice.bench.decode_ptx", "--tiles", "64x4")
    assert bad.returncode == 2 and "BLOCK_NxWARPSxSTAGES" in bad.stderr



def test_the_fused_decode_kernels_tiles_fit_four_programs_an_sm() -> None:
    """The fused decode kernel takes batches of up to FUSED_DECODE_MAX_PROGRAMS_PER_SM (4)
    programs an SM, so its tiles must let 4 be resident at once (registers and shared
    memory), or the batch runs in two waves: what the unified kernel's 8-bit tiles did (140
    registers a thread: 3 programs an SM), the fifteenth session's finding on the H200."""
    from sluice.attention.triton_backend import FUSED_DECODE_MAX_PROGRAMS_PER_SM

    run = _run(str(ROOT / "tests" / "kernels" / "ptx_probe.py"), "fused")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])

    for name in ("bf16 fused", "fp8e4nv fused", "fp8e5 fused"):
        assert report[name]["programs_per_sm"] >= FUSED_DECODE_MAX_PROGRAMS_PER_SM, report
    # The premise: the unified kernel's 8-bit tiles do not fit four of the fused kernel.
    assert (report["fp8e4nv unified tiles"]["programs_per_sm"]
            < FUSED_DECODE_MAX_PROGRAMS_PER_SM), report


def test_programs_per_sm_counts_registers_in_eights_and_a_reserved_kib():
    from sluice.bench.decode_ptx import programs_per_sm

    assert programs_per_sm(128, 128, 39168) == 4  # 16,384 registers a program
    assert programs_per_sm(129, 128, 39168) == 3  # 136 after rounding: 17,408
    assert programs_per_sm(64, 128, 56 * 1024) == 4  # 57 KiB with the reserve: 4 in 228
    assert programs_per_sm(64, 128, 57 * 1024) == 3


def test_kernels_the_cpu_runs_only_interpreted_compile_for_sm90() -> None:
    """The interpreter runs code Triton's compiler refuses (a branch on a run-time value that
    changes a tensor's shape, say): the windowed decode kernels and the FP8 norm and SiLU
    that quantize their output compile for sm90."""
    run = _run(str(ROOT / "tests" / "kernels" / "ptx_probe.py"), "variants")
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in report:
        pytest.skip(report["skip"])
    assert len(report) == 10 and all(size > 1000 for size in report.values()), report
