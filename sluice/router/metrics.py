"""The router's Prometheus metrics (its own registry: several routers may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from sluice.router.workers import WorkerPool


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("sluice_router_requests", "Requests answered, by route and "
                                "HTTP status", ["route", "status"], registry=self.registry)
        self.attempts = Counter("sluice_router_attempts", "Attempts tried (a worker, or a "
                                "prefill/decode pair)", registry=self.registry)
        self.retries = Counter("sluice_router_retries", "Attempts that failed and were "
                               "retried (or gave up), by the role at fault", ["role"],
                               registry=self.registry)
        self.healthy = Gauge("sluice_router_worker_healthy", "1 while an instance is routed "
                             "to", ["role", "url"], registry=self.registry)
        self.in_flight = Gauge("sluice_router_worker_in_flight", "Requests in flight on an "
                               "instance through this router", ["role", "url"],
                               registry=self.registry)

    def render(self, pool: WorkerPool) -> bytes:
        for worker in pool.workers:
            self.healthy.labels(role=worker.role, url=worker.url).set(int(worker.healthy))
            self.in_flight.labels(role=worker.role, url=worker.url).set(worker.in_flight)
        return generate_latest(self.registry)
