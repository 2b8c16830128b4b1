"""The measurements behind sluice.model.triton_gemm's choices, on the four projections of
Qwen3-0.6B or Qwen3-8B (q/k/v, o, gate_up, down with SiLU-and-mul folded in), bf16, in CUDA graphs
over rotating weight copies (no L2 reuse between calls, as in the model):

1. per shape and batch size: cuBLAS (the down projection: the SiLU-and-mul kernel then cuBLAS),
   the best of a sweep of Triton configurations (tensor-core tiles, and for at most 4 rows the
   CUDA-core tiles of GemmConfig.fma), the five best, and the configuration choose_config picks;
2. the whole decode chain of 28 layers' four projections, cuBLAS against triton_gemm.linear /
   silu_mul_linear (what the model runs) and against the best configuration of each shape.

    PYTHONPATH=. python benchmarks/tools/gemm_sweep.py OUT_DIR [ROWS]
        # writes OUT_DIR/gemm-sweep.json; ROWS: e.g. 1,4,16 (the default)
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import sys

import torch
import torch.nn.functional as F

from sluice.bench.record import make_record, write_record
from sluice.model import triton_gemm, triton_ops
from sluice.model.triton_gemm import GemmConfig, choose_config, skinny_mm

# (N, K) of each projection, the decoder's layers, hidden size and q/k/v's query columns
ARCHS = {
    "qwen3-0.6b": ({"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024),
                    "down": (1024, 3072)}, 28, 1024, 2048),
    "qwen3-8b": ({"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
                  "down": (4096, 12288)}, 36, 4096, 4096),
}
SWEEP_ROWS = [1, 4, 16]
COPIES = 24
REPS = 10


def time_graph(fns: list) -> float:
    """Microseconds per call: the calls captured in one graph, best of 5 timings of REPS
    replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPS):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / REPS / len(fns))
    return best


def configs(m: int, k: int):
    if m > 16:  # tiles as tall as the batch (a power of two), weight tiles 32 to 128 wide
        bm = 1 << (m - 1).bit_length()
        for bn, bk, stages, split in itertools.product((32, 64, 128), (128, 256), (3, 4, 5),
                                                       (1, 2, 4)):
            if k % (bk * split) == 0 and k // split >= 2 * bk and (
                    bn + bm) * bk * 2 * stages <= 200_000:
                yield GemmConfig(bn, bm, bk, 4, stages, split)
        return
    for bn, bm, bk, stages, split in itertools.product(
            (16, 32, 64, 128), (16, 32, 64), (128, 256), (3, 5), (1, 2, 4, 8)):
        if bm > max(16, 1 << (m - 1).bit_length()) or k % (bk * split) or k // split < 2 * bk:
            continue
        if (bn + bm) * bk * 2 * stages > 200_000:
            continue
        yield GemmConfig(bn, bm, bk, 4, stages, split)
    if m > 4:
        return
    if m == 1:  # one row a program (_row_mm_kernel); stages 2: loaded ahead by hand
        for bn, bk, warps, stages, split in itertools.product(
                (2, 4, 8, 16), (512, 1024, 2048), (4, 8), (2, 3), (1, 2)):
            if k % (bk * split) == 0 and k // split >= bk:
                yield GemmConfig(bn, 1, bk, warps, stages, split, True)
        return
    bm = 1 << (m - 1).bit_length()  # CUDA-core tiles: the rows in one tile
    for bn, bk, warps, stages, split in itertools.product(
            (4, 8, 16, 32), (128, 256, 512, 1024), (4, 8), (1, 3), (1, 2)):
        if k % (bk * split) == 0 and k // split >= bk:
            yield GemmConfig(bn, bm, bk, warps, stages, split, True)


