"""Time of the tensor-parallel all-reduces of one step, from NCCL alone: per call and per step
(two per layer: after attention's o_proj and the MLP's down_proj) for a model's hidden size and
layer count, at several token counts. A microbenchmark of the collective, not a profile of the
engine: it bounds what TP's communication costs a step.

    python benchmarks/tools/allreduce_time.py [--world-size 2] [--hidden 1024] [--layers 28]
        [--out F]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOKENS = (1, 64, 256, 1024, 8192)


def run(rank: int, world: int, port: int, hidden: int, layers: int, out: str | None) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    rows = []
    for tokens in TOKENS:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        for _ in range(20):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        iters = 200
        start.record()
        for _ in range(iters):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        per_call_us = start.elapsed_time(end) * 1e3 / iters
        rows.append({"tokens": tokens, "bytes": x.numel() * 2, "per_call_us": per_call_us,
                     "per_step_ms": per_call_us * 2 * layers / 1e3})
    if rank == 0:
        from sluice.bench.record import make_record, write_record

        record = make_record("allreduce-time", {
            "world_size": world, "hidden": hidden, "layers": layers,
            "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"), "rows": rows},
            device="cuda:0")
        print(json.dumps(record, indent=1), flush=True)
        if out:
            write_record(out, record)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--port", type=int, default=29531)
    parser.add_argument("--out", default=None)
    ns = parser.parse_args()
    mp.spawn(run, args=(ns.world_size, ns.port, ns.hidden, ns.layers, ns.out),
             nprocs=ns.world_size)


if __name__ == "__main__":
    main()
