"""The shared host tier of the global KV pool: one server process per host owning one
shared-memory arena of fixed-size slots, its index (key -> slot) and its LRU; the instances of the
host map the arena once and copy values straight between their staging buffers and its slots.
Only index operations travel over the socket (typed msgpack frames, 4-byte length prefix).

    sluice pool-server --port 7070 --capacity-bytes 8589934592 --slot-bytes 2359552

    client (shm_store.py)                       server (here, one thread)
      Hello                         ───────▶      Welcome: pid, memfd fd, inode, size, slots
      map /proc/<pid>/fd/<fd> once (disagg/shm.py's map_peer_memfd)
      GetBegin(keys, max sizes)     ───────▶      GetGrant(slot, size per key): pinned
      memcpy slot -> staging; GetEnd(slots)  ─▶   unpinned (no reply)
      PutBegin(keys, sizes)         ───────▶      PutGrant: a reserved slot, PRESENT or NO_ROOM
      memcpy staging -> slot; PutCommit(slots) ─▶ Committed: the keys become visible now

Rules that keep readers safe: a pinned slot (a get between its grant and its end) is never
evicted or reused; a reserved slot is invisible until its commit, so a client killed mid-put
leaves nothing behind; a connection's pins and reservations are dropped when it closes (a client
killed or timed out mid-call). A client that does not read its replies within 1 s is dropped.
Eviction takes the least recently used unpinned value (a get grant or a put of a present key
counts as a use). The arena is a memfd: nothing is left under /dev/shm, and its memory goes
with the last mapping (the server's fd and the clients' mappings).
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import selectors
import signal
import socket
import struct
from dataclasses import dataclass, field

from sluice.channel import Encoder, Message, MessageDecoder
from sluice.kv_transfer.disagg.shm import create_memfd, host_id, process_start, shm_unavailable

logger = logging.getLogger("sluice")

LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 64 << 20
PRESENT, NO_ROOM = -1, -2  # PutGrant slots that are not slots
DEFAULT_SLOT_BYTES = 4 << 20
SEND_TIMEOUT_S = 1.0


# ---- the frames ----

class Hello(Message, tag="pool.shm.hello"):
    pass


class Welcome(Message, tag="pool.shm.welcome"):
    host_id: str
    pid: int
    pid_start: int
    fd: int
    inode: int
    nbytes: int
    slot_bytes: int
    num_slots: int


class Exists(Message, tag="pool.shm.exists"):
    keys: list[str]


class Present(Message, tag="pool.shm.present"):
    found: list[bool]


class GetBegin(Message, tag="pool.shm.get_begin"):
    keys: list[str]
    max_sizes: list[int]


class GetGrant(Message, tag="pool.shm.get_grant"):
    slots: list[int]  # -1: no value (missing, or larger than its max size)
    sizes: list[int]


class GetEnd(Message, tag="pool.shm.get_end"):
    slots: list[int]


class PutBegin(Message, tag="pool.shm.put_begin"):
    keys: list[str]
    sizes: list[int]


class PutGrant(Message, tag="pool.shm.put_grant"):
    slots: list[int]  # a reserved slot, PRESENT or NO_ROOM


class PutCommit(Message, tag="pool.shm.put_commit"):
    slots: list[int]


class Committed(Message, tag="pool.shm.committed"):
    stored: list[bool]


class Count(Message, tag="pool.shm.count"):
    prefix: str


class Counted(Message, tag="pool.shm.counted"):
    num_keys: int


class StatsRequest(Message, tag="pool.shm.stats"):
    pass


class Stats(Message, tag="pool.shm.stats_reply"):
    num_connections: int
    num_slots: int
    num_values: int
    num_pinned: int
    num_reserved: int
    num_evicted: int
    num_refused: int  # puts that found no room


class Refused(Message, tag="pool.shm.refused"):
    reason: str


Request = Hello | Exists | GetBegin | GetEnd | PutBegin | PutCommit | Count | StatsRequest
Reply = Welcome | Present | GetGrant | PutGrant | Committed | Counted | Stats | Refused


def send_frame(sock: socket.socket, encoder: Encoder, message: Message) -> None:
    payload = encoder.encode(message)
    sock.sendall(LENGTH.pack(len(payload)) + payload)


# ---- the index ----

@dataclass(slots=True)
class _Value:
    key: str
    slot: int
    size: int
    pins: int = 0


@dataclass(slots=True)
class _Connection:
    sock: socket.socket
    inbox: bytearray = field(default_factory=bytearray)
    pins: collections.Counter = field(default_factory=collections.Counter)  # slot -> count
    reserved: dict[int, tuple[str, int]] = field(default_factory=dict)  # slot -> (key, size)


class ArenaIndex:
    """Which slot holds which key, in LRU order; pins and reservations by connection."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.values: collections.OrderedDict[str, _Value] = collections.OrderedDict()
        self.by_slot: dict[int, _Value] = {}
        self.free = list(range(num_slots - 1, -1, -1))  # lowest slot first (pop from the end)
        self.num_evicted = 0
        self.num_refused = 0

    def exists(self, keys: list[str]) -> list[bool]:
        return [key in self.values for key in keys]

    def begin_get(self, conn: _Connection, keys: list[str], max_sizes: list[int]) -> GetGrant:
        slots, sizes = [], []
        for key, max_size in zip(keys, max_sizes):
            value = self.values.get(key)
            if value is None or value.size > max_size:
                slots.append(-1)
                sizes.append(0)
                continue
            self.values.move_to_end(key)
            value.pins += 1
            conn.pins[value.slot] += 1
            slots.append(value.slot)
            sizes.append(value.size)
        return GetGrant(slots=slots, sizes=sizes)

    def end_get(self, conn: _Connection, slots: list[int]) -> None:
        for slot in slots:
            if conn.pins[slot] <= 0:
                continue  # not pinned by this connection: ignore
            conn.pins[slot] -= 1
            self.by_slot[slot].pins -= 1

    def begin_put(self, conn: _Connection, keys: list[str], sizes: list[int]) -> PutGrant:
        slots = []
        for key, size in zip(keys, sizes):
            if key in self.values:
                self.values.move_to_end(key)
                slots.append(PRESENT)
                continue
            slot = self._allocate() if 0 < size <= self.slot_bytes else None
            if slot is None:
                self.num_refused += 1
                slots.append(NO_ROOM)
                continue
            conn.reserved[slot] = (key, size)
            slots.append(slot)
        return PutGrant(slots=slots)

    def commit(self, conn: _Connection, slots: list[int]) -> Committed:
        stored = []
        for slot in slots:
            reservation = conn.reserved.pop(slot, None)
            if reservation is None:
                stored.append(False)
                continue
            key, size = reservation
            if key in self.values:  # another client committed the same key first
                self.free.append(slot)
            else:
                value = _Value(key, slot, size)
                self.values[key] = value
                self.by_slot[slot] = value
            stored.append(True)
        return Committed(stored=stored)

    def drop(self, conn: _Connection) -> None:
        """A connection closed: its pins go, its reserved slots are free again."""
        for slot, count in conn.pins.items():
            if count > 0:
                self.by_slot[slot].pins -= count
        conn.pins.clear()
        self.free.extend(conn.reserved)
        conn.reserved.clear()

    def count(self, prefix: str) -> int:
        return sum(1 for key in self.values if key.startswith(prefix))

    def stats(self, connections: list[_Connection]) -> Stats:
        return Stats(num_connections=len(connections), num_slots=self.num_slots,
                     num_values=len(self.values),
                     num_pinned=sum(1 for v in self.values.values() if v.pins),
                     num_reserved=sum(len(c.reserved) for c in connections),
                     num_evicted=self.num_evicted, num_refused=self.num_refused)

    def _allocate(self) -> int | None:
        if self.free:
            return self.free.pop()
        victim = next((v for v in self.values.values() if v.pins == 0), None)
        if victim is None:
            return None  # every value is being read
        del self.values[victim.key]
        del self.by_slot[victim.slot]
        self.num_evicted += 1
        return victim.slot


