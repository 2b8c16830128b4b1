"""Real pool servers for tests and benchmarks: `redis-server`, `mooncake_master`, a process
that owns a Mooncake Store segment, Mooncake's standalone real client (`mooncake_client`, the
memory owner that same-host dummy clients share memory with), and `sluice pool-server` (the
shared host tier), each on loopback ports picked free (or given).

    with start_redis() as server:            # waits until it answers PING
        backend = create_backend(server.url)
        server.kill()                        # SIGKILL, reaped
        server.pause(); server.resume()      # SIGSTOP (waits until stopped), SIGCONT
        server.restart()                     # same port, waits until it answers again
    # leaving the block stops it (SIGTERM, then SIGKILL) and removes its folder

Every process is started with `setpriv --pdeathsig KILL` where util-linux has it, so a test run
that dies without its teardown (a crash in a native library) still takes its servers with it.
The death signal follows the thread that started the process: start servers from the main
thread (pytest fixtures do). Logs go to a temporary folder; a server that does not come up
raises `ServerError` with the tail of its log.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

HOST = "127.0.0.1"


class ServerError(RuntimeError):
    """A server did not start or answer in time."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def redis_server_path() -> str | None:
    return shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/sbin/redis-server") if os.access(p, os.X_OK)),
        None)


def mooncake_master_path() -> str | None:
    """The `mooncake_master` of the installed Mooncake wheel (or on PATH)."""
    try:
        import mooncake
    except ImportError:
        return shutil.which("mooncake_master")
    bundled = Path(mooncake.__file__).parent / "mooncake_master"
    return str(bundled) if os.access(bundled, os.X_OK) else shutil.which("mooncake_master")


def redis_missing() -> str | None:
    """Why the Redis backend cannot be tested here, or None."""
    if redis_server_path() is None:
        return "redis-server not installed (Debian: apt-get install redis-server)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "redis-py not installed (pip install 'redis[hiredis]')"
    return None


def mooncake_client_path() -> str | None:
    """The `mooncake_client` (standalone real client) of the installed Mooncake wheel (or on
    PATH)."""
    master = mooncake_master_path()
    if master is not None:
        bundled = Path(master).parent / "mooncake_client"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    return shutil.which("mooncake_client")


def mooncake_missing() -> str | None:
    """Why the Mooncake backend cannot be tested here, or None."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as exc:
        return (f"Mooncake Store client not importable ({exc}); pip install "
                "mooncake-transfer-engine-non-cuda and apt-get install libibverbs1 "
                "ibverbs-providers")
    if mooncake_master_path() is None:
        return "mooncake_master not found (it ships in the mooncake-transfer-engine wheels)"
    return None


def _port_open(port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class ServerProcess:
    """One server process: its port, its log, kill / restart / stop. `ready` says when it
    answers; `start` starts it and waits for that (`spawn` alone does not wait, `wait_ready`
    then does). By default it runs in `workdir`, dies with the thread that started it (setpriv
    --pdeathsig) and shares the test run's process group; with `own_session` it leads a session
    of its own, and `kill` ends the whole group (a server with its engine core and workers)."""

    def __init__(self, name: str, argv: Callable[[], list[str]], port: int,
                 ready: Callable[[], bool], workdir: Path, startup_timeout_s: float, *,
                 env: dict[str, str] | None = None, run_in_workdir: bool = True,
                 die_with_parent: bool = True, own_session: bool = False,
                 poll_s: float = 0.02, stop_grace_s: float = 5.0) -> None:
        self.name = name
        self.port = port
        self.workdir = workdir
        self.log_path = workdir / f"{name}.log"
        self._argv = argv
        self._ready = ready
        self._startup_timeout_s = startup_timeout_s
        self._env = env
        self._run_in_workdir = run_in_workdir
        self._die_with_parent = die_with_parent
        self._own_session = own_session
        self._poll_s = poll_s
        self._stop_grace_s = stop_grace_s
        self._proc: subprocess.Popen | None = None

    @property
    def proc(self) -> subprocess.Popen | None:
        return self._proc

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def spawn(self) -> None:
        """Start the process, without waiting for it to answer."""
        if self.alive():
            raise ServerError(f"{self.name} on {self.address} is already running")
        argv = self._argv()
        setpriv = shutil.which("setpriv") if self._die_with_parent else None
        if setpriv:
            argv = [setpriv, "--pdeathsig", "KILL", "--", *argv]
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=self.workdir if self._run_in_workdir else None, env=self._env,
                start_new_session=self._own_session)

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Return once it answers; ServerError with its log's tail if it exits first or does
        not answer within `timeout_s` (the start-up timeout if None)."""
        timeout_s = self._startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerError(f"{self.name} exited with {self._proc.returncode} at start "
                                  f"on {self.address}; log:\n{self.log_tail()}")
            if self._ready():
                return
            time.sleep(self._poll_s)
        raise ServerError(f"{self.name} did not answer on {self.address} within "
                          f"{timeout_s:g} s; log:\n{self.log_tail()}")

    def start(self) -> None:
        self.spawn()
        try:
            self.wait_ready()
        except ServerError:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL (a crash, as far as clients can tell; with `own_session`, of the whole
        group) and reap."""
        if self._proc is None:
            return
        if self._own_session:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        elif self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()

    def pause(self, within_s: float = 5.0) -> None:
        """SIGSTOP (a stalled server), returning once every thread is stopped: a thread that is
        running when the signal comes may still answer a call (seen under load: an exists call
        answered 2 ms after the signal was sent)."""
        assert self._proc is not None
        pid = self._proc.pid
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + within_s
        while True:
            states = []
            for task in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            if states and all(state in "Tt" for state in states):
                return
            if time.monotonic() > deadline:
                raise ServerError(f"{self.name} not stopped within {within_s:g} s "
                                  f"(thread states {states})")
            time.sleep(0.01)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        assert self._proc is not None
        os.kill(self._proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        """Start again on the same port (after `kill` or `stop`)."""
        self.kill()
        self.start()

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM, SIGKILL after `grace_s` (or of what is left of its group), reap; returns
        its exit status if it exited of SIGTERM (None: it did not in time, or never ran)."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(self._stop_grace_s if grace_s is None else grace_s)
        code = self._proc.poll()
        self.kill()
        return code

    def close(self) -> None:
        """Stop and remove the working folder."""
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def log(self) -> str:
        """All of its log (empty before it starts)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, num_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "(no log)"
        return data[-num_bytes:].decode(errors="replace")

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{self.name} {self.address} pid={self.pid}>"


