"""The Mooncake Store pool backend: `mooncake_master` plus `MooncakeDistributedStore` clients
(the `mooncake-transfer-engine-non-cuda` wheel on CPU machines, a CUDA wheel on GPU ones).

Each client contributes `global_segment_size` bytes of its own memory to the pool (0: a client
that only reads and writes others' memory); the master decides where each value lives and keeps
the metadata. Transfers are zero-copy: the staging buffer is registered with the transfer engine
and values move with `batch_put_from` / `batch_get_into` straight between it and the segments
(P2P handshake metadata, TCP by default, `protocol="rdma"` where a device exists).

What the API returned in each case (wheel 0.3.13.post1, TCP on loopback, measured here), and
what this backend makes of it:

- ok: put 0; get the bytes read; exists 1.
- put of a key that exists: 0, the old value kept (also for another size) -> True (dedup).
- missing or evicted key: get -704 OBJECT_NOT_FOUND, exists 0 -> False.
- stored value larger than the slot: get -600 INVALID_PARAMS, nothing written -> False; smaller:
  get returns its size -> False (the trailer check wants the exact size).
- store full (the master's 90% watermark): put -200 NO_AVAILABLE_HANDLE for some keys of the
  batch -> False; older values are evicted silently -> later gets -704, False.
- segment owner killed (the process whose memory held the values): for the master's
  `client_ttl` (10 s by default; 5-7 s seen) exists still says 1, while get returns -800
  TRANSFER_FAIL in up to ~1 s with nothing written, and puts the master places on that segment
  -800 in up to ~1 s -> False, never garbage. After that: exists 0, get -704, and with no
  segment left put -200.
- master killed: -900 RPC_FAIL for every key, at once or after ~4.3 s (the RPC client's
  reconnect) -> `PoolUnavailable`. Restarted: calls work again ~1 s later without a new
  client (it re-registers and remounts its segment itself); the keys are gone (no HA).
- master stopped (SIGSTOP): -901 RPC_TIMEOUT after `MC_RPC_TIMEOUT_MS` -> `PoolTimeout`.
- more than 1,024 values to one peer in one call: some -800 after a 60 s stall, and the TCP
  lane to that peer stayed broken for the client's life -> batches are split into 512.
- client setup with the master down: -1 after 20 retries of ~4.5 s (90 s); a global segment
  under 16 MiB: setup fails.

`health_check()` turns 2 about 1 s after the master dies (the client's heartbeat): calls then
fail at once with `PoolUnavailable` instead of waiting. Every native call also runs on a worker
thread waited on until the call's deadline, so a call returns or raises `PoolTimeout` within
`timeout_s` whatever the library does; while a timed-out native call is still running (it may
still read or write its slots of the staging buffer) `busy` is True and further calls raise
`PoolUnavailable`. Seen: a put that timed out while the master was down landed once the master
was back.

Settings the library reads from the environment at `setup`, set here unless already set:
`MC_RPC_TIMEOUT_MS` and `MC_RPC_CONNECT_TIMEOUT_MS` to twice `timeout_s` (30 s by default), and
`MC_STORE_CLIENT_SETUP_RETRIES` = 1 (by default a client whose master is down retries for
90 s). The environment is process-wide, so the first backend's timeout applies to later ones in
the same process.

Sockets: the master binds what it is told (`sluice.testing.servers` keeps it on 127.0.0.1), but
this wheel's client binds its transfer and handshake ports on all interfaces (hard-coded in the
transfer engine; `MC_TCP_BIND_ADDRESS` only changes the advertised address in HTTP-metadata
mode). Keep the pool's hosts behind a firewall.

Dummy clients (`client="dummy"`, `real_client="HOST:PORT"`). On one host the pool's memory can
be owned by a standalone real client process (`mooncake_client`; for tests and benchmarks
`servers.start_mooncake_real_client`) and each engine be a dummy client of it
(`setup_dummy(mem_pool_size, local_buffer_size, real_client_address)`; the first argument is
unused in 0.3.13's source). The dummy talks only to the real
client: calls go over its RPC port; values do not cross a socket, the real client maps the
dummy's memory (memfd regions whose descriptors it gets over the abstract Unix socket
`@mooncake_client_<port>.sock`) and copies between them and its segment itself (local memcpy,
`MC_STORE_MEMCPY` on by default over TCP). A dummy's `register_buffer` takes only a whole region
of its own mapping (`alloc_from_mem_pool`, -1 otherwise): `host_memory(size)` hands one out (the
worker stages in it: no copy here); any other staging buffer is staged through a region of the
same size (one memmove per value and call). The master's address serves `count_keys` only.

Measured (same 2-core CPU box, values of 2.36 MB: a 16-token block of an 8B model; 256 per call,
between processes, medians): the native batch get 8.8 GB/s as a dummy, 1.7 GB/s as a real client
over TCP; the batch put 8.8 vs 1.8 GB/s once the owner's segment pages have been touched (a fresh
segment's first-touch page faults hold puts to 1-2 GB/s in both modes). Through this backend
(framing included): get 6.2 GB/s with `host_memory`, 3.2 with the staging copy, 1.2 over TCP.
What a dummy returned, where it differs from the list above:

- batch exists: -1 for any failure (the RPC's code is dropped) -> `PoolUnavailable`.
- put or get of memory the real client has not mapped: -600 INVALID_PARAMS.
- health_check is 2 until the dummy's first ping is back (milliseconds): setup waits for it.
- real client killed: the first call -900 at once, then calls hang on the dead connection
  (-> `PoolTimeout`, `busy`) until the dummy's ping (every 1 s) marks it lost; then
  health_check 2 -> `PoolUnavailable` at once. Started again on its port after that: the dummy
  maps its memory into it again by itself and calls work again; the keys are gone. But only
  where it is the process's one dummy: the library's reconnection maps every region of the
  process, other dummies' too, and the new real client refuses a second local buffer ("local
  buffer is already mapped") or an overlapping region, so with two dummies in a process (an
  engine's scheduler and worker under the uniproc executor) neither comes back: calls keep
  raising `PoolUnavailable` (the pool is off, loads recompute) until the engine restarts. Started
  again before the ping noticed (within ~1 s): the new process never learns the dummy's memory,
  every put -600 (all keys of a batch -> `PoolUnavailable`, saying so) and every get -600 (a
  miss), until the backend is created again.
- real client stopped (SIGSTOP): calls time out (`PoolTimeout`, `busy`); resumed, the dummy
  reconnects within ~2 s (`PoolUnavailable` meanwhile) and the values are all there.
- master killed: -900, then timeouts, as for a real client.

The real client's RPC port binds its `--host` (127.0.0.1 in `sluice.testing.servers`), its
transfer engine all interfaces; the abstract Unix socket is open to every process of the host's
network namespace, and whoever connects can have memory mapped or read values: keep untrusted
local users off the pool's hosts. Calls are coro_rpc (struct_pack), no pickle.

`count_keys` lists the master's keys over its admin HTTP port (`admin_port=`, the master's
`--metrics_port`), O(all keys): for tests and dedup checks, not the serving path.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from sluice.kv_transfer.pool.backend import PoolBackend, PoolError

logger = logging.getLogger(__name__)

OK = 0
OBJECT_ALREADY_EXISTS = -705
INVALID_PARAMS = -600
RPC_FAIL = -900
RPC_TIMEOUT = -901
HEALTH_MASTER_UNREACHABLE = 2
DUMMY_EXISTS_FAILED = -1  # a dummy client's batch_is_exist for any error
MIN_SEGMENT_SIZE = 16 << 20  # the client's allocator refuses smaller segments


class MooncakeBackend(PoolBackend):
    backend_name = "mooncake"
    # The TCP transport queues at most 1,024 transfers per peer
    # (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER); a batch beyond it stalls 60 s and breaks the lane.
    # Half of it leaves room for a second thread of this process writing to the same peer.
    max_keys_per_call = 512
    max_keys_per_lookup = 4096  # one RPC to the master, no transfer

    def __init__(self, host: str = "127.0.0.1", port: int = 50051, *, timeout_s: float = 5.0,
                 global_segment_size: int = 1 << 30, local_buffer_size: int = 16 << 20,
                 local_hostname: str = "127.0.0.1", protocol: str = "tcp",
                 rdma_devices: str = "", metadata_server: str = "P2PHANDSHAKE",
                 admin_port: int | None = None, num_workers: int = 4, client: str = "real",
                 real_client: str | None = None) -> None:
        super().__init__(f"{host}:{port}", timeout_s)
        if client not in ("real", "dummy"):
            raise ValueError(f"client must be 'real' or 'dummy', got {client!r}")
        if client == "dummy":
            real_host, _, real_port = (real_client or "").rpartition(":")
            if not real_host or not real_port.isdigit() or not 0 < int(real_port) < 65536:
                raise ValueError(f"a dummy client needs real_client='HOST:PORT' (the "
                                 f"mooncake_client of this host), got {real_client!r}")
            self.address = f"{host}:{port} via {real_client}"
        elif real_client is not None:
            raise ValueError("real_client is the address of the real client a dummy client "
                             "uses: pass client='dummy' with it")
        if not isinstance(global_segment_size, int) or not (
                global_segment_size == 0 or global_segment_size >= MIN_SEGMENT_SIZE):
            raise ValueError(f"global_segment_size must be 0 (this client owns no pool memory) "
                             f"or at least {MIN_SEGMENT_SIZE} bytes, got {global_segment_size!r}")
        if not isinstance(local_buffer_size, int) or local_buffer_size < 0:
            raise ValueError(f"local_buffer_size must be a non-negative int of bytes, "
                             f"got {local_buffer_size!r}")
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        if admin_port is not None and (not isinstance(admin_port, int)
                                       or not 0 < admin_port < 65536):
            raise ValueError(f"admin_port must be a port number, got {admin_port!r}")
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ImportError(
                "the mooncake pool backend needs the Mooncake Store client: pip install "
                "mooncake-transfer-engine-non-cuda (CPU; a CUDA wheel on GPUs) and the "
                f"libibverbs1 / ibverbs-providers system packages ({exc})") from exc
        self.host, self.port, self.admin_port = host, port, admin_port
        self.client, self.real_client = client, real_client
        # Twice the call's bound: the library's own timeouts end a native call that the guard
        # below has given up on soon after, without racing the guard.
        timeout_ms = str(max(1, round(2 * self.timeout_s * 1000)))
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", timeout_ms)
        os.environ.setdefault("MC_RPC_CONNECT_TIMEOUT_MS", timeout_ms)
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")

        self._executor = concurrent.futures.ThreadPoolExecutor(
            num_workers, thread_name_prefix="sluice-mooncake")
        self._stuck: list[concurrent.futures.Future] = []
        self._stuck_lock = threading.Lock()
        self._store: Any = None
        # Dummy mode: the shared-memory regions this client handed out (address -> size), and
        # the bounce region standing in for a staging buffer outside them (0: none).
        self._shared: dict[int, int] = {}
        self._bounce = 0
        deadline = time.monotonic() + self.timeout_s
        # A refused connection fails here at once; the client's own setup would take ~4 s.
        if client == "dummy":
            real_host, _, real_port = real_client.rpartition(":")
            self._probe(real_host, int(real_port), "real client", deadline)
        else:
            self._probe(host, port, "master", deadline)
        store = MooncakeDistributedStore()
        try:
            if client == "dummy":
                rc = self._run(store.setup_dummy, deadline, 0, local_buffer_size, real_client)
            else:
                rc = self._run(store.setup, deadline, local_hostname, metadata_server,
                               global_segment_size, local_buffer_size, protocol, rdma_devices,
                               f"{host}:{port}")
        except PoolError:
            self._executor.shutdown(wait=False)
            raise
        if rc != OK:
            self._run(store.close, time.monotonic() + self.timeout_s)
            self._executor.shutdown(wait=False)
            raise self.unavailable(f"client setup failed (rc {rc})")
        if client == "dummy":
            # The dummy reports itself unhealthy until its ping thread's first ping is back.
            while store.health_check() != OK:
                if time.monotonic() >= deadline:
                    self._run(store.close, time.monotonic() + self.timeout_s)
                    self._executor.shutdown(wait=False)
                    raise self.timed_out("the real client did not answer the dummy's first "
                                         "ping")
                time.sleep(0.005)
        self._store = store

    # ---- native calls, bounded ----

    def _probe(self, host: str, port: int, what: str, deadline: float) -> None:
        try:
            with socket.create_connection((host, port),
                                          timeout=max(0.01, deadline - time.monotonic())):
                pass
        except TimeoutError as exc:
            raise self.timed_out(f"the {what} did not accept a connection ({exc})") from exc
        except OSError as exc:
            raise self.unavailable(f"cannot reach the {what} ({exc})") from exc

    @property
    def busy(self) -> bool:
        with self._stuck_lock:
            self._stuck = [future for future in self._stuck if not future.done()]
            return bool(self._stuck)

    def _check_ready(self) -> None:
        if self.busy:
            raise self.unavailable("an earlier call that timed out is still running")

    def _run(self, fn: Callable, deadline: float, *args: Any) -> Any:
        with self._stuck_lock:
            self._stuck = [future for future in self._stuck if not future.done()]
            if self._stuck:
                raise self.unavailable("an earlier call that timed out is still running")
            future = self._executor.submit(fn, *args)
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            with self._stuck_lock:
                self._stuck.append(future)
            raise self.timed_out(
                f"{getattr(fn, '__name__', 'call')} not done within timeout_s="
                f"{self.timeout_s:g}") from None

    def _native(self, fn: Callable, deadline: float, *args: Any) -> list[int]:
        if self._store.health_check() == HEALTH_MASTER_UNREACHABLE:
            if self.client == "dummy":
                raise self.unavailable("real client unreachable (the dummy's ping fails)")
            raise self.unavailable("master unreachable (the client's heartbeat fails)")
        codes = self._run(fn, deadline, *args)
        peer = "master or real client" if self.client == "dummy" else "master"
        if RPC_FAIL in codes:
            raise self.unavailable(f"{peer} RPC failed ({RPC_FAIL})")
        if RPC_TIMEOUT in codes:
            raise self.timed_out(f"{peer} RPC timed out ({RPC_TIMEOUT})")
        return codes

    # ---- the backend ----

    def host_memory(self, size: int) -> int | None:
        """Dummy mode: `size` bytes of memory shared with the real client (a memfd mapping of
        the library's), whose address registered as the staging buffer moves values without
        a copy here; it stays mapped until the process exits (the library has no call that
        frees it). None for a real client (any memory is as good)."""
        self._check_open()
        if self.client != "dummy":
            return None
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"size must be a positive int, got {size!r}")
        address = self._run(self._store.alloc_from_mem_pool, time.monotonic() + self.timeout_s,
                            size)
        if not address:
            raise PoolError(self.backend_name, self.address,
                            f"allocating {size} bytes of shared memory failed")
        self._shared[address] = size
        return address

    def _register(self, address: int, size: int) -> None:
        target = address
        if self.client == "dummy" and self._shared.get(address) != size:
            # The dummy registers only memory of its own mapping: stage through a copy.
            target = self.host_memory(size)
            self._bounce = target
        rc = self._run(self._store.register_buffer, time.monotonic() + self.timeout_s,
                       target, size)
        if rc != OK:
            raise PoolError(self.backend_name, self.address,
                            f"registering the {size}-byte staging buffer failed (rc {rc})")

    def _exists(self, keys: list[str], deadline: float) -> list[bool]:
        codes = self._native(self._store.batch_is_exist, deadline, keys)
        if self.client == "dummy" and DUMMY_EXISTS_FAILED in codes:
            # The dummy reports every failed lookup as -1 (the RPC's error code is dropped).
            raise self.unavailable("lookup failed (-1): the real client or the master is "
                                   "unreachable")
        return [code == 1 for code in codes]

    def _put(self, keys: list[str], offsets: list[int], sizes: list[int],
             deadline: float) -> list[bool]:
        base = self._bounce or self._buffer_address
        if self._bounce:
            self._check_ready()  # a late native call may still read or write the bounce slots
            for offset, size in zip(offsets, sizes, strict=True):
                ctypes.memmove(self._bounce + offset, self._buffer_address + offset, size)
        codes = self._native(self._store.batch_put_from, deadline, keys,
                             [base + offset for offset in offsets], sizes)
        if self.client == "dummy" and codes and all(code == INVALID_PARAMS for code in codes):
            raise self.unavailable(
                f"the real client refuses this dummy's memory ({INVALID_PARAMS}): restarted "
                "before the dummy noticed it was gone; the backend must be created again")
        return [code in (OK, OBJECT_ALREADY_EXISTS) for code in codes]

    def _get(self, keys: list[str], offsets: list[int], sizes: list[int],
             deadline: float) -> list[int]:
        base = self._bounce or self._buffer_address
        codes = self._native(self._store.batch_get_into, deadline, keys,
                             [base + offset for offset in offsets], sizes)
        if self._bounce:
            for offset, size, code in zip(offsets, sizes, codes, strict=True):
                if code > 0:
                    ctypes.memmove(self._buffer_address + offset, self._bounce + offset,
                                   min(code, size))
        return [code if code >= 0 else -1 for code in codes]

    def count_keys(self, prefix: str = "") -> int:
        self._check_open()
        if self.admin_port is None:
            raise NotImplementedError(
                "mooncake counts keys through the master's admin port: pass admin_port=")
        url = f"http://{self.host}:{self.admin_port}/get_all_keys"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as response:
                body = response.read().decode()
        except TimeoutError as exc:
            raise self.timed_out(f"{url} did not answer ({exc})") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise self.unavailable(f"{url} failed ({exc})") from exc
        return sum(1 for key in body.splitlines() if key and key.startswith(prefix))

    def _close(self) -> None:
        # Closing the client under a native call still running would crash the process: wait
        # for such calls a while, and leave the client open (logged) if they do not end.
        with self._stuck_lock:
            stuck = [future for future in self._stuck if not future.done()]
        _, still_running = concurrent.futures.wait(stuck, timeout=2 * self.timeout_s)
        if still_running:
            logger.warning("%s: %d native call(s) still running at close; client left open",
                           self._describe(), len(still_running))
            self._executor.shutdown(wait=False)
            return
        if self._buffer_address:
            self._store.unregister_buffer(self._bounce or self._buffer_address)
        self._store.close()
        self._executor.shutdown(wait=True)
