"""The load generator's HTTP/1.1 + SSE client (http_stream.py, openai_client.py): answers split
anywhere are parsed the same, content chunks are timed on arrival, and every failure becomes a
failed request with its reason. Against a real asyncio server on loopback (sse_server.py) and,
for every split position, against the parser fed byte by byte."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from sluice.bench.http_stream import ConnectionPool, _Connection
from sluice.bench.openai_client import (
    PreparedRequest,
    RequestInput,
    _EventStream,
    prepare,
    send_request,
)
from sluice.bench.serve_metrics import RequestTiming
from sluice.testing.servers import free_port
from sluice.testing.sse_server import (
    LAST_CHUNK,
    STREAM_HEAD,
    HTTPRequest,
    Reply,
    SSEServer,
    chat_chunk,
    chunk,
    completion_chunk,
    head,
    json_reply,
    openai_events,
    openai_handler,
    sse,
    usage_chunk,
)

pytestmark = pytest.mark.serial

TEXTS = ["Hel", "lo", " wor", "ld", "!"]


def completion_answer() -> bytes:
    """A chunked completions stream: 5 text chunks, a closing chunk, usage, [DONE]."""
    events = [sse(completion_chunk(t)) for t in TEXTS]
    events += [sse(completion_chunk("", "length")), sse(usage_chunk(7, 5)), sse("[DONE]")]
    return STREAM_HEAD + b"".join(chunk(e) for e in events) + LAST_CHUNK


def request_input(url: str, chat: bool = False) -> RequestInput:
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    return RequestInput(api_url=url + endpoint, model="fake", prompt="hi", prompt_len=1,
                        output_len=len(TEXTS), ignore_eos=True, temperature=0.0, chat=chat)


def send(url: str, chat: bool = False, api_key: str | None = None,
         repeat: int = 1) -> list[RequestTiming]:
    async def main() -> list[RequestTiming]:
        pool = ConnectionPool()
        request = prepare(request_input(url, chat), api_key)
        try:
            return [await send_request(pool, request) for _ in range(repeat)]
        finally:
            pool.close()

    return asyncio.run(main())


class _NullTransport:
    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def parse_in_pieces(answer: bytes, sizes: list[int], chat: bool = False) -> RequestTiming:
    """Feed `answer` to one connection's parser in pieces of `sizes` (cycled), each piece a
    read of its own with a later arrival time."""
    async def main() -> RequestTiming:
        connection = _Connection()
        connection.connection_made(_NullTransport())  # type: ignore[arg-type]
        timing = RequestTiming()
        events = _EventStream(chat, time.perf_counter(), timing)
        answered = asyncio.ensure_future(connection.exchange(b"", events, 60.0))
        await asyncio.sleep(0)
        pos = i = 0
        while pos < len(answer) and not answered.done():
            size = sizes[i % len(sizes)]
            connection.data_received(answer[pos:pos + size])
            pos, i = pos + size, i + 1
        response = await answered
        assert response.status == 200 and pos >= len(answer)
        timing.generated_text = "".join(events.texts)
        timing.success = events.got_token and not events.error
        return timing

    return asyncio.run(main())


@pytest.mark.parametrize("sizes", [[1], [2], [3, 1, 4, 1, 5, 9, 2, 6], [17], [64], [10**6]])
def test_an_answer_split_anywhere_parses_the_same(sizes: list[int]) -> None:
    timing = parse_in_pieces(completion_answer(), sizes)
    assert timing.success and timing.generated_text == "".join(TEXTS)
    assert (timing.output_tokens, timing.prompt_len) == (5, 7)
    assert len(timing.itl) == len(TEXTS) - 1  # the closing and usage chunks are no tokens


def test_crlf_lines_comments_chunk_extensions_and_trailers_parse() -> None:
    events = [b": keep-alive ping\r\n\r\n"]
    events += [b"event: message\r\ndata: " + json.dumps(completion_chunk(t)).encode()
               + b"\r\n\r\n" for t in TEXTS]
    events += [b"data: [DONE]\r\n\r\n", b"data: " + json.dumps(completion_chunk("late")).encode()
               + b"\n\n"]
    body = b"".join(b"%x;name=value\r\n%s\r\n" % (len(e), e) for e in events)
    answer = STREAM_HEAD + body + b"0\r\nX-Trailer: 1\r\n\r\n"
    for sizes in ([1], [5], [10**6]):
        timing = parse_in_pieces(answer, sizes)
        # Lines after [DONE] are ignored.
        assert timing.success and timing.generated_text == "".join(TEXTS)
        assert len(timing.itl) == len(TEXTS) - 1


def test_a_content_length_answer_parses() -> None:
    events = b"".join(sse(completion_chunk(t)) for t in TEXTS) + sse("[DONE]")
    answer = head(200, {"content-length": str(len(events))}) + events
    for sizes in ([1], [7], [10**6]):
        timing = parse_in_pieces(answer, sizes)
        assert timing.success and timing.generated_text == "".join(TEXTS)


def test_chat_role_and_closing_chunks_are_not_tokens_but_empty_deltas_are() -> None:
    events = [chat_chunk({"role": "assistant", "content": ""}), chat_chunk({"content": "a"}),
              chat_chunk({}),  # a token whose text is held back
              chat_chunk({"reasoning_content": "b"}), chat_chunk({}, "stop")]
    answer = STREAM_HEAD + b"".join(chunk(sse(e)) for e in events) + LAST_CHUNK
    timing = parse_in_pieces(answer, [11], chat=True)
    assert timing.success and timing.generated_text == "ab"
    assert len(timing.itl) == 2  # three tokens: "a", the held-back one, "b"


def test_events_split_across_tcp_reads_are_parsed_and_timed_on_arrival() -> None:
    answer = completion_answer()
    # Pieces of 1 to 13 bytes, 2 ms apart: splits fall inside the status line, the chunk-size
    # lines, between \r and \n, inside "data:", the JSON and [DONE], and each arrives on its own.
    cuts, pos, sizes = [], 0, [1, 2, 13, 3, 5, 8]
    while pos < len(answer):
        cuts.append(answer[pos:pos + sizes[len(cuts) % len(sizes)]])
        pos += len(cuts[-1])

    with SSEServer(lambda request: Reply(cuts, gap_s=0.002)) as server:
        [timing] = send(server.url)
    assert timing.success, timing.error
    assert timing.generated_text == "".join(TEXTS)
    assert (timing.output_tokens, timing.prompt_len) == (5, 7)
    assert len(timing.itl) == len(TEXTS) - 1
    # Each event is many 2 ms pieces after the one before: its time is its own read's.
    assert all(gap > 0.002 for gap in timing.itl), timing.itl
    assert timing.ttft > 0 and timing.latency == pytest.approx(timing.ttft + sum(timing.itl))


def test_keep_alive_reuses_one_connection_and_sends_the_api_key() -> None:
    with SSEServer(openai_handler()) as server:
        timings = send(server.url, api_key="sk-test", repeat=3)
        chat = send(server.url, chat=True)
    assert all(t.success for t in timings + chat)
    assert [t.output_tokens for t in timings] == [len(TEXTS)] * 3
    assert chat[0].generated_text == " tok" * len(TEXTS) and len(chat[0].itl) == len(TEXTS) - 1
    assert server.connections == 2  # one per pool (send() makes one per call)
    assert [r.seq for r in server.requests[:3]] == [0, 1, 2]
    assert server.requests[0].headers["authorization"] == "Bearer sk-test"
    payload = json.loads(server.requests[0].body)
    assert payload["stream"] and payload["max_tokens"] == len(TEXTS)
    assert payload["stream_options"] == {"include_usage": True}


def test_a_connection_closed_while_idle_is_retried_on_a_fresh_one() -> None:
    answer = b"".join(chunk(e) for e in openai_events(False, 2)) + LAST_CHUNK

    def handler(request: HTTPRequest) -> Reply:
        if request.seq == 1:  # the keep-alive race: the server drops the idle connection
            return Reply([], close=True)
        return Reply([STREAM_HEAD + answer])

    with SSEServer(handler) as server:
        timings = send(server.url, repeat=2)
    assert [t.success for t in timings] == [True, True], [t.error for t in timings]
    assert server.connections == 2


def failing_handler(request: HTTPRequest) -> Reply:
    kind = json.loads(request.body)["prompt"]
    if kind == "http-500":
        return json_reply(500, {"error": {"message": "boom", "code": 500}})
    if kind == "error-event":
        events = [sse(completion_chunk("a")),
                  sse({"error": {"message": "engine died", "type": "InternalServerError"}})]
        return Reply([STREAM_HEAD + b"".join(chunk(e) for e in events) + LAST_CHUNK])
    if kind == "no-content":
        return Reply([STREAM_HEAD + chunk(sse(usage_chunk(1, 0))) + chunk(sse("[DONE]"))
                      + LAST_CHUNK])
    if kind == "cut":  # the server dies mid-stream
        return Reply([STREAM_HEAD + chunk(sse(completion_chunk("a")))], close=True)
    if kind == "bad-framing":
        return Reply([STREAM_HEAD + b"zz\r\n" + sse(completion_chunk("a"))], close=True)
    return Reply([STREAM_HEAD + chunk(sse(completion_chunk("ok"))) + LAST_CHUNK])


@pytest.mark.parametrize("kind, error", [
    ("http-500", 'HTTP 500: {"error": {"message": "boom", "code": 500}}'),
    ("error-event", 'error event: {"message":"engine died","type":"InternalServerError"}'),
    ("no-content", "the stream ended without a content chunk (no TTFT)"),
    ("cut", "HTTPError: the server closed the connection mid-answer"),
    ("bad-framing", "HTTPError: bad chunk-size line b'zz'"),
])
def test_http_errors_and_error_events_become_failed_requests(kind: str, error: str) -> None:
    async def main(url: str) -> tuple[RequestTiming, RequestTiming]:
        pool = ConnectionPool()

        def request(prompt: str) -> PreparedRequest:
            return prepare(RequestInput(url + "/v1/completions", "fake", prompt, 1, 4, True,
                                        None, False), None)
        try:
            failed = await send_request(pool, request(kind))
            # The pool still serves the next request (on the same or a new connection).
            return failed, await send_request(pool, request("fine"))
        finally:
            pool.close()

    with SSEServer(failing_handler) as server:
        failed, after = asyncio.run(main(server.url))
    assert not failed.success and failed.error.startswith(error), failed.error
    assert after.success and after.generated_text == "ok"


def test_a_refused_connection_is_a_failed_request() -> None:
    [timing] = send(f"http://127.0.0.1:{free_port()}")
    assert not timing.success and timing.error.startswith("ConnectionRefusedError")


def test_the_stepped_fake_server_paces_every_stream_once_a_step() -> None:
    async def main(url: str) -> list[RequestTiming]:
        pool = ConnectionPool()
        request = prepare(request_input(url), None)
        try:
            return list(await asyncio.gather(*[send_request(pool, request) for _ in range(4)]))
        finally:
            pool.close()

    with SSEServer(openai_handler(stepped=True), step_s=0.02) as server:
        timings = asyncio.run(main(server.url))
    assert all(t.success and t.output_tokens == len(TEXTS) for t in timings)
    gaps = [gap for t in timings for gap in t.itl]
    assert len(gaps) == 4 * (len(TEXTS) - 1)
    # One token a 20 ms step (a step late or early now and then on a busy machine).
    assert 0.015 < sum(gaps) / len(gaps) < 0.04, gaps
