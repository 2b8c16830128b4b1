"""Compile the unified kernel's decode variant for sm90 without a GPU (sluice.bench.decode_ptx)
and count the PTX instructions that show how it treats an 8-bit cache (run by test_fp8_ptx.py
in a process of its own: the kernel tests' interpreter would otherwise wrap the kernels).
Prints one JSON line: per cache format, with the float16 dots and without, the counts of byte
loads from shared memory, of ldmatrix, and of conversions to bfloat16 in the main loop."""

from __future__ import annotations

import itertools
import json
import re
import sys


def main() -> None:
    try:
        from sluice.bench.decode_ptx import PROBE_TILES, compile_decode_kernel, main_loop

        counts = {}
        for cache, fp16_dots in itertools.product(("fp8e4nv", "fp8e5"), (True, False)):
            ptx = compile_decode_kernel(cache, "bf16", PROBE_TILES, fp16_dots).asm["ptx"]
            counts[f"{cache} {fp16_dots}"] = {
                "ld_shared_b8": len(re.findall(r"\bld\.shared\.b8\b", ptx)),
                "ldmatrix": len(re.findall(r"\bldmatrix\.", ptx)),
                "loop_to_bf16": sum("cvt.bf16" in i or "cvt.rn.bf16" in i
                                    for i in main_loop(ptx))}
    except (ImportError, FileNotFoundError, RuntimeError) as exc:
        print(json.dumps({"skip": f"cannot compile for sm90 here: {exc}"}))
        return
    print(json.dumps(counts))


if __name__ == "__main__":
    sys.exit(main())
