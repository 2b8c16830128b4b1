"""Child processes and local sockets shared by the engine-core and worker processes.

Children are fresh interpreters (`python -m MODULE JSON`), so CUDA initializes in them and
nothing is pickled, not even at start-up; they find this checkout through PYTHONPATH.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

import zmq

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


def local_address(ipc_path: str) -> str:
    """An address for a socket not bound yet (another process binds it): the ipc:// path, or a
    loopback TCP port free now if the path is too long."""
    if len(ipc_path) <= _MAX_IPC_PATH:
        return f"ipc://{ipc_path}"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


def spawn_module(module: str, startup_json: str, env: dict[str, Any] | None = None,
                 pass_fds: tuple[int, ...] = (), new_session: bool = False) -> ChildProcess:
    """Start `python -m module startup_json` with this checkout importable. `pass_fds`: file
    descriptors the child inherits; `new_session`: out of the terminal's process group, so a
    Ctrl-C reaches it only through its parent."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # above sluice/
    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, child_env.get("PYTHONPATH")) if p)
    popen = subprocess.Popen([sys.executable, "-m", module, startup_json], env=child_env,
                             stdin=subprocess.DEVNULL, pass_fds=pass_fds,
                             start_new_session=new_session)
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


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs; a zombie (exited, not yet reaped by its parent) does not."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the OS whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class WatchedProcess:
    """A process this one did not start and does not stop (the engine core, to an API server
    of several): the ChildProcess operations the front end uses, by pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    @property
    def exitcode(self) -> int | None:
        return None  # not our child: its status is its parent's to read

    def is_alive(self) -> bool:
        return pid_alive(self.pid)

    def stop(self, grace_s: float = 5.0) -> None:
        """Nothing: the process that started it stops it."""
