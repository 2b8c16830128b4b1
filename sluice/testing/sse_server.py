"""A scripted HTTP/1.1 server of server-sent events, for the load generator's tests and for
measuring the client alone: it answers as fast as a socket takes bytes, so the client is the
limit.

    with SSEServer(handler) as server:       # its own thread and event loop, a free port
        server.url                           # http://127.0.0.1:PORT
        server.requests, server.connections  # what it was sent, connections accepted
        server.open_connections              # of those, not yet closed

A handler maps each request to a `Reply`: byte pieces written one write each (with `gap_s`
between them, so that each arrives in its own TCP read), then the connection is kept for the
next request or closed. `openai_handler()` streams OpenAI-shaped chunks, one per requested token
(`max_tokens` / `max_completion_tokens`), then the usage chunk and `[DONE]`.

As a process (for `sluice bench serve` or the client speed benchmark), it prints its URL first:
    python -m sluice.testing.sse_server --port 0 --events-per-write 1 [--step-ms 10]
With `--step-ms`, every running stream gets its next event in the same step, once a step, as an
engine's decode steps send them (256 streams and 10 ms steps: 25.6k events/s, the H200 run's
rate, each event in its own TCP read when the client keeps up).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

HOST = "127.0.0.1"
LAST_CHUNK = b"0\r\n\r\n"


@dataclass(frozen=True, slots=True)
class HTTPRequest:
    method: str
    target: str
    headers: dict[str, str]  # names in lower case
    body: bytes
    connection: int  # which accepted connection it came on, from 0
    seq: int  # its place among that connection's requests, from 0


@dataclass(frozen=True, slots=True)
class Reply:
    pieces: Sequence[bytes]
    gap_s: float = 0.0  # pause after each piece
    close: bool = False  # close the connection after the last piece
    # One piece a server step (SSEServer.step_s), every stepped answer's piece in the same step,
    # as an engine's decode step sends a token to every running stream at once.
    stepped: bool = False


Handler = Callable[[HTTPRequest], Reply]


def head(status: int, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


STREAM_HEAD = head(200, {"content-type": "text/event-stream", "transfer-encoding": "chunked"})


def chunk(payload: bytes) -> bytes:
    """One chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def sse(event: dict[str, Any] | str) -> bytes:
    data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
    return b"data: " + data.encode() + b"\n\n"


def json_reply(status: int, body: dict[str, Any], close: bool = False) -> Reply:
    data = json.dumps(body).encode()
    return Reply([head(status, {"content-type": "application/json",
                                "content-length": str(len(data))}) + data], close=close)


def completion_chunk(text: str, finish_reason: str | None = None) -> dict[str, Any]:
    return {"id": "cmpl-0123456789abcdef0123456789abcdef", "object": "text_completion",
            "created": 1700000000, "model": "fake",
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason}], "usage": None}


def chat_chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-0123456789abcdef0123456789abcdef",
            "object": "chat.completion.chunk", "created": 1700000000, "model": "fake",
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish_reason}], "usage": None}


