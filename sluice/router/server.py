"""`sluice router`: the router as an HTTP server (FastAPI under uvicorn), in one of two modes.

    sluice router --port 8000 --worker http://127.0.0.1:8100 --worker http://127.0.0.1:8101 \
                  [--policy cache_aware]                                 # plain replicas
    sluice router --port 8000 --prefill http://127.0.0.1:8100 8998 \
                  --decode http://127.0.0.1:8200 [--policy cache_aware]  # PD

Plain mode (only `--worker` given; replicas.py) sends each request whole to one colocated
`sluice serve`; PD mode (`--prefill` and `--decode`; proxy.py) pairs a prefill and a decode.
Giving both is an error. Routes: POST /v1/completions and /v1/chat/completions (streamed or
not), GET /v1/models (a healthy worker's, or decode's), /health (200 while every role has a
healthy instance, else 503 naming the missing one), /metrics (Prometheus text), /workers (each
instance's health and load, JSON, by role). A prefill given without a bootstrap port uses 8998
(the default of `--disaggregation-bootstrap-port`). Port 0 picks a free port (logged).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sluice.entrypoints.openai.connection import bind_socket
from sluice.entrypoints.openai.errors import error_response
from sluice.router.metrics import RouterMetrics
from sluice.router.policies import POLICIES, make_policy
from sluice.router.proxy import Proxy
from sluice.router.relay import Relay, forward_headers
from sluice.router.replicas import ROLE, ReplicaProxy
from sluice.router.workers import Worker, WorkerPool

logger = logging.getLogger("sluice")

# /v1/models asks a worker with 5 s to connect and 5 s for any read.
MODELS_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=5.0)


def check_instance_url(url: str) -> None:
    """ValueError unless `url` is http(s)://host:port with no path beyond "/"."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if (parts.scheme not in ("http", "https") or not parts.hostname or port == -1
            or parts.path not in ("", "/") or parts.query or parts.fragment):
        raise ValueError(f"an instance URL must be http(s)://host:port, got {url!r}")


@dataclass(frozen=True)
class RouterArgs:
    prefills: tuple[tuple[str, int], ...] = ()  # (url, bootstrap port)
    decodes: tuple[str, ...] = ()
    workers: tuple[str, ...] = ()  # plain replicas (the other mode)
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

    @property
    def plain(self) -> bool:
        return bool(self.workers)

    def __post_init__(self) -> None:
        pd_given = [flag for flag, value in (
            ("--prefill", self.prefills), ("--decode", self.decodes),
            ("--prefill-policy", self.prefill_policy), ("--decode-policy", self.decode_policy))
            if value]
        if self.workers and pd_given:
            raise ValueError(f"--worker (plain replicas) cannot be combined with the PD flags "
                             f"{', '.join(pd_given)}: give --worker URL ... alone, or "
                             f"--prefill and --decode")
        if not self.workers and (not self.prefills or not self.decodes):
            raise ValueError("the router needs --worker URL (plain replicas), or at least one "
                             "--prefill and one --decode (PD)")
        urls = [u for u, _ in self.prefills] + list(self.decodes) + list(self.workers)
        for url in urls:
            check_instance_url(url)
        if len({u.rstrip("/") for u in self.workers}) < len(self.workers):
            raise ValueError(f"a --worker URL is given twice: {list(self.workers)}")
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


def _relay(args: RouterArgs, metrics: RouterMetrics) -> Relay:
    if args.plain:
        pool = WorkerPool([Worker(url.rstrip("/"), ROLE) for url in args.workers],
                          args.health_check_interval_s, args.health_failure_threshold)
        return ReplicaProxy(pool, {ROLE: make_policy(args.policy)}, args.max_retries,
                            args.request_timeout_s, metrics)
    pool = WorkerPool(
        [*(Worker(url.rstrip("/"), "prefill", bootstrap_port=port) for url, port in args.prefills),
         *(Worker(url.rstrip("/"), "decode") for url in args.decodes)],
        args.health_check_interval_s, args.health_failure_threshold)
    policies = {"prefill": make_policy(args.prefill_policy or args.policy),
                "decode": make_policy(args.decode_policy or args.policy)}
    return Proxy(pool, policies, args.max_retries, args.request_timeout_s, metrics)


def build_app(args: RouterArgs) -> FastAPI:
    metrics = RouterMetrics()
    proxy = _relay(args, metrics)
    pool = proxy.pool
    answering = ROLE if args.plain else "decode"  # whose /v1/models the router shows
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
    async def models(request: Request) -> Response:
        headers = forward_headers(request)
        for worker in pool.healthy(answering):
            try:
                async with proxy.session.get(f"{worker.url}/v1/models", headers=headers,
                                             timeout=MODELS_TIMEOUT,
                                             allow_redirects=False) as response:
                    content, status = await response.read(), response.status
            except Exception:  # noqa: BLE001 - try the next one
                continue
            return Response(content, status_code=status, media_type="application/json")
        return error_response(503, f"no healthy {answering} instance")

    @app.get("/health")
    async def health() -> Response:
        missing = [role for role in pool.roles if not pool.healthy(role)]
        if missing:
            return error_response(503, f"no healthy {' or '.join(missing)} instance")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(pool), media_type="text/plain; version=0.0.4")

    @app.get("/workers")
    async def workers() -> JSONResponse:
        return JSONResponse({role: [w.describe() for w in pool.of_role(role)]
                             for role in pool.roles})

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
        pool = app.state.pool
        await app.state.proxy.start()  # its HTTP session, in this loop
        pool.start()
        logger.info("router on http://%s:%d: %s", host, port, ", ".join(
            f"{role} {[w.url for w in pool.of_role(role)]}" for role in pool.roles))
        try:
            await server.serve(sockets=[sock])
        finally:
            await pool.stop()
            await app.state.proxy.close()

    try:
        asyncio.run(serve())
    finally:
        sock.close()
    logger.info("router stopped")
    return 0
