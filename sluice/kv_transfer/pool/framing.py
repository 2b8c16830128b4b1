"""How a KV block value is laid out in the pool: the payload, then an 8-byte trailer.

    value = payload (n bytes) | crc32(key, payload) (4 bytes, LE) | n (4 bytes, LE)

The trailer lets a reader tell a good value from a wrong one whatever the backend did: a value of
another size (a different block layout stored under the key), a torn or corrupted value, a value
stored under another key, or a buffer the store left untouched while reporting success. The
checksum covers the key too, so a value that lands under the wrong key fails it.

Backends move whole values (`value_size(n)` bytes) between the store and the registered staging
buffer, so the caller leaves `TRAILER_SIZE` bytes after each payload: `seal` writes the trailer
there before a put, `is_intact` checks it after a get. zlib's crc32 (stdlib, about 3.5 GB/s on
one core here, GIL released) keeps the format independent of optional packages; a batch of
values is checked on several threads (`seal_all`, `intact_all`), and the shm tier copies a
batch's values on the same threads (`parallel_map`): on the H200's host one thread checks 3.5 GB/s
and copies 5.7, 16 threads 28 and 36 (benchmarks/journal/2026-12-02-pool-host-path-h200.md).
"""

from __future__ import annotations

import concurrent.futures
import os
import struct
import threading
import zlib
from collections.abc import Callable, Sequence

TRAILER = struct.Struct("<II")  # (crc32 of key + payload, payload length)
TRAILER_SIZE = TRAILER.size
MAX_PAYLOAD_SIZE = 2**32 - 1


def value_size(payload_size: int) -> int:
    """Bytes a payload of `payload_size` bytes occupies in the store and in the staging buffer."""
    if not isinstance(payload_size, int) or not 0 < payload_size <= MAX_PAYLOAD_SIZE:
        raise ValueError(f"payload_size must be an int in [1, {MAX_PAYLOAD_SIZE}], "
                         f"got {payload_size!r}")
    return payload_size + TRAILER_SIZE


def checksum(key: str, payload: memoryview | bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(key.encode()))


def seal(view: memoryview, offset: int, size: int, key: str) -> None:
    """Write the trailer of the payload view[offset:offset+size] right after it."""
    end = offset + size
    TRAILER.pack_into(view, end, checksum(key, view[offset:end]), size)


def is_intact(view: memoryview, offset: int, size: int, key: str, received: int) -> bool:
    """Whether `received` bytes read into view[offset:] form the value of `key` with a
    payload of `size` bytes."""
    if received != size + TRAILER_SIZE:
        return False
    crc, length = TRAILER.unpack_from(view, offset + size)
    return length == size and crc == checksum(key, view[offset:offset + size])


def frame(key: str, payload: bytes) -> bytes:
    """The stored form of `payload` under `key` (for writing values without a staging buffer)."""
    return payload + TRAILER.pack(checksum(key, payload), len(payload))


# Values of a KV block are megabytes: one task each is cheap beside its checksum or its copy.
_NUM_THREADS = max(1, min(16, os.cpu_count() or 1))
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def parallel_map(fn: Callable, *columns: Sequence) -> list:
    """[fn(*row) for row in zip(*columns)], the rows spread over the pool's threads: for work
    on megabyte values that releases the GIL (crc32, ctypes.memmove, buffer copies)."""
    global _executor
    rows = list(zip(*columns))
    if _NUM_THREADS == 1 or len(rows) < 2:
        return [fn(*row) for row in rows]
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(
                _NUM_THREADS, thread_name_prefix="sluice-pool-crc")
    return list(_executor.map(lambda row: fn(*row), rows))


def seal_all(view: memoryview, offsets: Sequence[int], sizes: Sequence[int],
             keys: Sequence[str]) -> None:
    """`seal` each payload, on several threads."""
    parallel_map(lambda offset, size, key: seal(view, offset, size, key), offsets, sizes, keys)


def intact_all(view: memoryview, offsets: Sequence[int], sizes: Sequence[int],
               keys: Sequence[str], received: Sequence[int]) -> list[bool]:
    """`is_intact` of each value, on several threads."""
    return parallel_map(lambda offset, size, key, got: is_intact(view, offset, size, key, got),
                offsets, sizes, keys, received)
