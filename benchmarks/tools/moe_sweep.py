"""Tiles of the grouped MoE path (sluice.model.triton_moe) for one GPU, measured on it: for each
batch of `--batches` tokens (random routing, each token's top k distinct), every candidate tile
set of each GEMM (gate/up, down) at each alignment block_m, and the alignment kernel against
torch's sort; the fastest sum per batch is written as that GPU's tuned file, which
`triton_moe.moe_tiles` then reads (as vLLM ships its fused-MoE configs per GPU).

    python benchmarks/tools/moe_sweep.py --preset qwen3-30b-a3b \\
        --write-config sluice/model/moe_configs/NVIDIA_H200.json \\
        --output benchmarks/results/kernels/DATE-moe-sweep-h200.json

Each timing is triton.testing.do_bench's median (the L2 cleared between runs: in a model each
layer has its own experts). The heuristic tiles (`_heuristic_config`, what runs without a file)
are timed the same way, and the report gives the ratio, and the expert bytes the step touches
per second (distinct experts hit x their bytes / time). The chosen tiles' output is checked
against the heuristic tiles' (the same sums in another order: bf16 tolerance).
"""

# ruff: noqa: B023 (every closure below is timed before its loop variables move on)
from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sluice.model import tiny, triton_moe  # noqa: E402
from sluice.model.triton_moe import GemmTiles, MoeTiles  # noqa: E402

SMEM_BYTES = 227 * 1024  # an H100 / H200 block's shared memory


def candidates(block_m: int, n: int, k: int) -> list[GemmTiles]:
    out = []
    for block_n, block_k, warps, stages in itertools.product(
            (64, 128), (128, 256), (4, 8), (3, 4)):  # (block_k 64: the heuristic, timed too)
        if block_n > max(64, n) or block_k > max(64, k):
            continue
        if stages * (block_m + block_n) * block_k * 2 > SMEM_BYTES:
            continue
        out.append(GemmTiles(block_n, block_k, warps, stages))
    return out


def bench(fn, triton) -> float:  # noqa: ANN001
    """Microseconds a call: do_bench's median on CUDA; on the CPU (TRITON_INTERPRET=1, a smoke
    run of this script on a small preset) one timed call."""
    if not torch.cuda.is_available():
        fn()
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1e6
    return triton.testing.do_bench(fn, warmup=5, rep=25) * 1e3


