"""How long a step's small device-to-host copy (its sampled tokens) waits while the pool's save
copy of one 8B 4k-token prompt (576 MiB, pinned) runs on another stream: issued whole, and in
pieces of the pool's DMA_CHUNK_BYTES (sluice/kv_transfer/pool/mover.py). Also the same for a
small host-to-device copy (a step's inputs) behind a load copy.

    PYTHONPATH=. python3 benchmarks/tools/dma_interleave.py
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from sluice.bench.serve import machine_line
from sluice.kv_transfer.pool.mover import DMA_CHUNK_BYTES, chunked_copy

BIG = 576 << 20


def wait_ms(direction: str, chunk: int, repeats: int = 5) -> float:
    dev = torch.empty(BIG, dtype=torch.uint8, device="cuda")
    host = torch.empty(BIG, dtype=torch.uint8, pin_memory=True)
    small_dev = torch.zeros(64, dtype=torch.int64, device="cuda")
    small_host = torch.zeros(64, dtype=torch.int64, pin_memory=True)
    side = torch.cuda.Stream()
    waits = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            if direction == "d2h":
                chunked_copy(host, dev, chunk)
            else:
                chunked_copy(dev, host, chunk)
        time.sleep(0.002)  # the big copy is running
        start = time.perf_counter()
        if direction == "d2h":
            small_host.copy_(small_dev, non_blocking=True)
        else:
            small_dev.copy_(small_host, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        waits.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(waits)


def main() -> int:
    print("PYTHONPATH=. python3 " + " ".join(sys.argv))
    print(machine_line())
    for direction in ("d2h", "h2d"):
        whole = wait_ms(direction, 0)
        pieces = wait_ms(direction, DMA_CHUNK_BYTES)
        print(f"{direction}: a 512-byte copy behind a 576 MiB copy waits {whole:.2f} ms (whole), "
              f"{pieces:.2f} ms (pieces of {DMA_CHUNK_BYTES >> 20} MiB): {whole / pieces:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
