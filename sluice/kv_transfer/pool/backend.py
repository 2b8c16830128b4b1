"""The storage interface of the global KV pool: fixed-size block values, moved in batches between
a store and one registered host staging buffer.

Lifecycle of a backend (the engine's pool connector drives it):

    backend = create_backend("redis://127.0.0.1:6379", timeout_s=2.0)   # connects, or raises
    backend.register_buffer(staging.data_ptr(), staging.numel())         # once; caller owns it
    present = backend.batch_exists(keys)                                 # scheduler: lookup
    ok = backend.batch_get(keys, offsets, sizes)                         # worker: load
    ok = backend.batch_put(keys, offsets, sizes)                         # worker: save
    backend.close()

Slots. `sizes[i]` is a payload size; the slot at `offsets[i]` spans `value_size(sizes[i])` bytes of
the staging buffer: the payload, then `TRAILER_SIZE` bytes the backend uses for the value's
trailer (`framing.py`). A put writes the trailer there, then stores the whole slot; a get reads
the whole stored value into the slot and checks the trailer (on the shm tier, in the same task
as the value's copy). Slots of one call must not overlap.

Results. Keys are content-addressed (same key, same content): a put of a key that exists stores
nothing and reports success. Per-key outcomes are booleans: a put is False when the store did not
take the value (full, a transfer failed); a get is False for a missing key (never stored, evicted,
its owner gone), a value of another size or format version, or one failing its checksum. None
of these raise; `rejections()` counts the values read and refused.

Errors. A call raises only when the backend as a whole cannot answer: `PoolUnavailable` (cannot
connect, connection lost, closed server), `PoolTimeout` (no answer within `timeout_s`). Each
call is bounded by about `timeout_s` from its start, whatever the server does (stopped, dead,
slow), so the engine can fall back to recomputing; calls after the server is back work again
without re-creating the backend.

After a timeout. A backend whose client library cannot be interrupted (Mooncake) returns
`PoolTimeout` while the native call goes on; until it ends, `busy` is True, new calls raise
`PoolUnavailable`, and the store may still read or write that call's slots. The caller must not
reuse those slots (not even to stage the next values) before `busy` turns False (`wait_idle`):
a late get landing in a slot refilled for a put would be sealed and stored as that put's value.
"""

from __future__ import annotations

import ctypes
import logging
import operator
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from sluice.kv_transfer.pool import framing

logger = logging.getLogger("sluice")


class PoolError(RuntimeError):
    """A pool backend could not serve a call. The message names the backend and its address."""

    def __init__(self, backend: str, address: str, message: str) -> None:
        super().__init__(f"{backend} pool at {address}: {message}")
        self.backend = backend
        self.address = address


class PoolUnavailable(PoolError):
    """The store cannot be reached: not running, connection refused or lost, or shut down."""


class PoolTimeout(PoolError):
    """The store did not answer within the backend's timeout."""


