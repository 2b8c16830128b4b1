"""The decode attention kernel as an H100 would run it, read on any machine: the unified kernel's
decode variant compiled for sm90 by Triton (with its bundled ptxas, no GPU needed), and what
its code says about the cost of a key: the shared memory a program takes, the registers a
thread uses, how many programs an SM holds at once, and the PTX instructions a key of its main
loop issues, by opcode.

This is how the 8-bit cache's costs were found: its V read back from shared memory a byte at a
time (`ld.shared.b8`, twelfth session), and its conversions to bfloat16 taking 11.7
instructions a key against the bfloat16 cache's 4.1 (thirteenth session).

    python -m sluice.bench.decode_ptx [--caches bf16,fp8e4nv,fp8e5] [--model-dtype bf16]
                                      [--tiles 128x4x3,64x4x5] [--output FILE]

Caches and dtypes are Triton's names (bf16, fp16, fp32, fp8e4nv = float8_e4m3fn, fp8e5 =
float8_e5m2); tiles are BLOCK_NxWARPSxSTAGES (BLOCK_M 16). Shapes are Qwen3-0.6B's (2 query
heads a KV head, head_dim 128, block size 16). An 8-bit cache under a 16-bit model takes the
float16 dots, as on a GPU (KernelDtypes.fp16_dots); `--no-fp16-dots` compiles the plain
conversions instead.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

from sluice.attention.triton import TileConfig

_16_BIT = ("bf16", "fp16")
_8_BIT = ("fp8e4nv", "fp8e5")
# What the PTX test compiles (tests/kernels/ptx_probe.py): SHORT_DECODE_TILES' shape.
PROBE_TILES = TileConfig(16, 64, 4, 3)


def gpu_fp16_dots(cache: str, model_dtype: str) -> bool:
    """Whether a GPU runs this cache under this model with the float16 dots
    (KernelDtypes.fp16_dots), in Triton's dtype names."""
    return cache in _8_BIT and model_dtype in _16_BIT


def compile_decode_kernel(cache: str, model_dtype: str = "bf16",
                          tiles: TileConfig = PROBE_TILES,
                          fp16_dots: bool | None = None, sliding: bool = False) -> Any:
    """The unified kernel's decode variant (one query a request, ordered, paged, PDL) compiled
    for sm90. `fp16_dots` None: as KernelDtypes.of chooses on an NVIDIA GPU."""
    from sluice.attention.triton.unified import _unified_attention_kernel as kernel

    if fp16_dots is None:
        fp16_dots = gpu_fp16_dots(cache, model_dtype)
    constants = dict(GROUP=2, GROUP_PAD=2, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_Q=8,
                     BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, PAGE_SIZE=16, PAGED=True,
                     UPCAST_DOT=False,
                     DOT_PRECISION="ieee" if model_dtype == "fp32" else "tf32",
                     FP16_DOTS=fp16_dots, ONE_QUERY=True, ORDERED=True, USE_PDL=True,
                     SLIDING=sliding)
    pointers = dict(out_ptr=f"*{model_dtype}", query_ptr=f"*{model_dtype}",
                    key_ptr=f"*{cache}", value_ptr=f"*{cache}", block_tables_ptr="*i32",
                    seq_lens_ptr="*i32", query_start_loc_ptr="*i32", order_ptr="*i32")
    return _compile_sm90(kernel, constants, pointers, ("qk_scale",),
                         ["stride_query_token", "stride_query_head", "stride_out_token",
                          "stride_out_head", "stride_kv_block", "stride_kv_slot",
                          "stride_kv_head"], tiles)


def compile_fused_decode_kernel(cache: str, tiles: TileConfig,
                                model_dtype: str = "bf16", sliding: bool = False) -> Any:
    """The fused decode kernel (sluice.attention.triton.decode_qkv: q/k norm, RoPE, the KV
    store and attention in one launch) as Qwen3-0.6B's layers run it (q/k norms, the input
    norm folded, ordered, PDL), compiled for sm90."""
    from sluice.attention.triton.decode_qkv import _decode_from_qkv_kernel as kernel

    constants = dict(NUM_HEADS=16, GROUP=2, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                     HEAD_DIM=128, PAGE_SIZE=16, HAS_NORM=True, ROW_RMS=True, HIDDEN_PAD=1024,
                     ORDERED=True, UPCAST_DOT=False,
                     DOT_PRECISION="ieee" if model_dtype == "fp32" else "tf32",
                     FP16_DOTS=gpu_fp16_dots(cache, model_dtype), USE_PDL=True,
                     SLIDING=sliding)
    pointers = dict(out_ptr=f"*{model_dtype}", qkv_ptr=f"*{model_dtype}",
                    positions_ptr="*i64", cos_sin_ptr="*fp32", q_weight_ptr=f"*{model_dtype}",
                    k_weight_ptr=f"*{model_dtype}", residual_ptr=f"*{model_dtype}",
                    slot_mapping_ptr="*i64", key_cache_ptr=f"*{cache}",
                    value_cache_ptr=f"*{cache}", block_tables_ptr="*i32", seq_lens_ptr="*i32",
                    order_ptr="*i32")
    return _compile_sm90(kernel, constants, pointers, ("qk_scale", "eps", "residual_eps"),
                         ["stride_qkv_token", "stride_position", "stride_residual",
                          "stride_out_token", "stride_out_head", "stride_kv_block",
                          "stride_kv_slot", "stride_kv_head"], tiles)


