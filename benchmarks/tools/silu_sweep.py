"""silu_and_mul on Qwen3-8B's shapes (intermediate 12,288, the residual's 1 / rms over hidden
4,096, bf16) at five token counts, by column blocks a program: the measurement behind
triton_ops.silu_blocks_per_program. CUDA only.

    PYTHONPATH=. python benchmarks/tools/silu_sweep.py OUT_JSON
"""

from __future__ import annotations

import json
import sys

import torch
import triton

from sluice.model import triton_ops

TOKENS = (64, 256, 1024, 3072, 8192)
BLOCKS_PER_PROGRAM = (1, 2, 3, 4, 6, 8, 12)


def main() -> None:
    result = {}
    for tokens in TOKENS:
        x = torch.randn(tokens, 2 * 12288, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
        row = {}
        for per in BLOCKS_PER_PROGRAM:
            triton_ops.silu_blocks_per_program = lambda n, c, per=per: per
            ms = triton.testing.do_bench(
                lambda x=x, r=residual: triton_ops.silu_and_mul(x, r, 1e-6), warmup=20, rep=100)
            row[per] = round(ms * 1e3, 1)
        result[tokens] = row
        print(tokens, "tokens, us by blocks per program:", row, flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
