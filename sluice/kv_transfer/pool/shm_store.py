"""The shared host tier's pool backend (`shm://HOST:PORT`): a client of `sluice pool-server`
(shm_server.py) on this host. It maps the server's arena once per server life and copies each
value with one memcpy (GIL released) between its staging buffer and the arena, sealing or
checking it in the same task (framing.py); the socket carries only the index operations (two
round trips a get or put chunk, one an exists).

- Direct gets (`get_pinned`, the worker's default load from this tier): GetBegin pins a chunk
  of values and returns a `PinnedGet` with each value's address in this process's mapping and
  its stored size; its checks (trailer, size, format, xxh3 over the arena bytes) start at once
  on framing's threads (fanned out from the backend's check thread), while the caller copies
  out of the addresses (worker.py, mover.py `load_direct`: CPU into the cache blocks, CUDA DMA
  from the registered mapping). `release` waits for the checks, sends GetEnd and ends the call:
  until then the mapping stays mapped (a replaced arena closes after), the bounds are a get's.
  Stages: get.pin (GetBegin), get.checksum (the threads' hashing), get.check_wait (the caller
  waiting for the checks). `_Arena.on_close` hooks run before a mapping closes (the worker's
  CUDA registration is undone there).

- Threads: each calling thread has its own connection (kept until `close`: the engine's
  threads are few and long-lived), so a worker's load never waits behind its save thread's
  copies; the arena mapping is shared, and a mapping replaced (the server was restarted) is
  closed only once no call is in flight.
- Bounds: the connect and each reply wait for at most what is left of `timeout_s`. A silent
  server is `PoolTimeout` (the connection is dropped: the server then drops its pins and
  reservations), a refused or lost connection `PoolUnavailable`; the next call connects again.
  Copies are local, so nothing runs on after a call returns: `busy` is always False.
- A server killed while a get copies: the client's mapping keeps the memory, the copy ends with
  the value's bytes (and its checksum says so). A restarted server has a new, empty arena: the
  client maps it on its next handshake and drops the old mapping.
- The server must be on this host and in this pid namespace (`disagg.shm.host_id`); another is
  `PoolUnavailable` naming both.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import logging
import mmap
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from sluice.channel import Encoder, MessageDecoder, WireError
from sluice.kv_transfer.disagg.shm import host_id, map_peer_memfd
from sluice.kv_transfer.pool import framing
from sluice.kv_transfer.pool.backend import PoolBackend, _check_keys
from sluice.kv_transfer.pool.shm_server import (
    LENGTH,
    MAX_FRAME_BYTES,
    Committed,
    Count,
    Counted,
    Exists,
    GetBegin,
    GetEnd,
    GetGrant,
    Hello,
    Present,
    PutBegin,
    PutCommit,
    PutGrant,
    Refused,
    Reply,
    Stats,
    StatsRequest,
    Welcome,
    send_frame,
)

logger = logging.getLogger("sluice")


@dataclass(slots=True, eq=False)
class _Arena:
    welcome: Welcome
    mapping: mmap.mmap
    view: ctypes.Array  # over the mapping: its address; dropped before the mapping closes
    address: int
    # Run before the mapping closes (once no call is in flight): a CUDA registration undone.
    close_hooks: list[Callable[[], None]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.welcome.nbytes

    @property
    def slot_bytes(self) -> int:
        return self.welcome.slot_bytes

    def on_close(self, hook: Callable[[], None]) -> None:
        """Call `hook` before this mapping closes (on the thread that closes it)."""
        self.close_hooks.append(hook)

    def close(self) -> None:
        hooks, self.close_hooks = self.close_hooks, []
        for hook in hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 (the mapping must close all the same)
                logger.exception("shm pool: a hook before the arena mapping closes failed")
        del self.view
        self.mapping.close()


class PinnedGet:
    """One chunk of keys pinned in the arena (`ShmPoolBackend.get_pinned`): `addresses[i]` is
    where keys[i]'s value lies in this process's mapping of the arena (-1: a miss) and
    `sizes[i]` its stored size. The checks run on framing's threads from the start; `checks()`
    waits for them, `release()` (or leaving the `with`) waits for them too, then unpins the
    values (GetEnd) and lets the mapping go: copy out of the addresses only before that."""

    def __init__(self, backend: ShmPoolBackend, connected: contextlib.AbstractContextManager,
                 conn: _Connection, arena: _Arena, keys: list[str], slots: list[int],
                 sizes: list[int], payload_size: int) -> None:
        self._backend, self._connected, self._conn = backend, connected, conn
        self.arena = arena
        self.keys = keys
        self.slots = slots
        self.addresses = [arena.address + slot * arena.slot_bytes if slot >= 0 else -1
                          for slot in slots]
        self.sizes = [size if slot >= 0 else 0 for slot, size in zip(slots, sizes)]
        self.payload_size = payload_size
        self._released = False
        self._result: list[bool] | None = None
        self._checked = backend._check_thread().submit(
            framing.parallel_map, self._check_one, keys, self.addresses, self.sizes)

    def _check_one(self, key: str, address: int, stored: int) -> tuple[bool, float]:
        """(On a framing thread.) Whether the value at `address` is intact, and the seconds."""
        start = time.perf_counter()
        if address < 0:
            verdict = framing.Verdict.MISSING
        else:
            view = memoryview((ctypes.c_ubyte * stored).from_address(address)).cast("B")
            verdict = framing.verify(view, 0, self.payload_size, key, stored)
        return self._backend._count_verdict(key, verdict), time.perf_counter() - start

    def checks(self) -> list[bool]:
        """Whether each value is intact (waits for the checks)."""
        if self._result is None:
            start = time.perf_counter()
            checked = self._checked.result()
            self._backend._add_stage_seconds(
                ("get.check_wait", time.perf_counter() - start),
                ("get.checksum", sum(seconds for _, seconds in checked)))
            self._result = [ok for ok, _ in checked]
        return self._result

    def release(self) -> None:
        """Unpin the values (after the checks: they read the arena) and end the call."""
        if self._released:
            return
        self._released = True
        try:
            concurrent.futures.wait([self._checked])
            pinned = [slot for slot in self.slots if slot >= 0]
            if pinned:
                try:
                    send_frame(self._conn.sock, self._conn.encoder, GetEnd(slots=pinned))
                except OSError:
                    self._backend._drop(self._conn)  # the server drops the connection's pins
        finally:
            self._connected.__exit__(None, None, None)

    def __enter__(self) -> PinnedGet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(slots=True, eq=False)
class _Connection:
    """One thread's connection, and the arena its server announced."""

    sock: socket.socket
    encoder: Encoder
    decoder: MessageDecoder
    welcome: Welcome | None = None