def _start(make: Callable[[int], ServerProcess], port: int) -> ServerProcess:
    """Start the server on `port`, or on a free port (retried: another process may take the
    port between picking and binding)."""
    attempts = 1 if port else 3
    for attempt in range(attempts):
        server = make(port or free_port())
        try:
            server.start()
            return server
        except ServerError:
            server.close()
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


class RedisServer(ServerProcess):
    @property
    def url(self) -> str:
        return f"redis://{self.address}"


def start_redis(port: int = 0, *, maxmemory: str | None = None,
                maxmemory_policy: str = "allkeys-lru",
                startup_timeout_s: float = 10.0) -> RedisServer:
    """`redis-server` on 127.0.0.1 without persistence. `maxmemory` (e.g. "16mb") caps it,
    evicting by `maxmemory_policy`."""
    binary = redis_server_path()
    if binary is None:
        raise ServerError("redis-server not installed")

    def make(chosen: int) -> RedisServer:
        workdir = Path(tempfile.mkdtemp(prefix="sluice-redis-"))

        def argv() -> list[str]:
            args = [binary, "--port", str(chosen), "--bind", HOST, "--save", "",
                    "--appendonly", "no", "--protected-mode", "yes", "--daemonize", "no",
                    "--dir", str(workdir), "--logfile", ""]
            if maxmemory:
                args += ["--maxmemory", maxmemory, "--maxmemory-policy", maxmemory_policy]
            return args

        def ready() -> bool:
            try:
                with socket.create_connection((HOST, chosen), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    return sock.recv(64).startswith(b"+PONG")
            except OSError:
                return False

        return RedisServer("redis-server", argv, chosen, ready, workdir, startup_timeout_s)

    server = _start(make, port)
    assert isinstance(server, RedisServer)
    return server


class MooncakeMaster(ServerProcess):
    admin_port: int

    @property
    def url(self) -> str:
        return f"mooncake://{self.address}"


def start_mooncake_master(port: int = 0, *, admin_port: int = 0, client_ttl_s: int | None = None,
                          startup_timeout_s: float = 20.0) -> MooncakeMaster:
    """`mooncake_master` with its RPC port, admin/metrics HTTP port (`admin_port`: `/health`,
    `/metrics`, `/get_all_keys`) and its (disabled) HTTP metadata server all on 127.0.0.1.
    `client_ttl_s`: how long the master keeps a silent client's segments (its default 10 s)."""
    binary = mooncake_master_path()
    if binary is None:
        raise ServerError("mooncake_master not found")

    def make(chosen: int) -> MooncakeMaster:
        workdir = Path(tempfile.mkdtemp(prefix="sluice-mooncake-"))
        chosen_admin = admin_port or free_port()
        metadata_port = free_port()

        def argv() -> list[str]:
            args = [binary, f"--rpc_address={HOST}", f"--rpc_port={chosen}",
                    f"--metrics_host={HOST}", f"--metrics_port={chosen_admin}",
                    "--enable_http_metadata_server=false",
                    f"--http_metadata_server_host={HOST}",
                    f"--http_metadata_server_port={metadata_port}",
                    "--logtostderr=true"]
            if client_ttl_s is not None:
                args.append(f"--client_ttl={client_ttl_s}")
            return args

        def ready() -> bool:
            if not _port_open(chosen):
                return False
            try:
                url = f"http://{HOST}:{chosen_admin}/health"
                with urllib.request.urlopen(url, timeout=0.5) as response:
                    return response.status == 200
            except OSError:
                return False

        server = MooncakeMaster("mooncake_master", argv, chosen, ready, workdir,
                                startup_timeout_s)
        server.admin_port = chosen_admin
        return server

    server = _start(make, port)
    assert isinstance(server, MooncakeMaster)
    return server


def start_mooncake_segment_owner(master: str, segment_size: int, *,
                                 startup_timeout_s: float = 20.0) -> ServerProcess:
    """A separate client process that mounts `segment_size` bytes into the store of the
    master at `master` ("HOST:PORT") and does nothing else: values the master places there die
    with it (`kill()`), the case of an engine instance crashing."""
    workdir = Path(tempfile.mkdtemp(prefix="sluice-mooncake-segment-"))
    ready_file = workdir / "ready"

    def argv() -> list[str]:
        with contextlib.suppress(FileNotFoundError):
            ready_file.unlink()
        return [sys.executable, "-m", "sluice.testing.mooncake_segment", "--master", master,
                "--segment-size", str(segment_size), "--ready-file", str(ready_file)]

    server = ServerProcess("mooncake-segment-owner", argv, 0, ready_file.exists, workdir,
                           startup_timeout_s)
    try:
        server.start()
    except ServerError:
        server.close()
        raise
    return server


class MooncakeRealClient(ServerProcess):
    pass


def start_mooncake_real_client(master: str, segment_size: int, port: int = 0, *,
                               startup_timeout_s: float = 20.0) -> MooncakeRealClient:
    """`mooncake_client`: a standalone real client that mounts `segment_size` bytes into the
    store of the master at `master` ("HOST:PORT") and serves dummy clients of this host
    (`MooncakeBackend(client="dummy", real_client=server.address)`) on its RPC port on
    127.0.0.1, sharing memory with them through its IPC socket (the abstract Unix socket
    `@mooncake_client_<port>.sock`). Its transfer engine still binds all interfaces (see
    mooncake_store.py). `kill()` plays a crashed owner: its values die with it."""
    binary = mooncake_client_path()
    if binary is None:
        raise ServerError("mooncake_client not found (it ships in the mooncake-transfer-engine "
                          "wheels)")
    if not isinstance(segment_size, int) or segment_size <= 0:
        raise ValueError(f"segment_size must be a positive int of bytes, got {segment_size!r}")

    def make(chosen: int) -> MooncakeRealClient:
        workdir = Path(tempfile.mkdtemp(prefix="sluice-mooncake-real-client-"))

        def argv() -> list[str]:
            return [binary, f"--host={HOST}", f"--port={chosen}",
                    f"--master_server_address={master}", "--metadata_server=P2PHANDSHAKE",
                    f"--global_segment_size={segment_size}", "--protocol=tcp",
                    "--logtostderr=true"]

        # Its RPC port opens once the segment is mounted (setup comes first).
        return MooncakeRealClient("mooncake_client", argv, chosen, lambda: _port_open(chosen),
                                  workdir, startup_timeout_s)

    server = _start(make, port)
    assert isinstance(server, MooncakeRealClient)
    return server


class ShmPoolServer(ServerProcess):
    @property
    def url(self) -> str:
        return f"shm://{self.address}"


def start_shm_pool(port: int = 0, *, capacity_bytes: int = 256 << 20,
                   slot_bytes: int = 64 << 10, startup_timeout_s: float = 20.0) -> ShmPoolServer:
    """`sluice pool-server` on 127.0.0.1: an arena of `capacity_bytes` in slots of
    `slot_bytes` (ready once it accepts connections: it allocates the arena before listening)."""

    def make(chosen: int) -> ShmPoolServer:
        workdir = Path(tempfile.mkdtemp(prefix="sluice-shm-pool-"))

        def argv() -> list[str]:
            return [sys.executable, "-m", "sluice", "pool-server", "--port", str(chosen),
                    "--capacity-bytes", str(capacity_bytes), "--slot-bytes", str(slot_bytes)]

        # In the caller's folder (as engine instances): a checkout's sluice, not an installed one.
        return ShmPoolServer("sluice-pool-server", argv, chosen, lambda: _port_open(chosen),
                             workdir, startup_timeout_s, run_in_workdir=False)

    server = _start(make, port)
    assert isinstance(server, ShmPoolServer)
    return server
