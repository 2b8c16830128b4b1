"""The in-process pool backend: values in a dict of bytes, least recently used evicted first when
the byte budget is exceeded. For tests and a single instance (no server).

A `LocalStore` can be shared: two backends built on the same store (e.g. the scheduler-side and
worker-side connectors of one process) see the same values. `create_backend("local")` makes a
store of its own unless `store=` is passed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from sluice.kv_transfer.pool.backend import PoolBackend


class LocalStore:
    """Bytes by key under a byte budget; a get or a put of an existing key counts as a use."""

    def __init__(self, capacity_bytes: int = 1 << 30) -> None:
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.num_evicted = 0
        self._values: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._values)

    def contains(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [key in self._values for key in keys]

    def put_if_absent(self, key: str, value: bytes) -> bool:
        """Store `value` unless `key` exists; False if it can never fit."""
        if len(value) > self.capacity_bytes:
            return False
        with self._lock:
            if key in self._values:
                self._values.move_to_end(key)
                return True
            self._values[key] = value
            self.used_bytes += len(value)
            while self.used_bytes > self.capacity_bytes:
                _, evicted = self._values.popitem(last=False)
                self.used_bytes -= len(evicted)
                self.num_evicted += 1
            return True

    def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def set(self, key: str, value: bytes) -> None:
        """Replace a value (tests: write a bad value under a key)."""
        with self._lock:
            old = self._values.pop(key, None)
            self.used_bytes += len(value) - (len(old) if old is not None else 0)
            self._values[key] = value

    def count(self, prefix: str) -> int:
        with self._lock:
            return sum(1 for key in self._values if key.startswith(prefix))


class LocalBackend(PoolBackend):
    backend_name = "local"
    max_keys_per_call = 1 << 16  # no per-call limit; chunks only bound the time between checks
    max_keys_per_lookup = 1 << 16

    def __init__(self, *, capacity_bytes: int = 1 << 30, store: LocalStore | None = None,
                 timeout_s: float = 5.0) -> None:
        super().__init__("local", timeout_s)
        self.store = store if store is not None else LocalStore(capacity_bytes)

    def _exists(self, keys: list[str], deadline: float) -> list[bool]:
        return self.store.contains(keys)

    def _put(self, keys: list[str], offsets: list[int], sizes: list[int],
             deadline: float) -> list[bool]:
        view = self._buffer
        assert view is not None
        # tobytes: a third of bytes()'s time on a 2 MiB value (both hold the GIL: no threads).
        return [self.store.put_if_absent(key, view[offset:offset + size].tobytes())
                for key, offset, size in zip(keys, offsets, sizes)]

    def _get(self, keys: list[str], offsets: list[int], sizes: list[int],
             deadline: float) -> list[int]:
        view = self._buffer
        assert view is not None
        received = []
        for key, offset, size in zip(keys, offsets, sizes):
            value = self.store.get(key)
            if value is None or len(value) > size:
                received.append(-1)
                continue
            view[offset:offset + len(value)] = value
            received.append(len(value))
        return received

    def count_keys(self, prefix: str = "") -> int:
        self._check_open()
        return self.store.count(prefix)
