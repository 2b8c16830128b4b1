"""Moving KV bytes from a prefill rank's paged cache into a decode rank's: the transfer
backends.

Every backend writes synchronously into memory the peer registered, addressed by raw addresses,
and return only once the bytes are there (or with an error), so the status sent after a write
never overtakes the data:

- `mooncake`: Mooncake Transfer Engine (`batch_transfer_sync_write`, metadata P2PHANDSHAKE, TCP
  here, RDMA where present), straight from the prefill's registered KV memory into decode's.
  TCP batches above the per-peer queue limit fail, so a write is split into batches of at most
  `max_batch` descriptors.
- `fake`: the same writes over a plain loopback ZMQ socket (no Mooncake): the writer sends a
  FakeWrite header and the bytes, the owner of the memory copies them into its registered
  tensors and acknowledges. Real bytes move, so greedy output through it is exact.
- `shm` (shm.py): prefill and decode on one host. The decode's cache is in shared memory (CPU)
  or exported by CUDA IPC (GPU); the prefill maps it once per peer and copies into it.

`auto` (the default setting) brings up shm (CPU caches only: its CUDA IPC path has not run on a
GPU yet) and, where Mooncake is installed, mooncake; the
decode picks one per prefill from what both have up and whether they share a host
(`choose_backend`) and names it in each ask.

What moves (whole blocks, or a head slice per token when the TP sizes differ) is
descriptors.py's.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from sluice.channel import Encoder, WireError
from sluice.kv_transfer.disagg.descriptors import batches
from sluice.kv_transfer.disagg.messages import (
    CacheExport,
    FakePing,
    FakeWrite,
    FakeWriteAck,
    fake_ack_decoder,
    fake_decoder,
)

logger = logging.getLogger("sluice")

# How long the fake backend waits for the peer's acknowledgement of one batch.
_FAKE_ACK_TIMEOUT_S = 10.0
_FAKE_PROBE_TIMEOUT_S = 1.0


class TransferBackend(ABC):
    """One rank's transfer endpoint. `write` is called from one thread at a time."""

    name: str
    session: str  # how peers address this endpoint

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch

    @abstractmethod
    def register(self, tensors: list[Any]) -> None:
        """Make these (contiguous) tensors readable and writable by peers."""

    @abstractmethod
    def write(self, peer: str, src: list[int], dst: list[int], lengths: list[int],
              should_stop: Callable[[], bool] | None = None) -> str | None:
        """Copy each local range src[i] into the peer's dst[i]; None once every byte is there,
        else what went wrong (some bytes may be written). `should_stop` is asked between
        batches: True ends the write there (an error)."""

    @abstractmethod
    def probe(self, peer: str) -> bool:
        """Whether the peer's endpoint answers now."""

    def export(self, tensors: Sequence[Any]) -> CacheExport | None:
        """What a decode rank's asks carry for the writer to reach its memory (None: the
        session says it all)."""
        return None

    def attach(self, peer: str, export: CacheExport | None) -> str | None:
        """Before a write to `peer`: reach its memory (once); None, or why not."""
        return None

    def sweep(self, now: float) -> None:
        """Drop what is held for peers that are gone (called about every 50 ms)."""
        return None

    def close(self) -> None:
        return None


def create_backend(name: str, host: str, max_batch: int, protocol: str = "tcp",
                   device: str = "", arena: Any = None) -> TransferBackend:
    if name == "fake":
        return FakeBackend(host, max_batch)
    if name == "mooncake":
        return MooncakeBackend(host, max_batch, protocol, device)
    if name == "shm":
        from sluice.kv_transfer.disagg.shm import ShmBackend

        return ShmBackend(max_batch, arena)
    raise ValueError(f"unknown PD transfer backend {name!r}")


def create_backends(setting: str, host: str, max_batch: int, protocol: str = "tcp",
                    device: str = "", arena: Any = None) -> dict[str, TransferBackend]:
    """The backends a transfer_backend setting brings up, by name: one, or for `auto` shm
    (shared memory, CUDA IPC for GPU caches) and mooncake where each can run here (at least
    one)."""
    if setting != "auto":
        return {setting: create_backend(setting, host, max_batch, protocol, device, arena)}
    backends: dict[str, TransferBackend] = {}
    problems = []
    for name in ("shm", "mooncake"):
        try:
            backends[name] = create_backend(name, host, max_batch, protocol, device, arena)
        except ValueError as exc:
            problems.append(str(exc))
    if not backends:
        raise ValueError("PD transfer_backend auto: neither shm nor mooncake can run here: "
                         + "; ".join(problems))
    for problem in problems:
        logger.info("PD transfer_backend auto without one backend: %s", problem)
    return backends


