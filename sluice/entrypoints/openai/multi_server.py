"""`sluice serve --api-server-count N`: one engine core, N API-server processes.

One API server is one asyncio loop: tokenizing, chat templates, detokenizing, JSON and SSE
chunks of every request share a core. With N, the parent binds the HTTP port (a taken port
fails at once), starts the engine core for N front ends (core_client.launch_shared_engine_core),
then N API servers (`python -m sluice.entrypoints.openai.multi_server JSON`): each is the
single server (api_server.run_server) over an AsyncLLM attached to the core by its client
index, on the listening socket it inherits, so the kernel hands each new connection to one of
them. The core sends each its own requests' outputs.

The parent supervises. SIGTERM / SIGINT is passed to every API server (they run in their own
sessions, so a terminal's Ctrl-C reaches them only this way), which drain as the single server
does; then the core stops and the parent returns 0. A second signal is passed on too: they stop
at once. When the core or an API server exits on its own, the parent stops the others and
returns 1: an API server without a core cannot answer, and a core that lost a front end would
keep generating for requests nobody reads. An API server whose parent is gone stops itself.

A scrape of /metrics, whichever API server answers, gives every API server's request counters
summed and the core's state once (metrics.py: prometheus_client's multiprocess mode, in a temp
dir the parent makes and removes). Each API server logs its own lines.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from types import FrameType
from typing import Any

from sluice.engine.arg_utils import EngineArgs
from sluice.engine.async_llm import core_process_args
from sluice.engine.core_client import (
    CoreAttachment,
    SharedEngineCore,
    launch_shared_engine_core,
)
from sluice.entrypoints.openai.api_server import ServerArgs, run_server
from sluice.entrypoints.openai.connection import bind_socket
from sluice.entrypoints.openai.metrics import MULTIPROC_DIR_ENV
from sluice.process_utils import ChildProcess, parent_alive, spawn_module

logger = logging.getLogger("sluice")

# How often (s) the parent looks at its children, and an API server at its parent.
_POLL_S = 0.2
# Where an API server finds the --api-key (its environment: see run_multi_server).
_API_KEY_ENV = "SLUICE_API_SERVER_KEY"
# After the API servers' own drain limit (shutdown_timeout_s and their abort grace), how long
# (s) the parent waits before it kills them.
_STOP_GRACE_S = 10.0


def run_multi_server(server_args: ServerArgs, engine_args: EngineArgs, count: int,
                     model_name: str | None = None) -> int:
    """Serve with `count` API-server processes until SIGTERM / SIGINT (returns 0 once they
    drained) or until a child exits on its own (returns 1)."""
    if count < 1:
        raise ValueError(f"api_server_count must be >= 1, got {count}")
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    config = engine_args.create_engine_config()  # bad arguments fail here, before any process
    sock = bind_socket(server_args.host, server_args.port)
    core: SharedEngineCore | None = None
    servers: list[ChildProcess] = []
    # Where the API servers' Prometheus values meet (metrics.py: multiprocess mode).
    metrics_dir = tempfile.mkdtemp(prefix="sluice-metrics-")
    supervisor = _Supervisor()
    try:
        # The API servers rebuild the configs from the core's arguments (the model folder
        # resolved once, here), so front ends and core agree.
        core_args = core_process_args(engine_args, config)
        core = launch_shared_engine_core(core_args, count, logger.getEffectiveLevel())
        # The API key goes in the environment, which only its user can read, not in the
        # command line, which everyone's `ps` shows.
        public_args = dataclasses.replace(server_args, api_key=None)
        env = {MULTIPROC_DIR_ENV: metrics_dir}
        if server_args.api_key is not None:
            env[_API_KEY_ENV] = server_args.api_key
        for attachment in core.attachments:
            startup = {"server_args": dataclasses.asdict(public_args),
                       "engine_args": core_args, "model_name": model_name,
                       "attach": dataclasses.asdict(attachment), "fd": sock.fileno(),
                       "parent_pid": os.getpid()}
            servers.append(spawn_module("sluice.entrypoints.openai.multi_server",
                                        json.dumps(startup), env=env,
                                        pass_fds=(sock.fileno(),), new_session=True))
        host, port = sock.getsockname()[:2]
        logger.info("serving on http://%s:%d with %d API servers (pids %s), engine core pid %d",
                    f"[{host}]" if ":" in host else host, port, count,
                    [s.pid for s in servers], core.process.pid)
        return supervisor.watch(core.process, servers, server_args.shutdown_timeout_s)
    finally:
        supervisor.restore()
        for server in servers:
            server.stop(grace_s=2.0)
        if core is not None:
            core.release()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        sock.close()
        logger.info("server stopped")


class _Supervisor:
    """The parent's loop: signals passed on, children watched (see the module doc)."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.previous = {sig: signal.signal(sig, self._on_signal)
                         for sig in (signal.SIGTERM, signal.SIGINT)}

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self.signals.append(sig)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def watch(self, core: ChildProcess, servers: list[ChildProcess],
              shutdown_timeout_s: float) -> int:
        passed_on = 0
        stop_by: float | None = None
        while True:
            while passed_on < len(self.signals):
                sig = self.signals[passed_on]
                passed_on += 1
                logger.info("%s: passed on to the API servers", signal.Signals(sig).name)
                for server in servers:
                    if server.is_alive():
                        os.kill(server.pid, signal.SIGTERM)
                if stop_by is None:
                    stop_by = time.monotonic() + shutdown_timeout_s + _STOP_GRACE_S
            if passed_on:
                if not any(s.is_alive() for s in servers):
                    return 0 if all(s.exitcode == 0 for s in servers) else 1
                if stop_by is not None and time.monotonic() > stop_by:
                    logger.error("API servers still running %g s after the signal: killing "
                                 "them", shutdown_timeout_s + _STOP_GRACE_S)
                    return 1
            else:
                gone = [s for s in servers if not s.is_alive()]
                if gone or not core.is_alive():
                    what = (f"API server pid {gone[0].pid} exited with status "
                            f"{gone[0].exitcode}" if gone else
                            f"the engine core (pid {core.pid}) exited with status "
                            f"{core.exitcode}")
                    logger.error("%s: stopping the server", what)
                    return 1
            time.sleep(_POLL_S)


def _leave_when_parent_is_gone(parent_pid: int) -> None:
    """An API server whose supervisor died: drain, then stop (a second SIGTERM) if the drain
    has not ended after a grace."""
    while parent_alive(parent_pid):
        time.sleep(_POLL_S)
    logger.error("the server's parent process is gone: stopping")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(_STOP_GRACE_S)
    os.kill(os.getpid(), signal.SIGTERM)


def _run_api_server(startup: dict[str, Any]) -> int:
    server_fields = dict(startup["server_args"])
    server_fields["served_model_name"] = tuple(server_fields["served_model_name"])
    server_fields["api_key"] = os.environ.pop(_API_KEY_ENV, None)
    sock = socket.socket(fileno=startup["fd"])
    threading.Thread(target=_leave_when_parent_is_gone, args=(startup["parent_pid"],),
                     name="sluice-parent-watch", daemon=True).start()
    return run_server(ServerArgs(**server_fields), EngineArgs(**startup["engine_args"]),
                      startup["model_name"], attach=CoreAttachment(**startup["attach"]),
                      sock=sock)


if __name__ == "__main__":
    sys.exit(_run_api_server(json.loads(sys.argv[1])))
