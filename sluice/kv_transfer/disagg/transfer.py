"""Moving KV bytes from a prefill rank's paged cache into a decode rank's: the transfer backends
and the descriptors they move.

Both backends write synchronously into memory the peer registered, addressed by raw addresses,
and return only once the bytes are there (or with an error), so the status sent after a write
never overtakes the data:

- `mooncake`: Mooncake Transfer Engine (`batch_transfer_sync_write`, metadata P2PHANDSHAKE, TCP
  here, RDMA where present), straight from the prefill's registered KV memory into decode's.
  TCP batches above the per-peer queue limit fail, so a write is split into batches of at most
  `max_batch` descriptors.
- `fake`: the same writes over a plain loopback ZMQ socket (no Mooncake): the writer sends a
  FakeWrite header and the bytes, the owner of the memory copies them into its registered
  tensors and acknowledges. Real bytes move, so greedy output through it is exact.

Descriptors: a layer's cache is one tensor [2, num_blocks, block_size, heads, dim], so block b's
K is at base + b * B and its V at base + (num_blocks + b) * B (B: bytes of one block's K).
Block pairs that are consecutive on both sides are coalesced into one descriptor per layer and
half ([5,6,7,12,13] -> [9,10,11,2,3] is runs (5->9, 3) and (12->2, 2)).

Heterogeneous TP (heads.py): a prefill rank then sends a slice of the heads of each token, or
a decode rank receives one, and in this layout (heads inside a token's row) a head slice of a
block is strided: one piece of `num_heads * head_dim` elements per token. Such a write is one
descriptor per token, layer and K / V, straight from cache to cache. The other designs were a
staging buffer (gather the slice into contiguous memory on the side whose slice is strided,
scatter it on the other) or a head-major cache layout ([.., heads, block_size, dim], where a
slice is contiguous per block: what vLLM's NIXL connector asks for). Staging needs a second
registered region sized for the rooms in flight, a copy on each side, and, when the strided
side is the receiver (prefill TP > decode TP, the common case), a scatter that decode must run
and order against its own steps before the room may succeed; a head-major layout touches every
attention kernel. Per-token descriptors need none of that and stay correct for any TP pair;
their cost is the descriptor count, block_size times that of a whole-row transfer (batched,
`max_batch` a batch), with pieces of heads * head_dim * dtype bytes (1 KiB for 4 heads of 128 in
bfloat16): fine over RDMA, slow over Mooncake's TCP transport, which is for tests and loopback
here. Where the slice is the whole row on both sides (equal TP sizes), writes stay coalesced.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from sluice.channel import Encoder, WireError
from sluice.kv_transfer.disagg.heads import HeadSlice
from sluice.kv_transfer.disagg.messages import (
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


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """Where one rank's paged KV cache lives: one tensor per layer,
    [2, num_blocks, block_size, num_kv_heads, head_dim]."""

    layer_addresses: tuple[int, ...]
    num_blocks: int
    block_size: int
    num_kv_heads: int  # on this rank
    head_bytes: int  # one head of one token, K or V

    @property
    def token_bytes(self) -> int:
        return self.num_kv_heads * self.head_bytes

    @property
    def half_block_bytes(self) -> int:
        """One block's K (or V)."""
        return self.block_size * self.token_bytes

    @property
    def bytes_per_block_layer(self) -> int:
        """K and V of one block of one layer."""
        return 2 * self.half_block_bytes