# Where both sides have several, the first of these they share (shm only on one host).
_PREFERENCE = ("shm", "mooncake", "fake")


def choose_backend(decode_setting: str, decode_backends: Sequence[str], decode_host: str,
                   prefill_setting: str, prefill_backends: Sequence[str], prefill_host: str
                   ) -> tuple[str | None, str | None]:
    """(the backend a decode rank and a prefill rank transfer over, why they cannot): shm when
    both have it up and share a host, else another backend both have."""
    same_host = bool(decode_host) and decode_host == prefill_host
    shared = [b for b in _PREFERENCE if b in decode_backends and b in prefill_backends]
    for name in shared:
        if name != "shm" or same_host:
            return name, None
    if "shm" in shared:
        return None, (f"transfer_backend shm needs the prefill and decode on one host (and "
                      f"pid namespace): the prefill is on {prefill_host!r}, this decode on "
                      f"{decode_host!r}; set --disaggregation-transfer-backend to auto or "
                      "mooncake on both")
    return None, (f"the prefill transfers over {prefill_setting!r} (up: "
                  f"{', '.join(prefill_backends)}), this decode instance over "
                  f"{decode_setting!r} (up: {', '.join(decode_backends)}); no backend in "
                  "common (--disaggregation-transfer-backend)")


class _Regions:
    """Registered tensors by address, as flat uint8 views."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._regions: list[tuple[int, int, Any]] = []

    def add(self, tensor: Any, start: int | None = None) -> None:
        """`tensor`'s bytes, at its own address or (a peer's memory mapped here) `start`."""
        import torch

        if not tensor.is_contiguous():
            raise ValueError("only contiguous tensors can be registered")
        start = tensor.data_ptr() if start is None else start
        flat = tensor.view(-1).view(torch.uint8)
        index = bisect.bisect(self._starts, start)
        self._starts.insert(index, start)
        self._regions.insert(index, (start, start + flat.numel(), flat))

    def _find(self, address: int, length: int) -> tuple[int, Any]:
        index = bisect.bisect(self._starts, address) - 1
        if index >= 0:
            start, end, flat = self._regions[index]
            if address + length <= end:
                return address - start, flat
        raise ValueError(f"address {address:#x} + {length} is not within a registered tensor")

    def slice(self, address: int, length: int) -> Any:
        offset, flat = self._find(address, length)
        return flat[offset:offset + length]

    def local_address(self, address: int, length: int) -> int:
        """Where [address, address + length) of the region is in this process."""
        offset, flat = self._find(address, length)
        return flat.data_ptr() + offset


class FakeBackend(TransferBackend):
    """Writes over loopback ZMQ (see the module docstring)."""

    name = "fake"

    def __init__(self, host: str, max_batch: int) -> None:
        super().__init__(max_batch)
        self._regions = _Regions()
        self._context = zmq.Context()
        self._encoder = Encoder()
        self._server = self._context.socket(zmq.ROUTER)
        self._server.setsockopt(zmq.LINGER, 0)
        port = self._server.bind_to_random_port(f"tcp://{host}")
        self.session = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        # Writers: one DEALER per peer, used by the one writing thread only.
        self._peers: dict[str, Any] = {}
        self._next_batch = 0
        self._ack_decoder = fake_ack_decoder()
        self._thread = threading.Thread(target=self._serve, name="pd-fake-receiver",
                                        daemon=True)
        self._thread.start()

    def register(self, tensors: list[Any]) -> None:
        for tensor in tensors:
            self._regions.add(tensor)

    # ---- the receiving side: copies what peers send into the registered tensors ------------

    def _serve(self) -> None:
        decoder = fake_decoder()
        poller = zmq.Poller()
        poller.register(self._server, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            parts = self._server.recv_multipart(copy=False)
            identity, frames = parts[0], parts[1:]
            try:
                header = decoder.decode(frames[0].buffer)
            except WireError as exc:
                logger.error("PD fake backend dropped a frame: %s", exc)
                continue
            error = None
            if isinstance(header, FakeWrite):
                error = self._apply(header, frames[1].buffer if len(frames) > 1 else b"")
            ack = FakeWriteAck(batch_id=header.batch_id, error=error)
            self._server.send_multipart([identity, self._encoder.encode(ack)])

    def _apply(self, header: FakeWrite, payload: memoryview | bytes) -> str | None:
        import torch

        if sum(header.lengths) != len(payload):
            return f"payload of {len(payload)} bytes for {sum(header.lengths)} announced"
        data = np.frombuffer(payload, dtype=np.uint8)
        offset = 0
        try:
            for address, length in zip(header.addresses, header.lengths):
                target = self._regions.slice(address, length)
                piece = data[offset:offset + length]
                if target.device.type == "cpu":
                    target.numpy()[:] = piece
                else:
                    target.copy_(torch.from_numpy(piece.copy()), non_blocking=False)
                offset += length
        except ValueError as exc:
            return str(exc)
        return None

    # ---- the writing side ------------------------------------------------------------------

    def _socket(self, peer: str) -> Any:
        socket = self._peers.get(peer)
        if socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(peer)
            self._peers[peer] = socket
        return socket

    def _drop(self, peer: str) -> None:
        socket = self._peers.pop(peer, None)
        if socket is not None:
            socket.close(linger=0)

    def _request(self, peer: str, frames: list[Any], batch_id: int, timeout_s: float
                 ) -> str | None:
        socket = self._socket(peer)
        try:
            socket.send_multipart(frames, copy=False)
            if not socket.poll(int(timeout_s * 1000)):
                self._drop(peer)  # a late ack must not answer a later batch
                return f"no acknowledgement from {peer} within {timeout_s:g} s"
            ack = self._ack_decoder.decode(socket.recv())
        except (zmq.ZMQError, WireError) as exc:
            self._drop(peer)
            return f"{type(exc).__name__}: {exc}"
        if ack.batch_id != batch_id:
            self._drop(peer)
            return f"acknowledgement of batch {ack.batch_id} for batch {batch_id}"
        return ack.error

    def write(self, peer: str, src: list[int], dst: list[int], lengths: list[int],
              should_stop: Callable[[], bool] | None = None) -> str | None:
        for start, end in batches(len(src), self.max_batch):
            if should_stop is not None and should_stop():
                return "stopped between batches"
            try:
                payload = b"".join(self._read(a, n) for a, n in zip(src[start:end],
                                                                    lengths[start:end]))
            except ValueError as exc:
                return str(exc)
            self._next_batch += 1
            header = FakeWrite(batch_id=self._next_batch, addresses=dst[start:end],
                               lengths=lengths[start:end])
            error = self._request(peer, [self._encoder.encode(header), payload],
                                  self._next_batch, _FAKE_ACK_TIMEOUT_S)
            if error is not None:
                return error
        return None

    def _read(self, address: int, length: int) -> bytes:
        source = self._regions.slice(address, length)
        if source.device.type != "cpu":
            source = source.cpu()
        return source.numpy().tobytes()

    def probe(self, peer: str) -> bool:
        self._next_batch += 1
        ping = FakePing(batch_id=self._next_batch)
        return self._request(peer, [self._encoder.encode(ping)], self._next_batch,
                             _FAKE_PROBE_TIMEOUT_S) is None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for peer in list(self._peers):
            self._drop(peer)
        self._server.close(linger=0)
        self._context.term()


class MooncakeBackend(TransferBackend):
    """Mooncake Transfer Engine, P2PHANDSHAKE metadata (no metadata server)."""

    name = "mooncake"

    def __init__(self, host: str, max_batch: int, protocol: str, device: str) -> None:
        super().__init__(max_batch)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise ValueError(
                f"the mooncake PD transfer backend needs Mooncake Transfer Engine ({exc}): pip "
                "install mooncake-transfer-engine-non-cuda (or the wheel of your CUDA) and "
                "apt-get install libibverbs1 ibverbs-providers; or use the fake backend"
            ) from None
        if protocol == "tcp":
            # Without it the engine's TCP transport listens on a non-loopback address.
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise ValueError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, "
                             f"{protocol!r}) failed with {rc}")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: list[int] = []

    def register(self, tensors: list[Any]) -> None:
        for tensor in tensors:
            address = tensor.data_ptr()
            rc = self._engine.register_memory(address, tensor.numel() * tensor.element_size())
            if rc != 0:
                raise ValueError(f"Mooncake register_memory failed with {rc}")
            self._registered.append(address)

    def write(self, peer: str, src: list[int], dst: list[int], lengths: list[int],
              should_stop: Callable[[], bool] | None = None) -> str | None:
        for start, end in batches(len(src), self.max_batch):
            if should_stop is not None and should_stop():
                return "stopped between batches"
            rc = self._engine.batch_transfer_sync_write(peer, src[start:end], dst[start:end],
                                                        lengths[start:end])
            if rc != 0:
                return (f"Mooncake batch_transfer_sync_write to {peer} ({end - start} "
                        f"descriptors) returned {rc}")
        return None

    def probe(self, peer: str) -> bool:
        send_probe = getattr(self._engine, "send_probe", None)
        return send_probe is None or send_probe(peer) == 0

    def close(self) -> None:
        for address in self._registered:
            self._engine.unregister_memory(address)
        self._registered = []
