"""One backend client of one half of the pool connector, which may arrive late.

Each process half has its own client: the scheduler's (lookups only, a short timeout, and for
Mooncake no segment of its own) and every worker rank's (loads and saves through its registered
staging buffer). A client that cannot connect at start is a clear error naming the address
(`on_backend_error: "fail"`, the default), or, under `"recompute"`, a warning said once: the
engine runs without the pool while a background thread tries again every `retry_interval_s`,
and the pool is used as soon as it answers.

The `local` backend is an in-process store shared by every engine in the process (the scheduler
half and the worker half of one engine must see the same values); it cannot serve an engine whose
workers run in other processes (the `mp` executor): that is refused at start.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from sluice.config import KVTransferConfig
from sluice.kv_transfer.pool import LocalBackend, LocalStore, PoolBackend, PoolError, create_backend
from sluice.kv_transfer.pool.settings import BackendHealth, PoolSettings

logger = logging.getLogger("sluice")

# The `local` pool of this process, made by the first client that asks (its capacity wins), and
# the configs of the engines whose worker half is in this process (by id, checked by identity:
# in one process both halves get the very same config object).
_LOCAL_STORE: list[LocalStore] = []
_LOCAL_WORKERS: dict[int, weakref.ref] = {}
_LOCAL_LOCK = threading.Lock()


def local_store(capacity_bytes: int | None = None) -> LocalStore:
    with _LOCAL_LOCK:
        if not _LOCAL_STORE:
            _LOCAL_STORE.append(LocalStore(capacity_bytes) if capacity_bytes else LocalStore())
        return _LOCAL_STORE[0]


def register_local_worker(config: KVTransferConfig) -> None:
    with _LOCAL_LOCK:
        _LOCAL_WORKERS[id(config)] = weakref.ref(config)


def has_local_worker(config: KVTransferConfig) -> bool:
    with _LOCAL_LOCK:
        ref = _LOCAL_WORKERS.get(id(config))
        return ref is not None and ref() is config


class PoolClient:
    def __init__(self, settings: PoolSettings, who: str, consequence: str, *,
                 options: dict[str, Any], call_timeout_s: float | None = None,
                 on_connect: Callable[[PoolBackend], None] | None = None) -> None:
        self.settings = settings
        self.who = who
        self.options = dict(options)
        self.call_timeout_s = call_timeout_s
        self.on_connect = on_connect
        self.health = BackendHealth(settings.url, who, settings.retry_interval_s, consequence)
        self.backend: PoolBackend | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self.backend = self._connect()
        except PoolError as exc:
            if settings.on_backend_error == "fail":
                raise RuntimeError(
                    f"KVPoolConnector: the {settings.backend} pool at {settings.url} cannot be "
                    f"used by the {who}: {exc}. Start it, or set kv_connector_extra_config."
                    "on_backend_error to 'recompute' to run without the pool until it is back"
                ) from exc
            logger.warning("KV pool at %s unreachable at start from the %s (%s): running "
                           "without the pool (%s); trying again every %.1f s", settings.url,
                           who, exc, consequence, settings.retry_interval_s)
            self.health.mark_down()
            self._thread = threading.Thread(target=self._reconnect, daemon=True,
                                            name="sluice-pool-connect")
            self._thread.start()

    def _connect(self) -> PoolBackend:
        settings = self.settings
        if settings.backend == "local":
            options = dict(self.options)
            store = local_store(options.pop("capacity_bytes", None))
            backend: PoolBackend = LocalBackend(store=store, timeout_s=settings.timeout_s)
        else:
            backend = create_backend(settings.url, timeout_s=settings.timeout_s, **self.options)
        try:
            if self.call_timeout_s is not None:
                backend.set_timeout(self.call_timeout_s)
            if self.on_connect is not None:
                self.on_connect(backend)
        except BaseException:
            backend.close()
            raise
        return backend

    def _reconnect(self) -> None:
        while not self._stop.wait(self.settings.retry_interval_s):
            try:
                backend = self._connect()
            except PoolError:
                continue
            with self._lock:
                if self._stop.is_set():
                    backend.close()
                    return
                self.backend = backend
            self.health.succeeded()
            return

    def close(self) -> bool:
        """Close the client; whether no native call of it may still touch the staging buffer
        (a Mooncake call that timed out and never ended: its buffer must outlive it)."""
        with self._lock:
            self._stop.set()
            backend, self.backend = self.backend, None
        if self._thread is not None:
            self._thread.join(self.settings.timeout_s + 1.0)
        if backend is None:
            return True
        backend.close()
        return not backend.busy
