"""How a KV block value is laid out in the pool: the payload, then a 16-byte trailer.

    value = payload (n bytes) | xxh3_64(key, payload) (8 bytes) | n (4) | FORMAT_VERSION (4)

(little-endian). The trailer lets a reader tell a good value from a wrong one whatever the
backend did: a value of another size (a different block layout stored under the key), a torn or
corrupted value, a value stored under another key, a buffer the store left untouched while
reporting success, or a value of another format version. The hash covers the key too, so a value
that lands under the wrong key fails it.

Format 1 (before 2026-12-02) had an 8-byte trailer, crc32(key, payload) and n: `verify` names
such a value `OTHER_FORMAT` (a miss, counted), and format-1 readers take a format-2 value for one
too large (a miss). Keys carry the version as well (settings.key_prefix), so an upgraded fleet
writes fresh values rather than finding the old ones under its keys.

Backends move whole values (`value_size(n)` bytes) between the store and the registered staging
buffer, so the caller leaves `TRAILER_SIZE` bytes after each payload: `seal` writes the trailer
there before a put, `verify` checks it after a get. xxh3_64 runs at about twice memcpy's rate
(6-9x zlib's crc32 on one core; both release the GIL: the note
benchmarks/journal/2026-12-02-pool-checksum-xxh3.md). Values are sealed and checked on several
threads (`parallel_map`), by the shm tier in the same task as each value's copy.
"""

from __future__ import annotations

import concurrent.futures
import enum
import os
import struct
import threading
import zlib
from collections.abc import Callable, Sequence

import xxhash

FORMAT_VERSION = 2
TRAILER = struct.Struct("<QII")  # (xxh3_64 of key + payload, payload length, FORMAT_VERSION)
TRAILER_SIZE = TRAILER.size
MAX_PAYLOAD_SIZE = 2**32 - 1
_V1_TRAILER = struct.Struct("<II")  # (crc32 of key + payload, payload length)


class Verdict(enum.Enum):
    """What a get found in a slot."""

    INTACT = "intact"
    MISSING = "missing"            # the store had no value (or none that fit the slot)
    WRONG_SIZE = "wrong_size"      # a value of another payload size, or a truncated one
    CORRUPT = "corrupt"            # right size, but the hash, length or key does not match
    OTHER_FORMAT = "other_format"  # a whole value of another format version (format 1: crc32)


def value_size(payload_size: int) -> int:
    """Bytes a payload of `payload_size` bytes occupies in the store and in the staging buffer."""
    if not isinstance(payload_size, int) or not 0 < payload_size <= MAX_PAYLOAD_SIZE:
        raise ValueError(f"payload_size must be an int in [1, {MAX_PAYLOAD_SIZE}], "
                         f"got {payload_size!r}")
    return payload_size + TRAILER_SIZE


def checksum(key: str, payload: memoryview | bytes) -> int:
    """xxh3_64 of the key's UTF-8 bytes then the payload. The hasher object rather than the
    one-shot `xxh3_64_intdigest`: python-xxhash's `update` releases the GIL in every version."""
    hasher = xxhash.xxh3_64(key.encode())
    hasher.update(payload)
    return hasher.intdigest()


def seal(view: memoryview, offset: int, size: int, key: str) -> None:
    """Write the trailer of the payload view[offset:offset+size] right after it."""
    end = offset + size
    TRAILER.pack_into(view, end, checksum(key, view[offset:end]), size, FORMAT_VERSION)


def verify(view: memoryview, offset: int, size: int, key: str, received: int) -> Verdict:
    """What `received` bytes read into view[offset:] are, for the value of `key` with a payload
    of `size` bytes (`received` < 0: nothing was read)."""
    if received < 0:
        return Verdict.MISSING
    if received == size + TRAILER_SIZE:
        digest, length, version = TRAILER.unpack_from(view, offset + size)
        if version != FORMAT_VERSION and length == size:
            return Verdict.OTHER_FORMAT
        if length != size or digest != checksum(key, view[offset:offset + size]):
            return Verdict.CORRUPT
        return Verdict.INTACT
    if received == size + _V1_TRAILER.size:
        crc, length = _V1_TRAILER.unpack_from(view, offset + size)
        if length == size and crc == zlib.crc32(view[offset:offset + size],
                                                zlib.crc32(key.encode())):
            return Verdict.OTHER_FORMAT
    return Verdict.WRONG_SIZE


def frame(key: str, payload: bytes) -> bytes:
    """The stored form of `payload` under `key` (for writing values without a staging buffer)."""
    return payload + TRAILER.pack(checksum(key, payload), len(payload), FORMAT_VERSION)


# Values of a KV block are megabytes: one task each is cheap beside its hash or its copy.
_NUM_THREADS = max(1, min(16, os.cpu_count() or 1))
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def parallel_map(fn: Callable, *columns: Sequence) -> list:
    """[fn(*row) for row in zip(*columns)], the rows spread over the pool's threads: for work
    on megabyte values that releases the GIL (xxh3, ctypes.memmove, buffer copies)."""
    global _executor
    rows = list(zip(*columns))
    if _NUM_THREADS == 1 or len(rows) < 2:
        return [fn(*row) for row in rows]
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(
                _NUM_THREADS, thread_name_prefix="sluice-pool-io")
    return list(_executor.map(lambda row: fn(*row), rows))


def seal_all(view: memoryview, offsets: Sequence[int], sizes: Sequence[int],
             keys: Sequence[str]) -> None:
    """`seal` each payload, on several threads."""
    parallel_map(lambda offset, size, key: seal(view, offset, size, key), offsets, sizes, keys)


def verify_all(view: memoryview, offsets: Sequence[int], sizes: Sequence[int],
               keys: Sequence[str], received: Sequence[int]) -> list[Verdict]:
    """`verify` each value, on several threads."""
    return parallel_map(lambda offset, size, key, got: verify(view, offset, size, key, got),
                        offsets, sizes, keys, received)
