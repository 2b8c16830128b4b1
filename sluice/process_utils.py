"""Child processes and local sockets shared by the engine-core and worker processes.

Children are fresh interpreters (`python -m MODULE JSON`), so CUDA initializes in them and
nothing is pickled, not even at start-up; they find this checkout through PYTHONPATH.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import zmq

import sluice

# Unix socket paths longer than this do not fit sockaddr_un; such a temp dir falls back to TCP.
_MAX_IPC_PATH = 100


def bind_local(socket: zmq.Socket, ipc_path: str) -> str:
    """Bind to an ipc:// path, or to a free loopback TCP port if the path is too long;
    returns the address to connect to."""
    if len(ipc_path) <= _MAX_IPC_PATH:
        socket.bind(f"ipc://{ipc_path}")
        return f"ipc://{ipc_path}"
    socket.bind("tcp://127.0.0.1:*")
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)


def spawn_module(module: str, startup_json: str, env: dict[str, Any] | None = None,
                 ) -> ChildProcess:
    """Start `python -m module startup_json` with this checkout importable."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(sluice.__file__)))
    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, child_env.get("PYTHONPATH")) if p)
    popen = subprocess.Popen([sys.executable, "-m", module, startup_json], env=child_env,
                             stdin=subprocess.DEVNULL)
    return ChildProcess(popen)


class ChildProcess:
    """The few process operations the parents use, over subprocess.Popen."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; reaps the process."""
        if self.is_alive():
            self.terminate()
            self.join(grace_s)
            if self.is_alive():
                self.kill()
                self.join(grace_s)


def parent_alive(parent_pid: int) -> bool:
    # A child whose parent died is re-parented, so its parent pid changes.
    return os.getppid() == parent_pid
