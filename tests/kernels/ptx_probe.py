"""Compile the unified kernel's decode variant for sm90 without a GPU and count the PTX
instructions that show how it reads its V tile (run by test_fp8_ptx.py in a process of its own:
the kernel tests' interpreter would otherwise wrap the kernels). Prints one JSON line: per cache
format and V-conversion setting, the counts of byte loads from shared memory and of ldmatrix."""

from __future__ import annotations

import itertools
import json
import re
import sys


def compile_decode_kernel(cache: str, convert_v_first: bool) -> str:
    """`cache`: Triton's name for the 8-bit format (fp8e4nv, fp8e5)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sluice.attention.triton.unified import _unified_attention_kernel as kernel

    constants = dict(GROUP=2, GROUP_PAD=2, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_Q=8,
                     BLOCK_M=16, BLOCK_N=64, PAGE_SIZE=16, PAGED=True, UPCAST_DOT=False,
                     DOT_PRECISION="tf32", FP16_DOTS=convert_v_first, ONE_QUERY=True,
                     ORDERED=True, USE_PDL=True)
    pointers = dict(out_ptr="*bf16", query_ptr="*bf16", key_ptr=f"*{cache}",
                    value_ptr=f"*{cache}", block_tables_ptr="*i32", seq_lens_ptr="*i32",
                    query_start_loc_ptr="*i32", order_ptr="*i32")
    signature = {name: "constexpr" if name in constants else pointers.get(
        name, "fp32" if name == "qk_scale" else "i32") for name in kernel.arg_names}
    aligned = [*pointers, "stride_query_token", "stride_query_head", "stride_out_token",
               "stride_out_head", "stride_kv_block", "stride_kv_slot", "stride_kv_head"]
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, num_stages=3))
    return compiled.asm["ptx"]


def main() -> None:
    try:
        counts = {}
        for cache, convert_v_first in itertools.product(("fp8e4nv", "fp8e5"), (True, False)):
            ptx = compile_decode_kernel(cache, convert_v_first)
            counts[f"{cache} {convert_v_first}"] = {
                "ld_shared_b8": len(re.findall(r"\bld\.shared\.b8\b", ptx)),
                "ldmatrix": len(re.findall(r"\bldmatrix\.", ptx))}
    except (ImportError, FileNotFoundError, RuntimeError) as exc:
        print(json.dumps({"skip": f"cannot compile for sm90 here: {exc}"}))
        return
    print(json.dumps(counts))


if __name__ == "__main__":
    sys.exit(main())
