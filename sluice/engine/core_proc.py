"""The engine core in its own process, driven over ZMQ by AsyncLLM.

Lifecycle: `launch_engine_core` (in the front end) binds two sockets, a PUSH for requests and a
PULL for outputs (ipc:// in a temp dir, or loopback TCP on a free port), and starts
`run_engine_core` in a child interpreter (`python -m sluice.engine.core_proc JSON`, see
sluice/process_utils.py), so CUDA can initialize there and nothing is pickled.
The process connects, builds the EngineCore from the engine arguments (a plain dict), sends
`Ready`, then loops: take every waiting message (blocking in a short poll only while it has no
work), apply adds / aborts / finishes / utility calls, run one step, send its outputs with the
scheduler stats. A frame that does not decode is logged and dropped. Any other exception ends
the loop: the process sends `EngineDead` with the error and exits with status 1. It exits
quietly when its parent process is gone. SIGINT is ignored: the front end decides when to stop.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from sluice.channel import Encoder, WireError
from sluice.core.outputs import EngineCoreOutput, SpecDecodingStats
from sluice.core.request import RequestStatus
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
    ResponseDecoder,
    UtilityReply,
    UtilityRequest,
)
from sluice.errors import EngineDeadError
from sluice.process_utils import ChildProcess, bind_local, parent_alive, spawn_module
from sluice.worker.model_runner import resolve_device

logger = logging.getLogger("sluice")

# While idle, how often (ms) to look up from the input socket to check the parent is alive.
_IDLE_POLL_MS = 500
# With only KV transfers pending, how often (ms) to step so the workers can report them.
_TRANSFER_POLL_MS = 2
# How long (ms) a closing socket may keep trying to deliver the last frames (a dead notice).
_CLOSE_LINGER_MS = 2000


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
    """The busy loop around one EngineCore, reading and writing the given sockets."""

    def __init__(self, engine_args: EngineArgs, input_socket: zmq.Socket,
                 output_socket: zmq.Socket, parent_pid: int) -> None:
        config = engine_args.create_engine_config()
        _leave_a_cpu_to_the_front_end(config.model_config.device)
        self.engine_core = EngineCore(config)
        self.scheduler_config = config.scheduler_config
        self.cache_config = config.cache_config
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.parent_pid = parent_pid
        self.encoder = Encoder()
        self.decoder = RequestDecoder()
        self.poller = zmq.Poller()
        self.poller.register(input_socket, zmq.POLLIN)

    def send_ready(self) -> None:
        self._send(Ready(
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
                outputs = core.step()
                self._send(EngineCoreOutputs(
                    outputs=outputs,
                    scheduler_stats=make_scheduler_stats(core),
                    timestamp=time.time(),
                ))
            elif changed:
                # Idle after aborts or finishes: let the front end see the freed blocks.
                self._send(EngineCoreOutputs(outputs=[],
                                             scheduler_stats=make_scheduler_stats(core),
                                             timestamp=time.time()))

    def _process_input(self, block: bool, timeout_ms: int = 0) -> bool:
        """Apply every waiting message; with `block`, first wait up to `timeout_ms` for one.
        Returns whether requests were added or ended."""
        if block and not self.poller.poll(timeout_ms):
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
        if isinstance(message, AddRequest):
            request = message.request
            try:
                core.add_request(request)
            except ValueError as exc:
                # The front end validates first; never let one bad request stop the engine.
                logger.error("engine core rejected request %r: %s", request.request_id, exc)
                self._send(EngineCoreOutputs(
                    outputs=[EngineCoreOutput(req_id=request.request_id, new_token_ids=[],
                                              finish_reason="abort")],
                    scheduler_stats=make_scheduler_stats(core), timestamp=time.time()))
                return False
            return True
        if isinstance(message, AbortRequests):
            core.abort_requests(message.request_ids)
            return True
        if isinstance(message, FinishRequests):
            core.finish_requests(message.request_ids, RequestStatus.FINISHED_STOPPED)
            return True
        if isinstance(message, UtilityRequest):
            self._send(self._call_utility(message))
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

    def _send(self, message: object) -> None:
        self.output_socket.send(self.encoder.encode(message), copy=False)

    def _parent_alive(self) -> bool:
        return parent_alive(self.parent_pid)


def run_engine_core(engine_args: dict[str, Any], input_address: str, output_address: str,
                    parent_pid: int, log_level: int) -> None:
    """The spawned process's entry point. Exits 0 when the parent is gone, 1 on an error."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(format="%(asctime)s %(levelname)s [engine core] %(message)s")
    logger.setLevel(log_level)
    context = zmq.Context()
    input_socket = context.socket(zmq.PULL)
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader
    input_socket.connect(input_address)
    output_socket.connect(output_address)
    status = 0
    try:
        proc = EngineCoreProc(EngineArgs(**engine_args), input_socket, output_socket,
                              parent_pid)
        proc.send_ready()
        proc.run_busy_loop()
    except BaseException as exc:  # report anything, even SystemExit, before going
        status = 1
        logger.exception("engine core died")
        dead = EngineDead(error=f"{type(exc).__name__}: {exc}",
                          traceback="".join(traceback.format_exception(exc)))
        try:
            output_socket.send(Encoder().encode(dead))
        except zmq.ZMQError:
            pass
    finally:
        input_socket.close(linger=0)
        output_socket.close(linger=_CLOSE_LINGER_MS)
        context.term()
    sys.exit(status)


