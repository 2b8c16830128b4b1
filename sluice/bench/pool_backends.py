"""Throughput of the global KV pool's backends: put, put again (every key exists), exists and
get of N values of S bytes through one staging buffer, in GB/s of payload, each against the
in-process `local` backend measured in the same run.

Servers are started here on free loopback ports (`sluice.testing.servers`) unless URLs are
given. `mooncake` keeps every value in another process's segment, so each transfer crosses TCP
(one instance reading another's memory); `mooncake-self` lets the client own the segment
(transfers are local copies); `shm` is the shared host tier (`sluice pool-server` in another
process, the values copied in and out of its shared arena). Times are medians over `--repeats`
rounds of fresh keys; each round's values are checked byte for byte after the get.

    python -m sluice.bench.pool_backends [--num-values 1000] [--value-size 262144] \
        [--backends local,redis,mooncake,mooncake-self,shm] [--output pool.json]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from sluice.kv_transfer.pool import PoolBackend, create_backend, framing, value_size
from sluice.testing import servers

KINDS = ("local", "redis", "mooncake", "mooncake-self", "shm")


@dataclass(frozen=True, slots=True)
class BackendResult:
    backend: str
    url: str
    put_gb_s: float
    put_again_gb_s: float  # every key exists: what dedup costs
    exists_keys_s: float
    get_gb_s: float
    put_s: float  # medians over the rounds
    put_again_s: float
    exists_s: float
    get_s: float
    vs_local: dict[str, float]  # this backend's GB/s (keys/s) / local's, per operation


def machine() -> dict[str, str]:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions = {}
    for package in ("redis", "hiredis", "mooncake-transfer-engine-non-cuda",
                    "mooncake-transfer-engine"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version
            versions[package] = version(package)
    redis_server = servers.redis_server_path()
    if redis_server:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([redis_server, "--version"], capture_output=True, text=True,
                                 timeout=10).stdout
            versions["redis-server"] = out.split("v=", 1)[1].split()[0] if "v=" in out else "?"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return {"cpu": cpu, "cpus": str(os.cpu_count()), "load_1min": f"{load:.2f}",
            "platform": platform.platform(), "python": platform.python_version(), **versions}


def checksum_gb_s(value_bytes: int, num_values: int) -> float:
    """The trailer's hash (xxh3_64) alone over the run's payload, on one thread: what a put or
    a get spends checking every byte once (spread over framing's threads in the backends)."""
    payload = np.random.default_rng(1).integers(0, 256, value_bytes, np.uint8).tobytes()
    start = time.perf_counter()
    for _ in range(num_values):
        framing.checksum("key", payload)
    return num_values * value_bytes / (time.perf_counter() - start) / 1e9


def _timed(fn, *args) -> tuple[float, list[bool]]:
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def measure(backend: PoolBackend, kind: str, num_values: int, value_bytes: int,
            repeats: int) -> dict[str, float]:
    """Median seconds of each operation on `num_values` values of `value_bytes` bytes."""
    slot = value_size(value_bytes)
    staging = np.zeros(2 * num_values * slot, dtype=np.uint8)
    backend.register_buffer(staging.ctypes.data, staging.nbytes)
    rng = np.random.default_rng(0)
    put_offsets = [i * slot for i in range(num_values)]
    get_offsets = [(num_values + i) * slot for i in range(num_values)]
    sizes = [value_bytes] * num_values
    times: dict[str, list[float]] = {"put": [], "put_again": [], "exists": [], "get": []}

    calls = {"put": (backend.batch_put, put_offsets), "put_again": (backend.batch_put, put_offsets),
             "exists": (backend.batch_exists, None), "get": (backend.batch_get, get_offsets)}
    for _ in range(repeats):
        keys = [f"bench-{uuid.uuid4().hex[:12]}/{i}" for i in range(num_values)]
        for offset in put_offsets:
            staging[offset:offset + value_bytes] = rng.integers(0, 256, value_bytes, np.uint8)
        for name, (fn, offsets) in calls.items():
            args = (keys,) if offsets is None else (keys, offsets, sizes)
            elapsed, result = _timed(fn, *args)
            if not all(result):
                raise RuntimeError(f"{kind} {name}: {result.count(False)} of {len(result)} "
                                   "keys failed")
            times[name].append(elapsed)
        for put_at, get_at in zip(put_offsets, get_offsets):
            if not np.array_equal(staging[put_at:put_at + value_bytes],
                                  staging[get_at:get_at + value_bytes]):
                raise RuntimeError(f"{kind}: a value read back differs from the one put")
    return {name: statistics.median(values) for name, values in times.items()}


@contextlib.contextmanager
def backend_for(kind: str, args: argparse.Namespace, total_bytes: int
                ) -> Iterator[tuple[PoolBackend, str]]:
    # Room for every round's values below Mooncake's 90% eviction watermark.
    segment = max(16 << 20, int(total_bytes / 0.8))
    with contextlib.ExitStack() as stack:
        if kind == "local":
            url, options = "local", {"capacity_bytes": 2 * total_bytes}
        elif kind == "redis":
            url = args.redis_url or stack.enter_context(servers.start_redis()).url
            options = {"timeout_s": 60.0}
        elif kind == "shm":
            slot = -(-value_size(args.value_size) // 4096) * 4096
            url = stack.enter_context(servers.start_shm_pool(
                capacity_bytes=2 * total_bytes // args.value_size * slot, slot_bytes=slot)).url
            options = {"timeout_s": 60.0}
        else:
            if args.mooncake_url:
                url = args.mooncake_url
            else:
                master = stack.enter_context(servers.start_mooncake_master())
                url = master.url
            options = {"timeout_s": 60.0, "global_segment_size": segment}
            if kind == "mooncake":
                owner = servers.start_mooncake_segment_owner(url.split("://", 1)[1], segment)
                stack.callback(owner.close)
                options["global_segment_size"] = 0
        backend = create_backend(url, **options)
        stack.callback(backend.close)
        yield backend, url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-values", type=int, default=1000)
    parser.add_argument("--value-size", type=int, default=256 << 10, help="payload bytes")
    parser.add_argument("--backends", default=",".join(KINDS),
                        help=f"comma-separated, of {', '.join(KINDS)} (local always runs)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of fresh keys (median)")
    parser.add_argument("--redis-url", default=None, help="use this server instead of one here")
    parser.add_argument("--mooncake-url", default=None, help="use this master")
    parser.add_argument("--output", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    kinds = [kind.strip() for kind in args.backends.split(",") if kind.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown backends {unknown}; known: {', '.join(KINDS)}")
    for name in ("num_values", "value_size", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    kinds = ["local"] + [kind for kind in kinds if kind != "local"]

    command = shlex.join([sys.executable.rsplit("/", 1)[-1], "-m", "sluice.bench.pool_backends",
                          *(sys.argv[1:] if argv is None else argv)])
    info = machine()
    print(f"command: {command}")
    print("machine: " + " | ".join(f"{key} {value}" for key, value in info.items()))
    payload = args.num_values * args.value_size
    print(f"{args.num_values} values x {args.value_size} bytes = {payload / 1e6:.1f} MB per "
          f"call, median of {args.repeats} rounds; GB/s of payload")
    results: list[BackendResult] = []
    local: dict[str, float] = {}
    ceiling = checksum_gb_s(args.value_size, args.num_values)
    print(f"xxh3_64 of the payload alone, one thread: {ceiling:.2f} GB/s")
    print(f"{'backend':<14}{'put':>9}{'put again':>11}{'exists':>16}{'get':>9}   vs local "
          "(put / put again / exists / get)")
    for kind in kinds:
        with backend_for(kind, args, payload * args.repeats) as (backend, url):
            secs = measure(backend, kind, args.num_values, args.value_size, args.repeats)
        rates = {"put": payload / secs["put"] / 1e9,
                 "put_again": payload / secs["put_again"] / 1e9,
                 "exists": args.num_values / secs["exists"],
                 "get": payload / secs["get"] / 1e9}
        if kind == "local":
            local = rates
        ratios = {name: rates[name] / local[name] for name in rates}
        results.append(BackendResult(
            kind, url, rates["put"], rates["put_again"], rates["exists"], rates["get"],
            secs["put"], secs["put_again"], secs["exists"], secs["get"], ratios))
        print(f"{kind:<14}{rates['put']:>9.2f}{rates['put_again']:>11.2f}"
              f"{rates['exists'] / 1e3:>9.0f}k keys/s{rates['get']:>9.2f}   "
              + " / ".join(f"{ratios[name]:.2f}" for name in rates), flush=True)
    if args.output:
        from sluice.bench.record import make_record, write_record

        # machine: the host, and here also the CPU, its load and the backends' versions.
        record = make_record("pool-backends", {
            "num_values": args.num_values, "value_size": args.value_size,
            "repeats": args.repeats, "checksum_gb_s": ceiling,
            "backends": [asdict(result) for result in results]}, command=shlex.split(command))
        record["machine"].update(info)
        write_record(args.output, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