def main() -> None:
    import triton

    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(tiny.PRESETS))
    ap.add_argument("--batches", default="4,8,16,32,64,128,256,512")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--write-config")
    ap.add_argument("--output")
    ap.add_argument("--shape", help="E,H,I,top_k instead of the preset's (a CPU smoke run)")
    a = ap.parse_args()
    cfg = tiny.PRESETS[a.preset]
    e, h, inter, top_k = (map(int, a.shape.split(",")) if a.shape else (
        cfg["num_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"],
        cfg["num_experts_per_tok"]))
    dtype = getattr(torch, a.dtype)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    w13 = torch.randn(e, 2 * inter, h, device=dev, dtype=dtype) * 0.02
    w2 = torch.randn(e, h, inter, device=dev, dtype=dtype) * 0.02
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    key = triton_moe.moe_shape_key(e, h, inter, top_k, dtype)
    started = time.time()
    rows, buckets = [], {}
    for t in (int(b) for b in a.batches.split(",")):
        pairs = t * top_k
        if pairs <= triton_moe.PAIR_KERNEL_MAX_PAIRS:
            continue  # the pair kernel: no tiles
        x = torch.randn(t, h, device=dev, dtype=dtype)
        ids = torch.rand(t, e, device=dev).topk(top_k, dim=1).indices
        weights = torch.rand(t, top_k, device=dev, dtype=dtype)
        flat_w = weights.reshape(-1).contiguous()
        inter_buf = torch.empty(pairs, 2 * inter, device=dev, dtype=dtype)
        out = torch.empty(pairs, h, device=dev, dtype=dtype)
        hit = int(ids.unique().numel())
        heuristic = triton_moe._heuristic_config(pairs, e, 2 * inter, h, inter, None)
        base_us = bench(lambda: triton_moe.fused_experts(x, w13, w2, weights, ids,
                                                         tiles=heuristic), triton)
        best = None
        for block_m in (16, 32, 64):
            align = {}
            for mode in triton_moe.ALIGN_MODES:
                if mode == "kernel" and pairs > triton_moe.ALIGN_KERNEL_MAX_PAIRS:
                    continue
                align[mode] = bench(lambda: triton_moe.align_by_expert(ids, e, block_m, mode),
                                    triton)
            mode = min(align, key=align.get)
            sorted_ids, block_expert = triton_moe.align_by_expert(ids, e, block_m, mode)
            picks = {}
            for part, (a_in, b, c, per_pair, silu, mul) in {
                    "gate_up": (x, w13, inter_buf, False, False, False),
                    "down": (inter_buf, w2, out, True, True, True)}.items():
                timed = []
                base_tiles = getattr(heuristic, part)
                for tiles in {base_tiles, *candidates(block_m, b.shape[1], b.shape[2])}:
                    def run(tiles=tiles, a_in=a_in, b=b, c=c, per_pair=per_pair, silu=silu,
                            mul=mul) -> None:
                        triton_moe._gemm(a_in, b, c, flat_w, sorted_ids, block_expert, top_k,
                                         block_m, a_row_per_pair=per_pair, silu_mul=silu,
                                         mul_weight=mul, tiles=tiles)
                    try:
                        timed.append((bench(run, triton), tiles))
                    except Exception as exc:  # noqa: BLE001 (out of resources: not a candidate)
                        print(f"  skip {part} {tiles}: {type(exc).__name__}", flush=True)
                picks[part] = min(timed)
            total = align[mode] + picks["gate_up"][0] + picks["down"][0]
            if best is None or total < best[0]:
                best = (total, MoeTiles(block_m, picks["gate_up"][1], picks["down"][1], mode))
                align_us = {k: round(v, 1) for k, v in align.items()}
        tiles = best[1]
        tuned_us = bench(lambda: triton_moe.fused_experts(x, w13, w2, weights, ids,
                                                          tiles=tiles), triton)
        want = triton_moe.fused_experts(x, w13, w2, weights, ids, tiles=heuristic)
        got = triton_moe.fused_experts(x, w13, w2, weights, ids, tiles=tiles)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
        row = {"tokens": t, "pairs": pairs, "experts_hit": hit,
               "heuristic_us": round(base_us, 1), "tuned_us": round(tuned_us, 1),
               "speedup": round(base_us / tuned_us, 3),
               "tuned_tb_s": round(hit * expert_bytes / tuned_us / 1e6, 2),
               "align_us": align_us, "heuristic": heuristic._asdict(),
               "tuned": tiles._asdict()}
        rows.append(row)
        if tuned_us < base_us:  # else no entry: the heuristic stays
            buckets[str(pairs)] = {"block_m": tiles.block_m, "gate_up": list(tiles.gate_up),
                                   "down": list(tiles.down), "align": tiles.align}
        print(f"T={t:4d} pairs={pairs:5d} hit={hit:3d}  heuristic {base_us:8.1f} us  "
              f"tuned {tuned_us:8.1f} us  x{base_us / tuned_us:.3f}  "
              f"{row['tuned_tb_s']:.2f} TB/s  {tiles}", flush=True)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    command = "python " + " ".join(sys.argv)
    if a.write_config:
        path = Path(a.write_config)
        path.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(path.read_text()) if path.is_file() else {"shapes": {}}
        old["gpu"] = gpu
        old.setdefault("shapes", {})[key] = buckets
        old.setdefault("commands", {})[key] = command
        path.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")
    record = {"bench": "moe-sweep", "command": command, "gpu": gpu, "shape": key,
              "machine": platform.node(), "torch": torch.__version__,
              "triton": triton.__version__, "seconds": round(time.time() - started, 1),
              "rows": rows}
    if a.output:
        Path(a.output).write_text(json.dumps(record, indent=1) + "\n")
    print(f"command: {command}\nmachine: {gpu} | torch {torch.__version__} | "
          f"triton {triton.__version__}; {record['seconds']} s")


if __name__ == "__main__":
    main()