class PoolBackend(ABC):
    """One connection to a KV pool store. Thread-safe: calls may come from several threads.

    Subclasses move whole values (`_exists`, `_put`, `_get` on one chunk of at most
    `max_keys_per_call` keys); this class validates arguments, frames values, splits batches
    into chunks and keeps each call within its deadline.
    """

    backend_name: ClassVar[str]
    # Keys per native call moving values: larger batches are split (Mooncake's TCP transport
    # fails above 1,024 queued transfers per peer; Redis pipelines of about 100 values are the
    # fastest). Lookups move no values and take larger chunks: one round trip for a long prompt.
    max_keys_per_call: ClassVar[int]
    max_keys_per_lookup: ClassVar[int]

    def __init__(self, address: str, timeout_s: float) -> None:
        if not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.address = address
        self.timeout_s = float(timeout_s)
        self._buffer: memoryview | None = None
        self._buffer_address = 0
        self._closed = False
        # Seconds spent so far in each host stage of the calls moving values ("get.copy",
        # "get.checksum", "put.checksum", "put.copy"): benchmarks split a load's time by them.
        # On the shm tier a value's checksum runs in its copy's task: there "get.copy" and
        # "put.copy" are the wall time of both, and the checksum stages the threads' seconds of
        # hashing inside it (overlapping the copies, not added to them).
        self._stage_seconds: dict[str, float] = {}
        self._rejections: dict[str, int] = {}
        self._stage_lock = threading.Lock()

    # ---- what a backend implements ----

    def _register(self, address: int, size: int) -> None:  # noqa: B027 (optional hook)
        """Make the buffer known to the store (zero-copy backends); most need nothing."""

    @abstractmethod
    def _exists(self, keys: list[str], deadline: float) -> list[bool]: ...

    @abstractmethod
    def _put(self, keys: list[str], offsets: list[int], sizes: list[int],
             deadline: float) -> list[bool]:
        """Store buffer[offsets[i]:offsets[i]+sizes[i]] (whole framed values) under keys[i]
        unless the key exists; True where the key now holds a value."""

    @abstractmethod
    def _get(self, keys: list[str], offsets: list[int], sizes: list[int],
             deadline: float) -> list[int]:
        """Read each key's value into buffer[offsets[i]:offsets[i]+sizes[i]]: the value's size
        where one was read (it must fit), -1 where none was (missing, too large, failed)."""

    def _close(self) -> None:  # noqa: B027 (optional hook)
        """Release the connection."""

    def _check_ready(self) -> None:  # noqa: B027 (optional hook)
        """Raise `PoolUnavailable` if calls cannot start now (before any slot is touched)."""

    @abstractmethod
    def count_keys(self, prefix: str = "") -> int:
        """How many keys starting with `prefix` the store holds (tests, metrics)."""

    # ---- the interface ----

    @property
    def busy(self) -> bool:
        """True while a native call that timed out is still running: its slots may still be
        read or written by the store (see the module docstring). False for most backends."""
        return False

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until `busy` is False; whether it is, within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.busy:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def set_timeout(self, timeout_s: float) -> None:
        """Bound later calls by `timeout_s` instead (a client set up with a generous timeout,
        then used for quick lookups that must not hold anyone up)."""
        if not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)

    @property
    def max_value_size(self) -> int | None:
        """The largest value (payload and trailer) the store takes; None: no fixed limit."""
        return None

    def host_memory(self, size: int) -> int | None:
        """The address of `size` bytes of host memory that this backend moves values from and
        to without a copy when registered as the staging buffer (the backend keeps it mapped
        for the process's life), or None: any memory is as good (most backends)."""
        return None

    @property
    def buffer(self) -> memoryview | None:
        """The registered staging buffer as bytes, or None before `register_buffer`."""
        return self._buffer

    def register_buffer(self, address: int, size: int) -> None:
        """Use the `size` bytes of host memory at `address` as the staging buffer of every call.
        The caller owns the memory and keeps it alive until `close()`."""
        self._check_open()
        if not isinstance(address, int) or address <= 0:
            raise ValueError(f"buffer address must be a positive int, got {address!r}")
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"buffer size must be a positive int, got {size!r}")
        if self._buffer is not None:
            raise RuntimeError(f"{self._describe()}: a staging buffer is already registered")
        self._register(address, size)
        self._buffer = memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B")
        self._buffer_address = address

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Which keys the store holds (one round trip per chunk)."""
        self._check_open()
        keys = _check_keys(keys)
        self._check_ready()
        deadline = time.monotonic() + self.timeout_s
        out: list[bool] = []
        step = self.max_keys_per_lookup
        for start in range(0, len(keys), step):
            self._check_deadline(deadline)
            out += self._exists(keys[start:start + step], deadline)
        return out

    def batch_put(self, keys: Sequence[str], offsets: Sequence[int],
                  sizes: Sequence[int]) -> list[bool]:
        """Store each payload buffer[offsets[i]:offsets[i]+sizes[i]] under keys[i]. Every slot
        is sealed afterwards, stored or not (the tiered backend's far put reuses the trailers)."""
        keys, offsets, sizes, value_sizes = self._check_slots(keys, offsets, sizes)
        return self._chunked(self._put_sealing, keys, offsets, sizes, value_sizes)

    def batch_get(self, keys: Sequence[str], offsets: Sequence[int],
                  sizes: Sequence[int]) -> list[bool]:
        """Read each key's payload into buffer[offsets[i]:offsets[i]+sizes[i]]; False where it
        is missing, of another size or format, or corrupt (the slot's bytes are then
        unspecified). `rejections` counts the values read and refused, by kind."""
        keys, offsets, sizes, value_sizes = self._check_slots(keys, offsets, sizes)
        return self._chunked(self._get_checking, keys, offsets, sizes, value_sizes)

    # ---- sealing and checking, around the store's copies ----

    def _put_sealing(self, keys: list[str], offsets: list[int], sizes: list[int],
                     value_sizes: list[int], deadline: float) -> list[bool]:
        """Seal one chunk's payloads, then `_put` them: two passes over each value. A backend
        whose copies run on framing's threads overrides this to seal in each value's copy task
        (one pass over cache-hot data)."""
        view = self._buffer
        assert view is not None
        start = time.perf_counter()
        framing.seal_all(view, offsets, sizes, keys)
        sealed = time.perf_counter()
        try:
            return self._put(keys, offsets, value_sizes, deadline)
        finally:
            self._add_stage_seconds(("put.checksum", sealed - start),
                                    ("put.copy", time.perf_counter() - sealed))

    def _get_checking(self, keys: list[str], offsets: list[int], sizes: list[int],
                      value_sizes: list[int], deadline: float) -> list[bool]:
        """`_get` one chunk, then check its values on framing's threads. A backend whose copies
        run on those threads overrides this to check each value in its copy task
        (`_check_value`), so values are hashed while others are still copied."""
        start = time.perf_counter()
        try:
            received = self._get(keys, offsets, value_sizes, deadline)
        finally:
            copied = time.perf_counter()
            self._add_stage_seconds(("get.copy", copied - start))
        intact = framing.parallel_map(self._check_value, keys, offsets, sizes, received)
        self._add_stage_seconds(("get.checksum", time.perf_counter() - copied))
        return intact

    def _check_value(self, key: str, offset: int, size: int, received: int) -> bool:
        """(On a copy thread.) Whether the value read into a slot is intact; a value read and
        refused is counted by kind (an old format's is also logged, once per backend)."""
        view = self._buffer
        assert view is not None
        return self._count_verdict(key, framing.verify(view, offset, size, key, received))

    def _count_verdict(self, key: str, verdict: framing.Verdict) -> bool:
        """Whether `verdict` is INTACT; a value read and refused is counted by kind (an old
        format's is also logged, once per backend)."""
        if verdict is framing.Verdict.INTACT:
            return True
        if verdict is not framing.Verdict.MISSING:
            with self._stage_lock:
                first = verdict.value not in self._rejections
                self._rejections[verdict.value] = self._rejections.get(verdict.value, 0) + 1
            if first and verdict is framing.Verdict.OTHER_FORMAT:
                logger.warning(
                    "%s: a value of another format version under %r (format %d reads only its "
                    "own; format 1 was the crc32 trailer): read as a miss, counted in "
                    "rejections()['other_format']", self._describe(), key,
                    framing.FORMAT_VERSION)
        return False

    def rejections(self) -> dict[str, int]:
        """Values read so far and refused, by kind (framing.Verdict's values other than intact
        and missing): wrong_size, corrupt, other_format."""
        with self._stage_lock:
            return dict(self._rejections)

    def stage_seconds(self) -> dict[str, float]:
        """Seconds spent so far in each host stage of `batch_get` / `batch_put` (the copy is
        the store's transfer: for a network store, the round trips too)."""
        with self._stage_lock:
            return dict(self._stage_seconds)

    def _add_stage_seconds(self, *stages: tuple[str, float]) -> None:
        with self._stage_lock:
            for name, seconds in stages:
                self._stage_seconds[name] = self._stage_seconds.get(name, 0.0) + seconds

    def close(self) -> None:
        """Release the connection (idempotent). The staging buffer is the caller's to free."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> PoolBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.address}{' closed' if self._closed else ''}>"

    # ---- helpers for subclasses ----

    def unavailable(self, message: str) -> PoolUnavailable:
        return PoolUnavailable(self.backend_name, self.address, message)

    def timed_out(self, message: str) -> PoolTimeout:
        return PoolTimeout(self.backend_name, self.address, message)

    def _check_deadline(self, deadline: float) -> None:
        if time.monotonic() >= deadline:
            raise self.timed_out(f"call not done within timeout_s={self.timeout_s:g}")

    # ---- internals ----

    def _describe(self) -> str:
        return f"{self.backend_name} pool at {self.address}"

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self._describe()}: backend is closed")

    def _chunked(self, op, *columns: list) -> list:
        """op(*chunk_of_each_column, deadline) over chunks of `max_keys_per_call` rows, within
        one deadline; the results concatenated."""
        deadline = time.monotonic() + self.timeout_s
        out: list = []
        step = self.max_keys_per_call
        for start in range(0, len(columns[0]), step):
            self._check_deadline(deadline)
            out += op(*(column[start:start + step] for column in columns), deadline)
        return out

    def _check_slots(self, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int]
                     ) -> tuple[list[str], list[int], list[int], list[int]]:
        self._check_open()
        if self._buffer is None:
            raise RuntimeError(f"{self._describe()}: register_buffer() before moving values")
        keys = _check_keys(keys)
        offsets, sizes = _check_ints("offsets", offsets), _check_ints("sizes", sizes)
        if not len(keys) == len(offsets) == len(sizes):
            raise ValueError(f"keys, offsets and sizes differ in length: "
                             f"{len(keys)}, {len(offsets)}, {len(sizes)}")
        capacity = len(self._buffer)
        value_sizes = []
        for offset, size in zip(offsets, sizes):
            value_size = framing.value_size(size)
            if offset < 0 or offset + value_size > capacity:
                raise ValueError(
                    f"slot at offset {offset!r} of {value_size} bytes (payload {size} + trailer "
                    f"{framing.TRAILER_SIZE}) is outside the {capacity}-byte staging buffer")
            value_sizes.append(value_size)
        self._check_ready()
        return keys, offsets, sizes, value_sizes


def _check_ints(name: str, values: Sequence[int]) -> list[int]:
    """Plain ints (numpy integers and other `__index__` types accepted)."""
    try:
        return [operator.index(value) for value in values]
    except TypeError:
        bad = next(value for value in values if not hasattr(value, "__index__"))
        raise ValueError(f"{name} must be integers, got {bad!r}") from None


def _check_keys(keys: Sequence[str]) -> list[str]:
    keys = list(keys)
    for key in keys:
        if not isinstance(key, str) or not key:
            raise ValueError(f"keys must be non-empty strings, got {key!r}")
    return keys
