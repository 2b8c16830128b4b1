"""Streaming requests to an OpenAI-compatible server, timed on the client.

One request: POST with `stream: true` and `stream_options: {include_usage: true}`, read the
server-sent events, and stamp every content chunk with the `time.perf_counter()` of its arrival:
the time the TCP read that completed its `data:` line was handed to the client (http_stream.py
takes it once per read, so the events of one read share it). A content chunk is one that carries
generated text, or a token with no text (a special token) that is not the closing chunk;
role-only chat deltas and the final usage chunk are not tokens. TTFT is request sent (before the
connection is taken from the pool or opened) -> first content chunk; each ITL is the gap between
consecutive content chunks; the latency ends at the last content chunk. Usage, when the server
sends it, gives the prompt and completion token counts.

Each `data:` line is one event (OpenAI servers never split one over several lines); other lines
(blank separators, SSE comments such as keep-alive pings, event names) are skipped, and lines
after `data: [DONE]` are ignored. Events are decoded by msgspec into structs of only the fields
used here; the texts of the chunks are joined once, when the stream ends.

Any failure (connection, HTTP status, an `error` event, a stream with no content) becomes a
`RequestTiming` with `success=False` and the error as text, so one bad request never stops a run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from sluice.bench.http_stream import ConnectionPool, Origin, encode_request, split_url
from sluice.bench.serve_metrics import RequestTiming

# A benchmark of long outputs at a low rate can legitimately hold a stream open for hours.
_TIMEOUT_S = 6 * 3600.0
_MAX_ERROR_CHARS = 1000


@dataclass(frozen=True, slots=True)
class RequestInput:
    api_url: str
    model: str
    prompt: str
    prompt_len: int
    output_len: int
    ignore_eos: bool
    temperature: float | None
    chat: bool  # /v1/chat/completions (messages) rather than /v1/completions (prompt)
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request encoded once, before the run, so sending it is one write."""

    origin: Origin
    data: bytes  # request line, headers and JSON body
    chat: bool
    prompt_len: int


def build_payload(request: RequestInput) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": request.model, "stream": True,
                               "stream_options": {"include_usage": True}}
    if request.chat:
        payload["messages"] = [{"role": "user", "content": request.prompt}]
        payload["max_completion_tokens"] = request.output_len
    else:
        payload["prompt"] = request.prompt
        payload["max_tokens"] = request.output_len
    if request.temperature is not None:
        payload["temperature"] = request.temperature
    if request.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(request.extra_body)
    return payload


def prepare(request: RequestInput, api_key: str | None) -> PreparedRequest:
    origin, target = split_url(request.api_url)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = encode_request("POST", origin, target, msgspec.json.encode(build_payload(request)),
                          headers)
    return PreparedRequest(origin=origin, data=data, chat=request.chat,
                           prompt_len=request.prompt_len)


# The fields of a chunk the client reads; msgspec skips the rest without building them.
class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    role: str | None | msgspec.UnsetType = msgspec.UNSET


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


class _EventStream:
    """The SSE consumer of one answer: a `BodySink` that times content chunks as they come."""

    __slots__ = ("chat", "start", "last", "timing", "texts", "error", "finished", "got_token",
                 "_partial")

    def __init__(self, chat: bool, start: float, timing: RequestTiming) -> None:
        self.chat = chat
        self.start = self.last = start
        self.timing = timing
        self.texts: list[str] = []
        self.error = ""
        self.finished = False  # [DONE] seen
        self.got_token = False
        self._partial = b""  # an incomplete line carried to the next read

    def __call__(self, data: bytes, now: float) -> bool:
        if self.finished:
            return False
        if self._partial:
            data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if not line or line[:5] != b"data:":
                continue  # blank separators, SSE comments (keep-alive pings), event names
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.finished = True
                return False  # read on to the answer's end, so the connection is kept
            if self._event(_decode_chunk(payload), now):
                return True
        return False

    def _event(self, chunk: _Chunk, now: float) -> bool:
        """Take one decoded chunk; True stops the stream (an error event)."""
        if chunk.error is not msgspec.UNSET:
            error = bytes(chunk.error).decode(errors="replace")
            self.error = f"error event: {error}"[:_MAX_ERROR_CHARS]
            return True
        if chunk.choices:
            choice = chunk.choices[0]
            finished = choice.finish_reason is not None
            if self.chat:
                delta = choice.delta
                if delta is None:
                    text, is_token = "", not finished
                else:
                    text = delta.content or delta.reasoning_content or ""
                    is_token = bool(text) or not (finished or delta.role is not msgspec.UNSET)
            else:
                text = choice.text or ""
                is_token = bool(text) or not finished
            if text:
                self.texts.append(text)
            if is_token:
                if self.got_token:
                    self.timing.itl.append(now - self.last)
                else:
                    self.timing.ttft = now - self.start
                    self.got_token = True
                self.last = now
        if (usage := chunk.usage) is not None:
            self.timing.output_tokens = int(usage.completion_tokens or 0)
            if usage.prompt_tokens is not None:
                self.timing.prompt_len = int(usage.prompt_tokens)
        return False


async def send_request(pool: ConnectionPool, request: PreparedRequest,
                       t0: float = 0.0) -> RequestTiming:
    """Send one streaming request; `t0` is the benchmark's start on the perf_counter clock."""
    timing = RequestTiming(prompt_len=request.prompt_len)
    start = time.perf_counter()
    timing.start_time = start - t0
    events = _EventStream(request.chat, start, timing)
    try:
        response = await pool.request(request.origin, request.data, events, _TIMEOUT_S)
    except Exception as e:  # any failure is recorded on the request, never raised
        timing.error = f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]
        return timing
    if response.status != 200:
        body = response.body.decode(errors="replace")
        timing.error = f"HTTP {response.status}: {body[:_MAX_ERROR_CHARS]}"
        return timing
    if events.error:
        timing.error = events.error
        return timing
    timing.generated_text = "".join(events.texts)
    if not events.got_token:
        timing.error = "the stream ended without a content chunk (no TTFT)"
        return timing
    timing.latency = events.last - start
    timing.success = True
    return timing


async def first_model(base_url: str, api_key: str | None = None) -> tuple[str, str]:
    """(id, root) of the first model GET /v1/models lists; root is the served folder or name."""
    import httpx  # once per run, off the hot path

    url = f"{base_url}/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=60.0, headers=headers) as client:
            resp = await client.get(url)
            resp.raise_for_status()
            models = resp.json().get("data") or []
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot list models at {url} (is the server running?): {e}") from None
    if not models:
        raise ValueError(f"the server at {base_url} lists no models")
    return models[0]["id"], models[0].get("root") or models[0]["id"]
