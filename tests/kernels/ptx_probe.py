"""Compile the decode kernels for sm90 without a GPU (sluice.bench.decode_ptx) and print one
JSON line about them; run by test_fp8_ptx.py in a process of its own (the kernel tests'
interpreter would otherwise wrap the kernels).

- `ptx_probe.py` (the unified kernel's decode variant): per 8-bit cache format, with the float16
  dots and without, the counts of byte loads from shared memory, of ldmatrix, and of
  conversions to bfloat16 in the main loop: how it treats an 8-bit cache.
- `ptx_probe.py fused` (the fused decode kernel, with the backend's fused tiles and with the
  unified kernel's 8-bit tiles): per case, the registers a thread uses (ptxas), the shared
  memory a program takes, and how many programs an SM holds at once.
- `ptx_probe.py variants`: kernels and variants the CPU tests run only under the interpreter,
  which accepts code Triton's compiler refuses: the decode kernels with a sliding window, the
  FP8 norm and SiLU that quantize their output (sluice.model.fp8_gemm); the PTX size of each."""

from __future__ import annotations

import dataclasses
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


def variants() -> dict:
    from sluice.attention.triton_backend import FUSED_DECODE_TILES
    from sluice.bench.decode_ptx import (
        PROBE_TILES,
        _compile_sm90,
        compile_decode_kernel,
        compile_fused_decode_kernel,
    )
    from sluice.model import fp8_gemm

    report = {}
    for cache in ("bf16", "fp8e4nv"):
        report[f"unified decode {cache} sliding"] = len(
            compile_decode_kernel(cache, "bf16", PROBE_TILES, sliding=True).asm["ptx"])
        report[f"fused decode {cache} sliding"] = len(
            compile_fused_decode_kernel(cache, FUSED_DECODE_TILES, sliding=True).asm["ptx"])
    fp8 = dict(FP8_MAX_VALUE=448.0, MIN_SCALE=1e-10)
    for group in (None, 128):  # Qwen3-8B's rows: per token, and per 128-channel group
        size = 4096 if group is None else group
        for residual in (False, True):
            tiles = dataclasses.replace(PROBE_TILES, num_warps=16, num_stages=1)
            compiled = _compile_sm90(
                fp8_gemm._rms_norm_quant_kernel,
                dict(BLOCK=4096, GROUP=size, GROUPS_PAD=4096 // size, NUM_GROUPS=4096 // size,
                     HAS_RESIDUAL=residual, **fp8),
                dict(x_ptr="*bf16", residual_ptr="*bf16", weight_ptr="*bf16",
                     q_ptr="*fp8e4nv", s_ptr="*fp32", sum_ptr="*bf16"), ("eps",), [], tiles)
            report[f"rms_norm_quant {group} {residual}"] = len(compiled.asm["ptx"])
        size = 12288 if group is None else group
        per_program = 1 if group is None else 8
        tiles = dataclasses.replace(PROBE_TILES, num_warps=8, num_stages=1)
        compiled = _compile_sm90(
            fp8_gemm._silu_and_mul_quant_kernel,
            dict(GROUP=size, GROUP_PAD=1 << (size - 1).bit_length(),
                 GROUPS_PER_PROGRAM=per_program, NUM_GROUPS=1 if group is None else 96, **fp8),
            dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32"), (), [], tiles)
        report[f"silu_and_mul_quant {group}"] = len(compiled.asm["ptx"])
    return report


def main(argv: list[str]) -> None:
    probe = {"fused": fused_occupancy, "variants": variants}.get(
        argv[1] if len(argv) > 1 else "", conversions)
    try:
        report = probe()
    except (ImportError, FileNotFoundError, RuntimeError) as exc:
        print(json.dumps({"skip": f"cannot compile for sm90 here: {exc}"}))
        return
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
