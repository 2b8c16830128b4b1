"""The front end's side of the engine-core process (sluice.engine.core_proc): start it, or
attach to one another process started, and wait until it is ready.

`launch_engine_core` binds two sockets, a PUSH for requests and a PULL for outputs (ipc:// in a
temp dir, or loopback TCP on a free port), and starts the core in a child interpreter
(`python -m sluice.engine.core_proc JSON`, see sluice/process_utils.py). Several front ends
(`sluice serve --api-server-count N`: sluice.entrypoints.openai.multi_server) each bind such a
pair at addresses `launch_shared_engine_core` chose and attach to the core
(`attach_engine_core`).

This module imports no PyTorch, nor anything that does: the API server starts the core first
and loads its tokenizer (which imports PyTorch through transformers) while the core starts, so
the two processes' start-ups overlap.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import zmq

from sluice.engine.wire import EngineDead, Ready, ResponseDecoder
from sluice.errors import EngineDeadError
from sluice.process_utils import (
    ChildProcess,
    WatchedProcess,
    bind_local,
    local_address,
    spawn_module,
)

logger = logging.getLogger("sluice")


@dataclass(slots=True)
class EngineCoreHandle:
    """The front end's hold on an engine-core process and its two sockets: a process it
    started (ChildProcess), or one another process started that it attached to."""

    process: ChildProcess | WatchedProcess
    context: zmq.Context
    input_socket: zmq.Socket  # PUSH, requests to the core; sends never block (no HWM)
    output_socket: zmq.Socket  # PULL, outputs from the core
    input_address: str
    output_address: str
    ipc_dir: str | None  # the sockets' temp dir, removed on release (None: not ours)

    def wait_for_ready(self, timeout_s: float) -> Ready:
        """Block until the core says Ready; EngineDeadError if it dies or is too slow."""
        decoder = ResponseDecoder()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.output_socket.poll(200):
                message = decoder.decode(self.output_socket.recv())
                if isinstance(message, Ready):
                    self._wait_for_the_core_to_read(deadline)
                    return message
                if isinstance(message, EngineDead):
                    raise EngineDeadError(f"the engine core failed to start: {message.error}\n"
                                          f"{message.traceback}")
                logger.warning("engine core sent %s before ready", type(message).__name__)
            elif not self.process.is_alive():
                raise EngineDeadError(f"the engine core (pid {self.process.pid}) exited with "
                                      f"status {self.process.exitcode} while starting")
        raise EngineDeadError(f"the engine core was not ready after {timeout_s} s")

    def _wait_for_the_core_to_read(self, deadline: float) -> None:
        """Until the core's input socket has connected to ours: a core shared by several front
        ends connects to each one's in turn (ZMQ retrying until it is bound), and may send
        Ready before, and the front end's sends never wait (a PUSH with no peer refuses)."""
        while not self.input_socket.poll(200, zmq.POLLOUT):
            if not self.process.is_alive() or time.monotonic() > deadline:
                raise EngineDeadError("the engine core said it was ready but did not connect "
                                      f"to {self.input_address}")

    def release(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL) and free the sockets and the temp dir.
        Must not reference the AsyncLLM: it also runs as its weakref finalizer."""
        self.process.stop()
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.context.term()
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _front_end_sockets() -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    context = zmq.Context()
    input_socket = context.socket(zmq.PUSH)
    input_socket.setsockopt(zmq.SNDHWM, 0)
    output_socket = context.socket(zmq.PULL)
    output_socket.setsockopt(zmq.RCVHWM, 0)
    return context, input_socket, output_socket


def launch_engine_core(core_args: dict[str, Any], log_level: int) -> EngineCoreHandle:
    """Bind the sockets and start the engine-core process (it is not ready yet)."""
    ipc_dir = tempfile.mkdtemp(prefix="sluice-")
    context, input_socket, output_socket = _front_end_sockets()
    input_address = bind_local(input_socket, f"{ipc_dir}/input")
    output_address = bind_local(output_socket, f"{ipc_dir}/output")
    startup = json.dumps({"engine_args": core_args, "input_addresses": [input_address],
                          "output_addresses": [output_address], "parent_pid": os.getpid(),
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


@dataclass(frozen=True, slots=True)
class CoreAttachment:
    """How one of several front ends reaches an engine core another process started: its
    client index, the two addresses it binds (the core connects to them) and the core's pid."""

    client: int
    input_address: str
    output_address: str
    core_pid: int


@dataclass(slots=True)
class SharedEngineCore:
    """An engine-core process started for several front ends (launch_shared_engine_core)."""

    process: ChildProcess
    attachments: list[CoreAttachment]  # one per front end, by client index
    ipc_dir: str

    def release(self) -> None:
        self.process.stop()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def launch_shared_engine_core(core_args: dict[str, Any], num_clients: int,
                              log_level: int) -> SharedEngineCore:
    """Start an engine-core process for `num_clients` front ends, each to bind the addresses
    of its CoreAttachment (the core connects, and ZMQ retries until they are bound)."""
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    ipc_dir = tempfile.mkdtemp(prefix="sluice-")
    inputs = [local_address(f"{ipc_dir}/input-{i}") for i in range(num_clients)]
    outputs = [local_address(f"{ipc_dir}/output-{i}") for i in range(num_clients)]
    startup = json.dumps({"engine_args": core_args, "input_addresses": inputs,
                          "output_addresses": outputs, "parent_pid": os.getpid(),
                          "log_level": log_level})
    try:
        process = spawn_module("sluice.engine.core_proc", startup)
    except BaseException:
        shutil.rmtree(ipc_dir, ignore_errors=True)
        raise
    attachments = [CoreAttachment(i, inputs[i], outputs[i], process.pid)
                   for i in range(num_clients)]
    return SharedEngineCore(process, attachments, ipc_dir)


def attach_engine_core(attachment: CoreAttachment) -> EngineCoreHandle:
    """Bind this front end's two sockets where the shared core connects (it is not ready
    yet: wait_for_ready)."""
    context, input_socket, output_socket = _front_end_sockets()
    try:
        input_socket.bind(attachment.input_address)
        output_socket.bind(attachment.output_address)
    except zmq.ZMQError:
        input_socket.close(linger=0)
        output_socket.close(linger=0)
        context.term()
        raise
    return EngineCoreHandle(WatchedProcess(attachment.core_pid), context, input_socket,
                            output_socket, attachment.input_address, attachment.output_address,
                            ipc_dir=None)
