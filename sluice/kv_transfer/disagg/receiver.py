"""The decode side: a KVReceiver per room, driven by DecodeKVManager.

Lifecycle of a room (KVPoll, forward only, Failed sticky):

    Bootstrapping     blocks allocated; the route of the prefill instance (its bootstrap
                      server's GET /route, cached per instance) is being fetched, and its TP
                      size, page size, KV dtype and heads checked against ours (a pair that
                      cannot be served fails the room with a message saying why), and the
                      backend picked (transfer.choose_backend: shm on one host under auto)
    WaitingForInput   TransferRequest sent to each prefill rank that holds some of our heads
                      (heads.py: rank r at equal TP sizes; k ranks when the prefill's TP is k
                      times ours; one, shared with k - 1 other decode ranks, when ours is k
                      times the prefill's): room, our blocks (only those the local prefix cache
                      lacks), our TP size, rank and heads, where to write, and a lease
    Transferring      the prefill ranks say they are writing
    Success | Failed  every asked prefill rank sent its status: Success carries the first token
                      and its logprobs (the same from each, or the room fails)

A room's state is the minimum over the prefill ranks it asked (KVPoll consensus): it succeeds
only once every one of them succeeded. The first Failed sends AbortRoom to the others still
writing, and the room fails only once each has answered (or the waiting deadline passed, or
the prefill is lost), so no late write lands in blocks the scheduler has freed.

Bounds: a room fails after `bootstrap_timeout_s` without a route, after `waiting_timeout_s`
without a final status once asked, and at once when its prefill instance is lost. Each prefill
with unfinished rooms is probed (`GET /health` of its bootstrap server) every
`heartbeat_interval_s`; `heartbeat_misses` failures in a row, or an answer from another
instance (it restarted), lose it: every unfinished room it owned fails, and its cached route is
dropped (a prefill that comes back is used again; nothing is blacklisted).

Who frees what: every room ends in `take_finished` exactly once; the scheduler then frees
(or recomputes) the request's blocks. A room aborted by its decode request (`KVReceiver.abort`)
that was already asked for sends AbortRoom to the prefill and ends only when the prefill
answers, the prefill is lost, or the waiting deadline passes, since until then the prefill may
still be writing into the blocks (the lease it was granted runs out before that deadline).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from sluice import stage_trace
from sluice.channel import Message
from sluice.kv_transfer.disagg import bootstrap
from sluice.kv_transfer.disagg.heads import check_tp_pair, held_heads, plan_slices
from sluice.kv_transfer.disagg.manager import Finished, KVManager
from sluice.kv_transfer.disagg.messages import (
    AbortRoom,
    CacheExport,
    Logprobs,
    Route,
    TransferRequest,
    TransferStatus,
)
from sluice.kv_transfer.disagg.poll import KVPoll, advance, consensus
from sluice.kv_transfer.disagg.shm import host_id
from sluice.kv_transfer.disagg.transfer import TransferBackend, choose_backend

logger = logging.getLogger("sluice")

_BOOTSTRAP_RETRY_S = 0.1


@dataclass(slots=True)
class _Room:
    room: int
    req_id: str
    prefill: str  # its bootstrap server, "host:port"
    block_ids: list[int]  # ours, for the prompt's blocks [first_block, ...)
    first_block: int
    num_prompt_tokens: int
    state: KVPoll = KVPoll.Bootstrapping  # the consensus of `peers` once asked
    deadline: float = math.inf
    instance_id: str | None = None  # of the prefill that was asked
    # The prefill ranks asked: rank -> (control address, where it stands).
    peers: dict[int, tuple[str, KVPoll]] = field(default_factory=dict)
    first: tuple[int, Logprobs | None] | None = None  # from the first peer that succeeded
    error: str | None = None  # the first failure: the room fails once every peer is done
    aborted: bool = False
    started: float = 0.0

    @property
    def asked(self) -> bool:
        return bool(self.peers)

    def unfinished_peers(self) -> list[str]:
        return [control for control, state in self.peers.values() if not state.is_done]


class KVReceiver:
    """One room being received; a handle on the manager's state (same interface on every
    backend)."""

    def __init__(self, manager: DecodeKVManager, room: int) -> None:
        self.manager = manager
        self.room = room

    def init(self, req_id: str, prefill: str, block_ids: list[int], first_block: int,
             num_prompt_tokens: int) -> None:
        self.manager.add_recv(self.room, req_id, prefill, block_ids, first_block,
                              num_prompt_tokens)

    def abort(self, reason: str) -> None:
        self.manager.abort_room(self.room, reason)

    def poll(self) -> KVPoll:
        return self.manager.poll(self.room)


class DecodeKVManager(KVManager):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rooms: dict[int, _Room] = {}
        self._routes: dict[str, Route] = {}
        # The backend each prefill (with a cached route) pairs with us over.
        self._pair_backends: dict[str, str] = {}
        self._host_id = host_id()
        self._misses: dict[str, int] = {}
        self._bootstrap_work = threading.Condition(self.lock)
        # Rooms aborted before their prefill was asked: (prefill, room, reason, deadline).
        self._unsent_aborts: list[tuple[str, int, str, float]] = []
        self._exports: dict[str, CacheExport | None] = {}  # backend name -> (_export)

    def start(self) -> None:
        super().start()
        self._spawn(self._bootstrap_loop, "pd-bootstrap")
        self._spawn(self._heartbeat_loop, "pd-heartbeat")

    def receiver(self, room: int) -> KVReceiver:
        return KVReceiver(self, room)

    def poll(self, room: int) -> KVPoll:
        with self.lock:
            entry = self.rooms.get(room)
            return entry.state if entry is not None else KVPoll.Failed

    # ---- from the scheduler ----------------------------------------------------------------

    def add_recv(self, room: int, req_id: str, prefill: str, block_ids: list[int],
                 first_block: int, num_prompt_tokens: int) -> None:
        now = time.monotonic()
        with self.lock:
            if room in self.rooms:
                self.add_stat("rooms_failed", 1)
                self.finish(Finished(req_id, ok=False, failed_block_ids=list(block_ids),
                                     error=f"room {room} is already in use on this decode "
                                           "instance"))
                return
            self.rooms[room] = _Room(room, req_id, prefill, list(block_ids), first_block,
                                     num_prompt_tokens, deadline=now
                                     + self.config.bootstrap_timeout_s, started=now)
            self._bootstrap_work.notify()

    def abort_room(self, room: int, reason: str) -> None:
        with self.lock:
            entry = self.rooms.get(room)
            if entry is None or entry.aborted:
                return
            entry.aborted = True
            if not entry.asked:
                # Nothing writes into its blocks yet: they can go now. The prefill may hold
                # its own for this room: tell it once its route is known.
                self._fail(entry, f"aborted ({reason}) before the prefill was asked")
                self._unsent_aborts.append((entry.prefill, room, reason, time.monotonic()
                                            + self.config.bootstrap_timeout_s))
                self._bootstrap_work.notify()
                return
            for control in entry.unfinished_peers():
                self.send_to(control, AbortRoom(room=room, decode_rank=self.rank,
                                                reason=reason))

    def notify_abort(self, prefill: str, room: int, reason: str) -> None:
        """Tell the prefill (once its route is known) that a room it may hold blocks for will
        never be asked for."""
        with self.lock:
            self._unsent_aborts.append((prefill, room, reason, time.monotonic()
                                        + self.config.bootstrap_timeout_s))
            self._bootstrap_work.notify()

    # ---- from the prefill ------------------------------------------------------------------

    def handle(self, message: Message) -> None:
        stage_trace.mark("d_status")
        if not isinstance(message, TransferStatus):
            logger.warning("PD decode rank %d ignored a %s", self.rank, type(message).__name__)
            return
        with self.lock:
            entry = self.rooms.get(message.room)
            if entry is None or message.prefill_rank not in entry.peers:
                return  # ended meanwhile (or never ours): a Failed for an unknown room is moot
            control, state = entry.peers[message.prefill_rank]
            state = advance(state, KVPoll(message.state))
            error = None
            if state == KVPoll.Failed:
                error = message.error or "no reason given"
            elif state == KVPoll.Success:
                if message.first_token is None:
                    state, error = KVPoll.Failed, "it reported success without a first token"
                elif entry.first is None:
                    entry.first = (message.first_token, message.first_logprobs)
                elif entry.first[0] != message.first_token:
                    state, error = KVPoll.Failed, (
                        f"its first token {message.first_token} is not the {entry.first[0]} "
                        "of another prefill rank")
            entry.peers[message.prefill_rank] = (control, state)
            if error is not None and entry.error is None:
                entry.error = (f"the prefill {entry.prefill} failed the room (rank "
                               f"{message.prefill_rank}): {error}")
                # The others may still be writing our blocks: stop them, and wait for them.
                for other in entry.unfinished_peers():
                    self.send_to(other, AbortRoom(room=entry.room, decode_rank=self.rank,
                                                  reason=f"another prefill rank failed: {error}"))
            self._settle(entry)

    def _settle(self, entry: _Room) -> None:
        """End the room once every asked prefill rank is done (lock held)."""
        states = [state for _, state in entry.peers.values()]
        pending = [state for state in states if not state.is_done]
        if pending:
            # Not done while a peer may still write, even if another failed already.
            entry.state = consensus(pending)
            return
        if entry.error is not None or consensus(states) != KVPoll.Success:
            self._fail(entry, entry.error or "a prefill rank failed the room")
        else:
            self._succeed(entry, *entry.first)

    # ---- asking (bootstrap thread) ---------------------------------------------------------

    def _bootstrap_loop(self) -> None:
        with httpx.Client(timeout=self.config.heartbeat_timeout_s) as client:
            while not self._stop.is_set():
                with self.lock:
                    pending: dict[str, list[int]] = {}
                    for entry in self.rooms.values():
                        if not entry.asked and not entry.state.is_done:
                            pending.setdefault(entry.prefill, []).append(entry.room)
                    now = time.monotonic()
                    self._unsent_aborts = [a for a in self._unsent_aborts if a[3] > now]
                    for prefill, *_ in self._unsent_aborts:
                        pending.setdefault(prefill, [])
                    if not pending:
                        self._bootstrap_work.wait(timeout=0.2)
                        continue
                for prefill, rooms in pending.items():
                    answer = self._route(client, prefill)
                    if answer is not None:
                        self._ask(prefill, *answer, rooms)
                with self.lock:
                    if self._unsent_aborts or any(not e.asked and not e.state.is_done
                                                  for e in self.rooms.values()):
                        self._bootstrap_work.wait(timeout=_BOOTSTRAP_RETRY_S)

    def _route(self, client: httpx.Client, prefill: str
               ) -> tuple[Route | None, str | None] | None:
        """(the prefill's route (cached), a reason it can never serve us), or None (retry)."""
        with self.lock:
            route = self._routes.get(prefill)
        if route is not None:
            return route, None
        try:
            route = bootstrap.fetch_route(client, prefill)
        except (bootstrap.RouteUnavailable, httpx.HTTPError):
            return None  # not up yet, or gone: the deadline or the heartbeat decides
        except ValueError as exc:
            return None, str(exc)
        problem = self._check_route(prefill, route)
        if problem is not None:
            return route, problem
        backend, problem = self._pick_backend(prefill, route)
        if problem is not None:
            return route, problem
        with self.lock:
            self._routes[prefill] = route
            if self._pair_backends.get(prefill) != backend:
                logger.info("PD decode rank %d: the prefill at %s pairs over %s (%s)",
                            self.rank, prefill, backend,
                            "same host" if route.ranks[0].host_id == self._host_id
                            else "another host")
            self._pair_backends[prefill] = backend
        return route, None

    def _pick_backend(self, prefill: str, route: Route) -> tuple[str | None, str | None]:
        """(the backend to ask `prefill`'s ranks over, why there is none)."""
        chosen = set()
        for peer in self._peer_ranks(route):
            rank = route.ranks[peer]
            backend, problem = choose_backend(
                self.config.transfer_backend, list(self.backends), self._host_id,
                rank.backend, rank.backends or [rank.backend], rank.host_id)
            if problem is not None:
                return None, f"the prefill instance at {prefill}: {problem}"
            chosen.add(backend)
        if len(chosen) != 1:
            return None, f"the prefill instance at {prefill}: its ranks pair over {chosen}"
        return chosen.pop(), None

    def _check_route(self, prefill: str, route: Route) -> str | None:
        spec = self.spec
        try:
            check_tp_pair(route.world_size, self.world_size)
        except ValueError as exc:
            return f"{exc} (the prefill instance at {prefill}, this decode instance)"
        for peer in self._peer_ranks(route):
            rank = route.ranks[peer]
            if rank.block_size != spec.block_size:
                return (f"page size mismatch: the prefill instance at {prefill} has block size "
                        f"{rank.block_size}, this decode instance {spec.block_size}; start "
                        "both with the same --block-size")
            if (rank.kv_dtype, rank.head_dim, rank.model_num_kv_heads) != (
                    spec.dtype, spec.head_dim, spec.model_num_kv_heads):
                return (f"KV layout mismatch: the prefill instance at {prefill} has "
                        f"{rank.kv_dtype} KV of {rank.model_num_kv_heads} heads of "
                        f"{rank.head_dim}, this decode instance {spec.dtype} of "
                        f"{spec.model_num_kv_heads} heads of {spec.head_dim} (same model and "
                        "--dtype on both)")
            expected = len(held_heads(rank.model_num_kv_heads, route.world_size, peer))
            if rank.num_kv_heads != expected:
                return (f"the prefill instance at {prefill}: rank {peer} of "
                        f"{route.world_size} holds {rank.num_kv_heads} KV heads, not the "
                        f"{expected} of {rank.model_num_kv_heads} heads over "
                        f"{route.world_size} ranks")
            if rank.num_layers != spec.num_layers:
                return (f"the prefill instance at {prefill} has {rank.num_layers} layers, this "
                        f"decode instance {spec.num_layers}: not the same model")
        try:
            plan_slices(spec.model_num_kv_heads, route.world_size, self.world_size, self.rank)
        except ValueError as exc:
            return f"the prefill instance at {prefill}: {exc}"
        return None

    def _peer_ranks(self, route: Route) -> list[int]:
        """The prefill ranks this rank asks (heads.py); every rank of a pair of TP sizes that
        cannot be served (to tell them all of an abort)."""
        try:
            return [s.prefill_rank for s in plan_slices(
                self.spec.model_num_kv_heads, route.world_size, self.world_size, self.rank)]
        except ValueError:
            return list(range(route.world_size))

    def _export(self, backend: TransferBackend) -> CacheExport | None:
        """The cache's export for `backend`, made once: the caches never move, and a CUDA
        export (an IPC handle per layer) costs milliseconds and a ref-counted share each."""
        name = backend.name
        if name not in self._exports:
            self._exports[name] = backend.export(list(self.kv_caches.values()))
        return self._exports[name]

    def _ask(self, prefill: str, route: Route | None, problem: str | None,
             rooms: list[int]) -> None:
        """Ask the prefill's ranks for each room; or, if it can never serve us (`problem`),
        fail them and tell it (when its route is known), so it frees what it holds for them."""
        now = time.monotonic()
        controls = ({r: route.ranks[r].control_address for r in self._peer_ranks(route)}
                    if route is not None else {})
        spec = self.spec
        backend = export = None
        if problem is None and route is not None:
            with self.lock:
                backend = self.backends[self._pair_backends[prefill]]
            stage_trace.mark("d_export")
            try:
                export = self._export(backend)
            except ValueError as exc:
                problem = str(exc)
        with self.lock:
            unsent = [a for a in self._unsent_aborts if a[0] == prefill]
            self._unsent_aborts = [a for a in self._unsent_aborts if a[0] != prefill]
            for _, room, reason, _ in unsent:
                for control in controls.values():
                    self.send_to(control, AbortRoom(room=room, decode_rank=self.rank,
                                                    reason=reason))
            for room in rooms:
                entry = self.rooms.get(room)
                if entry is None or entry.state.is_done or entry.asked:
                    continue
                if problem is not None:
                    self._fail(entry, problem)
                    for control in controls.values():
                        self.send_to(control, AbortRoom(room=room, decode_rank=self.rank,
                                                        reason=problem))
                    continue
                if entry.aborted:
                    self._fail(entry, "aborted before the prefill was asked")
                    continue
                assert backend is not None
                entry.peers = {r: (control, KVPoll.WaitingForInput)
                               for r, control in controls.items()}
                self.add_stat(f"rooms_over_{backend.name}", 1)
                entry.instance_id = route.instance_id
                entry.state = advance(entry.state, KVPoll.WaitingForInput)
                entry.deadline = now + self.config.waiting_timeout_s
                ask = TransferRequest(
                    room=room, decode_rank=self.rank, tp_size=self.world_size,
                    status_address=self.control_address, session=backend.session,
                    backend=backend.name, block_size=spec.block_size,
                    kv_dtype=spec.dtype, head_dim=spec.head_dim,
                    num_kv_heads=spec.num_kv_heads, model_num_kv_heads=spec.model_num_kv_heads,
                    layer_addresses=list(self.layout.layer_addresses),
                    num_blocks=self.layout.num_blocks, first_block=entry.first_block,
                    block_ids=entry.block_ids, num_prompt_tokens=entry.num_prompt_tokens,
                    lease_s=self.config.lease_s, export=export)
                stage_trace.mark("d_ask")
                for control in controls.values():
                    self.send_to(control, ask)

    # ---- heartbeat -------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        with httpx.Client(timeout=self.config.heartbeat_timeout_s) as client:
            while not self._stop.wait(interval):
                with self.lock:
                    prefills: dict[str, set[str | None]] = {}
                    for entry in self.rooms.values():
                        if not entry.state.is_done:
                            prefills.setdefault(entry.prefill, set()).add(entry.instance_id)
                    for gone in set(self._misses) - set(prefills):
                        del self._misses[gone]
                for prefill, instances in prefills.items():
                    instance_id = bootstrap.probe_health(client, prefill)
                    with self.lock:
                        if instance_id is None:
                            misses = self._misses.get(prefill, 0) + 1
                            self._misses[prefill] = misses
                            if misses >= self.config.heartbeat_misses:
                                self._lose(prefill, f"{misses} health probes failed in a row")
                        else:
                            self._misses[prefill] = 0
                            if instances - {None, instance_id}:
                                self._lose(prefill, "it restarted", keep=instance_id)

    def _lose(self, prefill: str, why: str, keep: str | None = None) -> None:
        """Fail every unfinished room of a lost prefill (lock held); rooms already asked of
        instance `keep` (the one answering now) go on."""
        self._routes.pop(prefill, None)
        self._pair_backends.pop(prefill, None)
        self._misses.pop(prefill, None)
        lost = [e for e in self.rooms.values()
                if e.prefill == prefill and not e.state.is_done
                and (keep is None or e.instance_id not in (None, keep))]
        if lost:
            logger.warning("PD decode rank %d: prefill %s lost (%s): failing %d room(s)",
                           self.rank, prefill, why, len(lost))
            self.add_stat("prefills_lost", 1)
        for entry in lost:
            self._fail(entry, f"prefill {prefill} lost: {why}")

    # ---- ends ------------------------------------------------------------------------------

    def check_deadlines(self, now: float) -> None:
        with self.lock:
            for entry in list(self.rooms.values()):
                if now <= entry.deadline or entry.state.is_done:
                    continue
                if not entry.asked:
                    self._fail(entry, f"no route from the prefill's bootstrap server at "
                                      f"{entry.prefill} within {self.config.bootstrap_timeout_s:g}"
                                      " s (bootstrap_timeout_s)")
                else:
                    for control in entry.unfinished_peers():
                        self.send_to(control, AbortRoom(
                            room=entry.room, decode_rank=self.rank, reason="waiting timeout"))
                    self._fail(entry, f"no status from the prefill at {entry.prefill} within "
                                      f"{self.config.waiting_timeout_s:g} s (waiting_timeout_s)")

    def _succeed(self, entry: _Room, first_token: int, first_logprobs: Logprobs | None) -> None:
        entry.state = KVPoll.Success
        del self.rooms[entry.room]
        self.add_stat("rooms_received", 1)
        self.add_stat("received_blocks", len(entry.block_ids))
        self.add_stat("wait_seconds", time.monotonic() - entry.started)
        self.finish(Finished(entry.req_id, ok=True, first_token=first_token,
                             first_logprobs=first_logprobs))

    def _fail(self, entry: _Room, error: str) -> None:
        entry.state = KVPoll.Failed
        del self.rooms[entry.room]
        self.add_stat("rooms_failed", 1)
        if not entry.aborted:
            logger.warning("PD room %d (request %s) failed on decode rank %d: %s", entry.room,
                           entry.req_id, self.rank, error)
        self.finish(Finished(entry.req_id, ok=False, failed_block_ids=list(entry.block_ids),
                             error=error))

    def num_rooms(self) -> int:
        with self.lock:
            return len(self.rooms)
