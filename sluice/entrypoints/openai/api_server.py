"""The OpenAI-compatible HTTP server: a FastAPI app over an AsyncLLM, run by uvicorn.

Routes: POST /v1/completions, /v1/chat/completions; GET /v1/models, /v1/models/{id}; POST /tokenize,
/detokenize; GET /health (200 while the engine runs, else 503), /metrics (Prometheus text),
/version, and /debug/engine (the engine-core and worker pids, which API server answered, the
tensor-parallel size and whether the experts are split whole (expert parallelism), the
scheduler's state now and the KV cache's integrity check, asked of the core: for tests and
operators; `num_free_blocks == num_blocks` once every request is done).

A gate in front of every route counts requests in flight, checks `Authorization: Bearer KEY`
on /v1 and /debug paths when an API key is set (401 otherwise), and, once draining, answers
503 to everything but /metrics and /version; it refuses a request body over
`max_request_body_bytes` with a 413 as soon as the Content-Length says so, or, without one, as
soon as that many bytes have come (the rest is never read), and echoes an `X-Request-Id`
header. SIGTERM (or SIGINT) starts the drain: requests in flight finish, then uvicorn stops, the
engine core is shut down and `run_server` returns 0; requests still in flight after
`shutdown_timeout_s` (a client stalling its body, a long generation) are aborted then. A second
signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice import stage_trace
from sluice.engine.arg_utils import EngineArgs
from sluice.engine.async_llm import AsyncLLM
from sluice.engine.core_client import CoreAttachment
from sluice.entrypoints.openai.chat_template import load_chat_template
from sluice.entrypoints.openai.connection import bind_socket
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
from sluice.entrypoints.openai.reasoning import REASONING_PARSERS
from sluice.entrypoints.openai.serving_chat import OpenAIServingChat
from sluice.entrypoints.openai.serving_completion import OpenAIServingCompletion
from sluice.entrypoints.openai.serving_engine import OpenAIServing, ServingOptions
from sluice.entrypoints.openai.text_inputs import ids_json
from sluice.entrypoints.openai.tool_parsers import TOOL_PARSERS
from sluice.version import __version__

logger = logging.getLogger("sluice")

_OPEN_WHILE_DRAINING = frozenset({"/metrics", "/version"})
# After the shutdown timeout aborts the requests in flight, how long they get to end.
_ABORT_GRACE_S = 5.0
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
    max_request_body_bytes: int = 32 << 20  # larger bodies get a 413 before they are read
    # After SIGTERM, requests still in flight this long are aborted (Kubernetes kills a pod
    # 30 s after SIGTERM by default: exit before that, cleanly).
    shutdown_timeout_s: float = 25.0
    trust_request_chat_template: bool = False  # run chat templates that requests send
    chat_template: str | None = None  # a file or the template itself (None: the model's)
    chat_template_timeout_s: float = 10.0  # longest a chat template may render
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # see tool_parsers.TOOL_PARSERS
    reasoning_parser: str | None = None  # see reasoning.REASONING_PARSERS

    def __post_init__(self) -> None:
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, "
                             f"got {self.max_request_body_bytes}")
        if self.shutdown_timeout_s < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, "
                             f"got {self.shutdown_timeout_s}")
        if self.chat_template_timeout_s <= 0:
            raise ValueError(f"chat_template_timeout must be > 0 seconds, "
                             f"got {self.chat_template_timeout_s}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        load_chat_template(self.chat_template)  # a bad path fails at start, naming it
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")

    def serving_options(self) -> ServingOptions:
        return ServingOptions(
            log_requests=self.enable_log_requests, max_log_len=self.max_log_len,
            trust_request_chat_template=self.trust_request_chat_template,
            chat_template=load_chat_template(self.chat_template),
            chat_template_timeout_s=self.chat_template_timeout_s,
            enable_auto_tool_choice=self.enable_auto_tool_choice,
            tool_call_parser=self.tool_call_parser, reasoning_parser=self.reasoning_parser)


@dataclass(slots=True)
class ServerState:
    """What the gate and the drain share (one per app)."""

    draining: bool = False
    in_flight: int = 0
    # One per request in flight: set by the shutdown timeout to end the request.
    abort_events: set[asyncio.Event] = field(default_factory=set)

    def abort_all(self) -> None:
        for event in self.abort_events:
            event.set()


class _BodyTooLarge(Exception):
    """Raised into the app from `receive` once a body passes the limit (the 413 is sent)."""


class _ShuttingDown(Exception):
    """Raised into the app from `receive` when the shutdown timeout ends a request whose body
    has not all come (the 503 is sent)."""


_DISCONNECT: Message = {"type": "http.disconnect"}


async def _receive_unless(receive: Receive, aborted: asyncio.Event) -> Message | None:
    """The next message, or None once `aborted` is set first."""
    if aborted.is_set():
        return None
    message = asyncio.ensure_future(receive())
    waiter = asyncio.ensure_future(aborted.wait())
    try:
        await asyncio.wait((message, waiter), return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not message.done():
            message.cancel()
    return message.result() if message.done() and not message.cancelled() else None


class _Gate:
    """Pure ASGI middleware (streams pass through untouched): drain, API key, in-flight count,
    the request body limit, X-Request-Id."""

    def __init__(self, app: ASGIApp, state: ServerState, api_key: str | None,
                 max_body_bytes: int) -> None:
        self.app = app
        self.state = state
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

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
        request_id = _header(scope, b"x-request-id")
        if request_id is not None:
            send = _with_request_id(send, request_id)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(scope, receive, send)
            return
        self.state.in_flight += 1
        try:
            await self._call_limited(scope, receive, send)
        finally:
            self.state.in_flight -= 1

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(413, f"the request body is larger than the server's limit of "
                                  f"{self.max_body_bytes} bytes (--max-request-body-bytes)"
                             )(scope, receive, send)

    async def _call_limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app, with a body counted as it is read: past the limit the 413 goes out and
        the app's own answer (FastAPI turns the failed read into a 400) is dropped. When the
        shutdown timeout aborts the request, a body still coming gets a 503 (its handler never
        starts), and a handler already running sees its client disconnect (which aborts its
        engine requests, streamed or not)."""
        received = 0
        body_done = False
        answered = False  # by the gate: the app's own answer is dropped
        aborted = asyncio.Event()

        async def counted_receive() -> Message:
            nonlocal received, body_done, answered
            message = await _receive_unless(receive, aborted)
            if message is None:
                if body_done:
                    return _DISCONNECT
                answered = True
                await error_response(503, "the server is shutting down (shutdown timeout)")(
                    scope, receive, send)
                raise _ShuttingDown
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_body_bytes and not answered:
                    answered = True
                    await self._too_large(scope, receive, send)
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            if not answered:
                await send(message)

        self.state.abort_events.add(aborted)
        try:
            await self.app(scope, counted_receive, guarded_send)
        except (_BodyTooLarge, _ShuttingDown):
            pass
        finally:
            self.state.abort_events.discard(aborted)

    def _authorized(self, scope: Scope) -> bool:
        assert self.api_key is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, key = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(
                    key.strip().encode(), self.api_key.encode())
        return False


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _with_request_id(send: Send, request_id: str) -> Send:
    """`send` that puts the client's X-Request-Id on the response (errors included)."""
    encoded = request_id.encode("latin-1")

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
            message = {**message, "headers": [*headers, (b"x-request-id", encoded)]}
        await send(message)

    return send_with_id