def _compile(job: tuple[str, str, tuple]) -> tuple | None:
    """Build one variant; the job back if it does not fit the GPU."""
    arch, name, cfg = job
    n, k = ARCHS[arch][0][name]
    silu = name == "down"
    x = torch.randn(4, 2 * k if silu else k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    try:
        skinny_mm(x, w, GemmConfig(*cfg), silu_mul=silu)
    except Exception:  # out of shared memory
        return job
    torch.cuda.synchronize()
    return None


def cublas(x: torch.Tensor, w: torch.Tensor, silu: bool) -> torch.Tensor:
    return F.linear(triton_ops.silu_and_mul(x) if silu else x, w)


def main() -> None:
    out_dir = sys.argv[1]
    rows = [int(r) for r in sys.argv[2].split(",")] if len(sys.argv) > 2 else SWEEP_ROWS
    arch = sys.argv[3] if len(sys.argv) > 3 else "qwen3-0.6b"
    shapes, num_layers, hidden, q_size = ARCHS[arch]
    jobs = sorted({(arch, name, tuple(c)) for name, (_, k) in shapes.items()
                   for m in rows for c in configs(m, k)})
    with mp.get_context("spawn").Pool(min(16, os.cpu_count() or 1)) as pool:
        # fill Triton's cache in parallel; drop what does not fit
        unfit = {job[1:] for job in pool.map(_compile, jobs, chunksize=4) if job is not None}
    result = {"arch": arch, "configs_swept": len(jobs) - len(unfit), "shapes": {},
              "chain_us": {}}
    best_configs: dict[tuple[str, int], GemmConfig] = {}
    for name, (n, k) in shapes.items():
        silu = name == "down"
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03
                   for _ in range(COPIES)]
        for m in rows:
            x = torch.randn(m, 2 * k if silu else k, device="cuda", dtype=torch.bfloat16)
            t_cublas = time_graph([lambda w=w, x=x, s=silu: cublas(x, w, s) for w in weights])
            times = {}
            for cfg in configs(m, k):
                if (name, tuple(cfg)) in unfit:
                    continue
                times[cfg] = time_graph([lambda w=w, x=x, c=cfg, s=silu:
                                         skinny_mm(x, w, c, silu_mul=s) for w in weights])
            ranked = sorted(times, key=times.get)
            best = ranked[0]
            best_configs[name, m] = best
            chosen = choose_config(m, n, k, silu_mul=silu)
            weight_bytes = n * k * 2
            row = {"cublas_us": round(t_cublas, 2), "best_us": round(times[best], 2),
                   "best_config": list(best),
                   "best_tb_s": round(weight_bytes / times[best] / 1e6, 2),
                   "cublas_tb_s": round(weight_bytes / t_cublas / 1e6, 2),
                   "top5": [[list(c), round(times[c], 2)] for c in ranked[:5]],
                   "chosen_config": list(chosen) if chosen else None,
                   "chosen_us": round(times[chosen], 2) if chosen in times else None}
            result["shapes"][f"{name} m={m}"] = row
            print(f"{name:8s} m={m:3d} {row}", flush=True)
        del weights
    layers = {name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03
                     for _ in range(num_layers)] for name, (n, k) in shapes.items()}
    for m in rows:
        h = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)

        def layer(i: int, kind: str, h: torch.Tensor = h, m: int = m):
            def best(name: str, x: torch.Tensor) -> torch.Tensor:
                return skinny_mm(x, layers[name][i], best_configs[name, m],
                                 silu_mul=name == "down")

            def run() -> None:
                if kind == "best":
                    best("down", best("gate_up", best("o", best("qkv", h)[:, :q_size])))
                    return
                lin = triton_gemm.linear if kind == "sluice" else F.linear
                qkv = lin(h, layers["qkv"][i])
                o = lin(qkv[:, :q_size], layers["o"][i])
                gate_up = lin(o, layers["gate_up"][i])
                if kind == "sluice":
                    triton_gemm.silu_mul_linear(gate_up, layers["down"][i])
                else:
                    F.linear(triton_ops.silu_and_mul(gate_up), layers["down"][i])
            return run

        row = {kind: round(num_layers * time_graph([layer(i, kind) for i in range(num_layers)]),
                           1)
               for kind in ("cublas", "sluice", "best")}
        result["chain_us"][f"m={m}"] = row
        print(f"{num_layers} layers' projections, {m} rows: {row} us", flush=True)
    write_record(os.path.join(out_dir, f"gemm-sweep-{arch}.json"),
                 make_record("gemm-sweep", result, device="cuda"))


if __name__ == "__main__":
    main()
