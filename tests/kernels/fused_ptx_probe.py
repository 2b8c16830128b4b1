"""Compile the fused decode kernel for sm90 without a GPU (sluice.bench.decode_ptx) with the
backend's fused tiles and with the unified kernel's 8-bit tiles, and print one JSON line: per
case, the registers a thread uses (ptxas), the shared memory a program takes, and how many
programs an SM holds at once. Run by
test_fused_decode_occupancy in a process of its own (the kernel tests' interpreter would
otherwise wrap the kernels)."""

from __future__ import annotations

import json
import sys


def main() -> None:
    try:
        from sluice.attention.triton_backend import (
            FP8_DECODE_TILES,
            FP8_FUSED_DECODE_TILES,
            FUSED_DECODE_TILES,
        )
        from sluice.bench.decode_ptx import (
            compile_fused_decode_kernel,
            programs_per_sm,
            ptxas_usage,
        )

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
                                usage["registers"], 32 * tiles.num_warps,
                                compiled.metadata.shared)}
    except (ImportError, FileNotFoundError, RuntimeError) as exc:
        print(json.dumps({"skip": f"cannot compile for sm90 here: {exc}"}))
        return
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