def build_app(engine: AsyncLLM, args: ServerArgs, default_model_name: str | None = None
              ) -> FastAPI:
    """The app for one engine; registers its Prometheus listener with the engine. Served
    under `args.served_model_name`, else `default_model_name` (the model as the user named
    it, a hub id say), else the model folder."""
    names = list(args.served_model_name) or [default_model_name or engine.model_config.name
                                             or engine.model_config.model]
    serving = OpenAIServing(engine, names, args.serving_options())
    completion = OpenAIServingCompletion(serving)
    chat = OpenAIServingChat(serving)
    spec = engine.scheduler_config.speculative_config
    kv_transfer = engine.config.kv_transfer_config
    metrics = PrometheusStatsListener(
        names[0], 0 if spec is None else spec.num_speculative_tokens,
        kv_pool=kv_transfer is not None and kv_transfer.kv_connector == "KVPoolConnector",
        record_engine=engine.client == 0)
    engine.add_stats_listener(metrics)
    state = ServerState()

    app = FastAPI(title="sluice", version=__version__, docs_url=None, redoc_url=None)
    app.state.server_state = state
    app.state.metrics = metrics
    app.state.serving = serving
    install_error_handlers(app)
    app.add_middleware(_Gate, state=state, api_key=args.api_key,
                       max_body_bytes=args.max_request_body_bytes)

    @app.get("/health")
    async def health() -> Response:
        error = engine.dead_error
        if error is not None:
            return error_response(503, f"the engine is dead: {error}")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/debug/engine")
    async def debug_engine() -> dict[str, Any]:
        parallel = engine.config.parallel_config
        info: dict[str, Any] = {"engine_core_pid": engine.engine_core_pid,
                                "worker_pids": engine.worker_pids,
                                "api_server": {"index": engine.client, "pid": os.getpid()},
                                "parallel": {
                                    "tensor_parallel_size": parallel.tensor_parallel_size,
                                    "enable_expert_parallel": parallel.enable_expert_parallel},
                                "dead_error": engine.dead_error, "num_blocks": engine.num_blocks,
                                "scheduler": None, "in_flight": state.in_flight}
        if info["dead_error"] is None:
            info["scheduler"] = msgspec.structs.asdict(await engine.get_stats())
            try:  # the KV cache's invariants (every block accounted for), checked now
                await engine.call_utility("check_integrity")
                info["integrity"] = "ok"
            except RuntimeError as exc:
                info["integrity"] = str(exc)
        return info

    def model_card(name: str) -> ModelCard:
        return ModelCard(id=name, root=engine.model_config.model,
                         max_model_len=engine.max_model_len)

    @app.get("/v1/models")
    async def list_models() -> Response:
        cards = [model_card(name) for name in names]
        return Response(ModelList(data=cards).model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> Response:
        if model_id not in names:
            raise OpenAIError(f"The model `{model_id}` does not exist. Served models: {names}",
                              404, "model")
        return Response(model_card(model_id).model_dump_json(), media_type="application/json")

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        stage_trace.mark("api_in")
        return await completion.create(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest,
                                     raw_request: Request) -> Response:
        return await chat.create(request, raw_request)

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(request: TokenizeRequest) -> Response:
        serving.model_name(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("give exactly one of prompt or messages", 400, "prompt")
        if request.prompt is not None:
            _, token_ids = await serving.tokenize_prompt(request.prompt,
                                                         request.add_special_tokens,
                                                         check_size=False)
        else:
            tools = (None if not request.tools
                     else [tool.model_dump(exclude_none=True) for tool in request.tools])
            token_ids = await serving.tokenize_chat(request, tools)
        # The body is built off the event loop: a 10 MB prompt has two million ids, whose
        # validation and json.dumps would hold the loop (and /health) for a second.
        tokens = await serving.text_inputs.run(ids_json, token_ids)
        return Response(f'{{"count":{len(token_ids)},"max_model_len":{engine.max_model_len},'
                        f'"tokens":{tokens}}}', media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        serving.model_name(request.model)
        vocab_size = engine.hf_config.vocab_size
        bad = [t for t in request.tokens if t >= vocab_size]
        if bad:
            raise OpenAIError(f"tokens must be integers in [0, {vocab_size}), got {bad[0]}",
                              400, "tokens")
        text = await serving.text_inputs.run(engine.tokenizer.decode, request.tokens)
        return DetokenizeResponse(prompt=text)

    return app


class _DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM / SIGINT drains instead of stopping (see module doc)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout_s: float
                 ) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout_s = shutdown_timeout_s
        self.drain_started: float | None = None
        self.aborted = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after serving, and a
        # drained server exits 0.
        if self.state.draining:
            logger.warning("second %s: stopping now", signal.Signals(sig).name)
            self.should_exit = self.force_exit = True
            return
        logger.info("%s: draining %d request(s) in flight, refusing new ones (at most %g s)",
                    signal.Signals(sig).name, self.state.in_flight, self.shutdown_timeout_s)
        self.state.draining = True
        self.drain_started = time.monotonic()

    async def on_tick(self, counter: int) -> bool:
        if self.state.draining and not self.should_exit:
            if self.state.in_flight == 0:
                logger.info("drained: shutting down")
                self.should_exit = True
            elif self.drain_started is not None:
                waited = time.monotonic() - self.drain_started
                if waited >= self.shutdown_timeout_s and not self.aborted:
                    # uvicorn would wait for these without end (a client stalling its body):
                    # end each one (see _Gate._call_limited); the drain then completes.
                    logger.warning("shutdown timeout (%g s): aborting %d request(s) still in "
                                   "flight", self.shutdown_timeout_s, self.state.in_flight)
                    self.aborted = True
                    self.state.abort_all()
                elif waited >= self.shutdown_timeout_s + _ABORT_GRACE_S:
                    logger.warning("%d request(s) did not end when aborted: stopping now",
                                   self.state.in_flight)
                    self.should_exit = self.force_exit = True
        return await super().on_tick(counter)


def run_server(server_args: ServerArgs, engine_args: EngineArgs,
               model_name: str | None = None, *, attach: CoreAttachment | None = None,
               sock: socket.socket | None = None) -> int:
    """Serve until drained by SIGTERM / SIGINT; returns the exit status (0). `model_name`: the
    model as the user named it (served under that name unless --served-model-name). One of
    several API servers (multi_server) passes the engine core to `attach` to and the
    listening socket it shares with the others."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    if sock is None:
        sock = bind_socket(server_args.host, server_args.port)
    try:
        engine = AsyncLLM.from_engine_args(engine_args,
                                           log_stats=not server_args.disable_log_stats,
                                           attach=attach)
        try:
            app = build_app(engine, server_args, model_name)
            config = uvicorn.Config(app, log_level=server_args.uvicorn_log_level,
                                    lifespan="off", timeout_keep_alive=5)
            server = _DrainingServer(config, app.state.server_state,
                                     server_args.shutdown_timeout_s)
            host, port = sock.getsockname()[:2]
            logger.info("%sserving %s (max_model_len %d) on http://%s:%d",
                        "" if attach is None else f"API server {attach.client}: ",
                        list(server_args.served_model_name) or model_name
                        or engine.model_config.name or engine.model_config.model,
                        engine.max_model_len, f"[{host}]" if ":" in host else host, port)
            try:
                asyncio.run(server.serve(sockets=[sock]))
            finally:
                app.state.serving.text_inputs.shutdown()
        finally:
            engine.shutdown()
    finally:
        sock.close()
    logger.info("server stopped")
    return 0
