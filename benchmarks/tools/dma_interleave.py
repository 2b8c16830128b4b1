"""How long a step's small device-to-host copy (its sampled tokens) waits while a pool save's
copy of one 8B 4k-token prompt (576 MiB, device -> pinned host) runs on another stream, and the
same for a small host-to-device copy (a step's inputs) behind a load-sized copy. The big copy
goes three ways: whole (what the pool's mover does), in 8 MiB pieces queued at once, and in
8 MiB pieces paced by a thread (each queued once the one before it finished).

    PYTHONPATH=. python3 benchmarks/tools/dma_interleave.py
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import torch

from sluice.bench.serve import machine_line

BIG = 576 << 20
PIECE = 8 << 20


def _pieces(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(dst[i:i + PIECE], src[i:i + PIECE]) for i in range(0, BIG, PIECE)]


def wait_ms(direction: str, how: str, repeats: int = 5) -> float:
    dev = torch.empty(BIG, dtype=torch.uint8, device="cuda")
    host = torch.empty(BIG, dtype=torch.uint8, pin_memory=True)
    small_dev = torch.zeros(64, dtype=torch.int64, device="cuda")
    small_host = torch.zeros(64, dtype=torch.int64, pin_memory=True)
    dst, src = (host, dev) if direction == "d2h" else (dev, host)
    side = torch.cuda.Stream()
    waits = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        pacer = None
        if how == "whole":
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
        elif how == "queued":
            with torch.cuda.stream(side):
                for d, s in _pieces(dst, src):
                    d.copy_(s, non_blocking=True)
        else:
            def pace() -> None:
                with torch.cuda.stream(side):
                    for d, s in _pieces(dst, src):
                        d.copy_(s, non_blocking=True)
                        side.synchronize()
            pacer = threading.Thread(target=pace)
            pacer.start()
        time.sleep(0.002)  # the big copy is running
        start = time.perf_counter()
        if direction == "d2h":
            small_host.copy_(small_dev, non_blocking=True)
        else:
            small_dev.copy_(small_host, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        waits.append((time.perf_counter() - start) * 1e3)
        if pacer is not None:
            pacer.join()
        torch.cuda.synchronize()
    return statistics.median(waits)


def copy_ms(how: str) -> float:
    """The big D2H copy's own time."""
    dev = torch.empty(BIG, dtype=torch.uint8, device="cuda")
    host = torch.empty(BIG, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        if how == "whole":
            host.copy_(dev, non_blocking=True)
        else:
            for d, s in _pieces(host, dev):
                d.copy_(s, non_blocking=True)
                torch.cuda.current_stream().synchronize()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> int:
    print("PYTHONPATH=. python3 " + " ".join(sys.argv))
    print(machine_line())
    for direction in ("d2h", "h2d"):
        waits = {how: wait_ms(direction, how) for how in ("whole", "queued", "paced")}
        print(f"{direction}: a 512-byte copy behind a 576 MiB copy waits "
              + ", ".join(f"{ms:.2f} ms ({how})" for how, ms in waits.items())
              + f"; whole/paced {waits['whole'] / waits['paced']:.1f}x")
    whole, paced = copy_ms("whole"), copy_ms("paced")
    print(f"the 576 MiB D2H copy itself: {whole:.2f} ms whole, {paced:.2f} ms paced "
          f"({BIG / whole / 1e6:.1f} / {BIG / paced / 1e6:.1f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