def block_runs(src_blocks: list[int], dst_blocks: list[int]) -> list[tuple[int, int, int]]:
    """(first source block, first destination block, length) of each run of pairs that are
    consecutive on both sides."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destinations")
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_blocks, dst_blocks):
        if runs:
            s, d, n = runs[-1]
            if src == s + n and dst == d + n:
                runs[-1] = (s, d, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def build_descriptors(src: CacheLayout, dst: CacheLayout, runs: list[tuple[int, int, int]],
                      heads: HeadSlice | None = None) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, destination addresses, lengths) that copy the blocks of `runs`, for
    every layer and K / V: whole blocks, one descriptor per run (`heads` None, or a slice that
    is every head on both sides), else `heads.num_heads` heads of each token, one descriptor
    per token (see the module docstring)."""
    if len(src.layer_addresses) != len(dst.layer_addresses):
        raise ValueError(f"{len(src.layer_addresses)} layers here, "
                         f"{len(dst.layer_addresses)} at the peer")
    if src.block_size != dst.block_size or src.head_bytes != dst.head_bytes:
        raise ValueError(f"blocks of {src.block_size} tokens and heads of {src.head_bytes} "
                         f"bytes here, {dst.block_size} and {dst.head_bytes} at the peer")
    if heads is None:
        if src.num_kv_heads != dst.num_kv_heads:
            raise ValueError(f"{src.num_kv_heads} KV heads here, {dst.num_kv_heads} at the "
                             "peer: a head slice is needed")
        heads = HeadSlice(0, 0, 0, 0, src.num_kv_heads)
    if (heads.src_head + heads.num_heads > src.num_kv_heads
            or heads.dst_head + heads.num_heads > dst.num_kv_heads):
        raise ValueError(f"{heads} does not fit {src.num_kv_heads} heads here and "
                         f"{dst.num_kv_heads} at the peer")
    whole = heads.num_heads == src.num_kv_heads == dst.num_kv_heads
    src_half, dst_half = src.half_block_bytes, dst.half_block_bytes
    piece = heads.num_heads * src.head_bytes
    src_addrs: list[int] = []
    dst_addrs: list[int] = []
    lengths: list[int] = []
    if piece == 0:
        return src_addrs, dst_addrs, lengths
    for src_base, dst_base in zip(src.layer_addresses, dst.layer_addresses):
        for kv in (0, 1):
            src_kv = src_base + kv * src.num_blocks * src_half
            dst_kv = dst_base + kv * dst.num_blocks * dst_half
            for s, d, n in runs:
                if whole:
                    src_addrs.append(src_kv + s * src_half)
                    dst_addrs.append(dst_kv + d * dst_half)
                    lengths.append(n * src_half)
                    continue
                # [n * block_size tokens] of the run, each its own piece of the row.
                first_src = src_kv + s * src_half + heads.src_head * src.head_bytes
                first_dst = dst_kv + d * dst_half + heads.dst_head * dst.head_bytes
                for token in range(n * src.block_size):
                    src_addrs.append(first_src + token * src.token_bytes)
                    dst_addrs.append(first_dst + token * dst.token_bytes)
                    lengths.append(piece)
    return src_addrs, dst_addrs, lengths


def batches(count: int, max_batch: int) -> list[tuple[int, int]]:
    """[start, end) index ranges of at most `max_batch` each."""
    return [(start, min(start + max_batch, count)) for start in range(0, count, max_batch)]


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

    def close(self) -> None:
        return None


def create_backend(name: str, host: str, max_batch: int, protocol: str = "tcp",
                   device: str = "") -> TransferBackend:
    if name == "fake":
        return FakeBackend(host, max_batch)
    if name == "mooncake":
        return MooncakeBackend(host, max_batch, protocol, device)
    raise ValueError(f"unknown PD transfer backend {name!r}")


class _Regions:
    """Registered tensors by address, as flat uint8 views."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._regions: list[tuple[int, int, Any]] = []

    def add(self, tensor: Any) -> None:
        import torch

        if not tensor.is_contiguous():
            raise ValueError("only contiguous tensors can be registered")
        start = tensor.data_ptr()
        flat = tensor.view(-1).view(torch.uint8)
        index = bisect.bisect(self._starts, start)
        self._starts.insert(index, start)
        self._regions.insert(index, (start, start + flat.numel(), flat))

    def slice(self, address: int, length: int) -> Any:
        index = bisect.bisect(self._starts, address) - 1
        if index >= 0:
            start, end, flat = self._regions[index]
            if address + length <= end:
                return flat[address - start:address - start + length]
        raise ValueError(f"address {address:#x} + {length} is not within a registered tensor")


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
