"""Candidate checksums of the pool's values (zlib.crc32, xxh3_64, xxh3_128, google_crc32c when
installed) on 1-16 MB buffers, on one thread and on two, against one thread's memmove; and
whether each releases the GIL (a thread hashes 256 MB eight times while the main thread spins
in Python, recording its longest stall: a call holding the GIL stalls it for the whole call).

    python benchmarks/tools/pool_hashes.py [--output rows.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import statistics
import threading
import time
import zlib
from collections.abc import Callable

import numpy as np
import xxhash

HASHES: dict[str, Callable[[memoryview], int]] = {
    "zlib.crc32": zlib.crc32,
    # The hasher objects, as framing.py uses them: their update releases the GIL.
    "xxh3_64": lambda buffer: xxhash.xxh3_64(buffer).intdigest(),
    "xxh3_128": lambda buffer: xxhash.xxh3_128(buffer).intdigest(),
}
try:
    import google_crc32c

    HASHES["google_crc32c"] = lambda buffer: google_crc32c.value(buffer.obj)  # read-only bytes
except ImportError:
    pass


def throughput(mb: int, threads: int, fn: Callable[[memoryview], int],
               pool: concurrent.futures.ThreadPoolExecutor, buffers: list[memoryview]) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        if threads == 1:
            for buffer in buffers:
                fn(buffer)
        else:
            list(pool.map(fn, buffers))
        best = min(best, time.perf_counter() - start)
    return len(buffers) * (mb << 20) / best / 1e9


def longest_stall(fn: Callable[[memoryview], int], buffer: memoryview) -> tuple[float, float]:
    """(median ms per call, median of the main thread's longest stall / the call's time)."""
    calls: list[tuple[float, float]] = []
    done = threading.Event()

    def work() -> None:
        for _ in range(8):
            start = time.perf_counter()
            fn(buffer)
            calls.append((start, time.perf_counter()))
        done.set()

    stamps: list[float] = []
    thread = threading.Thread(target=work)
    thread.start()
    while not done.is_set():
        stamps.append(time.perf_counter())
    thread.join()
    ratios = []
    for start, end in calls:
        points = [start, *(s for s in stamps if start <= s <= end), end]
        ratios.append(max(b - a for a, b in zip(points, points[1:])) / (end - start))
    return (1e3 * statistics.median(end - start for start, end in calls),
            statistics.median(ratios))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    rows: list[dict] = []
    for mb in (1, 2, 4, 16):
        buffers = [memoryview(rng.integers(0, 256, mb << 20, np.uint8).tobytes())
                   for _ in range(max(4, 64 // mb))]
        for name, fn in HASHES.items():
            for threads in (1, 2):
                gb_s = throughput(mb, threads, fn, pool, buffers)
                rows.append({"mb": mb, "hash": name, "threads": threads, "gb_s": round(gb_s, 2)})
                print(f"{mb:3d} MB {name:14} {threads} thread(s) {gb_s:6.2f} GB/s", flush=True)
    source = np.ones((32, 2 << 20), np.uint8)
    target = np.zeros_like(source)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for i in range(32):
            ctypes.memmove(target[i].ctypes.data, source[i].ctypes.data, 2 << 20)
        best = min(best, time.perf_counter() - start)
    memmove_gb_s = 32 * (2 << 20) / best / 1e9
    print(f"memmove of 2 MB, one thread: {memmove_gb_s:.2f} GB/s")
    big = memoryview(rng.integers(0, 256, 256 << 20, np.uint8).tobytes())
    gil = {}
    for name, fn in HASHES.items():
        ms, stall = longest_stall(fn, big)
        gil[name] = {"ms_per_256mb": round(ms, 1), "stall_over_call": round(stall, 2),
                     "releases_gil": stall < 0.8}
        print(f"{name:14} {ms:6.1f} ms per 256 MB; main thread's longest stall {stall:.2f} of "
              f"the call: GIL {'released' if stall < 0.8 else 'held'}")
    if args.output:
        with open(args.output, "w") as out:
            json.dump({"rows": rows, "memmove_2mb_gb_s": round(memmove_gb_s, 2), "gil": gil},
                      out, indent=1)


if __name__ == "__main__":
    main()
