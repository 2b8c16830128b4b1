"""Where the host time of a pool load and save goes: a batched put and get of KV-block-sized
values through a real backend (local; shm against an in-process `sluice pool-server` arena),
with the integrity check done three ways in the same run:

- crc32, two passes: format 1's check (zlib.crc32 on framing's threads), then the copy (the
  pool before 2026-12-02: the baseline);
- xxh3, two passes: format 2's hash in its own pass, then the copy;
- as shipped: `batch_put` / `batch_get` (on the shm tier, each value hashed in its copy's task).

Each figure is the best of `--repeats` rounds of fresh keys (a put of a key present copies
nothing). No GPU: the DMA to the device is not part of it.

    python benchmarks/tools/pool_host_stages.py [--blocks 400] [--block-bytes 2359296] \
        [--repeats 3] [--output record.json]
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import threading
import time
import zlib
from collections.abc import Callable

import torch

from sluice.kv_transfer.pool import create_backend, framing
from sluice.kv_transfer.pool.shm_server import ArenaServer

_CRC32 = (
    lambda view, offset, size, key: zlib.crc32(view[offset:offset + size],  # noqa: E731
                                               zlib.crc32(key.encode())))


def profile(url: str, num_blocks: int, block_bytes: int, repeats: int) -> dict[str, float]:
    """Best seconds of each stage over `repeats` rounds of fresh keys, by `<way>.<stage>`."""
    backend = create_backend(url, timeout_s=60.0)
    stride = framing.value_size(block_bytes)
    staging = torch.randint(0, 256, (num_blocks * stride,), dtype=torch.uint8)
    backend.register_buffer(staging.data_ptr(), staging.numel())
    view = backend.buffer
    assert view is not None
    offsets = [i * stride for i in range(num_blocks)]
    sizes = [block_bytes] * num_blocks
    value_sizes = [stride] * num_blocks
    rounds: dict[str, list[float]] = {}

    def timed(stage: str, fn: Callable, *args: object) -> object:
        start = time.perf_counter()
        result = fn(*args)
        rounds.setdefault(stage, []).append(time.perf_counter() - start)
        return result

    def crc_all(keys: list[str]) -> list[int]:
        return framing.parallel_map(lambda offset, size, key: _CRC32(view, offset, size, key),
                                    offsets, sizes, keys)

    for round_index in range(repeats):
        for way in ("crc32", "xxh3"):
            keys = [f"profile-{way}-{round_index}-{i}" for i in range(num_blocks)]
            if way == "crc32":
                timed("crc32.put.checksum", crc_all, keys)
            else:
                timed("xxh3.put.checksum", framing.seal_all, view, offsets, sizes, keys)
            timed(f"{way}.put.copy", backend._chunked, backend._put, keys, offsets, value_sizes)
            received = timed(f"{way}.get.copy", backend._chunked, backend._get, keys, offsets,
                             value_sizes)
            if way == "crc32":
                timed("crc32.get.checksum", crc_all, keys)
            else:
                verdicts = timed("xxh3.get.checksum", framing.verify_all, view, offsets, sizes,
                                 keys, received)
                assert set(verdicts) == {framing.Verdict.INTACT}, "a value came back corrupt"
        keys = [f"profile-shipped-{round_index}-{i}" for i in range(num_blocks)]
        assert all(timed("shipped.put", backend.batch_put, keys, offsets, sizes))
        assert all(timed("shipped.get", backend.batch_get, keys, offsets, sizes)), \
            "a value came back corrupt"
    backend.close()
    out = {stage: min(seconds) for stage, seconds in rounds.items()}
    for way in ("crc32", "xxh3"):
        out[f"{way}.put"] = out[f"{way}.put.checksum"] + out[f"{way}.put.copy"]
        out[f"{way}.get"] = out[f"{way}.get.copy"] + out[f"{way}.get.checksum"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=400)
    parser.add_argument("--block-bytes", type=int, default=2359296)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=None, help="write a sluice.bench record here")
    args = parser.parse_args()
    gb = args.blocks * args.block_bytes / 1e9
    slot = -(-framing.value_size(args.block_bytes) // 4096) * 4096
    server = ArenaServer(0, (args.blocks + 8) * slot, slot_bytes=slot)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    command = shlex.join(["python", "benchmarks/tools/pool_host_stages.py", *sys.argv[1:]])
    print(f"command: {command}")
    print(f"{args.blocks} values of {args.block_bytes} bytes ({gb:.2f} GB), {os.cpu_count()} "
          f"cores, {framing._NUM_THREADS} threads, best of {args.repeats}")
    results: dict[str, dict[str, float]] = {}
    for url in ("local", f"shm://127.0.0.1:{server.port}"):
        kind = url.split(":")[0]
        stages = profile(url, args.blocks, args.block_bytes, args.repeats)
        results[kind] = {name: 1e3 * seconds for name, seconds in stages.items()}
        for name in sorted(stages):
            print(f"{kind:6} {name:20} {stages[name] * 1e3:8.1f} ms {gb / stages[name]:6.2f} GB/s")
        for op in ("get", "put"):
            ratio = stages[f"crc32.{op}"] / stages[f"shipped.{op}"]
            results[kind][f"{op}_speedup_vs_crc32"] = ratio
            print(f"{kind:6} {op}: as shipped {ratio:.2f}x faster than crc32 in two passes")
    server.stop()
    if args.output:
        from sluice.bench.pool_backends import machine
        from sluice.bench.record import make_record, write_record

        record = make_record("pool-host-stages", {
            "blocks": args.blocks, "block_bytes": args.block_bytes, "repeats": args.repeats,
            "threads": framing._NUM_THREADS, "ms": results}, command=shlex.split(command))
        record["machine"].update(machine())
        write_record(args.output, record)


if __name__ == "__main__":
    main()