class ShmPoolBackend(PoolBackend):
    backend_name = "shm"
    max_keys_per_call = 1024
    max_keys_per_lookup = 1 << 14

    def __init__(self, host: str = "127.0.0.1", port: int = 7070, *,
                 timeout_s: float = 5.0) -> None:
        super().__init__(f"{host}:{port}", timeout_s)
        self.host, self.port = host, port
        self._lock = threading.Lock()  # the arena, the calls in flight, the connections
        self._arena: _Arena | None = None
        self._retired: list[_Arena] = []  # replaced while calls were in flight
        self._num_active = 0
        self._connections: set[_Connection] = set()
        self._local = threading.local()
        self._checker: concurrent.futures.ThreadPoolExecutor | None = None
        with self._connected(time.monotonic() + self.timeout_s):
            pass

    @property
    def max_value_size(self) -> int | None:
        """The server's slot size: the largest value it takes (None before a handshake)."""
        arena = self._arena
        return arena.welcome.slot_bytes if arena is not None else None

    # ---- the operations ----

    def _exists(self, keys: list[str], deadline: float) -> list[bool]:
        with self._connected(deadline) as (conn, _):
            return self._ask(conn, Exists(keys=keys), Present, deadline).found

    def _get(self, keys: list[str], offsets: list[int], sizes: list[int],
             deadline: float) -> list[int]:
        return self._read(keys, offsets, sizes, None, deadline)

    def _put(self, keys: list[str], offsets: list[int], sizes: list[int],
             deadline: float) -> list[bool]:
        return self._write(keys, offsets, sizes, None, deadline)[0]

    # One task per value on framing's threads (memmove and xxh3 release the GIL): one core's
    # memcpy bandwidth is well below the memory's (benchmarks/journal, 2026-12-02), and a
    # value's check runs in its copy's task, so values are hashed while others are copied.

    def _get_checking(self, keys: list[str], offsets: list[int], sizes: list[int],
                      value_sizes: list[int], deadline: float) -> list[bool]:
        start = time.perf_counter()
        try:
            checked = self._read(keys, offsets, value_sizes, sizes, deadline)
        finally:
            self._add_stage_seconds(("get.copy", time.perf_counter() - start))
        self._add_stage_seconds(("get.checksum", sum(seconds for _, seconds in checked)))
        return [ok for ok, _ in checked]

    def get_pinned(self, keys: Sequence[str], payload_size: int) -> PinnedGet:
        """Pin `keys`' values in the arena (one GetBegin, bounded by `timeout_s`) for the caller
        to copy straight out of the mapping (the worker's direct load: no staging buffer), and
        start checking them (framing's trailer, over the arena bytes, on framing's threads).
        At most `max_keys_per_call` keys. The values stay pinned, and the mapping mapped, until
        the PinnedGet is released."""
        self._check_open()
        keys = _check_keys(keys)
        if len(keys) > self.max_keys_per_call:
            raise ValueError(f"get_pinned takes at most {self.max_keys_per_call} keys, "
                             f"got {len(keys)}")
        value_size = framing.value_size(payload_size)
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        connected = self._connected(deadline)
        conn, arena = connected.__enter__()
        try:
            grant = self._ask(conn, GetBegin(keys=keys, max_sizes=[value_size] * len(keys)),
                              GetGrant, deadline)
            pinned = PinnedGet(self, connected, conn, arena, keys, grant.slots, grant.sizes,
                               payload_size)
        except BaseException:
            # Whatever GetBegin pinned goes with the connection (the server drops its pins).
            self._drop(conn)
            connected.__exit__(None, None, None)
            raise
        finally:
            self._add_stage_seconds(("get.pin", time.perf_counter() - start))
        return pinned

    def _check_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """The thread that runs a PinnedGet's checks (fanned out on framing's threads), so
        they run while the caller copies."""
        with self._lock:
            if self._checker is None:
                self._checker = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="sluice-pool-check")
            return self._checker

    def _put_sealing(self, keys: list[str], offsets: list[int], sizes: list[int],
                     value_sizes: list[int], deadline: float) -> list[bool]:
        start, hashed = time.perf_counter(), 0.0
        try:
            stored, hashed = self._write(keys, offsets, value_sizes, sizes, deadline)
            return stored
        finally:
            self._add_stage_seconds(("put.checksum", hashed),
                                    ("put.copy", time.perf_counter() - start))

    def _read(self, keys: list[str], offsets: list[int], value_sizes: list[int],
              payload_sizes: list[int] | None, deadline: float) -> list:
        """Copy each key's value into its slot: its size, or -1 where none was granted; with
        `payload_sizes`, (intact, seconds of hashing) of each value instead."""
        with self._connected(deadline) as (conn, arena):
            grant = self._ask(conn, GetBegin(keys=keys, max_sizes=value_sizes), GetGrant,
                              deadline)
            slot_bytes = arena.welcome.slot_bytes

            def read_one(key: str, offset: int, slot: int, stored: int,
                         payload_size: int | None) -> int | tuple[bool, float]:
                received = -1
                if slot >= 0:
                    ctypes.memmove(self._buffer_address + offset,
                                   arena.address + slot * slot_bytes, stored)
                    received = stored
                if payload_size is None:
                    return received
                copied = time.perf_counter()
                intact = self._check_value(key, offset, payload_size, received)
                return intact, time.perf_counter() - copied

            results = framing.parallel_map(read_one, keys, offsets, grant.slots, grant.sizes,
                                           payload_sizes or [None] * len(keys))
            pinned = [slot for slot in grant.slots if slot >= 0]
            if pinned:
                try:
                    send_frame(conn.sock, conn.encoder, GetEnd(slots=pinned))
                except OSError:
                    self._drop(conn)  # the copies are done: the values stand
        return results

    def _write(self, keys: list[str], offsets: list[int], value_sizes: list[int],
               payload_sizes: list[int] | None, deadline: float) -> tuple[list[bool], float]:
        """Copy each slot's value into the arena slot granted for it and commit them: whether
        each key holds a value now, and the threads' seconds of sealing (with `payload_sizes`,
        every slot is sealed first, in the same task as its copy)."""
        view = self._buffer
        assert view is not None
        with self._connected(deadline) as (conn, arena):
            grant = self._ask(conn, PutBegin(keys=keys, sizes=value_sizes), PutGrant, deadline)
            slot_bytes = arena.welcome.slot_bytes

            def write_one(key: str, offset: int, slot: int, value_size: int,
                          payload_size: int | None) -> float:
                start = time.perf_counter()
                if payload_size is not None:  # every slot, stored or not (backend.batch_put)
                    framing.seal(view, offset, payload_size, key)
                sealed = time.perf_counter()
                if slot >= 0:
                    ctypes.memmove(arena.address + slot * slot_bytes,
                                   self._buffer_address + offset, value_size)
                return sealed - start

            seconds = framing.parallel_map(write_one, keys, offsets, grant.slots, value_sizes,
                                           payload_sizes or [None] * len(keys))
            reserved = [slot for slot in grant.slots if slot >= 0]
            stored = iter(self._ask(conn, PutCommit(slots=reserved), Committed,
                                    deadline).stored if reserved else [])
            # PRESENT (-1): the key holds its value already, a success; NO_ROOM (-2): refused.
            return [next(stored) if slot >= 0 else slot == -1 for slot in grant.slots], sum(seconds)

    def count_keys(self, prefix: str = "") -> int:
        self._check_open()
        deadline = time.monotonic() + self.timeout_s
        with self._connected(deadline) as (conn, _):
            return self._ask(conn, Count(prefix=prefix), Counted, deadline).num_keys

    def stats(self) -> Stats:
        """The server's counts (tests, metrics)."""
        self._check_open()
        deadline = time.monotonic() + self.timeout_s
        with self._connected(deadline) as (conn, _):
            return self._ask(conn, StatsRequest(), Stats, deadline)

    def _close(self) -> None:
        with self._lock:
            for conn in list(self._connections):
                conn.sock.close()
            self._connections.clear()
            self._retire(self._arena)
            self._arena = None
            checker, self._checker = self._checker, None
        if checker is not None:
            checker.shutdown(wait=True)

    @contextlib.contextmanager
    def mapped_arena(self) -> Iterator[_Arena]:
        """The server's arena (a connection made now if this thread has none), mapped until
        the block ends: the worker registers it for DMA when it connects, before any load."""
        with self._connected(time.monotonic() + self.timeout_s) as (_, arena):
            yield arena

    # ---- connections and the arena ----

    @contextlib.contextmanager
    def _connected(self, deadline: float) -> Iterator[tuple[_Connection, _Arena]]:
        """This thread's connection (made now if there is none) and the arena it addresses,
        which stays mapped until the call ends."""
        conn: _Connection | None = getattr(self._local, "conn", None)
        with self._lock:
            if conn is not None and (self._arena is None or conn.welcome != self._arena.welcome):
                self._drop_locked(conn)  # another thread saw the server restart
                conn = None
        if conn is None:
            conn = self._handshake(deadline)
        with self._lock:
            arena = self._arena
            if arena is None or conn.welcome != arena.welcome:
                self._drop_locked(conn)
                raise self.unavailable("the server's arena changed during the call")
            self._num_active += 1
        try:
            yield conn, arena
        finally:
            with self._lock:
                self._num_active -= 1
                if self._num_active == 0:
                    for old in self._retired:
                        old.close()
                    self._retired.clear()

    def _handshake(self, deadline: float) -> _Connection:
        self._check_deadline(deadline)
        try:
            sock = socket.create_connection((self.host, self.port),
                                            timeout=max(0.01, deadline - time.monotonic()))
        except TimeoutError:
            raise self.timed_out(f"no connection within {self.timeout_s:g} s") from None
        except OSError as exc:
            with self._lock:  # the server is gone: let its memory go
                self._retire(self._arena)
                self._arena = None
            raise self.unavailable(f"cannot reach the server ({exc})") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Connection(sock, Encoder(), MessageDecoder(Reply, "shm pool reply",
                                                          "this client and the server"))
        with self._lock:
            self._connections.add(conn)
        self._local.conn = conn
        welcome = self._ask(conn, Hello(), Welcome, deadline)
        here = host_id()
        if welcome.host_id != here:
            self._drop(conn)
            raise self.unavailable(f"the server is on host {welcome.host_id!r}, this client on "
                                   f"{here!r}: the shm pool serves one host's instances")
        conn.welcome = welcome
        with self._lock:
            if self._arena is not None and self._arena.welcome == welcome:
                return conn
        try:
            # Populated: a slot's first copy would otherwise pay a page fault per 4 KiB.
            mapping = map_peer_memfd(welcome.pid, welcome.fd, welcome.inode, welcome.nbytes,
                                     populate=True)
        except (OSError, ValueError) as exc:
            self._drop(conn)
            raise self.unavailable(f"cannot map the server's arena "
                                   f"(/proc/{welcome.pid}/fd/{welcome.fd}): {exc}") from None
        view = (ctypes.c_ubyte * welcome.nbytes).from_buffer(mapping)
        arena = _Arena(welcome, mapping, view, ctypes.addressof(view))
        with self._lock:
            if self._arena is not None and self._arena.welcome == welcome:
                arena.close()  # another thread mapped it meanwhile
            else:
                self._retire(self._arena)  # the server was restarted: a new arena
                self._arena = arena
        return conn

    def _retire(self, arena: _Arena | None) -> None:
        """(Lock held.) Close `arena` now, or once the calls in flight are done."""
        if arena is None:
            return
        if self._num_active == 0:
            arena.close()
        else:
            self._retired.append(arena)

    def _ask(self, conn: _Connection, request, reply_type: type,  # noqa: ANN001
             deadline: float):  # noqa: ANN202
        """Send `request`, return its reply (of `reply_type`); drops the connection on error."""
        sock = conn.sock
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            send_frame(sock, conn.encoder, request)
            (length,) = LENGTH.unpack(self._receive(sock, LENGTH.size))
            if length > MAX_FRAME_BYTES:
                raise WireError(f"a {length}-byte reply frame")
            reply = conn.decoder.decode(self._receive(sock, length))
        except TimeoutError:
            self._drop(conn)
            raise self.timed_out(f"no answer within timeout_s={self.timeout_s:g}") from None
        except (OSError, WireError) as exc:
            self._drop(conn)
            raise self.unavailable(f"connection lost ({exc})") from None
        if isinstance(reply, Refused):
            raise self.unavailable(f"the server refused the call: {reply.reason}")
        if not isinstance(reply, reply_type):
            self._drop(conn)
            raise self.unavailable(f"expected {reply_type.__name__}, got "
                                   f"{type(reply).__name__}")
        return reply

    @staticmethod
    def _receive(sock: socket.socket, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            chunk = sock.recv(size - len(data))
            if not chunk:
                raise ConnectionResetError("the server closed the connection")
            data += chunk
        return bytes(data)

    def _drop(self, conn: _Connection) -> None:
        """Close this thread's connection (the server drops its pins and reservations); the
        arena stays mapped until a handshake says it changed (or `close`)."""
        with self._lock:
            self._drop_locked(conn)

    def _drop_locked(self, conn: _Connection) -> None:
        conn.sock.close()
        self._connections.discard(conn)
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
