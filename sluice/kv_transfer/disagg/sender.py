"""The prefill side: a KVSender per room, driven by PrefillKVManager.

Lifecycle of a room (KVPoll, forward only, Failed sticky):

    Bootstrapping     the scheduler handed the finished request's blocks and first token
                      (`KVSender.send`) but no decode rank has asked yet, or decode asked
                      (TransferRequest) before the prompt was done
    WaitingForInput   decode's ask is in, the KV is not (the prompt is still computing)
    Transferring      both are in: the transfer thread writes the blocks (after the fault
                      injection's delay, if any) into decode's registered memory
    Success | Failed  then the status goes to decode: Success with the first token and its
                      logprobs, or Failed with why

Who frees what: the scheduler holds the request's blocks (delay_free) until the room is
reported finished (`take_finished`), which happens when the write succeeded or failed, when
decode aborted the room (AbortRoom; a write in progress stops between batches), or when the
send lease expires with no ask from decode (`send_lease_s`). A room whose prefill request was
aborted before its first token (`KVSender.abort`) answers any later ask with Failed. Decode's
ask carries a lease: no write starts or goes on past it, since decode frees the blocks soon
after. A write that fails marks the peer suspect; the next room for it first probes it, and a
peer that answers is used again (a failed session is never blacklisted for good).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sluice.channel import Message
from sluice.kv_transfer.disagg import bootstrap
from sluice.kv_transfer.disagg.manager import Finished, KVManager
from sluice.kv_transfer.disagg.messages import (
    AbortRoom,
    Logprobs,
    RankRoute,
    TransferRequest,
    TransferStatus,
)
from sluice.kv_transfer.disagg.poll import KVPoll, advance
from sluice.kv_transfer.disagg.transfer import CacheLayout, block_runs, build_descriptors

logger = logging.getLogger("sluice")


@dataclass(slots=True)
class _Room:
    room: int
    state: KVPoll = KVPoll.Bootstrapping
    # From the scheduler (the finished prefill request).
    req_id: str | None = None
    block_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    first_token: int | None = None
    first_logprobs: Logprobs | None = None
    ready_event: Any = None  # CUDA event after the request's last step (None on the CPU)
    # From decode.
    ask: TransferRequest | None = None
    # Monotonic deadlines: of the lease decode granted (once asked), of the send lease (once
    # the KV is ready and nobody asked), of a tombstone or an unmatched ask.
    deadline: float = math.inf
    not_before: float = 0.0  # fault injection: the write waits until then
    aborted: str | None = None  # why the write must stop
    queued: bool = False
    writing: bool = False  # the transfer thread is writing it (its blocks are in use)
    error: str | None = None
    started: float = 0.0
    times: dict[str, float] = field(default_factory=dict)


class KVSender:
    """One room being sent; a handle on the manager's state (same interface on every
    backend)."""

    def __init__(self, manager: PrefillKVManager, room: int) -> None:
        self.manager = manager
        self.room = room

    def send(self, req_id: str, block_ids: list[int], num_prompt_tokens: int,
             first_token: int, first_logprobs: Logprobs | None, ready_event: Any = None
             ) -> None:
        self.manager.add_send(self.room, req_id, block_ids, num_prompt_tokens, first_token,
                              first_logprobs, ready_event)

    def abort(self, reason: str) -> None:
        self.manager.abort_room(self.room, reason)

    def poll(self) -> KVPoll:
        return self.manager.poll(self.room)


class PrefillKVManager(KVManager):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rooms: dict[int, _Room] = {}
        self._work = threading.Condition(self.lock)
        self._suspect_peers: set[str] = set()
        self.registered = threading.Event()

    def start(self) -> None:
        super().start()
        self._spawn(self._transfer_loop, "pd-transfer")
        self._spawn(self._register, "pd-register")

    def _register(self) -> None:
        route = RankRoute(
            rank=self.rank, world_size=self.world_size, control_address=self.control_address,
            backend=self.backend.name, block_size=self.spec.block_size,
            kv_dtype=self.spec.dtype, bytes_per_block_layer=self.spec.bytes_per_block_layer,
            num_layers=self.spec.num_layers, engine_id=self.config.engine_id)
        address = f"{self.config.host}:{self.config.bootstrap_port}"
        if bootstrap.register(address, route, self.config.register_timeout_s, self._stop):
            self.registered.set()

    def sender(self, room: int) -> KVSender:
        return KVSender(self, room)

    def poll(self, room: int) -> KVPoll:
        with self.lock:
            entry = self.rooms.get(room)
            return entry.state if entry is not None else KVPoll.Failed

    # ---- from the scheduler ----------------------------------------------------------------

    def add_send(self, room: int, req_id: str, block_ids: list[int], num_prompt_tokens: int,
                 first_token: int, first_logprobs: Logprobs | None, ready_event: Any) -> None:
        now = time.monotonic()
        with self.lock:
            entry = self.rooms.get(room)
            if entry is None:
                entry = self.rooms[room] = _Room(room)
            if entry.req_id is not None or entry.state == KVPoll.Failed:
                # A duplicate room, or one already given up: free the request's blocks.
                self.finish(Finished(req_id, ok=False, error=entry.error or "duplicate room"))
                return
            entry.req_id = req_id
            entry.block_ids = block_ids[:-(-num_prompt_tokens // self.spec.block_size)]
            entry.num_prompt_tokens = num_prompt_tokens
            entry.first_token = first_token
            entry.first_logprobs = first_logprobs
            entry.ready_event = ready_event
            entry.started = now
            if entry.ask is None:
                entry.deadline = now + self.config.send_lease_s
            self._maybe_queue(entry, now)

    def abort_room(self, room: int, reason: str) -> None:
        """The prefill request ended before its first token: nothing will be sent."""
        with self.lock:
            entry = self.rooms.get(room)
            if entry is None:
                entry = self.rooms[room] = _Room(room)
            if entry.req_id is not None:
                return  # the send is the scheduler's to finish
            self._fail(entry, f"the prefill request was {reason}", time.monotonic())

    # ---- from decode -----------------------------------------------------------------------

    def handle(self, message: Message) -> None:
        if isinstance(message, TransferRequest):
            self._on_ask(message)
        elif isinstance(message, AbortRoom):
            with self.lock:
                entry = self.rooms.get(message.room)
                if entry is None:
                    # Its prefill request is still computing: the send plan, when it comes,
                    # finds a failed room and frees the blocks at once.
                    entry = self.rooms[message.room] = _Room(message.room)
                if not entry.state.is_done:
                    entry.aborted = f"decode aborted the room: {message.reason}"
                    if not entry.queued and not entry.writing:
                        self._fail(entry, entry.aborted, time.monotonic())
        else:
            logger.warning("PD prefill rank %d ignored a %s", self.rank,
                           type(message).__name__)

    def _on_ask(self, ask: TransferRequest) -> None:
        now = time.monotonic()
        with self.lock:
            entry = self.rooms.get(ask.room)
            if entry is None:
                entry = self.rooms[ask.room] = _Room(ask.room)
                # Its prefill request has not finished yet (or never comes).
                entry.deadline = now + min(ask.lease_s, self.config.send_lease_s)
            if entry.ask is not None:
                return  # a repeated ask: the first one stands
            entry.ask = ask
            if entry.state == KVPoll.Failed:
                self._send_status(entry)  # aborted here before decode asked
                return
            problem = self._check_ask(ask, entry)
            if problem is not None:
                self._fail(entry, problem, now)
                return
            entry.deadline = now + ask.lease_s
            entry.state = advance(entry.state, KVPoll.WaitingForInput)
            self._maybe_queue(entry, now)

    def _check_ask(self, ask: TransferRequest, entry: _Room) -> str | None:
        spec = self.spec
        if ask.block_size != spec.block_size:
            return (f"page size mismatch: this prefill instance has block size "
                    f"{spec.block_size}, the decode instance {ask.block_size}; start both with "
                    "the same --block-size")
        if ask.kv_dtype != spec.dtype or ask.bytes_per_block_layer != spec.bytes_per_block_layer:
            return (f"KV layout mismatch: this prefill instance has {spec.dtype} KV of "
                    f"{spec.bytes_per_block_layer} bytes per block and layer, the decode "
                    f"instance {ask.kv_dtype} of {ask.bytes_per_block_layer}")
        if len(ask.layer_addresses) != spec.num_layers or ask.backend != self.backend.name:
            return (f"the decode instance has {len(ask.layer_addresses)} layers over "
                    f"{ask.backend!r}, this prefill instance {spec.num_layers} over "
                    f"{self.backend.name!r}")
        return self._check_blocks(ask, entry)

    def _check_blocks(self, ask: TransferRequest, entry: _Room) -> str | None:
        if entry.block_ids is None:
            return None  # checked again once the KV is ready
        if ask.num_prompt_tokens != entry.num_prompt_tokens:
            return (f"room {entry.room}: the decode request has {ask.num_prompt_tokens} prompt "
                    f"tokens, the prefill request {entry.num_prompt_tokens}")
        if ask.first_block + len(ask.block_ids) != len(entry.block_ids):
            return (f"room {entry.room}: decode asks for blocks {ask.first_block}.."
                    f"{ask.first_block + len(ask.block_ids)} of {len(entry.block_ids)}")
        return None

    # ---- sending ---------------------------------------------------------------------------

    def _maybe_queue(self, entry: _Room, now: float) -> None:
        """Queue the write once both halves are in (lock held)."""
        if entry.ask is None or entry.req_id is None or entry.queued or entry.state.is_done:
            return
        problem = self._check_blocks(entry.ask, entry)
        if problem is not None:
            self._fail(entry, problem, now)
            return
        entry.queued = True
        entry.not_before = now + self.faults.send_delay_s
        entry.state = advance(entry.state, KVPoll.Transferring)
        self.send_to(entry.ask.status_address, TransferStatus(
            room=entry.room, prefill_rank=self.rank, state=KVPoll.Transferring))
        self._work.notify()

    def _next_job(self) -> _Room | None:
        """The next room whose write may start, waiting for one (lock held)."""
        while not self._stop.is_set():
            now = time.monotonic()
            ready = [e for e in self.rooms.values()
                     if e.queued and e.state == KVPoll.Transferring]
            due = [e for e in ready if e.not_before <= now or e.aborted]
            if due:
                return min(due, key=lambda e: e.not_before)
            wake = min((e.not_before for e in ready), default=now + 0.1)
            self._work.wait(timeout=min(max(wake - now, 0.001), 0.1))
        return None

    def _transfer_loop(self) -> None:
        while True:
            with self.lock:
                entry = self._next_job()
                if entry is None:
                    return
                entry.queued = False
                ask = entry.ask
                if entry.aborted or time.monotonic() > entry.deadline:
                    self._fail(entry, entry.aborted or "decode's lease ran out before the "
                               "write could start", time.monotonic())
                    continue
                entry.writing = True
                src = entry.block_ids[ask.first_block:]
                ready_event = entry.ready_event
                suspect = ask.session in self._suspect_peers
                fail = self.faults.fail_transfer()

            def should_stop(entry: _Room = entry) -> bool:
                return entry.aborted is not None or time.monotonic() > entry.deadline

            error = self._write(ask, src, ready_event, suspect, fail, should_stop)
            now = time.monotonic()
            with self.lock:
                entry.writing = False
                if error is None and entry.aborted is None:
                    self._succeed(entry, now)
                else:
                    self._fail(entry, entry.aborted or error, now)

    def _write(self, ask: TransferRequest, src_blocks: list[int], ready_event: Any,
               suspect: bool, inject_failure: bool, should_stop: Any) -> str | None:
        if inject_failure:
            return "transfer failed (injected: SLUICE_PD_FAULT_TRANSFER_FAIL_PROB)"
        if suspect:
            if not self.backend.probe(ask.session):
                return f"the decode endpoint {ask.session} does not answer a probe"
            with self.lock:
                self._suspect_peers.discard(ask.session)
        if ready_event is not None:
            ready_event.synchronize()  # the request's last step has written its KV
        peer = CacheLayout(tuple(ask.layer_addresses), ask.num_blocks,
                           ask.bytes_per_block_layer)
        runs = block_runs(src_blocks, ask.block_ids)
        src, dst, lengths = build_descriptors(self.layout, peer, runs)
        start = time.perf_counter()
        error = self.backend.write(ask.session, src, dst, lengths, should_stop)
        elapsed = time.perf_counter() - start
        with self.lock:
            if error is not None:
                self._suspect_peers.add(ask.session)
                self.add_stat("transfer_errors", 1)
            else:
                self.add_stat("sent_bytes", sum(lengths))
                self.add_stat("sent_blocks", len(src_blocks))
                self.add_stat("sent_descriptors", len(lengths))
                self.add_stat("transfer_seconds", elapsed)
        return error

    # ---- ends ------------------------------------------------------------------------------

    def _succeed(self, entry: _Room, now: float) -> None:
        entry.state = KVPoll.Success
        self.add_stat("rooms_sent", 1)
        self._send_status(entry)
        self._end(entry, now, ok=True)

    def _fail(self, entry: _Room, error: str, now: float) -> None:
        if entry.state.is_done:
            return
        entry.state = KVPoll.Failed
        entry.error = error
        entry.queued = False
        self.add_stat("rooms_failed", 1)
        logger.warning("PD room %d failed on prefill rank %d: %s", entry.room, self.rank, error)
        if entry.ask is not None:
            self._send_status(entry)
        self._end(entry, now, ok=False)

    def _end(self, entry: _Room, now: float, ok: bool) -> None:
        if entry.req_id is not None:
            self.finish(Finished(entry.req_id, ok=ok, error=entry.error))
        if entry.ask is not None:
            del self.rooms[entry.room]
        else:
            # A tombstone: a late ask is answered Failed, until decode has given up anyway.
            entry.deadline = now + self.config.send_lease_s

    def _send_status(self, entry: _Room) -> None:
        ok = entry.state == KVPoll.Success
        if self.faults.drop_status():
            logger.warning("PD room %d: status dropped (injected: "
                           "SLUICE_PD_FAULT_DROP_STATUS_PROB)", entry.room)
            return
        self.send_to(entry.ask.status_address, TransferStatus(
            room=entry.room, prefill_rank=self.rank, state=entry.state,
            first_token=entry.first_token if ok else None,
            first_logprobs=entry.first_logprobs if ok else None,
            error=None if ok else entry.error))

    def check_deadlines(self, now: float) -> None:
        with self.lock:
            for entry in list(self.rooms.values()):
                if now <= entry.deadline or entry.queued or entry.writing:
                    continue
                if entry.state.is_done:
                    del self.rooms[entry.room]  # a tombstone that served its time
                elif entry.req_id is None:
                    self._fail(entry, "the prefill request for this room never arrived", now)
                elif entry.ask is None:
                    self._fail(entry, "no decode rank asked for this room within the send "
                                      "lease", now)
                else:
                    self._fail(entry, "decode's lease ran out", now)

    def num_rooms(self) -> int:
        with self.lock:
            return sum(1 for e in self.rooms.values() if not e.state.is_done)
