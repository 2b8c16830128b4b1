"""Bandwidth of a PD transfer backend between two processes on this machine: a prefill (this
process) writes N MiB of KV blocks into a decode's cache (a child process) through
`TransferBackend.write`, as a PrefillKVManager does, for each backend asked (shm, fake, and
mooncake where installed), and prints GB/s with the ratio to the first backend.

    python benchmarks/tools/pd_transfer_bandwidth.py --mib 256 --run-blocks 8 \
        --backends shm,fake --output benchmarks/results/kv-transfer/DATE-pd-shm-vs-fake-cpu.json

The blocks go in runs of `--run-blocks` consecutive blocks on both sides (descriptors.py
coalesces a run into one descriptor per layer and K / V), the runs scattered over the decode's
cache. After the timed rounds the decode sums its cache, which must equal the sum of what was
sent (every byte arrived). CPU caches only (float16, Qwen3-0.6B's layer shape: 28 layers, 8 KV
heads of 128, 16-token blocks)."""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sluice.bench.record import make_record, write_record  # noqa: E402
from sluice.kv_transfer.disagg.descriptors import (  # noqa: E402
    CacheLayout,
    block_runs,
    build_descriptors,
)
from sluice.kv_transfer.disagg.messages import ShmExport  # noqa: E402
from sluice.kv_transfer.disagg.transfer import create_backend  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 28, 8, 128, 16, torch.float16
HEAD_BYTES = HEAD_DIM * 2


def _shape(num_blocks: int) -> tuple[int, ...]:
    return (2, num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM)


def _names() -> list[str]:
    return [f"layer.{i}" for i in range(LAYERS)]


def decode_main(backend_name: str, num_blocks: int) -> None:
    """The child: a decode rank's cache behind `backend_name`; its endpoint on stdout, then
    the sum of its cache for every line on stdin."""
    from sluice.kv_transfer.disagg.shm import SharedKVArena

    arena = SharedKVArena("bench-decode") if backend_name == "shm" else None
    if arena is not None:
        caches = arena.allocate(_names(), _shape(num_blocks), DTYPE, torch.device("cpu"))
    else:
        caches = {name: torch.zeros(_shape(num_blocks), dtype=DTYPE) for name in _names()}
    backend = create_backend(backend_name, "127.0.0.1", 1024, arena=arena)
    tensors = list(caches.values())
    backend.register(tensors)
    export = backend.export(tensors)
    hello = {"session": backend.session, "addresses": [t.data_ptr() for t in tensors],
             "export": msgspec.json.decode(msgspec.json.encode(export)) if export else None}
    print(json.dumps(hello), flush=True)
    for _ in sys.stdin:
        total = sum(float(t.double().sum()) for t in tensors)
        print(json.dumps({"sum": total}), flush=True)
    backend.close()


def bench_backend(name: str, mib: int, run_blocks: int, rounds: int, seed: int
                  ) -> dict[str, object]:
    block_bytes = 2 * BLOCK_SIZE * HEADS * HEAD_BYTES * LAYERS  # K and V of every layer
    num_send = max(run_blocks, (mib << 20) // block_bytes // run_blocks * run_blocks)
    num_blocks = 2 * num_send  # the decode's cache: room to scatter the runs
    child = subprocess.Popen([sys.executable, __file__, "--decode", name, str(num_blocks)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        hello = json.loads(child.stdout.readline())
        generator = torch.Generator().manual_seed(seed)
        p_caches = [torch.randn(_shape(num_send), generator=generator).to(DTYPE)
                    for _ in range(LAYERS)]
        backend = create_backend(name, "127.0.0.1", 1024)
        backend.register(p_caches)
        export = (msgspec.json.decode(json.dumps(hello["export"]), type=ShmExport)
                  if hello["export"] else None)
        problem = backend.attach(hello["session"], export)
        assert problem is None, problem
        slots = list(range(num_blocks // run_blocks))
        random.Random(seed).shuffle(slots)
        dst_blocks = [slot * run_blocks + i for slot in slots[:num_send // run_blocks]
                      for i in range(run_blocks)]
        runs = block_runs(list(range(num_send)), dst_blocks)
        src_layout = CacheLayout(tuple(t.data_ptr() for t in p_caches), num_send, BLOCK_SIZE,
                                 HEADS, HEAD_BYTES)
        dst_layout = CacheLayout(tuple(hello["addresses"]), num_blocks, BLOCK_SIZE, HEADS,
                                 HEAD_BYTES)
        src, dst, lengths = build_descriptors(src_layout, dst_layout, runs)
        nbytes = sum(lengths)
        seconds = []
        for _ in range(rounds):
            start = time.perf_counter()
            error = backend.write(hello["session"], src, dst, lengths)
            seconds.append(time.perf_counter() - start)
            assert error is None, error
        child.stdin.write("sum\n")
        child.stdin.flush()
        got = json.loads(child.stdout.readline())["sum"]
        want = sum(float(t.double().sum()) for t in p_caches)
        backend.close()
        median = statistics.median(seconds)
        return {"backend": name, "bytes": nbytes, "blocks": num_send,
                "descriptors": len(lengths), "rounds_s": [round(s, 5) for s in seconds],
                "median_s": round(median, 5), "gb_per_s": round(nbytes / median / 1e9, 3),
                "gb_per_s_best": round(nbytes / min(seconds) / 1e9, 3),
                "every_byte_arrived": abs(got - want) <= 1e-6 * max(1.0, abs(want))}
    finally:
        child.stdin.close()
        child.wait(30)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--decode":
        decode_main(sys.argv[2], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB of blocks per write")
    parser.add_argument("--run-blocks", type=int, default=8,
                        help="consecutive blocks per run (one descriptor per layer and half)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backends", default="shm,fake")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for name in args.backends.split(","):
        row = bench_backend(name, args.mib, args.run_blocks, args.rounds, args.seed)
        row["vs_first"] = round(row["gb_per_s"] / rows[0]["gb_per_s"], 2) if rows else 1.0
        rows.append(row)
        print(f"{name:9s} {row['bytes'] / 2**20:7.1f} MiB in {row['descriptors']:6d} copies: "
              f"{row['gb_per_s']:7.3f} GB/s (median of {args.rounds}; x{row['vs_first']} of "
              f"{rows[0]['backend']}; best {row['gb_per_s_best']:.3f}), every byte arrived: "
              f"{row['every_byte_arrived']}",
              flush=True)
    if args.output is not None:
        results = {"mib": args.mib, "run_blocks": args.run_blocks, "rounds": args.rounds,
                   "layout": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM,
                              "block_size": BLOCK_SIZE, "dtype": str(DTYPE)},
                   "cpu": platform.processor() or platform.machine(), "rows": rows}
        write_record(args.output, make_record("pd-transfer-bandwidth", results,
                                              command=["python", *sys.argv]))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
