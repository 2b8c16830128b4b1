"""PDConnector: prefill/decode disaggregation as a KV connector (SGLang's design in vLLM's
connector shape). One class for both roles, `kv_role` kv_producer (prefill) or kv_consumer
(decode); a request takes part only when its kv_transfer_params say so (params.py), so either
instance still serves plain requests.

Prefill (producer), per request with {"do_remote_decode": true, "bootstrap_room": R}:
  its engine caps it at one output token; the prompt computes as usual (chunked, prefix cache);
  `update_request_output` keeps the first token and its logprobs; `request_finished` returns
  delay_free and plans the send (blocks covering the prompt, the token); the worker's
  PrefillKVManager writes the blocks once decode asks for room R, then sends the status (with
  `layerwise`, each step of the prompt plans a LayerSendPlan and the worker writes each layer's
  blocks to a decode that has asked as `save_kv_layer` sees the layer stored, so the send at
  the end has little or nothing left to write); the
  blocks are freed when the worker reports the room done (sent, failed, aborted, or its lease
  out). A request that ends before its first token (aborted) plans an abort instead: decode's
  ask gets Failed. The scheduler half runs the instance's bootstrap server.

Bootstrap queue (layer-wise, `bootstrap_wait_s` > 0): the router sends both halves at once,
and a prefill that starts before its decode has asked streams nothing of the steps it computed
meanwhile (all of a one-step prompt). So a new request is held (`get_num_new_matched_tokens`
answers None: it waits, the others go ahead) and named in each step's plan (`held`) until
every rank's worker has the decode's ask for its room (`ready_requests`), or for at most
bootstrap_wait_s; then it computes anyway and the room's whole write sends what did not stream.

Abort plans go out with delay_free, and the worker reports them in finished_sending as soon as
its manager has them: the engine keeps stepping until then, so an abort made when nothing else
is running still reaches the manager (and the peer).

Decode (consumer), per request with {"do_remote_prefill": true, "bootstrap_host": H,
"bootstrap_port": P, "bootstrap_room": R}:
  `get_num_new_matched_tokens` offers the whole prompt past the local prefix-cache hit as an
  asynchronous load, so the request is parked in WAITING_FOR_REMOTE_KVS with blocks for it;
  `update_state_after_alloc` plans the receive of only the blocks the prefix cache lacks; the
  worker's DecodeKVManager fetches the route, asks the prefill rank, and reports the room
  finished with the first token (Success) or with its blocks invalid (Failed: with the default
  kv_load_failure_policy "fail" the request ends with finish_reason "error" before any token,
  the signal a router retries on; "recompute" computes the prompt here instead). A decode
  request that ends mid-load plans an abort; its blocks stay with the scheduler until the room
  ends (see receiver.py). A decode request that ends before its receive began (aborted
  while queued, or computed here because it wants prompt logprobs) tells the prefill, so it
  frees what it holds for the room. A request is loaded remotely at most once: after
  preemption or a failed load it computes locally.

Tensor parallelism: both halves plan per request, not per rank; every rank's worker half gets
the same plan and runs its own KV manager over its own cache. A prefill room is finished once
every prefill rank reported it, a decode receive once every decode rank did (the executor merges
the ranks' reports), and the ranks of each side pair up by heads.py, so prefill and decode may
run different TP sizes (one a multiple of the other) with no change here.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import msgspec

from sluice import stage_trace
from sluice.config import KVTransferConfig
from sluice.core.kv_connector import KVCacheSpec, KVConnectorScheduler, SchedulerView
from sluice.core.outputs import FirstToken, KVConnectorOutput, PositionLogprobs, SchedulerOutput
from sluice.core.request import RequestStatus
from sluice.kv_transfer.disagg import params as pd_params
from sluice.kv_transfer.disagg.config import PDConfig
from sluice.kv_transfer.disagg.faults import Faults
from sluice.worker.kv_connector import KVConnectorWorker

if TYPE_CHECKING:
    import torch

    from sluice.attention.kv_layout import KVCacheAllocator
    from sluice.core.request import Request
    from sluice.kv_transfer.disagg.manager import KVManager
    from sluice.kv_transfer.disagg.shm import SharedKVArena

logger = logging.getLogger("sluice")


class SendPlan(msgspec.Struct):
    req_id: str
    room: int
    block_ids: list[int]  # every block of the finished request, in token order
    num_prompt_tokens: int
    first_token: int
    first_logprobs: PositionLogprobs | None = None


class RecvPlan(msgspec.Struct):
    req_id: str
    room: int
    bootstrap_host: str
    bootstrap_port: int
    block_ids: list[int]  # ours, for the prompt's blocks [first_block, ...)
    first_block: int
    num_prompt_tokens: int


class AbortPlan(msgspec.Struct):
    req_id: str
    room: int
    reason: str
    # Decode, for a request that never started its receive: the prefill (its bootstrap
    # server, "host:port") to tell, so it frees the blocks it holds for the room.
    prefill: str | None = None


class LayerSendPlan(msgspec.Struct):
    """Prefill, layer-wise: a request whose prompt computes this step. Each layer's blocks
    [0, len(block_ids)) go to the room's decode ranks that have asked, as that layer is
    stored (what an earlier step sent is skipped); afterwards the first `num_complete_blocks`
    hold their final KV."""

    room: int
    block_ids: list[int]  # the prompt's blocks up to this step's last token, in token order
    num_complete_blocks: int
    num_prompt_tokens: int


class HeldRequest(msgspec.Struct):
    """Prefill: a request held until its decode asks for the room (the bootstrap queue)."""

    req_id: str
    room: int


class PDMetadata(msgspec.Struct):
    sends: list[SendPlan] = msgspec.field(default_factory=list)
    held: list[HeldRequest] = msgspec.field(default_factory=list)
    layer_sends: list[LayerSendPlan] = msgspec.field(default_factory=list)
    recvs: list[RecvPlan] = msgspec.field(default_factory=list)
    aborts: list[AbortPlan] = msgspec.field(default_factory=list)


_SEND_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class PDConnectorScheduler(KVConnectorScheduler):
    metadata_type = PDMetadata

    def __init__(self, config: KVTransferConfig, kv_cache_spec: KVCacheSpec) -> None:
        super().__init__(config, kv_cache_spec)
        self.pd = PDConfig.from_kv_transfer_config(config)
        self.is_prefill = self.pd.role == "prefill"
        self.bootstrap_server = None
        if self.is_prefill:
            from sluice.kv_transfer.disagg.bootstrap import BootstrapServer

            self.bootstrap_server = BootstrapServer(self.pd.host, self.pd.bootstrap_port,
                                                    kv_cache_spec.tp_size)
        self._plan = PDMetadata()
        self._first_tokens: dict[str, FirstToken] = {}  # prefill: sampled, not yet finished
        self._in_flight: dict[str, int] = {}  # req_id -> room (a send or a receive)
        self._attempted: set[str] = set()  # decode: requests that had their remote load
        # Prefill, the bootstrap queue: held requests (-> room, monotonic deadline), and
        # those that may go (their decode asked, or the wait ran out).
        self._held: dict[str, tuple[int, float]] = {}
        self._released: set[str] = set()
        self._stats: dict[str, float] = {}

    def _count(self, name: str, value: float = 1) -> None:
        self._stats[name] = self._stats.get(name, 0.0) + value

    # ---- decode ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.is_prefill:
            return (None if self._holds(request, num_computed_tokens) else 0), False
        if request.request_id in self._attempted:
            return 0, False
        remote = pd_params.parse_or_none(request.kv_transfer_params)
        if not isinstance(remote, pd_params.RemotePrefill) or request.num_output_tokens:
            return 0, False
        return request.num_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        remote = pd_params.parse_or_none(request.kv_transfer_params)
        assert isinstance(remote, pd_params.RemotePrefill)
        stage_trace.mark("d_alloc")
        block_size = self.kv_cache_spec.block_size
        first_block = (request.num_computed_tokens - num_external_tokens) // block_size
        num_prompt_blocks = -(-request.num_prompt_tokens // block_size)
        self._attempted.add(request.request_id)
        self._in_flight[request.request_id] = remote.room
        self._plan.recvs.append(RecvPlan(
            req_id=request.request_id, room=remote.room, bootstrap_host=remote.host,
            bootstrap_port=remote.port, block_ids=block_ids[first_block:num_prompt_blocks],
            first_block=first_block, num_prompt_tokens=request.num_prompt_tokens))
        self._count("recv_rooms")
        self._count("local_hit_blocks", first_block)
        self._count("requested_blocks", num_prompt_blocks - first_block)

    # ---- prefill ---------------------------------------------------------------------------

    def _holds(self, request: Request, num_cached_tokens: int) -> bool:
        """Whether the bootstrap queue holds the request this step (see the module
        docstring): not one whose prompt past its prefix-cache hit is shorter than
        bootstrap_wait_min_tokens."""
        req_id = request.request_id
        if (req_id in self._released or not self.pd.layerwise or self.pd.bootstrap_wait_s <= 0
                or request.num_output_tokens or request.num_prompt_tokens - num_cached_tokens
                < self.pd.bootstrap_wait_min_tokens):
            return False
        now = time.monotonic()
        held = self._held.get(req_id)
        if held is None:
            remote = pd_params.parse_or_none(request.kv_transfer_params)
            if not isinstance(remote, pd_params.RemoteDecode):
                return False
            self._held[req_id] = (remote.room, now + self.pd.bootstrap_wait_s)
            self._count("bootstrap_held")
            return True
        if now < held[1]:
            return True
        self._release(req_id)
        self._count("bootstrap_wait_expired")
        return False

    def _release(self, req_id: str) -> None:
        if self._held.pop(req_id, None) is not None:
            self._released.add(req_id)

    def num_held(self) -> int:
        return len(self._held)

    def has_plans(self) -> bool:
        plan = self._plan
        return bool(plan.sends or plan.recvs or plan.aborts)

    def update_request_output(self, request: Request, new_token_ids: list[int],
                              new_logprobs: list[PositionLogprobs] | None) -> None:
        if (self.is_prefill and new_token_ids and request.request_id not in self._first_tokens
                and request.num_output_tokens == len(new_token_ids)):
            self._first_tokens[request.request_id] = FirstToken(
                token_id=new_token_ids[0], logprobs=new_logprobs[0] if new_logprobs else None)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        first_token = self._first_tokens.pop(req_id, None)
        stage_trace.mark("finished", str(self.is_prefill))
        self._held.pop(req_id, None)
        self._released.discard(req_id)
        if not self.is_prefill:
            room = self._in_flight.pop(req_id, None)
            attempted = req_id in self._attempted
            self._attempted.discard(req_id)
            # Only an aborted (or failed) request ends mid-load: stop the room.
            if room is not None and request.status not in _SEND_STATUSES:
                self._plan.aborts.append(AbortPlan(req_id, room, request.status.name.lower()))
            elif not attempted:
                # Ended before its receive began (aborted while queued, or computed here):
                # the prefill may be holding the room's blocks for us. Held until the worker
                # has the notice (the engine steps until then).
                remote = pd_params.parse_or_none(request.kv_transfer_params)
                if isinstance(remote, pd_params.RemotePrefill):
                    self._plan.aborts.append(AbortPlan(
                        req_id, remote.room, f"{request.status.name.lower()} before its "
                        "receive began", prefill=remote.bootstrap_address))
                    return True, None
            return False, None
        remote = pd_params.parse_or_none(request.kv_transfer_params)
        if not isinstance(remote, pd_params.RemoteDecode):
            return False, None
        if first_token is None or request.status not in _SEND_STATUSES:
            # Held until the worker has the abort (the engine steps until then), so a decode
            # that asks for the room later is told at once.
            self._plan.aborts.append(AbortPlan(req_id, remote.room,
                                               request.status.name.lower()))
            self._count("send_aborts")
            return True, None
        self._in_flight[req_id] = remote.room
        self._plan.sends.append(SendPlan(
            req_id=req_id, room=remote.room, block_ids=list(block_ids),
            num_prompt_tokens=request.num_prompt_tokens, first_token=first_token.token_id,
            first_logprobs=first_token.logprobs))
        self._count("send_rooms")
        return True, {"bootstrap_room": remote.room, "first_token_id": first_token.token_id}

    # ---- every step ------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput,
                             scheduler: SchedulerView) -> PDMetadata:
        plan, self._plan = self._plan, PDMetadata()
        if self.is_prefill and self.pd.layerwise:
            plan.layer_sends = self._layer_sends(scheduler_output, scheduler)
            plan.held = [HeldRequest(req_id, room) for req_id, (room, _) in self._held.items()]
        return plan

    def _layer_sends(self, scheduler_output: SchedulerOutput,
                     scheduler: SchedulerView) -> list[LayerSendPlan]:
        """The step's prompt chunks of requests a decode continues (before the step: the
        requests' num_computed_tokens are those of earlier steps)."""
        block_size = self.kv_cache_spec.block_size
        sends = []
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            num_prompt = request.num_prompt_tokens
            if request.num_computed_tokens >= num_prompt:
                continue
            remote = pd_params.parse_or_none(request.kv_transfer_params)
            if not isinstance(remote, pd_params.RemoteDecode):
                continue
            end = min(request.num_computed_tokens + num_new, num_prompt)
            num_blocks = -(-end // block_size)
            sends.append(LayerSendPlan(
                room=remote.room, block_ids=scheduler.get_block_ids(req_id)[:num_blocks],
                num_complete_blocks=num_blocks if end == num_prompt else end // block_size,
                num_prompt_tokens=num_prompt))
        return sends

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_recving | output.finished_sending:
            self._in_flight.pop(req_id, None)
        for req_id in output.ready_requests:
            stage_trace.mark("p_ready")
            self._release(req_id)
        for name, value in output.stats.items():
            self._count(f"worker_{name}", value)

    def get_stats(self) -> dict[str, float]:
        stats = dict(self._stats)
        stats["rooms_in_flight"] = len(self._in_flight)
        stats["bootstrap_holding"] = len(self._held)
        if self.bootstrap_server is not None:
            stats["bootstrap_port"] = self.bootstrap_server.port
            stats["registered_ranks"] = self.bootstrap_server.num_registered()
        return stats

    def check_integrity(self) -> None:
        """Nothing planned is forgotten: with no request left, no room is in flight."""
        assert not self._plan.sends and not self._plan.recvs, "a planned transfer never went out"

    def shutdown(self) -> None:
        if self.bootstrap_server is not None:
            self.bootstrap_server.shutdown()
            self.bootstrap_server = None


class PDConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, kv_cache_spec: KVCacheSpec) -> None:
        super().__init__(config, kv_cache_spec)
        self.pd = PDConfig.from_kv_transfer_config(config)
        self.faults = Faults.from_environ(os.environ)
        if self.faults.active:
            logger.warning("PD fault injection on: %s", self.faults)
        self.manager: KVManager | None = None
        self._invalid: set[int] = set()
        self._first_tokens: dict[str, FirstToken] = {}
        self._errors: dict[str, str] = {}
        self._ready: set[str] = set()  # held requests whose decode asked (this step)
        self._acknowledged: set[str] = set()  # requests whose abort plan the manager has
        self._arena: SharedKVArena | None = None

    def kv_cache_allocator(self) -> KVCacheAllocator | None:
        """A decode rank that may pair over shm places its (CPU) cache in shared memory, for
        a prefill on this host to write into (shm.py); a GPU cache is allocated as usual."""
        from sluice.kv_transfer.disagg.shm import SharedKVArena, shm_unavailable

        if self.pd.role != "decode" or self.pd.transfer_backend not in ("shm", "auto"):
            return None
        if self.pd.transfer_backend == "auto" and shm_unavailable() is not None:
            return None
        spec = self.kv_cache_spec
        self._arena = SharedKVArena(f"sluice-kv-{os.getpid()}-tp{spec.tp_rank}")
        return self._arena.allocate

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.pd.role == "prefill":
            from sluice.kv_transfer.disagg.sender import PrefillKVManager as Manager
        else:
            from sluice.kv_transfer.disagg.receiver import DecodeKVManager as Manager
        self.manager = Manager(self.pd, self.kv_cache_spec, kv_caches, self.faults,
                               arena=self._arena)
        self.manager.start()
        self.cuda = next(iter(kv_caches.values())).is_cuda
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}

    def start_load_kv(self) -> None:
        meta: PDMetadata | None = self._metadata
        if meta is None or self.manager is None:
            return
        ready_event = None
        if meta.sends and self.cuda:
            import torch

            # The sends read blocks the compute stream wrote: the transfer waits for this.
            ready_event = torch.cuda.Event()
            ready_event.record()
        manager = self.manager
        for send in meta.sends:
            manager.sender(send.room).send(send.req_id, send.block_ids, send.num_prompt_tokens,
                                           send.first_token, send.first_logprobs, ready_event)
        if meta.layer_sends:
            manager.begin_layer_sends(meta.layer_sends)
        if meta.held:
            asked = manager.asked_rooms([held.room for held in meta.held])
            self._ready = {held.req_id for held in meta.held if held.room in asked}
        for recv in meta.recvs:
            manager.receiver(recv.room).init(
                recv.req_id, f"{recv.bootstrap_host}:{recv.bootstrap_port}", recv.block_ids,
                recv.first_block, recv.num_prompt_tokens)
        for abort in meta.aborts:
            self._acknowledged.add(abort.req_id)
            if abort.prefill is not None:
                manager.notify_abort(abort.prefill, abort.room, abort.reason)
            else:
                manager.abort_room(abort.room, abort.reason)

    def has_saves(self) -> bool:
        meta: PDMetadata | None = self._metadata
        return meta is not None and bool(meta.layer_sends)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: Any) -> None:
        """Prefill, layer-wise: this layer's blocks of the step go out now (sender.py)."""
        layer = self._layer_index.get(layer_name)
        if layer is None or not self.has_saves() or self.manager is None:
            return  # (not one of the registered caches)
        stored = None
        if self.cuda:
            import torch

            # On the stream that stored the layer (the compute stream, or the bridge stream
            # after a graph replay): the write waits for this, not for the whole step.
            stored = torch.cuda.Event()
            stored.record()
        self.manager.send_layer(layer, stored)

    def wait_for_save(self) -> None:
        """The step's layer writes read blocks a later step may overwrite (a preempted or
        aborted request's, reused): the step ends once they are done."""
        if self.has_saves() and self.manager is not None:
            self.manager.wait_layer_sends()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(sends that ended and abort plans taken over: their delayed frees may happen,
        receives that ended)."""
        if self.manager is None:
            return set(), set()
        acknowledged, self._acknowledged = self._acknowledged, set()
        done = set()
        for finished in self.manager.take_finished():
            done.add(finished.req_id)
            if finished.ok and finished.first_token is not None:
                self._first_tokens[finished.req_id] = FirstToken(finished.first_token,
                                                                 finished.first_logprobs)
            self._invalid.update(finished.failed_block_ids)
            if not finished.ok and finished.error and self.pd.role == "decode":
                self._errors[finished.req_id] = f"PD transfer failed: {finished.error}"
        if self.pd.role == "prefill":
            return done | acknowledged, set()
        return acknowledged, done

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def get_first_tokens(self) -> dict[str, FirstToken]:
        tokens, self._first_tokens = self._first_tokens, {}
        return tokens

    def get_load_errors(self) -> dict[str, str]:
        errors, self._errors = self._errors, {}
        return errors

    def get_ready_requests(self) -> set[str]:
        ready, self._ready = self._ready, set()
        return ready

    def get_stats(self) -> dict[str, float]:
        return self.manager.take_stats() if self.manager is not None else {}

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown()
            self.manager = None


class PDConnector:
    """Prefill/decode disaggregation (see the module docstring)."""

    Scheduler = PDConnectorScheduler
    Worker = PDConnectorWorker
