"""The bootstrap server of a prefill instance, and its clients.

One per prefill instance, in its engine-core process (started by the connector's scheduler
half), on `bootstrap_port` (0: a free port), plain HTTP with JSON bodies:

    PUT /route    a rank registers (RankRoute: its control address, transfer backend, page size,
                  KV dtype, the instance's TP size and the rank's KV heads); 400 for a body of
                  the wrong shape or a rank that does not fit the world size
    GET /route    the Route of every rank; 503 until every rank has registered
    GET /health   200 while the engine-core process lives, with the server's instance id (new
                  at every start: decode instances probe it and notice a restart)

Ranks register from their worker process with retries (`register`), since a small model's
worker can be ready before the server is up. Decode ranks read the route (`fetch_route`) and
check the TP sizes (one a multiple of the other: heads.py), page size, dtype and heads against
their own before asking for any block.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import msgspec

from sluice.kv_transfer.disagg.messages import Health, RankRoute, Route

logger = logging.getLogger("sluice")

_MAX_BODY = 1 << 16


class _Routes:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.instance_id = uuid.uuid4().hex
        self.lock = threading.Lock()
        self.ranks: dict[int, RankRoute] = {}


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    # One request per connection: a probe must reach a live server, not a handler thread
    # left over from a keep-alive connection.
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        logger.debug("bootstrap server: " + format, *args)

    def _reply(self, status: int, body: bytes = b"", content_type: str = "application/json"
               ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._reply(status, msgspec.json.encode({"error": message}))

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._reply(HTTPStatus.OK, msgspec.json.encode(
                Health(instance_id=self.server.routes.instance_id)))
        elif path == "/route":
            routes = self.server.routes
            with routes.lock:
                registered = dict(routes.ranks)
            if len(registered) < routes.world_size:
                self._error(HTTPStatus.SERVICE_UNAVAILABLE,
                            f"{len(registered)} of {routes.world_size} prefill ranks registered")
                return
            route = Route(world_size=routes.world_size,
                          ranks=[registered[r] for r in range(routes.world_size)],
                          instance_id=routes.instance_id)
            self._reply(HTTPStatus.OK, msgspec.json.encode(route))
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no route {path}")

    def do_PUT(self) -> None:  # noqa: N802
        if self.path.split("?", 1)[0] != "/route":
            self._error(HTTPStatus.NOT_FOUND, f"no route {self.path}")
            return
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= _MAX_BODY:
            self._error(HTTPStatus.BAD_REQUEST, f"a RankRoute body of 1 to {_MAX_BODY} bytes")
            return
        try:
            rank = msgspec.json.decode(self.rfile.read(length), type=RankRoute)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self._error(HTTPStatus.BAD_REQUEST, f"not a RankRoute: {exc}")
            return
        routes = self.server.routes
        if rank.world_size != routes.world_size or not 0 <= rank.rank < routes.world_size:
            self._error(HTTPStatus.BAD_REQUEST,
                        f"rank {rank.rank} of world size {rank.world_size} does not fit this "
                        f"instance's world size {routes.world_size}")
            return
        with routes.lock:
            routes.ranks[rank.rank] = rank
        logger.info("bootstrap server: rank %d registered (%s, %s)", rank.rank,
                    rank.control_address, rank.backend)
        self._reply(HTTPStatus.OK, b"{}")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], routes: _Routes) -> None:
        self.routes = routes
        super().__init__(address, _Handler)


class BootstrapServer:
    """Serves in a daemon thread from construction until `shutdown`."""

    def __init__(self, host: str, port: int, world_size: int) -> None:
        try:
            self._server = _Server((host, port), _Routes(world_size))
        except OSError as exc:
            raise ValueError(f"the PD bootstrap server cannot bind {host}:{port}: {exc} "
                             "(--disaggregation-bootstrap-port; 0 picks a free port)") from None
        self.host = host
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.2},
                                        name="pd-bootstrap-server", daemon=True)
        self._thread.start()
        logger.info("PD bootstrap server on http://%s:%d", host, self.port)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def num_registered(self) -> int:
        with self._server.routes.lock:
            return len(self._server.routes.ranks)

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def register(address: str, rank: RankRoute, timeout_s: float,
             stop: threading.Event | None = None) -> bool:
    """PUT the rank's route to the bootstrap server at host:port, retrying (with backoff up to
    1 s) until it answers 200 or `timeout_s` passes; False if it never did (logged)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    body = msgspec.json.encode(rank)
    last_error = "no attempt"
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            try:
                response = client.put(f"http://{address}/route", content=body,
                                      headers={"Content-Type": "application/json"})
                if response.status_code == 200:
                    return True
                last_error = f"HTTP {response.status_code}: {response.text[:200]}"
                if response.status_code == 400:
                    break  # will not get better
            except httpx.HTTPError as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            time.sleep(delay)
            delay = min(1.0, delay * 2)
    logger.error("PD rank %d could not register with the bootstrap server at %s: %s",
                 rank.rank, address, last_error)
    return False


class RouteUnavailable(Exception):
    """The bootstrap server answered, but not every rank has registered yet (503)."""


def fetch_route(client: httpx.Client, address: str) -> Route:
    """GET /route of the bootstrap server at host:port. Raises RouteUnavailable (503),
    httpx.HTTPError (unreachable), or ValueError (an answer that is not a Route)."""
    response = client.get(f"http://{address}/route")
    if response.status_code == 503:
        raise RouteUnavailable(response.text[:200])
    if response.status_code != 200:
        raise ValueError(f"bootstrap server {address} answered GET /route with HTTP "
                         f"{response.status_code}: {response.text[:200]}")
    try:
        return msgspec.json.decode(response.content, type=Route)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"bootstrap server {address} sent a bad route: {exc}") from None


def probe_health(client: httpx.Client, address: str) -> str | None:
    """The instance id of the prefill whose bootstrap server is at host:port, or None if it
    does not answer 200 (within the client's timeout)."""
    try:
        response = client.get(f"http://{address}/health")
        if response.status_code != 200:
            return None
        return msgspec.json.decode(response.content, type=Health).instance_id
    except (httpx.HTTPError, msgspec.ValidationError, msgspec.DecodeError):
        return None
