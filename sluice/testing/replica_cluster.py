"""Plain `sluice serve` replicas behind a `sluice router --worker ...`, on loopback, for tests and
benchmarks: each replica its own process group on a port picked free (so `restart()` brings it
back on the same port), logs in a folder.

    cluster = start_replicas(model, engine_flags, num_workers=2)    # replicas, no router
    router = cluster.start_router(["--policy", "cache_aware"])     # one or several routers
    cluster.workers[1].kill()                                      # SIGKILL its whole group
    cluster.workers[1].restart()                                   # the same port again
    cluster.close()                                                # routers, then replicas

The replicas start at once (a cluster costs about one server start-up), or one after the other
(`one_at_a_time`: instances sharing a GPU size their memory from what is free when they start).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from sluice.testing.instances import Instance, serve_argv, start_instances, start_router
from sluice.testing.servers import ServerError, free_port


@dataclass
class ReplicaCluster:
    workers: list[Instance]
    workdir: Path
    routers: list[Instance] = field(default_factory=list)

    def start_router(self, flags: list[str], name: str | None = None,
                     ready_unhealthy: bool = False, timeout_s: float = 30.0) -> Instance:
        """A router over every replica (`--worker` each, in order) with `flags`, returned once
        it routes to all of them (its /health says 200 once one is admitted); with
        `ready_unhealthy`, once it answers at all."""
        worker_flags = [word for w in self.workers for word in ("--worker", w.url)]
        router = start_router(worker_flags, self.workdir, flags,
                              name or f"router{len(self.routers)}", ready_unhealthy)
        self.routers.append(router)
        deadline = time.monotonic() + timeout_s
        while not ready_unhealthy and not all(
                w["healthy"] for w in httpx.get(f"{router.url}/workers", timeout=10).json()[
                    "worker"]):
            if time.monotonic() > deadline:
                raise ServerError(f"{router.name} did not admit every replica within "
                                  f"{timeout_s:g} s; log:\n{router.log_tail()}")
            time.sleep(0.05)
        return router

    def stop_router(self, router: Instance) -> None:
        router.stop()
        self.routers.remove(router)

    def stop(self) -> None:
        for instance in [*reversed(self.routers), *self.workers]:
            instance.stop()
        self.routers.clear()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_replicas(model: str | None, engine_flags: list[str], num_workers: int = 2,
                   workdir: Path | None = None, env: list[dict[str, str]] | None = None,
                   one_at_a_time: bool = False, timeout_s: float = 180.0) -> ReplicaCluster:
    """`num_workers` colocated `sluice serve` instances of `model` with `engine_flags` (`env[i]`
    for replica i), up and healthy."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="sluice-replicas-"))
    workdir.mkdir(parents=True, exist_ok=True)
    workers = []
    for i in range(num_workers):
        port = free_port()
        workers.append(Instance(f"worker{i}", serve_argv(model, port, *engine_flags), port,
                                workdir, (env or [{}] * num_workers)[i]))
    start_instances(workers, timeout_s, one_at_a_time)
    return ReplicaCluster(workers, workdir)
