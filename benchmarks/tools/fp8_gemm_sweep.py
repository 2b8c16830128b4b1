"""The measurements behind sluice.model.fp8_gemm's choices, on Qwen3-8B's four projections (q/k/v,
o, gate_up, down), FP8 weights per 128 x 128 block and per channel, in CUDA graphs over rotating
weight copies (no L2 reuse between calls, as in the model):

1. per shape, scheme and batch size: bf16 cuBLAS on the same shape (the baseline), the
   weight-only kernel (up to 64 rows), at one row also triton_gemm's one-row kernel on the FP8
   weights (fp8_gemm.fp8_row_mm, "row" below: what fp8_linear runs there, over a sweep of its
   tiles, beside _w8a16_kernel's one-row branch in the same run) and the W8A8 path
   (activation quantization included; per channel also torch._scaled_mm) over a sweep of
   tiles, the best and the chosen ones;
2. the decode step's 36 layers of four projections at each swept batch size, chosen against
   bf16 cuBLAS;
3. whether this torch's _scaled_mm takes 1 x 128 / 128 x 128 block scales (recorded).

    PYTHONPATH=. python benchmarks/tools/fp8_gemm_sweep.py OUT_DIR [ROWS]
        # writes OUT_DIR/fp8-gemm-sweep.json; ROWS: e.g. 1,4,16,64,3000 (the default)
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import sys

import torch
import torch.nn.functional as F

from sluice.bench.record import make_record, write_record

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm_sweep import time_graph  # noqa: E402 (the same timing as the bf16 sweep)

from sluice.model import fp8_gemm
from sluice.model.fp8_gemm import Fp8GemmConfig, fp8_row_mm, w8a8_mm, w8a16_mm
from sluice.model.quantization import quantize_fp8
from sluice.model.triton_gemm import GemmConfig

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288)}
LAYERS = 36
ROWS = [1, 4, 16, 64, 3000]
BLOCK = (128, 128)


def w8a16_configs(m: int):
    if m == 1:
        for bn, bk, warps in itertools.product((4, 8, 16), (1024, 2048, 4096), (4, 8)):
            yield Fp8GemmConfig(1, bn, bk, warps, 1)
    elif m <= 8:  # one row a program, each row's programs reading the weights (from L2)
        yield fp8_gemm.w8a16_config(1, 4096, 4096, BLOCK)
        yield fp8_gemm.w8a16_config(1, 4096, 12288, BLOCK)


def row_configs(m: int, k: int):
    """The one-row kernel's tiles on FP8 weights (fp8_gemm.fp8_row_config's untuned rule among
    them): weight rows a program, K an iteration, warps, loads ahead (stages), split-K."""
    if m != 1:
        return
    for bn, bk, warps, stages, split in itertools.product(
            (2, 4, 8), (1024, 2048, 4096), (4, 8), (1, 2, 3), (1, 2)):
        if k % (bk * split) == 0:
            yield GemmConfig(bn, 1, bk, warps, stages, split, fma=True)


def w8a8_configs(m: int, block):
    if m <= 64:
        for bm, bn, bk, stages in itertools.product((16, 32, 64), (16, 32, 64, 128), (128, 256),
                                                    (3, 4, 5)):
            if bm <= max(16, 1 << (m - 1).bit_length()) and (bk == 128 or block is None):
                yield Fp8GemmConfig(bm, bn, bk, 4, stages)
        return
    for cfg in ((128, 256, 128, 8, 3), (128, 128, 128, 8, 3), (64, 256, 128, 8, 3),
                (128, 256, 128, 8, 4), (128, 128, 128, 4, 4), (64, 128, 128, 4, 3)):
        yield Fp8GemmConfig(*cfg)


def _weights(n: int, k: int, block, copies: int):
    out = []
    for _ in range(copies):
        w, s = quantize_fp8(torch.randn(n, k, device="cuda") * 0.03, "block" if block else
                            "channel", BLOCK)
        out.append((w, s if block else s.reshape(n)))
    return out


def _compile(job: tuple) -> tuple | None:
    kind, name, block, m, cfg = job
    n, k = SHAPES[name]
    (w, s), = _weights(n, k, block, 1)
    x = torch.randn(min(m, 256), k, device="cuda", dtype=torch.bfloat16)
    try:
        if kind == "w8a16":
            w8a16_mm(x, w, s, block, Fp8GemmConfig(*cfg))
        elif kind == "row":
            fp8_row_mm(x[:1], w, s, block, GemmConfig(*cfg))
        else:
            w8a8_mm(x, w, s, block, Fp8GemmConfig(*cfg), backend="triton")
        torch.cuda.synchronize()
    except Exception:  # out of shared memory or registers
        return job
    return None


def _jobs(rows: list[int]) -> list[tuple]:
    jobs = []
    for name, block, m in itertools.product(SHAPES, (BLOCK, None), rows):
        jobs += [("w8a16", name, block, 1, tuple(c)) for c in w8a16_configs(m)]
        jobs += [("row", name, block, 1, tuple(c)) for c in row_configs(m, SHAPES[name][1])]
        if m > 1:
            jobs += [("w8a8", name, block, 256, tuple(c)) for c in w8a8_configs(m, block)]
    return sorted(set(jobs), key=str)


def block_scaled_mm_probe() -> dict:
    """Whether torch._scaled_mm takes DeepSeek-style block scales here, and if so its error
    against the Triton kernel."""
    m, n, k = 256, 512, 1024
    w, s = quantize_fp8(torch.randn(n, k, device="cuda"), "block", BLOCK)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q, qs = fp8_gemm.quantize_activations(x, 128)
    want = w8a8_mm(x, w, s, BLOCK).float()
    tries = {"a [M, K/128], b [N/128, K/128]^T": (qs, s.t()),
             "a [M, K/128] col-major, b [K/128, N/128]": (qs.t().contiguous().t(), s.t())}
    out = {}
    for label, (sa, sb) in tries.items():
        try:
            y = torch._scaled_mm(q, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            out[label] = f"ran; max |diff| vs Triton {float((y.float() - want).abs().max()):.4g}"
        except Exception as e:  # noqa: BLE001 (recorded)
            out[label] = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return out


def main() -> None:
    out_dir = sys.argv[1]
    rows = [int(r) for r in sys.argv[2].split(",")] if len(sys.argv) > 2 else ROWS
    jobs = _jobs(rows)
    with mp.get_context("spawn").Pool(min(16, os.cpu_count() or 1)) as pool:
        unfit = {job for job in pool.map(_compile, jobs, chunksize=2) if job is not None}
    result: dict = {"configs_swept": len(jobs) - len(unfit), "shapes": {}, "chain_us": {},
                    "block_scaled_mm": block_scaled_mm_probe()}
    chain: dict = {}
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-200_000_000 // (n * k)))  # FP8 copies past the 50 MB L2, twice
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03
                 for _ in range(max(2, copies // 2))]
        for block in (BLOCK, None):
            scheme = "block" if block else "channel"
            weights = _weights(n, k, block, copies)
            for m in rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                entry = {"cublas_bf16_us": time_graph(
                    [lambda w=w, x=x: F.linear(x, w) for w in dense])}
                for kind, configs in (("w8a16", w8a16_configs(m)), ("row", row_configs(m, k)),
                                      ("w8a8", w8a8_configs(m, block) if m > 1 else [])):
                    times = {}
                    for cfg in configs:
                        rows_key = 256 if kind == "w8a8" else 1
                        if (kind, name, block, rows_key, tuple(cfg)) in unfit:
                            continue
                        fn = {"w8a16": w8a16_mm, "row": fp8_row_mm}.get(kind) or (
                            lambda *a, **kw: w8a8_mm(*a, backend="triton", **kw))
                        times[cfg] = time_graph(
                            [lambda w=w, s=s, c=cfg, x=x, f=fn, b=block: f(x, w, s, b, c)
                             for w, s in weights])
                    if times:
                        ranked = sorted(times, key=times.get)
                        entry[f"{kind}_best"] = [list(ranked[0]), times[ranked[0]]]
                        entry[f"{kind}_top5"] = [[list(c), times[c]] for c in ranked[:5]]
                if m > 1 and (block is None
                              or fp8_gemm.block_scaled_mm_supported(torch.device("cuda"))):
                    entry["scaled_mm_us"] = time_graph(
                        [lambda w=w, s=s, x=x, b=block: w8a8_mm(x, w, s, b, backend="scaled_mm")
                         for w, s in weights])
                entry["chosen_us"] = time_graph(
                    [lambda w=w, s=s, x=x, b=block: fp8_gemm.fp8_linear(x, w, s, b)
                     for w, s in weights])
                entry["fp8_weight_GBps_chosen"] = n * k / entry["chosen_us"] / 1e3
                result["shapes"][f"{name}/{scheme}/{m}"] = entry
                print(name, scheme, m, {key: v for key, v in entry.items() if "top5" not in key},
                      flush=True)
                for key in ("cublas_bf16_us", "chosen_us"):
                    chain.setdefault(f"{scheme}/{m}/{key}", 0.0)
                    chain[f"{scheme}/{m}/{key}"] += LAYERS * entry[key]
            del weights
        del dense
        torch.cuda.empty_cache()
    result["chain_us"] = chain
    record = make_record("fp8-gemm-sweep", result, device="cuda:0",
                         command=["python", "benchmarks/tools/fp8_gemm_sweep.py", *sys.argv[1:]])
    write_record(os.path.join(out_dir, "fp8-gemm-sweep.json"), record)


if __name__ == "__main__":
    main()
