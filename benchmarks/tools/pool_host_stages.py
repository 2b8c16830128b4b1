"""Where the host time of a pool load and save goes: each stage of a batched put and get of
~1 GB of KV-block-sized values through a real backend (local; shm against an in-process
`sluice pool-server` arena), timed apart: the checksum (framing) and the host copy between the
staging buffer and the store. No GPU: the DMA to the device is not part of it.

    python benchmarks/tools/pool_host_stages.py [--blocks 400] [--block-bytes 2359296]
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch

from sluice.kv_transfer.pool import create_backend, framing
from sluice.kv_transfer.pool.shm_server import ArenaServer


def _time(fn) -> float:  # noqa: ANN001
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def profile(url: str, num_blocks: int, block_bytes: int) -> dict[str, float]:
    backend = create_backend(url)
    stride = framing.value_size(block_bytes)
    staging = torch.randint(0, 256, (num_blocks * stride,), dtype=torch.uint8)
    backend.register_buffer(staging.data_ptr(), staging.numel())
    keys = [f"profile-{i}" for i in range(num_blocks)]
    offsets = [i * stride for i in range(num_blocks)]
    sizes = [block_bytes] * num_blocks
    value_sizes = [stride] * num_blocks
    view = backend.buffer
    out = {
        "put.checksum": _time(lambda: framing.seal_all(view, offsets, sizes, keys)),
        "put.copy": _time(lambda: backend._chunked(backend._put, keys, offsets, value_sizes)),
    }
    received: list = []
    out["get.copy"] = _time(lambda: received.extend(
        backend._chunked(backend._get, keys, offsets, value_sizes)))
    ok: list = []
    out["get.checksum"] = _time(lambda: ok.extend(
        framing.intact_all(view, offsets, sizes, keys, received)))
    assert all(ok), "a value came back corrupt"
    out["get.total"] = _time(lambda: backend.batch_get(keys, offsets, sizes))
    backend.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=400)
    parser.add_argument("--block-bytes", type=int, default=2359296)
    args = parser.parse_args()
    gb = args.blocks * args.block_bytes / 1e9
    server = ArenaServer(0, (args.blocks + 8) * (args.block_bytes + 256),
                         slot_bytes=args.block_bytes + 256)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"{args.blocks} values of {args.block_bytes} bytes ({gb:.2f} GB), "
          f"{os.cpu_count()} cores, {framing._NUM_THREADS} checksum threads")
    for url in ("local", f"shm://127.0.0.1:{server.port}"):
        for stage, seconds in profile(url, args.blocks, args.block_bytes).items():
            print(f"{url.split(':')[0]:6} {stage:13} {seconds * 1e3:8.1f} ms "
                  f"{gb / seconds:6.2f} GB/s")
    server.stop()


if __name__ == "__main__":
    main()
