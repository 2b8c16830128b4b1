"""Where dense prefill pays in a padded CUDA graph: cuDNN's dense attention over a graph's
padded size P against the paged Triton kernel over the L real tokens of a lone fresh prompt, one
Qwen3-0.6B layer (16 / 8 heads, head_dim 128, bf16), L2 flushed before each replay. The graph
runner's DENSE_MIN_FILL and DENSE_ALWAYS_UP_TO come from this. CUDA only.

    python benchmarks/tools/dense_fill_sweep.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch

from sluice.attention.dense import dense_causal_attention
from sluice.attention.triton_backend import TritonBackend
from sluice.bench.kernels import SCALE, GraphTimer, make_step
from sluice.bench.record import make_record, write_record

SIZES = (128, 256, 512, 1024, 2048, 4096, 8192)
FILLS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def main(output: str) -> None:
    device = torch.device("cuda")
    timer = GraphTimer(device, 20)
    backend = TritonBackend()
    rows = []
    for size in SIZES:
        query, key, value, _, _ = make_step([size], [size], device)
        dense_us = timer(lambda q=query, k=key, v=value: dense_causal_attention(q, k, v, SCALE))
        row = {"padded_tokens": size, "dense_us": round(dense_us * 1e6, 1), "paged_us": {}}
        for fill in FILLS:
            step = make_step([int(size * fill)], [int(size * fill)], device)
            paged = timer(lambda s=step: backend.forward(*s, SCALE, kv_stored=True))
            row["paged_us"][str(fill)] = round(paged * 1e6, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_record(output, make_record("dense-fill-sweep", {"rows": rows}, device=device))


if __name__ == "__main__":
    main(sys.argv[1])