# ---- the server ----

class ArenaServer:
    """The pool server: the arena (a memfd it never maps), the index, the connections."""

    def __init__(self, port: int, capacity_bytes: int, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 host: str = "127.0.0.1") -> None:
        problem = shm_unavailable()
        if problem is not None:
            raise ValueError(f"sluice pool-server: {problem}")
        for name, value in (("capacity_bytes", capacity_bytes), ("slot_bytes", slot_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"sluice pool-server: {name} must be a positive number of "
                                 f"bytes, got {value!r}")
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"sluice pool-server: port must be in [0, 65535], got {port!r}")
        num_slots = capacity_bytes // slot_bytes
        if num_slots < 1:
            raise ValueError(f"sluice pool-server: capacity_bytes ({capacity_bytes}) holds no "
                             f"slot of slot_bytes ({slot_bytes})")
        self.nbytes = num_slots * slot_bytes
        try:
            self.fd = create_memfd("sluice-kv-pool", self.nbytes)
        except OSError as exc:
            raise ValueError(f"sluice pool-server: cannot allocate {self.nbytes} bytes of "
                             f"shared memory: {exc}") from None
        self.index = ArenaIndex(num_slots, slot_bytes)
        try:
            self.listener = socket.create_server((host, port))
        except OSError as exc:
            os.close(self.fd)
            raise ValueError(f"sluice pool-server: cannot listen on {host}:{port}: {exc}") from None
        self.port = self.listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._connections: dict[socket.socket, _Connection] = {}
        self._encoder = Encoder()
        self._decoder = MessageDecoder(Request, "shm pool request", "this server and a client")
        pid = os.getpid()
        self.welcome = Welcome(host_id=host_id(), pid=pid, pid_start=process_start(pid) or 0,
                               fd=self.fd, inode=os.fstat(self.fd).st_ino, nbytes=self.nbytes,
                               slot_bytes=slot_bytes, num_slots=num_slots)
        self._running = True

    def stop(self) -> None:
        self._running = False

    def serve_forever(self) -> None:
        self.listener.setblocking(False)
        self._selector.register(self.listener, selectors.EVENT_READ)
        while self._running:
            for key, _ in self._selector.select(timeout=0.5):
                if key.fileobj is self.listener:
                    self._accept()
                else:
                    self._read(self._connections[key.fileobj])
        for conn in list(self._connections.values()):
            self._close(conn)
        self._selector.close()
        self.listener.close()
        os.close(self.fd)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(SEND_TIMEOUT_S)  # replies; reads come only when the selector says so
        conn = _Connection(sock)
        self._connections[sock] = conn
        self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(1 << 20)
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.inbox += data
        while len(conn.inbox) >= LENGTH.size:
            (length,) = LENGTH.unpack_from(conn.inbox)
            if length > MAX_FRAME_BYTES:
                logger.warning("shm pool: a %d-byte frame from a client: dropping it", length)
                self._close(conn)
                return
            if len(conn.inbox) < LENGTH.size + length:
                return
            frame = bytes(conn.inbox[LENGTH.size:LENGTH.size + length])
            del conn.inbox[:LENGTH.size + length]
            try:
                reply = self._handle(conn, self._decoder.decode(frame))
            except (ValueError, KeyError) as exc:
                reply = Refused(reason=str(exc))
            if reply is None:
                continue
            try:
                send_frame(conn.sock, self._encoder, reply)
            except OSError:  # gone, or not reading: its pins must not outlive it
                self._close(conn)
                return

    def _handle(self, conn: _Connection, request: Message) -> Message | None:
        index = self.index
        if isinstance(request, Exists):
            return Present(found=index.exists(request.keys))
        if isinstance(request, GetBegin):
            _same_length(request.keys, request.max_sizes)
            return index.begin_get(conn, request.keys, request.max_sizes)
        if isinstance(request, GetEnd):
            index.end_get(conn, request.slots)
            return None
        if isinstance(request, PutBegin):
            _same_length(request.keys, request.sizes)
            return index.begin_put(conn, request.keys, request.sizes)
        if isinstance(request, PutCommit):
            return index.commit(conn, request.slots)
        if isinstance(request, Count):
            return Counted(num_keys=index.count(request.prefix))
        if isinstance(request, StatsRequest):
            return index.stats(list(self._connections.values()))
        assert isinstance(request, Hello), request
        return self.welcome

    def _close(self, conn: _Connection) -> None:
        self.index.drop(conn)
        self._connections.pop(conn.sock, None)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()


def _same_length(keys: list[str], values: list[int]) -> None:
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys and {len(values)} sizes")


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("pool-server", help="the shared host tier of the KV pool: one "
                                                "shared-memory arena for this host's instances")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="0: a free port (printed)")
    parser.add_argument("--capacity-bytes", type=int, required=True,
                        help="the arena's size (whole slots of --slot-bytes)")
    parser.add_argument("--slot-bytes", type=int, default=DEFAULT_SLOT_BYTES,
                        help="one value's room: at least a KV block of every layer plus 8 "
                             f"(larger values are refused; default {DEFAULT_SLOT_BYTES})")
    parser.set_defaults(func=_cmd_pool_server)


def _cmd_pool_server(ns: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    server = ArenaServer(ns.port, ns.capacity_bytes, ns.slot_bytes, host=ns.host)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    logger.info("shm pool server on %s:%d: %d slots of %d bytes (%d bytes of shared memory)",
                ns.host, server.port, server.index.num_slots, server.index.slot_bytes,
                server.nbytes)
    print(f"sluice pool-server listening on {ns.host}:{server.port}", flush=True)
    server.serve_forever()
    return 0