# ---- the front end's side ------------------------------------------------------------------

@dataclass(slots=True)
class EngineCoreHandle:
    """The front end's hold on a started engine-core process and its two sockets."""

    process: ChildProcess
    context: zmq.Context
    input_socket: zmq.Socket  # PUSH, requests to the core; sends never block (no HWM)
    output_socket: zmq.Socket  # PULL, outputs from the core
    input_address: str
    output_address: str
    ipc_dir: str

    def wait_for_ready(self, timeout_s: float) -> Ready:
        """Block until the core says Ready; EngineDeadError if it dies or is too slow."""
        decoder = ResponseDecoder()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.output_socket.poll(200):
                message = decoder.decode(self.output_socket.recv())
                if isinstance(message, Ready):
                    return message
                if isinstance(message, EngineDead):
                    raise EngineDeadError(f"the engine core failed to start: {message.error}\n"
                                          f"{message.traceback}")
                logger.warning("engine core sent %s before ready", type(message).__name__)
            elif not self.process.is_alive():
                raise EngineDeadError(f"the engine core exited with status "
                                      f"{self.process.exitcode} while starting")
        raise EngineDeadError(f"the engine core was not ready after {timeout_s} s")

    def release(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL) and free the sockets and the temp dir.
        Must not reference the AsyncLLM: it also runs as its weakref finalizer."""
        self.process.stop()
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.context.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def launch_engine_core(core_args: dict[str, Any], log_level: int) -> EngineCoreHandle:
    """Bind the sockets and start the engine-core process (it is not ready yet)."""
    ipc_dir = tempfile.mkdtemp(prefix="sluice-")
    context = zmq.Context()
    input_socket = context.socket(zmq.PUSH)
    input_socket.setsockopt(zmq.SNDHWM, 0)
    output_socket = context.socket(zmq.PULL)
    output_socket.setsockopt(zmq.RCVHWM, 0)
    input_address = bind_local(input_socket, f"{ipc_dir}/input")
    output_address = bind_local(output_socket, f"{ipc_dir}/output")
    startup = json.dumps({"engine_args": core_args, "input_address": input_address,
                          "output_address": output_address, "parent_pid": os.getpid(),
                          "log_level": log_level})
    try:
        process = spawn_module("sluice.engine.core_proc", startup)
    except BaseException:
        input_socket.close(linger=0)
        output_socket.close(linger=0)
        context.term()
        shutil.rmtree(ipc_dir, ignore_errors=True)
        raise
    return EngineCoreHandle(process, context, input_socket, output_socket,
                            input_address, output_address, ipc_dir)


if __name__ == "__main__":
    run_engine_core(**json.loads(sys.argv[1]))
