"""`sluice router`: the PD router as an HTTP server (FastAPI under uvicorn).

    sluice router --port 8000 --prefill http://127.0.0.1:8100 8998 \
                  --decode http://127.0.0.1:8200 [--policy cache_aware]

Routes: POST /v1/completions and /v1/chat/completions (streamed or not; see proxy.py), GET
/v1/models (a healthy decode's), /health (200 while at least one prefill and one decode are
healthy, else 503 naming the missing role), /metrics (Prometheus text), /workers (each
instance's health and load, JSON). A prefill given without a bootstrap port uses 8998 (the
default of `--disaggregation-bootstrap-port`). Port 0 picks a free port (logged).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sluice.entrypoints.openai.connection import bind_socket
from sluice.entrypoints.openai.errors import error_response
from sluice.router.metrics import RouterMetrics
from sluice.router.policies import POLICIES, make_policy
from sluice.router.proxy import Proxy
from sluice.router.workers import Worker, WorkerPool

logger = logging.getLogger("sluice")


@dataclass(frozen=True)
class RouterArgs:
    prefills: tuple[tuple[str, int], ...]  # (url, bootstrap port)
    decodes: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "round_robin"
    prefill_policy: str | None = None  # None: `policy`
    decode_policy: str | None = None
    max_retries: int = 3
    health_check_interval_s: float = 2.0
    health_failure_threshold: int = 2
    request_timeout_s: float = 600.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not self.prefills or not self.decodes:
            raise ValueError("the router needs at least one --prefill and one --decode")
        for url in [u for u, _ in self.prefills] + list(self.decodes):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"an instance URL must be http(s)://host:port, got {url!r}")
        for _, port in self.prefills:
            if not 0 < port < 65536:
                raise ValueError(f"a bootstrap port must be in [1, 65535], got {port}")
        for name in (self.policy, self.prefill_policy, self.decode_policy):
            if name is not None and name not in POLICIES:
                raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.health_check_interval_s <= 0 or self.health_failure_threshold < 1:
            raise ValueError("health_check_interval_s must be > 0 and "
                             "health_failure_threshold >= 1")


def build_app(args: RouterArgs) -> FastAPI:
    pool = WorkerPool(
        [Worker(url.rstrip("/"), "prefill", bootstrap_port=port) for url, port in args.prefills],
        [Worker(url.rstrip("/"), "decode") for url in args.decodes],
        args.health_check_interval_s, args.health_failure_threshold)
    metrics = RouterMetrics()
    proxy = Proxy(pool, make_policy(args.prefill_policy or args.policy),
                  make_policy(args.decode_policy or args.policy), args.max_retries,
                  args.request_timeout_s, metrics)
    app = FastAPI(title="sluice router", docs_url=None, redoc_url=None)
    app.state.pool = pool
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.generate("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.generate("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        for worker in pool.healthy("decode"):
            try:
                response = await proxy.client.get(f"{worker.url}/v1/models", timeout=5.0)
            except Exception:  # noqa: BLE001 - try the next one
                continue
            return Response(response.content, status_code=response.status_code,
                            media_type="application/json")
        return error_response(503, "no healthy decode instance")

    @app.get("/health")
    async def health() -> Response:
        missing = [role for role in ("prefill", "decode") if not pool.healthy(role)]
        if missing:
            return error_response(503, f"no healthy {' or '.join(missing)} instance")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(pool), media_type="text/plain; version=0.0.4")

    @app.get("/workers")
    async def workers() -> JSONResponse:
        return JSONResponse({"prefill": [w.describe() for w in pool.prefills],
                             "decode": [w.describe() for w in pool.decodes]})

    return app


def run_router(args: RouterArgs) -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    sock = bind_socket(args.host, args.port)
    app = build_app(args)
    config = uvicorn.Config(app, log_level=args.log_level, lifespan="off",
                            timeout_keep_alive=5)
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]

    async def serve() -> None:
        app.state.pool.start()
        logger.info("router on http://%s:%d: prefill %s, decode %s", host, port,
                    [w.url for w in app.state.pool.prefills],
                    [w.url for w in app.state.pool.decodes])
        try:
            await server.serve(sockets=[sock])
        finally:
            await app.state.pool.stop()
            await app.state.proxy.close()

    try:
        asyncio.run(serve())
    finally:
        sock.close()
    logger.info("router stopped")
    return 0
