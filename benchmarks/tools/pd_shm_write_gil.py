"""A PD room's write over the shm backend (CPU caches) while another thread runs Python, as the
engine's loop does beside the transfer thread: the copies one native call per descriptor
(ctypes.memmove, the code before copy_batch) against copy_batch's one call per batch, each
alone and beside a thread spinning in Python. A call that releases the GIL waits up to the
switch interval (sys.getswitchinterval(), 5 ms) to take it back from a thread that never
releases it, once per call.

    python benchmarks/tools/pd_shm_write_gil.py [--layers 36] [--runs 1] [--output F]

The default room is 8B-shaped: 36 layers, K and V, 64 blocks of 16 tokens x 8 heads x 128 dims
in bf16 (144 MiB), in `--runs` runs of contiguous blocks (72 descriptors for one run).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
import time

import torch

from sluice.bench.record import make_record, write_record
from sluice.bench.serve import machine_line
from sluice.kv_transfer.disagg.descriptors import CacheLayout, block_runs, build_descriptors
from sluice.kv_transfer.disagg.shm import SharedKVArena, ShmBackend, copy_batch


def _layout(caches: dict[str, torch.Tensor]) -> CacheLayout:
    first = next(iter(caches.values()))
    return CacheLayout(tuple(t.data_ptr() for t in caches.values()), first.shape[1],
                       first.shape[2], first.shape[3], first.shape[4] * first.element_size())


def per_descriptor(backend: ShmBackend, peer: str, src: list[int], dst: list[int],
                   lengths: list[int]) -> None:
    """The copy loop before copy_batch: one ctypes.memmove (GIL released) per descriptor."""
    mapped = backend._peers[peer]
    for s, d, n in zip(src, dst, lengths):
        ctypes.memmove(mapped.regions.local_address(d, n), backend._local.local_address(s, n), n)


def batched(backend: ShmBackend, peer: str, src: list[int], dst: list[int],
            lengths: list[int]) -> None:
    copy_batch(backend._peers[peer].regions, backend._local, src, dst, lengths)


def timed(fn, repeats: int, busy: bool) -> list[float]:  # noqa: ANN001
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    thread = threading.Thread(target=spin, daemon=True)
    if busy:
        thread.start()
        time.sleep(0.05)
    times = []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    finally:
        stop.set()
        if busy:
            thread.join()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--runs", type=int, default=1, help="runs of contiguous blocks")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--output", default=None)
    ns = parser.parse_args()
    print("python benchmarks/tools/pd_shm_write_gil.py " + " ".join(sys.argv[1:]))
    print(machine_line())
    shape = (2, ns.blocks * 2, 16, 8, 128)  # room for scattered destinations
    names = [f"l{i}" for i in range(ns.layers)]
    arena = SharedKVArena("pd-shm-write-gil")
    decode_caches = arena.allocate(names, shape, torch.bfloat16, torch.device("cpu"))
    decode = ShmBackend(max_batch=1 << 20, arena=arena)
    decode.register(list(decode_caches.values()))
    prefill_caches = {n: torch.ones(shape, dtype=torch.bfloat16) for n in names}
    prefill = ShmBackend(max_batch=1 << 20)
    prefill.register(list(prefill_caches.values()))
    assert prefill.attach(decode.session, decode.export(list(decode_caches.values()))) is None
    per_run = ns.blocks // ns.runs
    src_blocks = list(range(ns.blocks))
    dst_blocks = [r * 2 * per_run + i for r in range(ns.runs) for i in range(per_run)]
    src, dst, lengths = build_descriptors(_layout(prefill_caches), _layout(decode_caches),
                                          block_runs(src_blocks, dst_blocks))
    rows = {}
    for name, fn in (("per-descriptor memmove", per_descriptor), ("copy_batch", batched)):
        def write(fn=fn) -> None:  # noqa: ANN001
            fn(prefill, decode.session, src, dst, lengths)

        write()
        for busy in (False, True):
            times = timed(write, ns.repeats, busy)
            key = f"{name}, {'beside a busy thread' if busy else 'alone'}"
            rows[key] = {"median_ms": statistics.median(times), "max_ms": max(times)}
            print(f"{key}: median {rows[key]['median_ms']:.1f} ms, max {max(times):.1f} ms")
    ratio = (rows["per-descriptor memmove, beside a busy thread"]["median_ms"]
             / rows["copy_batch, beside a busy thread"]["median_ms"])
    print(f"{len(src)} descriptors, {sum(lengths) / 2**20:.0f} MiB; beside a busy thread "
          f"copy_batch is {ratio:.1f}x faster")
    for name in names:
        assert torch.equal(decode_caches[name][:, dst_blocks], prefill_caches[name][:, src_blocks])
    prefill.close()
    decode.close()
    arena.close()
    if ns.output:
        write_record(ns.output, make_record("pd-shm-write-gil", {
            "descriptors": len(src), "bytes": sum(lengths), "rows": rows,
            "ratio_beside_a_busy_thread": ratio}, device="cpu"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
