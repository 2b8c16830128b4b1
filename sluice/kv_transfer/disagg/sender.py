"""The prefill side: a KVSender per room, driven by PrefillKVManager.

A room has one target per decode rank that asks for it: one at equal TP sizes, and when the
prefill's TP is a multiple of decode's; k when decode's TP is k times the prefill's (heads.py:
each of those k decode ranks gets its own slice of this rank's heads). The first ask tells
which decode ranks will ask.

Lifecycle of a target (KVPoll, forward only, Failed sticky); a room's state is the minimum over
the decode ranks that will ask it (Bootstrapping for one that has not yet):

    Bootstrapping     the scheduler handed the finished request's blocks and first token
                      (`KVSender.send`) but no decode rank has asked yet, or decode asked
                      (TransferRequest) before the prompt was done
    WaitingForInput   decode's ask is in, the KV is not (the prompt is still computing)
    Transferring      both are in: the transfer thread writes the rank's heads of the blocks
                      (after the fault injection's delay or hold, if any) into decode's
                      registered memory (shm: its shared cache, mapped at the first write)
    Success | Failed  then the status goes to that decode rank: Success with the first token
                      and its logprobs, or Failed with why

Layer-wise (PDConfig.layerwise): while the prompt computes, targets that have asked get each
step's blocks layer by layer (`begin_layer_sends` before the forward, `send_layer` as each layer
is stored, `wait_layer_sends` at the step's end: the transfer thread takes layer writes before
any room's write); `streamed_blocks` is how far every layer has landed, and the room's write
(Transferring above) sends only the rest before the status. A layer write that fails only
marks the peer suspect: the room's write sends those blocks again, after a probe.

Who frees what: the scheduler holds the request's blocks (delay_free) until the room is
reported finished (`take_finished`), which happens once every decode rank that will ask has
been served (written, or failed), when decode aborted the room (AbortRoom from any of its
ranks: the decode request is over; a write in progress stops between batches, and the room is
reported only once no write reads its blocks), or when the send lease expires before every
decode rank asked (`send_lease_s`). A room whose prefill request was aborted before its first
token (`KVSender.abort`) answers any later ask with Failed. Each ask carries a lease: no write
for it starts or goes on past it, since decode frees the blocks soon after. A write that fails
marks the peer suspect; the next write to it first probes it, and a peer that answers is used
again (a failed session is never blacklisted for good).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sluice import stage_trace
from sluice.channel import Message
from sluice.engine import wakeup
from sluice.kv_transfer.disagg import bootstrap
from sluice.kv_transfer.disagg.descriptors import CacheLayout, block_runs, build_descriptors
from sluice.kv_transfer.disagg.heads import (
    HeadSlice,
    check_tp_pair,
    decode_peers,
    held_heads,
    slice_for,
)
from sluice.kv_transfer.disagg.manager import Finished, KVManager
from sluice.kv_transfer.disagg.messages import (
    AbortRoom,
    Logprobs,
    RankRoute,
    TransferRequest,
    TransferStatus,
)
from sluice.kv_transfer.disagg.poll import KVPoll, advance, consensus
from sluice.kv_transfer.disagg.shm import host_id

if TYPE_CHECKING:
    from sluice.kv_transfer.disagg.connector import LayerSendPlan

logger = logging.getLogger("sluice")

# How often a step whose last layer is still computing looks for it to finish while it waits
# for asks (wait_layer_sends); an ask itself wakes it at once.
_ASK_POLL_S = 0.0005


@dataclass(slots=True)
class _Target:
    """One decode rank's ask for a room, and the write that serves it."""

    ask: TransferRequest
    heads: HeadSlice | None  # what this rank writes there (None: the ask was refused)
    state: KVPoll = KVPoll.WaitingForInput
    deadline: float = math.inf  # of the lease decode granted
    not_before: float = 0.0  # fault injection: the write waits until then
    queued: bool = False
    writing: bool = False  # the transfer thread is writing it (the room's blocks are in use)
    error: str | None = None
    # Layer-wise: prompt blocks [ask.first_block, streamed_blocks) are there in every layer;
    # layer writes queued or running for it.
    streamed_blocks: int = 0
    layer_writes: int = 0
    refused: str | None = None  # why a step's layer writes left it out (counted once)

    @property
    def busy(self) -> bool:
        """A write reads the room's blocks for it."""
        return self.writing or self.layer_writes > 0