def _compile_sm90(kernel: Any, constants: dict[str, Any], pointers: dict[str, str],
                  floats: tuple[str, ...], aligned_strides: list[str],
                  tiles: TileConfig) -> Any:
    """`kernel` compiled for sm90: `constants` bound, `pointers` of their types, the `floats`
    float32 and every other argument int32, the pointers and `aligned_strides` 16-divisible
    (as a launch with aligned tensors specialises them)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in constants else pointers.get(
        name, "fp32" if name in floats else "i32") for name in kernel.arg_names}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in [*pointers, *aligned_strides]}
    return triton.compile(ASTSource(kernel, signature, constants, attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))


def main_loop(ptx: str) -> list[str]:
    """The instructions of the kernel's largest loop (the body between a label and the
    furthest backward branch to it), inline asm included, one string each."""
    lines = [line.strip() for line in ptx.splitlines()]
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"(\$L__\w+):", line))}
    best: tuple[int, int] = (0, 0)
    for i, line in enumerate(lines):
        target = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line)
        if target and labels.get(target.group(1), i) < i:
            start = labels[target.group(1)]
            if i - start > best[1] - best[0]:
                best = (start, i)
    body = lines[best[0] + 1: best[1] + 1]
    return [line for line in body if re.match(r"^(@!?%\w+\s+)?[a-z]", line)
            and not line.startswith(".reg")]


def _opcode(instruction: str) -> str:
    words = instruction.split()
    return words[1] if words[0].startswith("@") else words[0]


def ptxas_usage(ptx: str) -> dict[str, int]:
    """Registers a thread uses, from the bundled ptxas (-v) on the PTX."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o",
                              os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True, check=True)
    registers = re.search(r"Used (\d+) registers", run.stderr)
    return {"registers": int(registers.group(1)) if registers else -1}


# An H100 / H200 SM: 65,536 registers (a thread's count rounded up to 8), 228 KiB of shared
# memory, of which each resident block also reserves 1 KiB.
SM_REGISTERS = 65536
SM_SHARED_BYTES = 228 * 1024
BLOCK_RESERVED_SHARED_BYTES = 1024


def programs_per_sm(registers: int, threads: int, shared_bytes: int) -> int:
    """How many programs (thread blocks) of a kernel an sm90 SM holds at once, by its registers
    and its shared memory (the 32-block and 2,048-thread limits are never the binding ones
    here)."""
    by_registers = SM_REGISTERS // (-(-registers // 8) * 8 * threads)
    return min(by_registers, SM_SHARED_BYTES // (shared_bytes + BLOCK_RESERVED_SHARED_BYTES))


def describe(cache: str, model_dtype: str, tiles: TileConfig,
             fp16_dots: bool | None = None) -> dict[str, Any]:
    if fp16_dots is None:
        fp16_dots = gpu_fp16_dots(cache, model_dtype)
    compiled = compile_decode_kernel(cache, model_dtype, tiles, fp16_dots)
    ptx = compiled.asm["ptx"]
    usage = ptxas_usage(ptx)
    loop = main_loop(ptx)
    opcodes = collections.Counter(_opcode(i) for i in loop)
    return {
        "cache": cache, "model_dtype": model_dtype,
        "tiles": [tiles.block_n, tiles.num_warps, tiles.num_stages],
        "fp16_dots": fp16_dots,
        "shared_bytes": compiled.metadata.shared,
        **usage,
        "programs_per_sm": programs_per_sm(usage["registers"], 32 * tiles.num_warps,
                                           compiled.metadata.shared),
        "loop_instructions": len(loop),
        "loop_instructions_a_key": round(len(loop) / tiles.block_n, 2),
        "ld_shared_b8": sum(1 for i in loop if re.search(r"\bld\.shared\.b8\b", i)),
        "top_opcodes": dict(opcodes.most_common(12)),
    }


def _tiles(text: str) -> TileConfig:
    block_n, warps, stages = (int(v) for v in text.split("x"))
    return TileConfig(16, block_n, warps, stages)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.decode_ptx",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caches", default="bf16,fp8e4nv,fp8e5")
    parser.add_argument("--model-dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--tiles", default="128x4x3,64x4x5")
    parser.add_argument("--no-fp16-dots", action="store_true")
    parser.add_argument("--output")
    ns = parser.parse_args(argv)
    caches = [c for c in ns.caches.split(",") if c]
    for cache in caches:
        if cache not in (*_16_BIT, "fp32", *_8_BIT):
            parser.error(f"unknown cache dtype {cache!r} (bf16, fp16, fp32, fp8e4nv, fp8e5)")
    try:
        tiles = [_tiles(t) for t in ns.tiles.split(",") if t]
    except ValueError:
        parser.error(f"--tiles wants BLOCK_NxWARPSxSTAGES, comma-separated: {ns.tiles!r}")
    rows = [describe(cache, ns.model_dtype, t, False if ns.no_fp16_dots else None)
            for cache in caches for t in tiles]
    for row in rows:
        print(json.dumps(row))
    if ns.output:
        from sluice.bench.record import make_record, write_record

        command = ["python", "-m", "sluice.bench.decode_ptx",
                   *(sys.argv[1:] if argv is None else argv)]
        write_record(ns.output, make_record(
            "decode-ptx", {"target": "sm90 (compiled offline by Triton)", "kernels": rows},
            command=command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
