"""The replica router's request path against scripted workers: real HTTP servers on loopback
(sluice.testing.sse_server) that answer as each test's script says, the router's app driven
in-process: which failures are retried on the other worker, which drop a worker, what a 4xx and
a stream that breaks before or after its first token look like to the client. The same path
with real replicas and a SIGKILL: test_replica_router.py."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from sluice.router.server import RouterArgs, build_app
from sluice.testing.sse_server import (
    LAST_CHUNK,
    STREAM_HEAD,
    HTTPRequest,
    Reply,
    SSEServer,
    chunk,
    json_reply,
)

DONE = b"data: [DONE]\n\n"
A, B = "A", "B"  # the scripts' workers; their URLs are the servers'


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def token(text: str, finish: str | None = None) -> bytes:
    return sse({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


def whole(text: str, finish: str = "length", completion_tokens: int = 1) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}],
            "usage": {"prompt_tokens": 3, "completion_tokens": completion_tokens,
                      "total_tokens": 3 + completion_tokens}}


def stream_of(*parts: bytes, broken: bool = False) -> Reply:
    """A chunked event stream of `parts`; `broken`: the connection closes before the chunked
    body's end (the client reads a protocol error), else the body ends (with or without a
    [DONE] among the parts)."""
    pieces = [STREAM_HEAD] + [chunk(part) for part in parts]
    if broken:
        return Reply(pieces, close=True)
    return Reply(pieces + [LAST_CHUNK])


Script = Callable[[HTTPRequest], Reply] | None  # None: nothing listens (connection refused)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def route(scripts: dict[str, Script], body: dict[str, Any],
          headers: dict[str, str] | None = None
          ) -> tuple[httpx.Response, list[str], dict[str, Any]]:
    """POST `body` to a replica router over workers A and B (round_robin: A first), each a
    loopback server answering as its script says; the response, the workers asked in order
    ("A", "B"), and /workers."""
    asked: list[str] = []

    def handler(name: str, script: Callable[[HTTPRequest], Reply]
                ) -> Callable[[HTTPRequest], Reply]:
        def handle(request: HTTPRequest) -> Reply:
            if request.target.endswith("completions"):
                asked.append(name)
                return script(request)
            return json_reply(200, {})  # /health and the like

        return handle

    with ExitStack() as stack:
        urls = []
        for name in (A, B):
            script = scripts[name]
            if script is None:
                urls.append(f"http://127.0.0.1:{_free_port()}")
            else:
                urls.append(stack.enter_context(SSEServer(handler(name, script))).url)

        async def main() -> tuple[httpx.Response, dict[str, Any]]:
            app = build_app(RouterArgs(workers=tuple(urls), max_retries=2))
            for worker in app.state.pool.workers:
                worker.healthy = True
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                         base_url="http://router") as client:
                response = await client.post("/v1/completions", json=body, headers=headers)
                workers = (await client.get("/workers")).json()
                metrics = (await client.get("/metrics")).text
            await app.state.proxy.close()
            workers["retries"] = sum(float(line.split()[-1]) for line in metrics.splitlines()
                                     if line.startswith("sluice_router_retries_total"))
            return response, workers

        response, workers = asyncio.run(main())
    return response, asked, workers


def ok(text: str) -> Script:
    return lambda request: json_reply(200, whole(text))


def test_a_5xx_is_retried_on_the_other_worker_which_stays_routable() -> None:
    response, asked, workers = route(
        {A: lambda r: json_reply(503, {"error": {"message": "draining"}}), B: ok("b")},
        {"prompt": "x", "max_tokens": 1})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "b"
    assert asked == [A, B] and workers["retries"] == 1
    a = workers["worker"][0]
    assert a["healthy"] and a["num_errors"] == 1 and "HTTP 503" in a["last_error"]


def test_a_refused_connection_drops_the_worker_and_is_retried() -> None:
    refused = None  # a free port nothing listens on

    def answer(stream: bool) -> Script:
        return (lambda r: stream_of(token("b"), DONE)) if stream else ok("b")

    for stream in (False, True):
        response, asked, workers = route({A: refused, B: answer(stream)},
                                         {"prompt": "x", "stream": stream})
        assert response.status_code == 200 and asked == [B]
        assert [w["healthy"] for w in workers["worker"]] == [False, True]


def test_a_4xx_is_the_clients_answer_unchanged_and_not_retried() -> None:
    refusal = {"error": {"message": "max_tokens must be >= 1", "type": "BadRequestError",
                         "param": "max_tokens", "code": 400}}
    for stream in (False, True):
        response, asked, workers = route({A: lambda r: json_reply(400, refusal),
                                          B: ok("b")},
                                         {"prompt": "x", "max_tokens": -1, "stream": stream})
        assert response.status_code == 400 and response.json() == refusal
        assert asked == [A] and workers["retries"] == 0


def test_a_stream_that_breaks_before_its_first_token_is_retried() -> None:
    role_only = sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    for script in (lambda r: stream_of(role_only, broken=True),
                   lambda r: stream_of(role_only, DONE),  # ended, nothing said
                   lambda r: stream_of(sse({"error": {"message": "engine died"}}), DONE),
                   lambda r: stream_of(sse({"choices": [{"index": 0, "text": "",
                                                         "finish_reason": "error"}]}), DONE)):
        response, asked, workers = route({A: script, B: lambda r: stream_of(token("b"), DONE)},
                                         {"prompt": "x", "stream": True})
        assert response.status_code == 200 and asked == [A, B]
        assert response.text == (token("b") + DONE).decode()
        assert workers["retries"] == 1


def test_a_whole_answer_that_failed_before_any_token_is_retried() -> None:
    response, asked, _ = route(
        {A: lambda r: json_reply(200, whole("", "error", completion_tokens=0)),
         B: ok("b")}, {"prompt": "x"})
    assert response.json()["choices"][0]["text"] == "b" and asked == [A, B]


@pytest.mark.parametrize("broken", [True, False])
def test_a_stream_that_breaks_after_its_first_token_ends_with_an_error_event(
        broken: bool) -> None:
    # `broken` False: the stream ends without [DONE] (its body ended between events).
    response, asked, workers = route({A: lambda r: stream_of(token("a"), token("b"),
                                                             broken=broken),
                                      B: ok("never")}, {"prompt": "x", "stream": True})
    assert response.status_code == 200 and asked == [A]
    events = [line[len("data: "):] for line in response.text.splitlines() if line]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
    error = json.loads(events[2])["error"]
    assert error["code"] == 502 and error["type"] == "BadGatewayError"
    url = workers["worker"][0].get("url")
    assert error["message"].startswith(f"the worker instance {url} failed mid-stream"), (
        error, workers["worker"][0])
    assert events[3:] == ["[DONE]"]
    assert workers["worker"][0]["in_flight"] == workers["worker"][0]["streaming"] == 0


def test_the_clients_api_key_and_request_id_reach_the_worker() -> None:
    """Instances started with --api-key: the client's Authorization header (and X-Request-Id)
    go with the request; without the key the worker's 401 is the client's answer."""
    seen: list[dict[str, str]] = []

    def keyed(request: HTTPRequest) -> Reply:
        seen.append(request.headers)
        if request.headers.get("authorization") != "Bearer k":
            return json_reply(401, {"error": {"message": "bad key", "code": 401}})
        return json_reply(200, whole("a"))

    response, asked, _ = route({A: keyed, B: keyed}, {"prompt": "x"},
                               headers={"Authorization": "Bearer k", "X-Request-Id": "r1"})
    assert response.status_code == 200 and asked == [A]
    assert seen[-1]["authorization"] == "Bearer k" and seen[-1]["x-request-id"] == "r1"
    response, asked, _ = route({A: keyed, B: keyed}, {"prompt": "x", "stream": True})
    assert response.status_code == 401 and asked == [A]
    assert "authorization" not in seen[-1]


def test_a_stream_is_relayed_byte_for_byte() -> None:
    """What the worker streamed is what the client reads, however its writes split the events:
    mid-line, several events in one write, comment lines, and text with characters other line
    splitters end lines at (U+2028, U+0085, U+001E, sent raw as UTF-8)."""
    first = ("data: " + json.dumps({"choices": [{"index": 0, "text": "a\u2028b\x85c\x1ed",
                                                 "finish_reason": None}]},
                                   ensure_ascii=False) + "\n\n").encode()
    parts = [b": a comment line\n\n", first[:9], first[9:-1], first[-1:] + token("e"),
             token("f") + token("", "length") + DONE]
    response, asked, workers = route(
        {A: lambda r: Reply([STREAM_HEAD] + [chunk(p) for p in parts] + [LAST_CHUNK],
                            gap_s=0.01),
         B: ok("never")}, {"prompt": "x", "stream": True})
    assert response.status_code == 200 and asked == [A]
    assert response.content == b"".join(parts)
    assert workers["retries"] == 0


def test_a_client_that_goes_away_closes_the_workers_stream() -> None:
    """The client leaves after the first token: the router closes its connection to the
    worker (so an engine would abort the request) and its counts of the request end."""
    import uvicorn

    events = [token("a")] + [token("x")] * 500 + [DONE]  # 5 s of events, 10 ms apart
    with SSEServer(lambda r: Reply([STREAM_HEAD] + [chunk(e) for e in events] + [LAST_CHUNK],
                                   gap_s=0.01)) as worker:

        async def main() -> dict[str, Any]:
            app = build_app(RouterArgs(workers=(worker.url,)))
            app.state.pool.workers[0].healthy = True
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
            serving = asyncio.ensure_future(server.serve(sockets=[sock]))
            try:
                while not server.started:
                    await asyncio.sleep(0.01)
                async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                    async with client.stream("POST", "/v1/completions",
                                             json={"prompt": "x", "stream": True}) as response:
                        async for line in response.aiter_lines():
                            if line:
                                assert json.loads(line[6:])["choices"][0]["text"] == "a"
                                break
                    assert worker.open_connections == 1
                    deadline = time.monotonic() + 2.0
                    while worker.open_connections and time.monotonic() < deadline:
                        await asyncio.sleep(0.02)
                    assert worker.open_connections == 0, "the worker's stream was not closed"
                    return (await client.get("/workers")).json()["worker"][0]
            finally:
                server.should_exit = True
                await serving
                await app.state.proxy.close()
                sock.close()

        described = asyncio.run(main())
    assert described["in_flight"] == described["streaming"] == 0
    assert described["healthy"] and described["num_errors"] == 0
