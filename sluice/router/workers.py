"""The instances behind the router: their role, load and health.

A worker is admitted by its first health check that succeeds (GET /health, every
`health_check_interval_s`, the first at once); health checks that fail
`health_failure_threshold` times in a row, or a request that cannot connect to it, drop it; the
next health check that succeeds admits it again. Nothing is dropped for good.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

logger = logging.getLogger("sluice")


@dataclass(eq=False)
class Worker:
    url: str  # "http://host:port", no trailing slash
    role: str  # "prefill" | "decode" (PD) | "worker" (a colocated replica)
    bootstrap_port: int | None = None  # prefill: its PD bootstrap server
    healthy: bool = False  # until a health check says so
    in_flight: int = 0
    streaming: int = 0  # of those, streams past their first token (no longer retried)
    failures: int = 0  # health checks failed in a row
    num_requests: int = 0
    num_errors: int = 0
    last_error: str | None = None
    dropped_at: float | None = None

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    def describe(self) -> dict:
        return {"url": self.url, "role": self.role, "bootstrap_port": self.bootstrap_port,
                "healthy": self.healthy, "in_flight": self.in_flight,
                "streaming": self.streaming,
                "num_requests": self.num_requests, "num_errors": self.num_errors,
                "last_error": self.last_error}


class WorkerPool:
    def __init__(self, workers: list[Worker], health_check_interval_s: float,
                 health_failure_threshold: int, health_check_timeout_s: float = 2.0) -> None:
        self.workers = workers
        self.interval_s = health_check_interval_s
        self.threshold = health_failure_threshold
        self.timeout_s = health_check_timeout_s
        self._task: asyncio.Task | None = None

    @property
    def roles(self) -> list[str]:
        """The roles of its workers, in their order."""
        return list(dict.fromkeys(w.role for w in self.workers))

    def of_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    def healthy(self, role: str) -> list[Worker]:
        return [w for w in self.of_role(role) if w.healthy]

    def drop(self, worker: Worker, why: str) -> None:
        """Stop routing to it until a health check says it is back."""
        worker.num_errors += 1
        worker.last_error = why
        if worker.healthy:
            logger.warning("router: dropping %s %s: %s", worker.role, worker.url, why)
            worker.healthy = False
            worker.dropped_at = time.monotonic()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._check_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _check_forever(self) -> None:
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            while True:
                await asyncio.gather(*(self._check(client, w) for w in self.workers))
                await asyncio.sleep(self.interval_s)

    async def _check(self, client: httpx.AsyncClient, worker: Worker) -> None:
        try:
            ok = (await client.get(f"{worker.url}/health")).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok:
            worker.failures = 0
            if not worker.healthy:
                logger.info("router: %s %s is healthy", worker.role, worker.url)
                worker.healthy = True
                worker.dropped_at = None
            return
        worker.failures += 1
        if worker.failures >= self.threshold:
            self.drop(worker, f"{worker.failures} health checks failed in a row")