@dataclass(slots=True)
class _Room:
    room: int
    # From the scheduler (the finished prefill request).
    req_id: str | None = None
    block_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    first_token: int | None = None
    first_logprobs: Logprobs | None = None
    ready_event: Any = None  # CUDA event after the request's last step (None on the CPU)
    # From decode: a target per decode rank that asked; the ranks that will (from the first).
    targets: dict[int, _Target] = field(default_factory=dict)
    askers: tuple[int, ...] | None = None
    # Why the whole room failed (aborted on either side, a refused ask, no ask in time):
    # every target stops.
    failed: str | None = None
    ended: bool = False  # reported to the scheduler; kept only as a tombstone
    # Monotonic: of the send lease (the request is in, not every decode rank asked) or of
    # an unmatched ask (no request yet), then of the tombstone.
    deadline: float = math.inf
    started: float = 0.0

    @property
    def missing_askers(self) -> bool:
        return self.askers is None or any(d not in self.targets for d in self.askers)

    @property
    def state(self) -> KVPoll:
        if self.failed is not None:
            return KVPoll.Failed
        if self.askers is None:
            return KVPoll.Bootstrapping
        return consensus(self.targets[d].state if d in self.targets else KVPoll.Bootstrapping
                         for d in self.askers)


@dataclass(slots=True)
class _LayerStep:
    """One target's share of a step's layer-wise writes: the same runs in every layer."""

    entry: _Room
    target: _Target
    runs: list[tuple[int, int, int]]
    peer: CacheLayout
    num_complete_blocks: int  # the target's streamed_blocks once every layer landed
    num_landed: int = 0
    failed: bool = False


@dataclass(slots=True)
class _LayerWrite:
    step: _LayerStep
    layer: int
    stored: Any  # CUDA event recorded once the layer's KV was stored (None on the CPU)


