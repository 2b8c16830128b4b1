"""The executor of one worker process per rank.

Lifecycle: bind one PUSH socket per rank (the executor's requests) and one PULL socket for every
rank's replies (ipc:// in a temp dir), start `python -m sluice.executor.worker_proc JSON` per
rank, send each its Startup (the EngineConfig, its rank), and wait until every rank is ready.
Each step's SchedulerOutput is encoded once and sent to every rank; every rank answers with a
StepResult in step order. Rank 0's sampled tokens are the step's tokens; the connector reports
are merged across ranks (a request's send or load is finished only once every rank reported it).

Tensor parallelism (world_size == tensor_parallel_size > 1): the executor hosts a TCPStore on a
loopback port the OS picks and sends its port in every Startup; the ranks make their process
group there (sluice.distributed.tp). Every rank samples the step's tokens itself, from the same
gathered logits with the same seeds; the executor checks each step that the ranks agree (a rank
that drifted would feed the next step other tokens) and fails the engine if they do not.

Faults: while waiting for replies the executor looks at its workers every 100 ms; a worker that
exited, or said WorkerFailed, makes the wait raise EngineDeadError naming the rank and why, well
within 5 s, and stops every other rank at once (at TP > 1 they may be blocked in a collective
with the dead one). A rank that fails right after a peer died (its collective broke) is not the
cause: the error names the rank that died first. Workers exit on their own when this process goes
away. `shutdown` asks the workers to stop, then terminates and kills the stragglers.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass

import zmq

from sluice.channel import Encoder
from sluice.config import EngineConfig
from sluice.core.kv_connector import KVCacheSpec
from sluice.core.outputs import (
    FirstToken,
    KVConnectorOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from sluice.distributed.tp import host_store
from sluice.errors import EngineDeadError
from sluice.executor.base import Executor
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
    worker_reply_decoder,
)
from sluice.process_utils import ChildProcess, bind_local, spawn_module
from sluice.worker.profiler import ProfileSummary

logger = logging.getLogger("sluice")

# How often (ms) a wait for replies looks at the worker processes.
_LIVENESS_POLL_MS = 100
_SHUTDOWN_GRACE_S = 5.0
# After a WorkerFailed, how long to look for a peer that exited first (the failure's cause).
_PEER_EXIT_GRACE_S = 0.5


@dataclass
class _Workers:
    """The processes and sockets; also the finalizer's state, so it must not reference the
    executor."""

    context: zmq.Context
    request_sockets: list[zmq.Socket]
    reply_socket: zmq.Socket
    processes: list[ChildProcess]
    ipc_dir: str
    # The tensor-parallel ranks' rendezvous (a torch.distributed.TCPStore), kept for the
    # group's lifetime; None without tensor parallelism.
    tp_store: object | None = None

    def terminate(self) -> None:
        """SIGTERM to every live worker, without waiting (release reaps them)."""
        for process in self.processes:
            if process.is_alive():
                process.terminate()

    def release(self) -> None:
        for process in self.processes:
            process.stop(_SHUTDOWN_GRACE_S)
        for socket in self.request_sockets:
            socket.close(linger=0)
        self.reply_socket.close(linger=0)
        self.context.term()
        self.tp_store = None
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


class _MultiprocStep:
    def __init__(self, executor: MultiprocExecutor, step_id: int) -> None:
        self._executor = executor
        self._step_id = step_id
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._executor._wait_for_step(self._step_id)
        return self._output

    def take_connector_output(self) -> None:
        return None  # the workers' reports come with the step's result


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, world_size: int | None = None,
                 ready_timeout_s: float = 600.0) -> None:
        """`world_size`: worker processes (default: the tensor-parallel size); more than the
        model's ranks runs replicas, each computing the whole step (tests use it)."""
        super().__init__(config)
        tp_size = config.parallel_config.tensor_parallel_size
        self.world_size = world_size or config.parallel_config.world_size
        if tp_size > 1 and self.world_size != tp_size:
            raise ValueError(f"world_size ({self.world_size}) must equal tensor_parallel_size "
                             f"({tp_size}): replica ranks run only whole models")
        self._encoder = Encoder()
        self._decoder = worker_reply_decoder()
        self._next_step_id = 0
        self._profiling = False
        self._results: dict[int, dict[int, ModelRunnerOutput]] = defaultdict(dict)
        # req_id -> ranks that reported it so far (finished sending / receiving).
        self._sending_reports: dict[str, int] = defaultdict(int)
        self._recving_reports: dict[str, int] = defaultdict(int)
        # First tokens of loads not yet finished on every rank (handed on with the load's end).
        self._first_tokens: dict[str, FirstToken] = {}
        self._dead_error: str | None = None
        self._workers = self._start_workers()
        self._finalizer = weakref.finalize(self, self._workers.release)
        try:
            store_port = 0
            if tp_size > 1:
                self._workers.tp_store = host_store(self.world_size)
                store_port = self._workers.tp_store.port
            for rank in range(self.world_size):
                self._send(rank, Startup(config=config, rank=rank, world_size=self.world_size,
                                         tp_store_port=store_port))
            self._gather(WorkerReady, ready_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self) -> _Workers:
        ipc_dir = tempfile.mkdtemp(prefix="sluice-workers-")
        context = zmq.Context()
        reply_socket = context.socket(zmq.PULL)
        reply_socket.setsockopt(zmq.RCVHWM, 0)
        reply_address = bind_local(reply_socket, f"{ipc_dir}/replies")
        workers = _Workers(context, [], reply_socket, [], ipc_dir)
        try:
            for rank in range(self.world_size):
                socket = context.socket(zmq.PUSH)
                socket.setsockopt(zmq.SNDHWM, 0)
                workers.request_sockets.append(socket)
                request_address = bind_local(socket, f"{ipc_dir}/rank{rank}")
                startup = json.dumps({
                    "request_address": request_address, "reply_address": reply_address,
                    "rank": rank, "parent_pid": os.getpid(),
                    "log_level": logging.getLogger("sluice").getEffectiveLevel()})
                workers.processes.append(spawn_module("sluice.executor.worker_proc", startup))
        except BaseException:
            workers.release()
            raise
        return workers

    @property
    def worker_pids(self) -> list[int]:
        return [process.pid for process in self._workers.processes]

    def determine_num_blocks(self) -> int:
        self._broadcast(DetermineNumBlocks())
        replies = self._gather(NumBlocks)
        return min(reply.num_blocks for reply in replies)

    def initialize_kv_cache(self, num_blocks: int) -> KVCacheSpec:
        self._broadcast(InitializeKVCache(num_blocks=num_blocks))
        replies = self._gather(KVCacheReady)
        self.kv_cache_spec = replies[0].kv_cache_spec
        return self.kv_cache_spec

    def execute_model(self, scheduler_output: SchedulerOutput) -> _MultiprocStep:
        step_id = self._next_step_id
        self._next_step_id += 1
        self._broadcast(ExecuteModel(step_id=step_id, scheduler_output=scheduler_output))
        return _MultiprocStep(self, step_id)

    def start_profile(self) -> None:
        if self._profiling:
            raise RuntimeError("a profile is already running (stop_profile first)")
        self._broadcast(StartProfile())
        self._gather(ProfileStarted)
        self._profiling = True

    def stop_profile(self) -> list[ProfileSummary]:
        if not self._profiling:
            raise RuntimeError("no profile is running (start_profile first)")
        self._profiling = False
        self._broadcast(StopProfile())
        return [reply.summary for reply in self._gather(ProfileReady)]

    def check_health(self) -> None:
        self._raise_if_dead()
        for rank, process in enumerate(self._workers.processes):
            if not process.is_alive():
                self._dead(f"worker rank {rank} (pid {process.pid}) exited with status "
                           f"{process.exitcode}")

    def shutdown(self) -> None:
        if not self._finalizer.alive:
            return
        if self._dead_error is None:
            try:
                self._broadcast(Shutdown())
                deadline = time.monotonic() + _SHUTDOWN_GRACE_S
                for process in self._workers.processes:
                    process.join(max(0.0, deadline - time.monotonic()))
            except EngineDeadError:
                pass
        self._finalizer()

    # ---- internals -----------------------------------------------------------------------

    def _send(self, rank: int, message: object) -> None:
        self._workers.request_sockets[rank].send(self._encoder.encode(message), copy=False)

    def _broadcast(self, message: object) -> None:
        self._raise_if_dead()
        frame = self._encoder.encode(message)
        for socket in self._workers.request_sockets:
            socket.send(frame, copy=False)

    def _gather(self, reply_type: type, timeout_s: float | None = None) -> list:
        """One reply of `reply_type` from every rank, in rank order."""
        replies: dict[int, object] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(replies) < self.world_size:
            message = self._receive(deadline, f"waiting for {reply_type.__name__}")
            if isinstance(message, reply_type):
                replies[message.rank] = message
            elif isinstance(message, StepResult):
                self._results[message.step_id][message.rank] = message.output
            else:
                logger.warning("executor ignored an unexpected %s", type(message).__name__)
        return [replies[rank] for rank in range(self.world_size)]

    def _wait_for_step(self, step_id: int) -> ModelRunnerOutput:
        results = self._results[step_id]
        while len(results) < self.world_size:
            message = self._receive(None, f"waiting for step {step_id}")
            if isinstance(message, StepResult):
                self._results[message.step_id][message.rank] = message.output
            else:
                logger.warning("executor ignored an unexpected %s", type(message).__name__)
        del self._results[step_id]
        return self._merge([results[rank] for rank in range(self.world_size)])

    def _receive(self, deadline: float | None, doing: str) -> object:
        socket = self._workers.reply_socket
        while True:
            self._raise_if_dead()
            if socket.poll(_LIVENESS_POLL_MS):
                message = self._decoder.decode(socket.recv())
                if isinstance(message, WorkerFailed):
                    failure = f"worker rank {message.rank} failed: {message.error}"
                    exited = self._exited_peer(message.rank, _PEER_EXIT_GRACE_S)
                    if exited is not None:  # its collective broke because a peer died
                        self._dead(f"{self._exit_text(exited, doing)} (then {failure})")
                    self._dead(f"{failure}\n{message.traceback}")
                return message
            exited = self._exited_peer(None, 0.0)
            if exited is not None:
                self._dead(self._exit_text(exited, doing))
            if deadline is not None and time.monotonic() > deadline:
                self._dead(f"the workers did not answer in time while the executor was {doing}")

    def _exited_peer(self, failed_rank: int | None, grace_s: float) -> int | None:
        """The first rank other than `failed_rank` whose process has exited, looking for up to
        `grace_s`; None if every one is running."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, process in enumerate(self._workers.processes):
                if rank != failed_rank and not process.is_alive():
                    return rank
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def _exit_text(self, rank: int, doing: str) -> str:
        process = self._workers.processes[rank]
        return (f"worker rank {rank} (pid {process.pid}) exited with status "
                f"{process.exitcode} while the executor was {doing}")

    def _dead(self, error: str) -> None:
        self._dead_error = error
        logger.error("%s", error)
        # The engine is over: the other ranks may be blocked in a collective with the dead one.
        self._workers.terminate()
        raise EngineDeadError(error)

    def _raise_if_dead(self) -> None:
        if self._dead_error is not None:
            raise EngineDeadError(self._dead_error)

    def _merge(self, outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
        """Rank 0's output, with the connector reports of every rank combined."""
        output = outputs[0]
        for rank, other in enumerate(outputs[1:], start=1):
            if other.sampled_token_ids != output.sampled_token_ids:
                self._dead(f"worker rank {rank} sampled other tokens than rank 0 "
                           f"({other.sampled_token_ids} != {output.sampled_token_ids}): the "
                           f"ranks no longer compute the same step")
        reports = [o.kv_connector_output for o in outputs if o.kv_connector_output is not None]
        if len(outputs) == 1 or not reports:
            return output
        merged = KVConnectorOutput()
        # Every rank got the step's plan with the same held requests: one may go once all
        # say so in the same step (what a rank says ready stays ready).
        merged.ready_requests = set.intersection(*(r.ready_requests for r in reports)) if (
            len(reports) == len(outputs)) else set()
        for report in reports:
            merged.invalid_block_ids |= report.invalid_block_ids
            for key, value in report.stats.items():
                merged.stats[key] = merged.stats.get(key, 0.0) + value
            for req_id in report.finished_sending:
                self._sending_reports[req_id] += 1
            for req_id in report.finished_recving:
                self._recving_reports[req_id] += 1
            self._first_tokens.update(report.first_tokens)
            merged.load_errors.update(report.load_errors)
        for counts, done in ((self._sending_reports, merged.finished_sending),
                             (self._recving_reports, merged.finished_recving)):
            for req_id in [r for r, n in counts.items() if n == self.world_size]:
                del counts[req_id]
                done.add(req_id)
        for req_id in merged.finished_recving & self._first_tokens.keys():
            merged.first_tokens[req_id] = self._first_tokens.pop(req_id)
        output.kv_connector_output = merged
        return output
