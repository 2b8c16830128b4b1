"""A worker process of the multiprocess executor: one rank's Worker behind two sockets.

Started as `python -m sluice.executor.worker_proc JSON` (addresses, rank, parent pid). It
connects, reads its Startup (the EngineConfig), loads the model and says WorkerReady, then
serves requests in order. Steps are launched as soon as they arrive and answered as soon as
their tokens are on the host: while a step is in flight the loop alternates between the socket
(so the next step, sent by an engine core that schedules ahead, is launched behind it on the
device) and the step's completion; it spins rather than sleeps there, since a decode step takes
about a millisecond. Any exception ends the process after a WorkerFailed frame; it exits quietly
when the engine's process is gone. SIGINT is ignored: the executor decides when to stop.

At tensor_parallel_size > 1 the worker first joins its tensor-parallel group (the executor's
store port comes in Startup). A rank may then block inside a collective, where the loop cannot
look at its parent: a watchdog thread ends the process as soon as the engine's process is gone,
the group's timeout bounds a collective whose peers are alive but stuck, and a collective whose
peer died fails at once (gloo) or is ended by the executor, which stops every rank once one is
gone.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from typing import Any

import torch
import zmq

from sluice.channel import Encoder, MessageDecoder
from sluice.distributed.tp import SINGLE_RANK, destroy_tp_group, init_tp_group
from sluice.executor.messages import (
    DetermineNumBlocks,
    ExecuteModel,
    InitializeKVCache,
    KVCacheReady,
    NumBlocks,
    ProfileReady,
    ProfileStarted,
    Shutdown,
    StartProfile,
    Startup,
    StepResult,
    StopProfile,
    WorkerFailed,
    WorkerReady,
    worker_request_decoder,
)
from sluice.process_utils import parent_alive
from sluice.worker.step_handle import StepHandle
from sluice.worker.worker import Worker

logger = logging.getLogger("sluice")

# While idle, how often (ms) to look up from the socket to check the parent is alive.
_IDLE_POLL_MS = 500
_CLOSE_LINGER_MS = 2000


class WorkerProc:
    def __init__(self, request_socket: zmq.Socket, reply_socket: zmq.Socket,
                 parent_pid: int) -> None:
        self.request_socket = request_socket
        self.reply_socket = reply_socket
        self.parent_pid = parent_pid
        self.encoder = Encoder()
        self.rank = -1
        self.worker: Worker | None = None
        self.in_flight: deque[tuple[int, StepHandle]] = deque()

    def start(self) -> bool:
        """Wait for the Startup frame, build the worker, say ready; False if the parent went
        away first."""
        from sluice.kv_transfer.factory import metadata_type, worker_connector_factory

        while not self.request_socket.poll(_IDLE_POLL_MS):
            if not parent_alive(self.parent_pid):
                return False
        startup = MessageDecoder(Startup, "worker startup", "the executor and its workers"
                                 ).decode(self.request_socket.recv())
        self.rank = startup.rank
        config = startup.config
        _share_cpus(config.model_config.device, startup.world_size)
        device = torch.device("cpu")
        if config.model_config.device.startswith("cuda") or (
                config.model_config.device == "auto" and torch.cuda.is_available()):
            torch.cuda.set_device(self.rank % max(1, torch.cuda.device_count()))
            device = torch.device("cuda", torch.cuda.current_device())
        self.decoder = worker_request_decoder(metadata_type(config.kv_transfer_config))
        tp = SINGLE_RANK
        if startup.tp_store_port:
            tp = init_tp_group(
                self.rank, startup.world_size, startup.tp_store_port, device,
                expert_parallel=config.parallel_config.enable_expert_parallel)
        self.worker = Worker(config, rank=self.rank,
                             connector_factory=worker_connector_factory(config), tp=tp)
        self._reply(WorkerReady(rank=self.rank, pid=os.getpid()))
        return True

    def run(self) -> None:
        """Serve until Shutdown or the parent is gone."""
        while True:
            if self.in_flight:
                if self.request_socket.poll(0):
                    if not self._handle(self.decoder.decode(self.request_socket.recv())):
                        return
                elif self.in_flight[0][1].is_ready():
                    self._send_oldest_result()
                continue
            if not self.request_socket.poll(_IDLE_POLL_MS):
                if not parent_alive(self.parent_pid):
                    return
                continue
            if not self._handle(self.decoder.decode(self.request_socket.recv())):
                return

    def _handle(self, message: Any) -> bool:
        """Returns False on Shutdown."""
        worker = self.worker
        if isinstance(message, ExecuteModel):
            self.in_flight.append((message.step_id,
                                   worker.execute_model(message.scheduler_output)))
        elif isinstance(message, DetermineNumBlocks):
            self._reply(NumBlocks(rank=self.rank, num_blocks=worker.determine_num_blocks()))
        elif isinstance(message, InitializeKVCache):
            spec = worker.initialize_kv_cache(message.num_blocks)
            self._reply(KVCacheReady(rank=self.rank, kv_cache_spec=spec))
        elif isinstance(message, StartProfile):
            worker.start_profile()
            self._reply(ProfileStarted(rank=self.rank))
        elif isinstance(message, StopProfile):
            self._reply(ProfileReady(rank=self.rank, summary=worker.stop_profile()))
        elif isinstance(message, Shutdown):
            while self.in_flight:
                self._send_oldest_result()
            worker.shutdown()
            return False
        else:
            raise AssertionError(f"unhandled message {type(message).__name__}")
        return True

    def _send_oldest_result(self) -> None:
        step_id, handle = self.in_flight.popleft()
        self._reply(StepResult(rank=self.rank, step_id=step_id, output=handle.result()))

    def _reply(self, message: object) -> None:
        self.reply_socket.send(self.encoder.encode(message), copy=False)


def _share_cpus(device: str, world_size: int) -> None:
    """On the CPU, ranks share the cores (one left to the engine core and front end)."""
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return
    num_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    torch.set_num_threads(max(1, (num_cpus - 1) // world_size))


def _exit_when_parent_is_gone(parent_pid: int) -> None:
    """Runs in a daemon thread: the main thread may be blocked in a collective."""
    while parent_alive(parent_pid):
        time.sleep(_IDLE_POLL_MS / 1000)
    os._exit(0)


def run_worker(request_address: str, reply_address: str, rank: int, parent_pid: int,
               log_level: int) -> None:
    """The process's entry point. Exits 0 on Shutdown or when the parent is gone, 1 on an
    error (after telling the executor)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_parent_is_gone, args=(parent_pid,), daemon=True,
                     name="parent-watchdog").start()
    logging.basicConfig(format=f"%(asctime)s %(levelname)s [worker {rank}] %(message)s")
    logger.setLevel(log_level)
    context = zmq.Context()
    request_socket = context.socket(zmq.PULL)
    reply_socket = context.socket(zmq.PUSH)
    reply_socket.setsockopt(zmq.SNDHWM, 0)
    request_socket.connect(request_address)
    reply_socket.connect(reply_address)
    status = 0
    proc = WorkerProc(request_socket, reply_socket, parent_pid)
    try:
        if proc.start():
            proc.run()
    except BaseException as exc:
        status = 1
        logger.exception("worker rank %d died", rank)
        failed = WorkerFailed(rank=rank, error=f"{type(exc).__name__}: {exc}",
                              traceback="".join(traceback.format_exception(exc)))
        try:
            reply_socket.send(Encoder().encode(failed))
        except zmq.ZMQError:
            pass
    finally:
        request_socket.close(linger=0)
        reply_socket.close(linger=_CLOSE_LINGER_MS)
        context.term()
        if status == 0:
            destroy_tp_group()
    sys.exit(status)


if __name__ == "__main__":
    run_worker(**json.loads(sys.argv[1]))
