"""What a new attention shape costs cuDNN: the wall time of the first call of each shape (cuDNN
builds an execution plan for it) against two more calls of the same shape, for the dense
attention sluice runs (sluice.attention.dense): causal over a fresh prompt, and a chunk's
queries over a prefix. Qwen3-0.6B's heads (16 / 8, head_dim 128), bf16. CUDA only.

    PYTHONPATH=. python scripts/cudnn_plan_cost.py OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch

from sluice.attention.dense import _attention_with_lse, dense_causal_attention

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def wall_ms(fn, *args) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return round((time.perf_counter() - start) * 1e3, 2)


def randn(rows: int, heads: int) -> torch.Tensor:
    return torch.randn(rows, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)


def main(argv: list[str]) -> None:
    rows = []
    for n in [1000, 1024, 3000, 5000, 9000, 9001, 9002, 12345, 20000, 20001]:
        q, k, v = randn(n, HEADS), randn(n, KV_HEADS), randn(n, KV_HEADS)
        times = [wall_ms(dense_causal_attention, q, k, v, 0.088) for _ in range(3)]
        rows.append({"call": f"causal n={n}", "ms": times})
        print(rows[-1], flush=True)
    for n, context in [(2048, 3000), (2048, 3001), (4096, 9000), (4096, 9017), (8192, 20000),
                       (8192, 20111)]:
        q, k, v = randn(n, HEADS), randn(context, KV_HEADS), randn(context, KV_HEADS)
        times = [wall_ms(_attention_with_lse, q, k, v, 0.088, False) for _ in range(3)]
        rows.append({"call": f"prefix q={n} c={context}", "ms": times})
        print(rows[-1], flush=True)
    with open(argv[0], "w") as f:
        json.dump({"command": "python scripts/cudnn_plan_cost.py " + " ".join(argv),
                   "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "calls": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
