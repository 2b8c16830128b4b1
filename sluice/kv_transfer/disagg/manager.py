"""KVManager: one rank's end of prefill/decode disaggregation, in the worker process next to
the KV cache. The prefill side (sender.py) and the decode side (receiver.py) share this: the
transfer backend with the cache registered, the control socket and the thread that reads it,
sends to peers, and the per-room state behind one lock.

Threads: `pd-io` reads the control socket (a PULL bound on `host`, the address peers send
to), applies each frame to the rooms, and checks their deadlines every 50 ms; the subclasses add
theirs. Frames go out through PUSH sockets, one per peer address, under a lock (any thread may
send); a frame a peer cannot take now is dropped and counted, never blocks. What a room ends
with is queued for `take_finished`, which the connector's worker half drains once per step.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import zmq

from sluice.channel import Encoder, Message, WireError
from sluice.core.kv_connector import KVCacheSpec
from sluice.engine import wakeup
from sluice.kv_transfer.disagg.config import PDConfig
from sluice.kv_transfer.disagg.descriptors import CacheLayout
from sluice.kv_transfer.disagg.faults import Faults
from sluice.kv_transfer.disagg.messages import Logprobs, control_decoder
from sluice.kv_transfer.disagg.transfer import TransferBackend, create_backends

logger = logging.getLogger("sluice")

_IO_POLL_MS = 50
# A PUSH socket queues this many frames for a peer that is not there; then sends are dropped.
_SEND_HWM = 10_000


@dataclass(slots=True)
class Finished:
    """How one room ended, for the scheduler: the request, whether its KV (decode: and first
    token) arrived, the first token and its logprobs, the blocks that did not load."""

    req_id: str
    ok: bool
    first_token: int | None = None
    first_logprobs: Logprobs | None = None
    failed_block_ids: list[int] = field(default_factory=list)
    error: str | None = None


class KVManager(ABC):
    def __init__(self, config: PDConfig, spec: KVCacheSpec, kv_caches: dict[str, Any],
                 faults: Faults | None = None, backend: TransferBackend | None = None,
                 arena: Any = None) -> None:
        self.config = config
        self.spec = spec
        self.rank = spec.tp_rank
        self.world_size = spec.tp_size
        self.faults = faults or Faults()
        # Held for as long as the backend has them registered (it may keep only addresses).
        self.kv_caches = dict(kv_caches)
        tensors = list(kv_caches.values())
        first = tensors[0]
        self.layout = CacheLayout(
            layer_addresses=tuple(t.data_ptr() for t in tensors), num_blocks=first.shape[1],
            block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
            head_bytes=spec.head_bytes)
        assert self.layout.bytes_per_block_layer == spec.bytes_per_block_layer
        # By name: one, or for transfer_backend auto those that run here (the pair's is
        # chosen per peer: transfer.choose_backend). `arena`: the decode's shared-memory cache.
        self.backends: dict[str, TransferBackend] = (
            {backend.name: backend} if backend is not None else create_backends(
                config.transfer_backend, config.host, config.max_batch_descriptors,
                config.mooncake_protocol, config.mooncake_device, arena))
        for each in self.backends.values():
            each.register(tensors)
        self.lock = threading.Lock()
        self._finished: list[Finished] = []
        self._stats: dict[str, float] = defaultdict(float)
        self._encoder = Encoder()
        self._context = zmq.Context()
        self._control = self._context.socket(zmq.PULL)
        self._control.setsockopt(zmq.LINGER, 0)
        port = self._control.bind_to_random_port(f"tcp://{config.host}")
        self.control_address = f"tcp://{config.host}:{port}"
        self._out_lock = threading.Lock()
        self._out: dict[str, Any] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---- threads ---------------------------------------------------------------------------

    def start(self) -> None:
        self._spawn(self._io_loop, "pd-io")

    def _spawn(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=self._guarded, args=(target, name), name=name,
                                  daemon=True)
        thread.start()
        self._threads.append(thread)

    def _guarded(self, target: Any, name: str) -> None:
        try:
            target()
        except Exception:  # a dead thread would hang every room: say so loudly
            logger.exception("PD thread %s died", name)
            raise

    def _io_loop(self) -> None:
        decoder = control_decoder()
        poller = zmq.Poller()
        poller.register(self._control, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(_IO_POLL_MS):
                while True:
                    try:
                        frame = self._control.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        message = decoder.decode(frame)
                    except WireError as exc:
                        logger.error("PD rank %d dropped a control frame: %s", self.rank, exc)
                        continue
                    self.handle(message)
            now = time.monotonic()
            self.check_deadlines(now)
            for backend in self.backends.values():
                backend.sweep(now)

    @abstractmethod
    def handle(self, message: Message) -> None:
        """Apply one control frame from a peer."""

    @abstractmethod
    def check_deadlines(self, now: float) -> None:
        """End what has waited too long (called every ~50 ms)."""

    # ---- to peers and to the scheduler -----------------------------------------------------

    def send_to(self, address: str, message: Message) -> bool:
        """Queue a frame for the peer at `address`; False if it was dropped."""
        frame = self._encoder.encode(message)
        with self._out_lock:
            if self._stop.is_set():
                return False
            socket = self._out.get(address)
            if socket is None:
                socket = self._context.socket(zmq.PUSH)
                socket.setsockopt(zmq.LINGER, 0)
                socket.setsockopt(zmq.SNDHWM, _SEND_HWM)
                socket.connect(address)
                self._out[address] = socket
            try:
                socket.send(frame, zmq.NOBLOCK)
                return True
            except zmq.ZMQError as exc:
                logger.warning("PD rank %d dropped a %s for %s: %s", self.rank,
                               type(message).__name__, address, exc)
                self.add_stat("dropped_frames", 1)
                return False

    def finish(self, finished: Finished) -> None:
        """Queue a room's end for the scheduler (call with the lock held); the engine's loop
        steps now to take it (sluice/engine/wakeup.py)."""
        self._finished.append(finished)
        wakeup.notify()

    def take_finished(self) -> list[Finished]:
        with self.lock:
            finished, self._finished = self._finished, []
        return finished

    def add_stat(self, name: str, value: float) -> None:
        self._stats[name] += value

    def take_stats(self) -> dict[str, float]:
        with self.lock:
            stats, self._stats = dict(self._stats), defaultdict(float)
        return stats

    def shutdown(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)
        with self._out_lock:
            for socket in self._out.values():
                socket.close(linger=0)
            self._out.clear()
        self._control.close(linger=0)
        self._context.term()
        for backend in self.backends.values():
            backend.close()