def usage_chunk(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"id": "cmpl-0123456789abcdef0123456789abcdef", "object": "text_completion",
            "created": 1700000000, "model": "fake", "choices": [],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def openai_events(chat: bool, num_tokens: int, prompt_tokens: int = 1) -> list[bytes]:
    """The SSE events of a streamed answer of `num_tokens` tokens, each token " tok"."""
    if chat:
        token = sse(chat_chunk({"content": " tok"}))
        events = [sse(chat_chunk({"role": "assistant", "content": ""}))]
        events += [token] * num_tokens + [sse(chat_chunk({}, "length"))]
    else:
        token = sse(completion_chunk(" tok"))
        events = [token] * num_tokens + [sse(completion_chunk("", "length"))]
    return events + [sse(usage_chunk(prompt_tokens, num_tokens)), sse("[DONE]")]


def openai_handler(events_per_write: int = 1, stepped: bool = False) -> Handler:
    """An OpenAI-compatible fake: GET /v1/models, and streamed completions and chat
    completions of " tok" tokens, as many as asked, `events_per_write` chunks in one write (in
    server steps if `stepped`)."""
    if events_per_write < 1:
        raise ValueError(f"events_per_write must be >= 1, got {events_per_write}")

    def handle(request: HTTPRequest) -> Reply:
        if request.method == "GET" and request.target == "/v1/models":
            return json_reply(200, {"object": "list", "data": [
                {"id": "fake", "object": "model", "root": "fake", "owned_by": "sluice"}]})
        if request.method != "POST" or not request.target.endswith("completions"):
            return json_reply(404, {"error": {"message": f"no route {request.target}"}})
        payload = json.loads(request.body)
        chat = request.target.endswith("chat/completions")
        num_tokens = int(payload.get("max_completion_tokens" if chat else "max_tokens") or 16)
        prompt_tokens = len(str(payload.get("prompt") or payload.get("messages")).split())
        body = [chunk(e) for e in openai_events(chat, num_tokens, prompt_tokens)] + [LAST_CHUNK]
        pieces = [STREAM_HEAD] + [b"".join(body[i:i + events_per_write])
                                  for i in range(0, len(body), events_per_write)]
        return Reply(pieces, stepped=stepped)

    return handle


@dataclass
class SSEServer:
    handler: Handler
    port: int = 0
    step_s: float = 0.0  # period of the stepped answers' writes
    requests: list[HTTPRequest] = field(default_factory=list)
    connections: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _task: asyncio.Task | None = None
    _handlers: set[asyncio.Task] = field(default_factory=set)
    # Stepped answers in flight: [writer, the pieces left, set when all are written].
    _stepped: list[list[Any]] = field(default_factory=list)
    _stepper: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def open_connections(self) -> int:
        """Connections accepted and not yet closed (by either side)."""
        return len(self._handlers)

    async def serve(self, ready: Callable[[], None] | None = None) -> None:
        server = await asyncio.start_server(self._connection, HOST, self.port)
        self.port = server.sockets[0].getsockname()[1]
        if ready is not None:
            ready()
        async with server:
            await server.serve_forever()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        connection = self.connections
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            for seq in itertools.count():
                try:
                    head_bytes = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                request_line, *lines = head_bytes.decode("latin-1").split("\r\n")
                method, target, _ = request_line.split(" ", 2)
                headers = {}
                for line in lines:
                    if line:
                        name, _, value = line.partition(":")
                        headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                request = HTTPRequest(method, target, headers, body, connection, seq)
                self.requests.append(request)
                reply = self.handler(request)
                if reply.stepped:
                    written = asyncio.get_running_loop().create_future()
                    self._stepped.append([writer, iter(reply.pieces), written])
                    if self._stepper is None:
                        self._stepper = asyncio.create_task(self._step())
                    await written
                for piece in () if reply.stepped else reply.pieces:
                    writer.write(piece)
                    await writer.drain()
                    # Let other streams write in between, as a server of many streams does.
                    await asyncio.sleep(reply.gap_s)
                if reply.close:
                    return
        except asyncio.CancelledError:
            pass  # the server stops
        except ConnectionError:
            pass  # the client went away mid-answer
        finally:
            self._handlers.discard(task)
            writer.close()

    async def _step(self) -> None:
        """Each step, the next piece of every stepped answer; then sleep out the step."""
        loop = asyncio.get_running_loop()
        while self._stepped:
            start = loop.time()
            running = []
            for entry in self._stepped:
                writer, pieces, written = entry
                piece = next(pieces, None)
                if piece is None:
                    written.set_result(None)
                else:
                    writer.write(piece)
                    running.append(entry)
            self._stepped = running  # answers that come in during the sleep join the next step
            await asyncio.sleep(max(0.0, self.step_s - (loop.time() - start)))
        self._stepper = None

    def __enter__(self) -> SSEServer:
        started = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            assert self._loop is not None
            self._loop.run_until_complete(self._serve_until_cancelled(started.set))

        self._thread = threading.Thread(target=run, name="sse-server", daemon=True)
        self._thread.start()
        if not started.wait(10):
            raise RuntimeError("the SSE test server did not start in 10 s")
        return self

    async def _serve_until_cancelled(self, ready: Callable[[], None]) -> None:
        self._task = asyncio.current_task()
        try:
            await self.serve(ready)
        except asyncio.CancelledError:
            handlers = list(self._handlers)
            for handler in handlers:
                handler.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._thread is not None
        assert self._task is not None
        self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)
        self._loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="0: a free one")
    parser.add_argument("--events-per-write", type=int, default=1)
    parser.add_argument("--step-ms", type=float, default=None,
                        help="write every stream's next event together once per step of this "
                             "period, as an engine's decode steps do (default: each stream as "
                             "fast as it can)")
    ns = parser.parse_args()
    server = SSEServer(openai_handler(ns.events_per_write, stepped=ns.step_ms is not None),
                       port=ns.port, step_s=(ns.step_ms or 0.0) / 1000)
    from sluice.event_loop import run_event_loop  # uvloop when installed

    run_event_loop(server.serve(lambda: print(server.url, flush=True)))


if __name__ == "__main__":
    main()
