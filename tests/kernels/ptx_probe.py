"""Compile the decode kernels for sm90 without a GPU (sluice.bench.decode_ptx) and print one
JSON line about them; run by test_fp8_ptx.py in a process of its own (the kernel tests'
interpreter would otherwise wrap the kernels).

- `ptx_probe.py` (the unified kernel's decode variant): per 8-bit cache format, with the float16
  dots and without, the counts of byte loads from shared memory, of ldmatrix, and of
  conversions to bfloat16 in the main loop: how it treats an 8-bit cache.
- `ptx_probe.py fused` (the fused decode kernel, with the backend's fused tiles and with the
  unified kernel's 8-bit tiles): per case, the registers a thread uses (ptxas), the shared
  memory a program takes, and how many programs an SM holds at once."""

from __future__ import annotations

import itertools
import json
import re
import sys


def conversions() -> dict:
    from sluice.bench.decode_ptx import PROBE_TILES, compile_decode_kernel, main_loop

    counts = {}
    for cache, fp16_dots in itertools.product(("fp8e4nv", "fp8e5"), (True, False)):
        ptx = compile_decode_kernel(cache, "bf16", PROBE_TILES, fp16_dots).asm["ptx"]
        counts[f"{cache} {fp16_dots}"] = {
            "ld_shared_b8": len(re.findall(r"\bld\.shared\.b8\b", ptx)),
            "ldmatrix": len(re.findall(r"\bldmatrix\.", ptx)),
            "loop_to_bf16": sum("cvt.bf16" in i or "cvt.rn.bf16" in i
                                for i in main_loop(ptx))}
    return counts


def fused_occupancy() -> dict:
    from sluice.attention.triton_backend import (
        FP8_DECODE_TILES,
        FP8_FUSED_DECODE_TILES,
        FUSED_DECODE_TILES,
    )
    from sluice.bench.decode_ptx import compile_fused_decode_kernel, programs_per_sm, ptxas_usage

    cases = {"bf16 fused": ("bf16", FUSED_DECODE_TILES),
             "fp8e4nv fused": ("fp8e4nv", FP8_FUSED_DECODE_TILES),
             "fp8e5 fused": ("fp8e5", FP8_FUSED_DECODE_TILES),
             "fp8e4nv unified tiles": ("fp8e4nv", FP8_DECODE_TILES)}
    report = {}
    for name, (cache, tiles) in cases.items():
        compiled = compile_fused_decode_kernel(cache, tiles)
        usage = ptxas_usage(compiled.asm["ptx"])
        report[name] = {"shared_bytes": compiled.metadata.shared, **usage,
                        "programs_per_sm": programs_per_sm(
                            usage["registers"], 32 * tiles.num_warps, compiled.metadata.shared)}
    return report


def main(argv: list[str]) -> None:
    probe = fused_occupancy if argv[1:] == ["fused"] else conversions
    try:
        report = probe()
    except (ImportError, FileNotFoundError, RuntimeError) as exc:
        print(json.dumps({"skip": f"cannot compile for sm90 here: {exc}"}))
        return
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
