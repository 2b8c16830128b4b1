"""The OpenAI-compatible HTTP server: a FastAPI app over an AsyncLLM, run by uvicorn.

Routes: POST /v1/completions, /v1/chat/completions; GET /v1/models; POST /tokenize,
/detokenize; GET /health (200 while the engine runs, else 503), /metrics (Prometheus text),
/version, and /debug/engine (the engine-core pid and the scheduler's state now, asked of the
core: for tests and operators; `num_free_blocks == num_blocks` once every request is done).

A gate in front of every route counts requests in flight, checks `Authorization: Bearer KEY`
on /v1 and /debug paths when an API key is set (401 otherwise), and, once draining, answers
503 to everything but /metrics and /version. SIGTERM (or SIGINT) starts the drain: requests in
flight finish, then uvicorn stops, the engine core is shut down and `run_server` returns 0; a
second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import socket
from dataclasses import dataclass
from types import FrameType
from typing import Any

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

import sluice
from sluice.engine.arg_utils import EngineArgs
from sluice.engine.async_llm import AsyncLLM
from sluice.entrypoints.openai.errors import OpenAIError, error_response, install_error_handlers
from sluice.entrypoints.openai.metrics import CONTENT_TYPE, PrometheusStatsListener
from sluice.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from sluice.entrypoints.openai.serving_chat import OpenAIServingChat
from sluice.entrypoints.openai.serving_completion import OpenAIServingCompletion
from sluice.entrypoints.openai.serving_engine import OpenAIServing

logger = logging.getLogger("sluice")

_OPEN_WHILE_DRAINING = frozenset({"/metrics", "/version"})
_KEYED_PREFIXES = ("/v1", "/debug")


@dataclass(frozen=True, slots=True)
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free port, logged once bound
    api_key: str | None = None
    served_model_name: tuple[str, ...] = ()  # empty: the model folder
    disable_log_stats: bool = False
    enable_log_requests: bool = False
    max_log_len: int | None = None  # characters of prompt / number of ids in request logs
    uvicorn_log_level: str = "info"


@dataclass(slots=True)
class ServerState:
    """What the gate and the drain share (one per app)."""

    draining: bool = False
    in_flight: int = 0


class _Gate:
    """Pure ASGI middleware (streams pass through untouched): drain, API key, in-flight count."""

    def __init__(self, app: ASGIApp, state: ServerState, api_key: str | None) -> None:
        self.app = app
        self.state = state
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if self.state.draining and path not in _OPEN_WHILE_DRAINING:
            await error_response(503, "the server is shutting down")(scope, receive, send)
            return
        if (self.api_key is not None and path.startswith(_KEYED_PREFIXES)
                and scope["method"] != "OPTIONS" and not self._authorized(scope)):
            await error_response(401, "Unauthorized: a missing or wrong API key "
                                      "(send 'Authorization: Bearer KEY')")(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1

    def _authorized(self, scope: Scope) -> bool:
        assert self.api_key is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, key = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(
                    key.strip().encode(), self.api_key.encode())
        return False


def build_app(engine: AsyncLLM, args: ServerArgs) -> FastAPI:
    """The app for one engine; registers its Prometheus listener with the engine."""
    names = list(args.served_model_name) or [engine.model_config.model]
    serving = OpenAIServing(engine, names, log_requests=args.enable_log_requests,
                            max_log_len=args.max_log_len)
    completion = OpenAIServingCompletion(serving)
    chat = OpenAIServingChat(serving)
    spec = engine.scheduler_config.speculative_config
    metrics = PrometheusStatsListener(names[0], 0 if spec is None else spec.num_speculative_tokens)
    engine.add_stats_listener(metrics)
    state = ServerState()

    app = FastAPI(title="sluice", version=sluice.__version__, docs_url=None, redoc_url=None)
    app.state.server_state = state
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(_Gate, state=state, api_key=args.api_key)

    @app.get("/health")
    async def health() -> Response:
        error = engine.dead_error
        if error is not None:
            return error_response(503, f"the engine is dead: {error}")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": sluice.__version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/debug/engine")
    async def debug_engine() -> dict[str, Any]:
        info: dict[str, Any] = {"engine_core_pid": engine.engine_core_pid,
                                "dead_error": engine.dead_error, "num_blocks": engine.num_blocks,
                                "scheduler": None, "in_flight": state.in_flight}
        if info["dead_error"] is None:
            info["scheduler"] = msgspec.structs.asdict(await engine.get_stats())
        return info

    @app.get("/v1/models")
    async def list_models() -> Response:
        cards = [ModelCard(id=name, root=engine.model_config.model,
                           max_model_len=engine.max_model_len) for name in names]
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completion.create(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        return await chat.create(request, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        serving.model_name(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("give exactly one of prompt or messages", 400, "prompt")
        if request.prompt is not None:
            _, token_ids = serving.tokenize_prompt(request.prompt, request.add_special_tokens)
        else:
            assert request.messages is not None
            token_ids = serving.tokenize_chat(request.messages, request.add_generation_prompt,
                                              request.chat_template_kwargs)
        return TokenizeResponse(count=len(token_ids), max_model_len=engine.max_model_len,
                                tokens=token_ids)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        serving.model_name(request.model)
        vocab_size = engine.hf_config.vocab_size
        bad = [t for t in request.tokens if t >= vocab_size]
        if bad:
            raise OpenAIError(f"tokens must be integers in [0, {vocab_size}), got {bad[0]}",
                              400, "tokens")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(request.tokens))

    return app


class _DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM / SIGINT drains instead of stopping (see module doc)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after serving, and a
        # drained server exits 0.
        if self.state.draining:
            logger.warning("second %s: stopping now", signal.Signals(sig).name)
            self.should_exit = self.force_exit = True
            return
        logger.info("%s: draining %d request(s) in flight, refusing new ones",
                    signal.Signals(sig).name, self.state.in_flight)
        self.state.draining = True

    async def on_tick(self, counter: int) -> bool:
        if self.state.draining and self.state.in_flight == 0 and not self.should_exit:
            logger.info("drained: shutting down")
            self.should_exit = True
        return await super().on_tick(counter)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (not yet listen) before the model loads, so a taken port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot bind {host}:{port}: {exc}") from None
    sock.set_inheritable(True)
    return sock


def run_server(server_args: ServerArgs, engine_args: EngineArgs) -> int:
    """Serve until drained by SIGTERM / SIGINT; returns the exit status (0)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    sock = bind_socket(server_args.host, server_args.port)
    try:
        engine = AsyncLLM.from_engine_args(engine_args,
                                           log_stats=not server_args.disable_log_stats)
        try:
            app = build_app(engine, server_args)
            config = uvicorn.Config(app, log_level=server_args.uvicorn_log_level,
                                    lifespan="off", timeout_keep_alive=5)
            server = _DrainingServer(config, app.state.server_state)
            host, port = sock.getsockname()[:2]
            logger.info("serving %s (max_model_len %d) on http://%s:%d",
                        list(server_args.served_model_name) or engine.model_config.model,
                        engine.max_model_len, f"[{host}]" if ":" in host else host, port)
            asyncio.run(server.serve(sockets=[sock]))
        finally:
            engine.shutdown()
    finally:
        sock.close()
    logger.info("server stopped")
    return 0
