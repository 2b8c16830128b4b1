"""The engine core in its own process, driven over ZMQ by AsyncLLM.

The front end starts it (sluice.engine.core_client: `launch_engine_core`, or
`launch_shared_engine_core` for several front ends, each attaching to it) in a child interpreter
(`python -m sluice.engine.core_proc JSON`), so CUDA can initialize here and nothing is pickled.
The core reads every front end's requests from one PULL socket and sends each front end the
outputs of its own requests (the client index in AddRequest), with the scheduler's state every
step or at least every _IDLE_CLIENT_STATS_S.
The process connects, builds the EngineCore from the engine arguments (a plain dict), sends
`Ready` (to every front end), then loops: take every waiting message (blocking in a short poll
only while it has no work), apply adds / aborts / finishes / utility calls, run one step, send
its outputs with the scheduler stats. A frame that does not decode is logged and dropped. Any
other exception ends the loop: the process sends `EngineDead` with the error and exits with
status 1. It exits quietly when its parent process is gone. SIGINT is ignored: the front end
(or the process that started it) decides when to stop.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

import torch
import zmq

from sluice import stage_trace
from sluice.channel import Encoder, WireError
from sluice.core.outputs import EngineCoreOutput, SpecDecodingStats
from sluice.core.request import RequestStatus
from sluice.engine import wakeup
from sluice.engine.arg_utils import EngineArgs
from sluice.engine.core import EngineCore
from sluice.engine.stats import SchedulerStats
from sluice.engine.wire import (
    AbortRequests,
    AddRequest,
    EngineCoreOutputs,
    EngineDead,
    FinishRequests,
    Ready,
    RequestDecoder,
    UtilityReply,
    UtilityRequest,
)
from sluice.process_utils import (
    parent_alive,
)
from sluice.worker.model_runner import resolve_device

logger = logging.getLogger("sluice")

# While idle, how often (ms) to look up from the input socket to check the parent is alive.
_IDLE_POLL_MS = 500
# With only KV transfers pending, how often (ms) to step so the workers can report them.
_TRANSFER_POLL_MS = 2
# How long (ms) a closing socket may keep trying to deliver the last frames (a dead notice).
_CLOSE_LINGER_MS = 2000
# With several front ends, one with no output in a step still gets the scheduler's state this
# often (s), for its /metrics gauges.
_IDLE_CLIENT_STATS_S = 0.1


def _leave_a_cpu_to_the_front_end(device: str) -> None:
    """On the CPU, torch's intra-op threads would take every core; the front end's
    detokenizing then preempts one of them and each step waits on that thread."""
    if resolve_device(device).type != "cpu":
        return
    if hasattr(os, "sched_getaffinity"):
        num_cpus = len(os.sched_getaffinity(0))
    else:
        num_cpus = os.cpu_count() or 1
    torch.set_num_threads(max(1, min(torch.get_num_threads(), num_cpus - 1)))


def make_scheduler_stats(engine_core: EngineCore) -> SchedulerStats:
    scheduler = engine_core.scheduler
    manager = engine_core.kv_cache_manager
    spec = scheduler.spec_decoding_stats or SpecDecodingStats()  # None: speculation off
    return SchedulerStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        kv_cache_usage=manager.usage,
        prefix_cache_queries=manager.prefix_cache_queries,
        prefix_cache_hits=manager.prefix_cache_hits,
        num_preemptions_total=scheduler.num_preemptions_total,
        num_free_blocks=manager.get_num_free_blocks(),
        num_blocks=manager.block_pool.num_blocks - 1,
        peak_blocks_in_use=manager.peak_blocks_in_use,
        peak_blocks_per_request=manager.peak_blocks_per_request,
        num_window_freed_blocks=manager.num_window_freed_blocks_total,
        spec_num_drafts=spec.num_drafts,
        spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
        spec_num_accepted_tokens_per_pos=tuple(spec.num_accepted_tokens_per_pos),
        spec_num_steps_drafting=spec.num_steps_drafting,
        spec_num_steps_off_batch_size=spec.num_steps_off_batch_size,
        spec_num_steps_off_acceptance=spec.num_steps_off_acceptance,
        num_scheduled_tokens_total=scheduler.num_scheduled_tokens_total,
        kv_connector=(scheduler.connector.get_stats() if scheduler.connector is not None
                      else {}),
    )


class EngineCoreProc:
    """The busy loop around one EngineCore, reading and writing the given sockets (one output
    socket per front end)."""

    def __init__(self, engine_args: EngineArgs, input_socket: zmq.Socket,
                 output_sockets: list[zmq.Socket], parent_pid: int) -> None:
        config = engine_args.create_engine_config()
        _leave_a_cpu_to_the_front_end(config.model_config.device)
        self.engine_core = EngineCore(config)
        self.scheduler_config = config.scheduler_config
        self.cache_config = config.cache_config
        self.input_socket = input_socket
        self.output_sockets = output_sockets
        # With several front ends: each request's (AddRequest.client), until it ends.
        self._client_of: dict[str, int] = {}
        self._last_sent = [0.0] * len(output_sockets)  # time.monotonic() of each client's
        self.parent_pid = parent_pid
        self.encoder = Encoder()
        self.decoder = RequestDecoder()
        self.poller = zmq.Poller()
        self.poller.register(input_socket, zmq.POLLIN)
        # A connector's thread wakes the loop out of its wait for input (wakeup.py).
        self.poller.register(wakeup.fd(), zmq.POLLIN)

    def send_ready(self) -> None:
        self._broadcast(Ready(
            num_blocks=self.engine_core.kv_cache_manager.block_pool.num_blocks - 1,
            block_size=self.cache_config.block_size,
            max_model_len=self.scheduler_config.max_model_len,
            pid=os.getpid(),
            worker_pids=getattr(self.engine_core.executor, "worker_pids", []),
        ))

    def run_busy_loop(self) -> None:
        """Returns when the parent process is gone; raises on any engine error."""
        core = self.engine_core
        while self._parent_alive():
            has_work = core.has_unfinished_requests()
            # Only KV transfers pending (nothing to compute, requests parked while their KV
            # loads): step, but do not spin.
            waiting_on_transfers = (has_work and core.in_flight is None
                                    and not core.scheduler.has_requests_to_schedule())
            changed = self._process_input(
                block=not has_work or waiting_on_transfers,
                timeout_ms=_TRANSFER_POLL_MS if has_work else _IDLE_POLL_MS)
            if not has_work:
                core.executor.check_health()  # a worker that died while idle ends us too
            if core.has_unfinished_requests():
                self._send_outputs(core.step(), changed)
            elif changed:
                # Idle after aborts or finishes: let the front end see the freed blocks.
                self._send_outputs([], changed)

    def _send_outputs(self, outputs: list[EngineCoreOutput], changed: bool) -> None:
        """A step's outputs, with the scheduler's state: to the one front end, or to each its
        own requests' (and the state to the others when requests came, went or finished, or
        at least every _IDLE_CLIENT_STATS_S)."""
        if stage_trace.ON and outputs:
            stage_trace.mark("core_out", str(sum(len(o.new_token_ids) for o in outputs)))
        stats = make_scheduler_stats(self.engine_core)
        now = time.time()
        if len(self.output_sockets) == 1:
            self._send(EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=now))
            return
        per_client: list[list[EngineCoreOutput]] = [[] for _ in self.output_sockets]
        for out in outputs:
            client = self._client_of.get(out.req_id, 0)
            if out.finish_reason is not None:
                self._client_of.pop(out.req_id, None)
                changed = True
            per_client[client].append(out)
        clock = time.monotonic()
        for client, its_outputs in enumerate(per_client):
            if its_outputs or changed or clock - self._last_sent[client] >= _IDLE_CLIENT_STATS_S:
                self._send(EngineCoreOutputs(outputs=its_outputs, scheduler_stats=stats,
                                             timestamp=now), client)
                self._last_sent[client] = clock

    def _process_input(self, block: bool, timeout_ms: int = 0) -> bool:
        """Apply every waiting message; with `block`, first wait up to `timeout_ms` for one.
        Returns whether requests were added or ended."""
        if block:
            ready = self.poller.poll(timeout_ms)
            wakeup.drain()
            if not ready:
                return False
        changed = False
        while True:
            try:
                frame = self.input_socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return changed
            try:
                message = self.decoder.decode(frame.buffer)
            except WireError as exc:
                logger.error("engine core dropped a frame: %s", exc)
                continue
            changed |= self._handle(message)

    def _handle(self, message: object) -> bool:
        core = self.engine_core
        if isinstance(message, (AddRequest, UtilityRequest)) and not (
                0 <= message.client < len(self.output_sockets)):
            # Only a misconfigured front end sends this, and it cannot be answered.
            logger.error("engine core dropped a %s from unknown client %d (%d clients)",
                         type(message).__name__, message.client, len(self.output_sockets))
            return False
        if isinstance(message, AddRequest):
            stage_trace.mark("core_add")
            request = message.request
            try:
                core.add_request(request)
            except ValueError as exc:
                # The front end validates first; never let one bad request stop the engine.
                logger.error("engine core rejected request %r: %s", request.request_id, exc)
                self._send(EngineCoreOutputs(
                    outputs=[EngineCoreOutput(req_id=request.request_id, new_token_ids=[],
                                              finish_reason="abort")],
                    scheduler_stats=make_scheduler_stats(core), timestamp=time.time()),
                    message.client)
                return False
            if len(self.output_sockets) > 1:
                self._client_of[request.request_id] = message.client
            return True
        if isinstance(message, AbortRequests):
            core.abort_requests(message.request_ids)
            self._forget(message.request_ids)
            return True
        if isinstance(message, FinishRequests):
            core.finish_requests(message.request_ids, RequestStatus.FINISHED_STOPPED)
            self._forget(message.request_ids)
            return True
        if isinstance(message, UtilityRequest):
            self._send(self._call_utility(message), message.client)
            return False
        raise AssertionError(f"unhandled message {type(message).__name__}")

    def _call_utility(self, call: UtilityRequest) -> UtilityReply:
        core = self.engine_core
        try:
            if call.name == "stats":
                result: Any = make_scheduler_stats(core)
            elif call.name == "reset_prefix_cache":
                result = core.kv_cache_manager.reset_prefix_cache()
            elif call.name == "check_integrity":
                core.kv_cache_manager.check_integrity()
                check_connector = getattr(core.scheduler.connector, "check_integrity", None)
                if check_connector is not None:
                    check_connector()
                result = True
            else:
                return UtilityReply(call_id=call.call_id,
                                    error=f"unknown utility {call.name!r}")
        except AssertionError as exc:
            return UtilityReply(call_id=call.call_id, error=f"{call.name} failed: {exc}")
        return UtilityReply(call_id=call.call_id, result=result)

    def _forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._client_of.pop(request_id, None)

    def _send(self, message: object, client: int = 0) -> None:
        self.output_sockets[client].send(self.encoder.encode(message), copy=False)

    def _broadcast(self, message: object) -> None:
        frame = self.encoder.encode(message)
        for socket in self.output_sockets:
            socket.send(frame, copy=True)

    def _parent_alive(self) -> bool:
        return parent_alive(self.parent_pid)


def run_engine_core(engine_args: dict[str, Any], input_addresses: list[str],
                    output_addresses: list[str], parent_pid: int, log_level: int) -> None:
    """The spawned process's entry point: one (input, output) address pair per front end.
    Exits 0 when the parent is gone, 1 on an error."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(format="%(asctime)s %(levelname)s [engine core] %(message)s")
    logger.setLevel(log_level)
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)  # fair-queued over every front end's
    for address in input_addresses:
        input_socket.connect(address)
    output_sockets = []
    for address in output_addresses:
        output_sockets.append(context.socket(zmq.PUSH))
        output_sockets[-1].setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader
        output_sockets[-1].connect(address)
    status = 0
    try:
        proc = EngineCoreProc(EngineArgs(**engine_args), input_socket, output_sockets,
                              parent_pid)
        proc.send_ready()
        proc.run_busy_loop()
    except BaseException as exc:  # report anything, even SystemExit, before going
        status = 1
        logger.exception("engine core died")
        dead = Encoder().encode(EngineDead(error=f"{type(exc).__name__}: {exc}",
                                           traceback="".join(traceback.format_exception(exc))))
        for socket in output_sockets:
            try:
                socket.send(dead)
            except zmq.ZMQError:
                pass
    finally:
        input_socket.close(linger=0)
        for socket in output_sockets:
            socket.close(linger=_CLOSE_LINGER_MS)
        context.term()
    sys.exit(status)


if __name__ == "__main__":
    run_engine_core(**json.loads(sys.argv[1]))
