"""Requests that used to hurt `sluice serve` (issue 19): invalid Unicode (500s), a non-streaming
client leaving (a traceback in the log), chat templates sent by clients (run on the event loop
and unchecked), huge prompts and bodies (tokenized on the event loop, read in full), and a
client stalling its body through SIGTERM (the server never exited). Each is now a clean 4xx or
a bounded wait, with /health answering throughout and no KV block leaked."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.server.conftest import ServerProcess, launch_server
from tests.server.test_openai_server import wait_for_idle_engine, wait_until_running
from tests.server.test_server_errors import StreamReader, assert_error

pytestmark = pytest.mark.serial

MODEL = "tiny"
# A request body of this many bytes at most on the small-limit server.
SMALL_BODY_LIMIT = 2_000_000


@pytest.fixture(scope="module")
def strict_server(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[ServerProcess]:
    """A server that trusts request chat templates (with a 1 s bound) and takes bodies of at
    most 2 MB."""
    started = launch_server(qwen3_dir, tmp_path_factory.mktemp("strict") / "server.log",
                            "--served-model-name", MODEL, "--trust-request-chat-template",
                            "--chat-template-timeout", "1",
                            "--max-request-body-bytes", str(SMALL_BODY_LIMIT))
    yield started
    assert started.stop() == 0


def post(server: ServerProcess, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60, **kwargs)


def raw_post(server: ServerProcess, path: str, raw_json: str) -> httpx.Response:
    """A body as written (json= would escape a lone surrogate differently or refuse it)."""
    return httpx.post(f"{server.base_url}{path}", content=raw_json.encode(),
                      headers={"Content-Type": "application/json"}, timeout=60)


def assert_no_leak(server: ServerProcess) -> None:
    scheduler = wait_for_idle_engine(server)
    assert scheduler["num_free_blocks"] == scheduler["num_blocks"]


class HealthProbe(threading.Thread):
    """Times /health every 50 ms while a test does something heavy."""

    def __init__(self, server: ServerProcess) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.stop_event = threading.Event()
        self.latencies: list[float] = []

    def run(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self.stop_event.is_set():
                start = time.monotonic()
                assert http.get(f"{self.server.base_url}/health").status_code == 200
                self.latencies.append(time.monotonic() - start)
                time.sleep(0.05)

    def finish(self) -> float:
        self.stop_event.set()
        self.join(30)
        assert self.latencies
        return max(self.latencies)


# ---- 1. lone surrogates ----------------------------------------------------------------------

CHAT = '"messages": [{"role": "user", "content": "%s"}]'


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["fine", "a\\udfffb"], "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", "{" + CHAT % "hi \\ud800" + ', "max_tokens": 2}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", '
     '"text": "\\udc00"}]}], "max_tokens": 2}', "messages"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/tokenize", "{" + CHAT % "\\ud83d" + "}", "messages"),
])
def test_a_lone_surrogate_is_a_400_naming_it(server: ServerProcess, path: str, body: str,
                                             param: str) -> None:
    message = assert_error(raw_post(server, path, body), 400, "BadRequestError", param,
                           "is not valid Unicode: a lone surrogate")
    assert "\\ud" in message or "\\udfff" in message or "\\udc00" in message
    # A valid surrogate pair (an emoji) is fine.
    ok = raw_post(server, "/tokenize", '{"prompt": "\\ud83d\\ude00"}')
    assert ok.status_code == 200 and ok.json()["count"] > 0


# ---- 2. a non-streaming client that leaves ---------------------------------------------------


def test_a_leaving_non_streaming_client_logs_no_traceback(server: ServerProcess) -> None:
    log_before = len(server.log())
    cases = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "Leave"}]}),
             ("/v1/completions", {"prompt": "Leave me"})]

    async def leave(path: str, body: dict[str, Any]) -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            task = asyncio.create_task(http.post(
                f"{server.base_url}{path}",
                json={"model": MODEL, "max_tokens": 1000, "ignore_eos": True, **body}))
            await asyncio.to_thread(wait_until_running, server)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    for path, body in cases:
        asyncio.run(leave(path, body))
        assert_no_leak(server)
    # Each handler has returned (only this probe is in flight); uvicorn logs what a handler
    # raised right after it returns.
    deadline = time.monotonic() + 10
    while server.engine_info()["in_flight"] > 1:
        assert time.monotonic() < deadline, "a handler never returned"
        time.sleep(0.05)
    time.sleep(0.5)
    log = server.log()[log_before:]
    assert "Traceback" not in log and "InvalidStateError" not in log, log


# ---- 3. chat templates sent by clients -------------------------------------------------------

LOOP_TEMPLATE = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                 "{% endfor %}")
ECHO_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"


@pytest.mark.parametrize("where", ["chat_template", "chat_template_kwargs"])
def test_request_chat_templates_are_refused_without_trust(server: ServerProcess,
                                                          where: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                            "max_tokens": 2}
    if where == "chat_template":
        body["chat_template"] = ECHO_TEMPLATE
    else:
        body["chat_template_kwargs"] = {"chat_template": ECHO_TEMPLATE}
    for path in ("/v1/chat/completions", "/tokenize"):
        assert_error(post(server, path, body), 400, "BadRequestError", where,
                     "--trust-request-chat-template")


def test_chat_template_kwargs_cannot_set_the_renderers_own_parameters(
        server: ServerProcess) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
            "chat_template_kwargs": {"tokenize": False}}
    assert_error(post(server, "/v1/chat/completions", body), 400, "BadRequestError",
                 "chat_template_kwargs", "chat_template_kwargs.tokenize is not a template")


def test_a_trusted_request_template_renders_and_a_slow_one_is_stopped(
        strict_server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "hello"}]
    tokens = post(strict_server, "/tokenize", {"messages": messages,
                                               "chat_template": ECHO_TEMPLATE})
    assert tokens.status_code == 200, tokens.text
    text = httpx.post(f"{strict_server.base_url}/detokenize",
                      json={"tokens": tokens.json()["tokens"]}).json()["prompt"]
    assert text == "[user] hello"

    probe = HealthProbe(strict_server)
    probe.start()
    start = time.monotonic()
    response = post(strict_server, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 2,
        "chat_template_kwargs": {"chat_template": LOOP_TEMPLATE}})
    elapsed = time.monotonic() - start
    worst_health = probe.finish()
    assert_error(response, 400, "BadRequestError", "chat_template_kwargs",
                 "the chat template took longer than 1 s to render")
    assert elapsed < 5.0
    assert worst_health < 1.0, probe.latencies
    assert_no_leak(strict_server)


# ---- 4. huge prompts and bodies --------------------------------------------------------------


def test_a_prompt_too_large_for_the_context_is_refused_by_its_size_at_once(
        server: ServerProcess) -> None:
    huge = "word " * 2_000_000  # 10 MB
    start = time.monotonic()
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": huge,
                                                "max_tokens": 2})
    assert time.monotonic() - start < 3.0
    assert_error(response, 400, "BadRequestError", "prompt",
                 "maximum context length is 1024 tokens. However, your prompt is 10000000 "
                 "bytes long")
    # A list of prompts names the one at fault.
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": ["ok", huge],
                                                "max_tokens": 2})
    assert_error(response, 400, "BadRequestError", "prompt", "your prompt is 10000000 bytes")
    # Just under the size bound, a prompt is tokenized and judged by its token count.
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": "word " * 2000,
                                                  "max_tokens": 2}),
                 400, "BadRequestError", "max_tokens", "you requested")
    assert_no_leak(server)


def test_health_answers_while_a_huge_prompt_is_tokenized(server: ServerProcess) -> None:
    # /tokenize takes any length (it only counts): 4.5 MB is seconds of tokenizer work, and
    # its 1.8 million ids a JSON body the server must not build on the event loop.
    huge = "The quick brown fox jumps over the lazy dog. " * 100_000
    probe = HealthProbe(server)
    probe.start()
    time.sleep(0.2)
    start = time.monotonic()
    response = post(server, "/tokenize", {"prompt": huge})
    elapsed = time.monotonic() - start
    worst_health = probe.finish()
    assert response.status_code == 200 and response.json()["count"] > 1_000_000
    assert elapsed > 0.5, "too fast to show anything: make the prompt larger"
    assert len(probe.latencies) >= 5
    assert worst_health < 1.0, (elapsed, probe.latencies)


def read_response(sock: socket.socket, timeout_s: float) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of an HTTP/1.1 response read off a raw socket."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed without a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(int(line.split(":", 1)[1]) for line in lines
                  if line.lower().startswith("content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return int(lines[0].split()[1]), json.loads(body[:length])


def open_post(server: ServerProcess, path: str, headers: dict[str, str]) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    sock.sendall(head.encode())
    return sock


def test_a_body_over_the_limit_is_refused_before_it_is_read(
        server: ServerProcess, strict_server: ServerProcess) -> None:
    # Declared too large (50 MB > the default 32 MiB): refused on the headers alone.
    sock = open_post(server, "/v1/completions", {"Content-Length": str(50_000_000)})
    with sock:
        sock.sendall(b'{"prompt": "' + b"x" * 100_000)
        start = time.monotonic()
        status, body = read_response(sock, 10)
    assert time.monotonic() - start < 2.0
    assert status == 413
    assert body["error"]["type"] == "RequestTooLargeError" and body["error"]["code"] == 413
    assert "33554432 bytes (--max-request-body-bytes)" in body["error"]["message"]

    # Chunked, no length declared: refused once the limit is passed, the rest never read.
    sock = open_post(strict_server, "/v1/completions", {"Transfer-Encoding": "chunked"})
    with sock:
        piece = b"x" * 500_000
        sock.sendall(b'%x\r\n{"prompt": "\r\n' % len(b'{"prompt": "'))
        for _ in range(5):  # 2.5 MB > 2 MB; then the client stalls
            sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
        status, body = read_response(sock, 10)
    assert status == 413 and f"{SMALL_BODY_LIMIT} bytes" in body["error"]["message"]
    # Under the limit all is as before.
    assert post(strict_server, "/v1/completions", {"model": MODEL, "prompt": "small",
                                                   "max_tokens": 2}).status_code == 200
    assert httpx.get(f"{server.base_url}/health").status_code == 200


# ---- 5. SIGTERM with a client stalling its body ----------------------------------------------


def test_sigterm_with_a_stalled_body_exits_after_the_shutdown_timeout(
        make_server: Callable[..., ServerProcess]) -> None:
    server = make_server("--served-model-name", MODEL, "--shutdown-timeout", "2")
    # A long stream in flight too: it is aborted at the timeout, not waited for.
    reader = StreamReader(server, model=MODEL, prompt="Long", max_tokens=1000, n=8,
                          temperature=1.0, seed=0, extra_body={"ignore_eos": True})
    reader.start()
    assert reader.first_chunk.wait(30)
    sock = open_post(server, "/v1/completions", {"Content-Length": "1000"})
    with sock:
        sock.sendall(b'{"model": "tiny", "prompt": "never fin')
        deadline = time.monotonic() + 10
        while server.engine_info()["in_flight"] < 3:  # the stream, the stalled body, this
            assert time.monotonic() < deadline, "the stalled request never reached the app"
            time.sleep(0.05)
        # The probe counts itself until its handler returns, which may come after its
        # response reached us: let it end, so the drain sees the two requests alone.
        time.sleep(0.2)
        server.proc.send_signal(signal.SIGTERM)
        sent_at = time.monotonic()
        assert server.proc.wait(20) == 0
        assert time.monotonic() - sent_at < 2 + 5
        status, body = read_response(sock, 5)  # the stalled client was told
    assert status == 503 and "shutdown timeout" in body["error"]["message"]
    reader.join(10)
    assert not reader.is_alive()
    assert reader.usage is None  # cut off before its end
    log = server.log()
    assert "SIGTERM: draining 2 request(s) in flight" in log
    assert "shutdown timeout (2 s): aborting 2 request(s) still in flight" in log
    assert "drained: shutting down" in log and "did not end when aborted" not in log
    assert "server stopped" in log and "Traceback" not in log


def test_connections_are_accepted_with_nagle_off() -> None:
    """The listening socket sluice makes itself (bound before the model loads) must give
    accepted connections TCP_NODELAY, as asyncio's own sockets have: with Nagle's algorithm on,
    each response's second write on a kept-alive connection waited for the client's delayed
    ACK, 40 ms added to the first token of every request after a connection's first."""
    from sluice.entrypoints.openai.connection import bind_socket

    async def main() -> int:
        sock = bind_socket("127.0.0.1", 0)
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                             ) -> None:
            conn = writer.get_extra_info("socket")
            accepted.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(accepted, 10)
            writer.close()
        return value

    assert asyncio.run(main()) != 0
