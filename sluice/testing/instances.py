"""`sluice serve` and `sluice router` processes for tests and benchmarks, as users run them: the
one way they are launched (a PD cluster, sluice/testing/pd_cluster.py, and replicas behind a
router, sluice/testing/replica_cluster.py, are made of them).

    server = launch_serve(model, log_path, "--dtype", "float32")  # up and healthy, port 0
    httpx.get(f"{server.url}/health"); server.engine_info(); server.log()
    server.stop()                                                # SIGTERM: its exit status

An Instance is a ServerProcess (sluice/testing/servers.py) that is ready once `/health`
answers 200. Its port is given, or 0: the server then binds a free one itself and logs it,
which is read back from the log (no race with another process taking a port picked before).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import httpx

from sluice.testing.servers import HOST, ServerError, ServerProcess, free_port

_BOUND = re.compile(r"on http://127\.0\.0\.1:(\d+)")


class Instance(ServerProcess):
    """One sluice process (an engine instance or a router). `own_group` (the default): a
    session of its own that dies with the thread that started it (setpriv --pdeathsig), and
    `kill` ends the server with its engine core and workers, as a crash of its machine would;
    without it, a child of the test run like any other."""

    def __init__(self, name: str, argv: list[str], port: int, workdir: Path,
                 env: dict[str, str] | None = None, own_group: bool = True,
                 startup_timeout_s: float = 180.0, stop_grace_s: float = 20.0,
                 ready_unhealthy: bool = False) -> None:
        # Ready once /health answers at all: a router over instances that are down says 503.
        self.ready_unhealthy = ready_unhealthy
        super().__init__(name, lambda: argv, port, self._healthy, workdir, startup_timeout_s,
                         env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})},
                         run_in_workdir=False, die_with_parent=own_group,
                         own_session=own_group, poll_s=0.2, stop_grace_s=stop_grace_s)
        self.argv = argv
        self.bootstrap_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def base_url(self) -> str:
        """The same as `url` (the tests' name for it)."""
        return self.url

    def _healthy(self) -> bool:
        if not self.port:  # port 0: the one it logged once bound
            match = _BOUND.search(self.log())
            if match is None:
                return False
            self.port = int(match.group(1))
        try:
            status = httpx.get(f"{self.url}/health", timeout=2).status_code
        except httpx.HTTPError:
            return False
        return status == 200 or (self.ready_unhealthy and status == 503)

    def engine_info(self, timeout_s: float = 10.0, **headers: str) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/debug/engine", headers=headers, timeout=timeout_s)
        response.raise_for_status()
        return response.json()

    def log_tail(self, num_bytes: int = 6000) -> str:
        return super().log_tail(num_bytes)

    def __repr__(self) -> str:
        return f"<{self.name} {self.url} pid={self.pid}>"


def serve_argv(model: str | None, port: int, *flags: str) -> list[str]:
    """`sluice serve` of `model` (None: the built-in model)."""
    named = [] if model is None else ["--model", model]
    return [sys.executable, "-m", "sluice", "serve", *named, "--host", HOST, "--port", str(port),
            *flags]


def start_instances(instances: list[Instance], timeout_s: float = 180.0,
                    one_at_a_time: bool = False) -> None:
    """Start them all at once, then wait for each (stopping all if one fails); `one_at_a_time`:
    start each once the one before is up (instances sharing a GPU size their memory from what
    is free when they start)."""
    try:
        if one_at_a_time:
            for instance in instances:
                instance.spawn()
                instance.wait_ready(timeout_s)
        else:
            for instance in instances:
                instance.spawn()
            for instance in instances:
                instance.wait_ready(timeout_s)
    except BaseException:
        for instance in instances:
            instance.stop(5.0)
        raise


def start_router(instance_flags: list[str], workdir: Path, flags: list[str],
                 name: str = "router", ready_unhealthy: bool = False) -> Instance:
    """`sluice router` on a free port over the instances `instance_flags` name (`--worker URL
    ...`, or `--prefill URL PORT ... --decode URL ...`), with `flags`, up and healthy (or, with
    `ready_unhealthy`, answering /health at all)."""
    port = free_port()
    argv = [sys.executable, "-m", "sluice", "router", "--host", HOST, "--port", str(port),
            *instance_flags, *flags]
    router = Instance(name, argv, port, workdir, ready_unhealthy=ready_unhealthy)
    start_instances([router], timeout_s=60.0)
    return router


def launch_serve(model: str | None, log_path: Path, *flags: str, timeout_s: float = 180.0,
                 env: dict[str, str] | None = None) -> Instance:
    """`sluice serve --model MODEL --port 0 FLAGS`, up and healthy (ServerError with its log's
    tail if not, the process stopped), a child of the test run (own_group off: it may be
    started from any thread), logging to `log_path`."""
    server = Instance(log_path.stem, serve_argv(model, 0, *flags), 0, log_path.parent, env=env,
                      own_group=False, stop_grace_s=30.0)
    start_instances([server], timeout_s)
    return server


__all__ = ["Instance", "ServerError", "launch_serve", "serve_argv", "start_instances",
           "start_router"]