def _one_layer(layout: CacheLayout, layer: int) -> CacheLayout:
    return dataclasses.replace(layout, layer_addresses=(layout.layer_addresses[layer],))


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
        # Layer-wise (the step being computed): its targets, the layer writes not yet taken
        # by the transfer thread (before any room's whole write), those not yet landed.
        self._layer_steps: list[_LayerStep] = []
        self._layer_queue: deque[_LayerWrite] = deque()
        self._layer_writes_in_flight = 0
        # The step's plans and its layers stored so far ((layer, event)), for a decode rank
        # whose ask arrives mid-step: it gets the stored layers at once, then the rest.
        self._layer_plans: list[LayerSendPlan] = []
        self._stored_layers: list[tuple[int, Any]] = []

    def start(self) -> None:
        super().start()
        self._spawn(self._transfer_loop, "pd-transfer")
        self._spawn(self._register, "pd-register")

    def _register(self) -> None:
        spec = self.spec
        route = RankRoute(
            rank=self.rank, world_size=self.world_size, control_address=self.control_address,
            backend=self.config.transfer_backend, block_size=spec.block_size,
            kv_dtype=spec.dtype, head_dim=spec.head_dim, num_kv_heads=spec.num_kv_heads,
            model_num_kv_heads=spec.model_num_kv_heads, num_layers=spec.num_layers,
            engine_id=self.config.engine_id, backends=list(self.backends), host_id=host_id())
        address = f"{self.config.host}:{self.config.bootstrap_port}"
        if bootstrap.register(address, route, self.config.register_timeout_s, self._stop):
            self.registered.set()

    def sender(self, room: int) -> KVSender:
        return KVSender(self, room)

    def poll(self, room: int) -> KVPoll:
        with self.lock:
            entry = self.rooms.get(room)
            return entry.state if entry is not None else KVPoll.Failed

    def asked_rooms(self, rooms: list[int]) -> set[int]:
        """Of `rooms` (requests the scheduler holds), those every decode rank that will ask
        this rank has asked for, or that already failed (nothing to wait for)."""
        with self.lock:
            return {room for room in rooms if (entry := self.rooms.get(room)) is not None
                    and (entry.failed is not None or not entry.missing_askers)}

    # ---- from the scheduler ----------------------------------------------------------------

    def add_send(self, room: int, req_id: str, block_ids: list[int], num_prompt_tokens: int,
                 first_token: int, first_logprobs: Logprobs | None, ready_event: Any) -> None:
        stage_trace.mark("p_add_send")
        now = time.monotonic()
        with self.lock:
            entry = self.rooms.get(room)
            if entry is None:
                entry = self.rooms[room] = _Room(room)
            if entry.req_id is not None or entry.failed is not None or entry.ended:
                # A duplicate room, or one already given up: free the request's blocks.
                self.finish(Finished(req_id, ok=False, error=entry.failed or "duplicate room"))
                return
            entry.req_id = req_id
            entry.block_ids = block_ids[:-(-num_prompt_tokens // self.spec.block_size)]
            entry.num_prompt_tokens = num_prompt_tokens
            entry.first_token = first_token
            entry.first_logprobs = first_logprobs
            entry.ready_event = ready_event
            entry.started = now
            entry.deadline = now + self.config.send_lease_s  # for decode ranks yet to ask
            for target in list(entry.targets.values()):
                self._maybe_queue(entry, target, now)

    def abort_room(self, room: int, reason: str) -> None:
        """The prefill request ended before its first token: nothing will be sent."""
        with self.lock:
            entry = self.rooms.get(room)
            if entry is None:
                entry = self.rooms[room] = _Room(room)
            if entry.req_id is not None:
                return  # the send is the scheduler's to finish
            self._fail_room(entry, f"the prefill request was {reason}", time.monotonic())

    # ---- layer-wise, from the worker during a step -------------------------------------------

    def begin_layer_sends(self, plans: list[LayerSendPlan]) -> None:
        """Before the forward: which decode ranks get this step's layers, and which blocks.
        A rank whose ask arrives later in the step joins at the next layer stored (or at the
        step's end): it gets every layer stored until then at once (`_join_late`)."""
        with self.lock:
            self._layer_steps = []
            self._layer_plans = list(plans)
            self._stored_layers = []
            self._join_late()

    def _join_late(self) -> list[_LayerStep]:
        """(Lock held.) The step's layer writes for the targets that have asked and have none
        yet: the layers stored so far queued for them now. Returns the steps added."""
        joined = {id(step.target) for step in self._layer_steps}
        added: list[_LayerStep] = []
        for plan in self._layer_plans:
            entry = self.rooms.get(plan.room)
            if entry is None or entry.failed is not None or entry.ended:
                continue
            for target in entry.targets.values():
                if id(target) in joined:
                    continue
                step = self._layer_step(entry, target, plan)
                if step is not None:
                    added.append(step)
        for step in added:
            self._layer_steps.append(step)
            for layer, stored in self._stored_layers:
                self._queue_layer(step, layer, stored)
        if added and self._stored_layers:
            self.add_stat("layer_late_joins", len(added))
            self._work.notify_all()
        return added

    def _unasked_plans(self) -> bool:
        """(Lock held.) Whether a room of the step's layer plans has no target yet."""
        joined = {id(step.entry) for step in self._layer_steps}
        for plan in self._layer_plans:
            entry = self.rooms.get(plan.room)
            if entry is None or (id(entry) not in joined and entry.failed is None
                                 and not entry.ended and entry.missing_askers):
                return True
        return False

    def _queue_layer(self, step: _LayerStep, layer: int, stored: Any) -> None:
        step.target.layer_writes += 1
        self._layer_writes_in_flight += 1
        self._layer_queue.append(_LayerWrite(step, layer, stored))

    def _layer_step(self, entry: _Room, target: _Target, plan: LayerSendPlan
                    ) -> _LayerStep | None:
        ask = target.ask
        if target.heads is None or target.heads.num_heads == 0 or target.state.is_done:
            return None  # refused, nothing to write, or done
        reason = None
        if target.busy:
            reason = "busy"
        elif ask.session in self._suspect_peers:
            reason = "suspect_peer"  # left to the whole write (it probes)
        elif time.monotonic() > target.deadline:
            reason = "lease_out"
        elif (ask.num_prompt_tokens != plan.num_prompt_tokens or ask.first_block
                + len(ask.block_ids) != -(-plan.num_prompt_tokens // self.spec.block_size)):
            reason = "mismatch"  # the whole write refuses it, naming both
        if reason is not None:
            if target.refused is None:
                target.refused = reason
                self.add_stat(f"layer_skipped_{reason}", 1)
            return None
        first = max(ask.first_block, target.streamed_blocks)
        end = len(plan.block_ids)
        if first >= end:
            return None
        runs = block_runs(plan.block_ids[first:],
                          ask.block_ids[first - ask.first_block:end - ask.first_block])
        return _LayerStep(entry, target, runs, self._peer_layout(ask), plan.num_complete_blocks)

    def send_layer(self, layer: int, stored: Any) -> None:
        """Layer `layer` of the step is in the cache (on the device: once `stored` is):
        queue its writes."""
        with self.lock:
            self._stored_layers.append((layer, stored))
            late = {id(step) for step in self._join_late()} if self._layer_plans else ()
            for step in self._layer_steps:
                if id(step) not in late:  # (those got this layer with the ones before)
                    self._queue_layer(step, layer, stored)
            if self._layer_steps:
                self._work.notify_all()

    def wait_layer_sends(self) -> None:
        """Return once every layer write of the step has landed or failed (a rank that asked
        after the last layer was stored joins first). Each is bounded as a room's write is
        (the backend's own timeouts; the lease stops it between batches).

        The host reaches the step's end when its last layer is launched, long before the
        device has computed it (a prompt of 8k tokens: ~200 ms on an H200). While a room of
        the step has no target yet and the last layer is still computing, asks keep joining
        (`_join_late`), so an ask that comes then still streams behind the compute instead of
        waiting for the room's whole write after it. The wait is bounded by the step's own
        compute; on the CPU (no events) the step is computed already."""
        with self._work:
            if self._layer_plans and len(self._stored_layers) == len(self.layout.layer_addresses):
                self._join_late()
                last = self._stored_layers[-1][1] if self._stored_layers else None
                start = time.perf_counter()
                waited = False
                while (last is not None and self._unasked_plans() and not last.query()
                       and not self._stop.is_set()):
                    waited = True
                    self._work.wait(timeout=_ASK_POLL_S)
                    self._join_late()
                if waited:
                    self.add_stat("layer_ask_waits", 1)
                    self.add_stat("layer_ask_wait_seconds", time.perf_counter() - start)
            while self._layer_writes_in_flight and not self._stop.is_set():
                self._work.wait(timeout=0.1)
            self._layer_steps = []
            self._layer_plans = []
            self._stored_layers = []

    def _write_layer(self, job: _LayerWrite) -> None:
        """The transfer thread: one layer's runs to one decode rank."""
        step = job.step
        entry, target = step.entry, step.target
        ask = target.ask

        def should_stop() -> bool:
            return entry.failed is not None or time.monotonic() > target.deadline

        error = "stopped" if step.failed or should_stop() else None
        if error is None:
            backend = self.backends[ask.backend]
            error = backend.attach(ask.session, ask.export)
        if error is None:
            if job.stored is not None:
                job.stored.synchronize()
            src, dst, lengths = build_descriptors(_one_layer(self.layout, job.layer),
                                                  _one_layer(step.peer, job.layer), step.runs,
                                                  target.heads)
            start = time.perf_counter()
            error = backend.write(ask.session, src, dst, lengths, should_stop)
            elapsed = time.perf_counter() - start
        with self.lock:
            target.layer_writes -= 1
            self._layer_writes_in_flight -= 1
            if error is None:
                self.add_stat("layer_writes", 1)
                self.add_stat("layer_sent_bytes", sum(lengths))
                self.add_stat("layer_transfer_seconds", elapsed)
                step.num_landed += 1
                if step.num_landed == len(self.layout.layer_addresses):
                    target.streamed_blocks = max(target.streamed_blocks,
                                                 step.num_complete_blocks)
            elif not step.failed:
                # Left to the room's whole write, which probes the peer first.
                step.failed = True
                if error != "stopped":
                    self._suspect_peers.add(ask.session)
                    self.add_stat("layer_write_errors", 1)
                    logger.warning("PD room %d: a layer write to decode rank %d failed (the "
                                   "room's write will retry it): %s", entry.room,
                                   ask.decode_rank, error)
            if not target.busy and entry.failed is not None:
                self._fail_target(entry, target, entry.failed, time.monotonic())
            self._work.notify_all()

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
                # Any decode rank's abort means the decode request is over: stop every write.
                self._fail_room(entry, f"decode aborted the room: {message.reason}",
                                time.monotonic())
        else:
            logger.warning("PD prefill rank %d ignored a %s", self.rank,
                           type(message).__name__)

    def _on_ask(self, ask: TransferRequest) -> None:
        stage_trace.mark("p_ask")
        now = time.monotonic()
        with self.lock:
            entry = self.rooms.get(ask.room)
            if entry is None:
                entry = self.rooms[ask.room] = _Room(ask.room)
                # Its prefill request has not finished yet (or never comes).
                entry.deadline = now + min(ask.lease_s, self.config.send_lease_s)
            if ask.decode_rank in entry.targets:
                return  # a repeated ask: the first one stands
            heads, problem = self._check_ask(ask)
            target = entry.targets[ask.decode_rank] = _Target(ask, heads)
            if entry.askers is None and problem is None:
                entry.askers = tuple(decode_peers(self.world_size, ask.tp_size, self.rank))
            if entry.failed is not None or entry.ended:
                # Aborted here before this decode rank asked: tell it at once.
                self._fail_target(entry, target, entry.failed or "the room is over", now)
                return
            if problem is None:
                problem = self._check_blocks(ask, entry)
            if problem is not None:
                self._fail_room(entry, problem, now)
                return
            target.deadline = now + ask.lease_s
            self._work.notify_all()  # a step waiting in wait_layer_sends lets it join
            if entry.req_id is not None:
                # The prompt was computed before this rank asked: nothing of it streamed.
                self.add_stat("asks_after_prompt", 1)
                self.add_stat("ask_after_prompt_seconds", now - entry.started)
            self._maybe_queue(entry, target, now)
        wakeup.notify()  # a request held for this ask goes with the next step

    def _check_ask(self, ask: TransferRequest) -> tuple[HeadSlice | None, str | None]:
        """(what this rank writes for the ask, why it cannot be served)."""
        spec = self.spec
        if ask.block_size != spec.block_size:
            return None, (f"page size mismatch: this prefill instance has block size "
                          f"{spec.block_size}, the decode instance {ask.block_size}; start "
                          "both with the same --block-size")
        if (ask.kv_dtype, ask.head_dim, ask.model_num_kv_heads) != (
                spec.dtype, spec.head_dim, spec.model_num_kv_heads):
            return None, (f"KV layout mismatch: this prefill instance has {spec.dtype} KV of "
                          f"{spec.model_num_kv_heads} heads of {spec.head_dim}, the decode "
                          f"instance {ask.kv_dtype} of {ask.model_num_kv_heads} heads of "
                          f"{ask.head_dim} (same model and --dtype on both)")
        if len(ask.layer_addresses) != spec.num_layers or ask.backend not in self.backends:
            return None, (f"the decode instance has {len(ask.layer_addresses)} layers over "
                          f"{ask.backend!r}, this prefill instance {spec.num_layers} over "
                          f"{' or '.join(map(repr, self.backends))}")
        try:
            check_tp_pair(self.world_size, ask.tp_size)
            heads = slice_for(spec.model_num_kv_heads, self.world_size, ask.tp_size,
                              self.rank, ask.decode_rank)
        except ValueError as exc:
            return None, str(exc)
        expected = len(held_heads(spec.model_num_kv_heads, ask.tp_size, ask.decode_rank))
        if ask.num_kv_heads != expected:
            return None, (f"decode rank {ask.decode_rank} of {ask.tp_size} holds "
                          f"{ask.num_kv_heads} KV heads, not the {expected} of "
                          f"{spec.model_num_kv_heads} heads over {ask.tp_size} ranks")
        return heads, None

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

    def _peer_layout(self, ask: TransferRequest) -> CacheLayout:
        return CacheLayout(tuple(ask.layer_addresses), ask.num_blocks, ask.block_size,
                           ask.num_kv_heads, self.spec.head_bytes)

    # ---- sending ---------------------------------------------------------------------------

    def _maybe_queue(self, entry: _Room, target: _Target, now: float) -> None:
        """Queue a target's write once both halves are in (lock held)."""
        if entry.req_id is None or target.queued or target.state.is_done:
            return
        problem = self._check_blocks(target.ask, entry)
        if problem is not None:
            self._fail_room(entry, problem, now)
            return
        target.queued = True
        target.not_before = now + self.faults.send_delay_s
        target.state = advance(target.state, KVPoll.Transferring)
        self.send_to(target.ask.status_address, TransferStatus(
            room=entry.room, prefill_rank=self.rank, state=KVPoll.Transferring))
        self._work.notify()

    def _next_job(self) -> _LayerWrite | tuple[_Room, _Target] | None:
        """The next write that may start, waiting for one (lock held). Layer writes first:
        the step that queued them waits for them."""
        while not self._stop.is_set():
            now = time.monotonic()
            if self._layer_queue:
                return self._layer_queue.popleft()
            ready = [(e, t) for e in self.rooms.values() for t in e.targets.values()
                     if t.queued and t.state == KVPoll.Transferring and not t.layer_writes]
            holding = bool(ready) and self.faults.holding()
            due = [(e, t) for e, t in ready
                   if e.failed or (t.not_before <= now and not holding)]
            if due:
                return min(due, key=lambda job: job[1].not_before)
            # Held: look at the hold file again in 50 ms.
            wake = now + 0.05 if holding else min((t.not_before for _, t in ready),
                                                  default=now + 0.1)
            self._work.wait(timeout=min(max(wake - now, 0.001), 0.1))
        return None

    def _transfer_loop(self) -> None:
        while True:
            with self.lock:
                job = self._next_job()
                if job is None:
                    return
            if isinstance(job, _LayerWrite):
                self._write_layer(job)
            else:
                self._write_room(*job)

    def _write_room(self, entry: _Room, target: _Target) -> None:
        """A decode rank's write of the room once the request is done: what the layer writes
        of the prompt's steps left (layer-wise, usually nothing), then the status."""
        stage_trace.mark("p_room_start")
        with self.lock:
            target.queued = False
            ask = target.ask
            if entry.failed or time.monotonic() > target.deadline:
                self._fail_target(entry, target, entry.failed or "decode's lease ran out "
                                  "before the write could start", time.monotonic())
                return
            target.writing = True
            first = max(ask.first_block, target.streamed_blocks)
            src, dst = entry.block_ids[first:], ask.block_ids[first - ask.first_block:]
            ready_event = entry.ready_event
            suspect = ask.session in self._suspect_peers
            fail = self.faults.fail_transfer()

        def should_stop() -> bool:
            return entry.failed is not None or time.monotonic() > target.deadline

        error = self._write(ask, target.heads, src, dst, ready_event, suspect, fail,
                            should_stop)
        now = time.monotonic()
        with self.lock:
            target.writing = False
            if error is None and entry.failed is None:
                # Of the room's blocks, those its layer writes brought (sent_blocks: the rest).
                self.add_stat("streamed_blocks", first - ask.first_block)
                if not src:
                    self.add_stat("rooms_streamed", 1)
                self._succeed_target(entry, target, now)
            else:
                self._fail_target(entry, target, entry.failed or error, now)

    def _write(self, ask: TransferRequest, heads: HeadSlice, src_blocks: list[int],
               dst_blocks: list[int], ready_event: Any, suspect: bool, inject_failure: bool,
               should_stop: Any) -> str | None:
        if inject_failure:
            return "transfer failed (injected: SLUICE_PD_FAULT_TRANSFER_FAIL_PROB)"
        if heads.num_heads == 0:
            return None  # another prefill rank sends these heads
        backend = self.backends[ask.backend]
        problem = backend.attach(ask.session, ask.export)  # maps a shm peer, once
        if problem is not None:
            return problem
        if suspect:
            if not backend.probe(ask.session):
                return f"the decode endpoint {ask.session} does not answer a probe"
            with self.lock:
                self._suspect_peers.discard(ask.session)
        if ready_event is not None:
            ready_event.synchronize()  # the request's last step has written its KV
        stage_trace.mark("p_room_synced")
        runs = block_runs(src_blocks, dst_blocks)
        src, dst, lengths = build_descriptors(self.layout, self._peer_layout(ask), runs, heads)
        start = time.perf_counter()
        error = backend.write(ask.session, src, dst, lengths, should_stop)
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

    # ---- ends (lock held) ------------------------------------------------------------------

    def _succeed_target(self, entry: _Room, target: _Target, now: float) -> None:
        target.state = KVPoll.Success
        self._send_status(entry, target)
        self._maybe_end(entry, now)

    def _fail_target(self, entry: _Room, target: _Target, error: str, now: float) -> None:
        if target.state.is_done:
            return
        target.state = KVPoll.Failed
        target.error = error
        target.queued = False
        logger.warning("PD room %d failed on prefill rank %d for decode rank %d: %s",
                       entry.room, self.rank, target.ask.decode_rank, error)
        self._send_status(entry, target)
        self._maybe_end(entry, now)

    def _fail_room(self, entry: _Room, error: str, now: float) -> None:
        """Stop every target: those not being written fail now, a write in progress stops
        between batches (and fails then)."""
        if entry.failed is not None or entry.ended:
            return
        entry.failed = error
        for target in entry.targets.values():
            if not target.busy:
                self._fail_target(entry, target, error, now)
        self._maybe_end(entry, now)

    def _maybe_end(self, entry: _Room, now: float) -> None:
        """Report the room to the scheduler once no write reads its blocks and nothing more
        will: every decode rank that asks was served, or the room failed."""
        if entry.ended or any(not t.state.is_done for t in entry.targets.values()):
            return
        if entry.failed is None and entry.missing_askers:
            return
        entry.ended = True
        ok = entry.failed is None and all(t.state == KVPoll.Success
                                          for t in entry.targets.values())
        if entry.req_id is not None:
            self.add_stat("rooms_sent" if ok else "rooms_failed", 1)
            error = entry.failed or next((t.error for t in entry.targets.values() if t.error),
                                         None)
            self.finish(Finished(entry.req_id, ok=ok, error=error))
        elif entry.failed is not None:
            self.add_stat("rooms_failed", 1)
            logger.warning("PD room %d failed on prefill rank %d: %s", entry.room, self.rank,
                           entry.failed)
        if entry.missing_askers or entry.req_id is None:
            # A tombstone: a late ask is answered Failed, a late send plan (the prefill
            # request still computing when decode aborted) frees its blocks at once.
            entry.deadline = now + self.config.send_lease_s
        else:
            del self.rooms[entry.room]

    def _send_status(self, entry: _Room, target: _Target) -> None:
        stage_trace.mark("p_status")
        ok = target.state == KVPoll.Success
        if self.faults.drop_status():
            logger.warning("PD room %d: status dropped (injected: "
                           "SLUICE_PD_FAULT_DROP_STATUS_PROB)", entry.room)
            return
        self.send_to(target.ask.status_address, TransferStatus(
            room=entry.room, prefill_rank=self.rank, state=target.state,
            first_token=entry.first_token if ok else None,
            first_logprobs=entry.first_logprobs if ok else None,
            error=None if ok else target.error))

    def check_deadlines(self, now: float) -> None:
        with self.lock:
            for entry in list(self.rooms.values()):
                if entry.ended:
                    if now > entry.deadline:
                        del self.rooms[entry.room]  # a tombstone that served its time
                    continue
                for target in list(entry.targets.values()):
                    if (not target.state.is_done and not target.queued and not target.busy
                            and now > target.deadline):
                        self._fail_target(entry, target, "decode's lease ran out", now)
                if entry.ended or now <= entry.deadline:
                    continue
                if entry.req_id is None:
                    self._fail_room(entry, "the prefill request for this room never arrived",
                                    now)
                elif entry.missing_askers:
                    self._fail_room(entry, "no decode rank asked for this room within the "
                                    "send lease", now)

    def num_rooms(self) -> int:
        with self.lock:
            return sum(1 for e in self.rooms.values() if not e.ended)
