"""A minimal HTTP/1.1 client for the load generator's hot path: one request at a time per
keep-alive connection, the response body handed to a sink read by read.

Why not httpx here: per server-sent event, httpx's streaming goes through h11's event parser, a
chain of decoders and a line decoder, tens of microseconds of Python per event; at 25-30k events
a second one client process spends all its time there. Here the connection is an
`asyncio.Protocol`: each TCP read is one `data_received` call, which takes the arrival time once
(`time.perf_counter()`), undoes the chunked framing with `bytes.find` and slices, and passes each
piece of body to the caller's sink with that time.

Scope, what an OpenAI-compatible server's answers need: POST and GET with a Content-Length body
(or none); responses with a chunked, Content-Length or until-close body; 1xx interim answers
skipped; keep-alive connections per origin, where a pooled connection the server closed while it
was idle (before a byte of the answer) is retried once on a fresh one; http and https. No
redirects, no compression (none is asked for: a Content-Encoding answer is an error), no
proxies, no HTTP/2.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

# A piece of a 200 answer's body and the perf_counter time of the read that brought it; returns
# True to stop reading (the connection is then closed and the exchange ends).
BodySink = Callable[[bytes, float], bool]

_MAX_HEAD_BYTES = 64 * 1024
_MAX_ERROR_BODY_BYTES = 64 * 1024

# Response parser states.
_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILERS, _LENGTH, _UNTIL_CLOSE, _DONE = range(8)


class HTTPError(Exception):
    """The answer broke HTTP/1.1 framing, or the connection ended before the answer did."""


class _StaleConnection(HTTPError):
    """A pooled connection closed by the server before a byte of the answer: safe to retry."""


@dataclass(frozen=True, slots=True)
class Origin:
    scheme: str  # "http" | "https"
    host: str
    port: int

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"


def split_url(url: str) -> tuple[Origin, str]:
    """(origin, request target: path and query) of an absolute http(s) URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an absolute http:// or https:// URL, got {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Origin(parts.scheme, parts.hostname, port), target


def encode_request(method: str, origin: Origin, target: str, body: bytes | None = None,
                   headers: dict[str, str] | None = None) -> bytes:
    """The request's bytes as sent: request line, headers, body."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {origin.host_header}",
             "Accept: */*"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    # A 200 answer's body went to the sink, so this is empty; other answers' bodies are kept (up
    # to 64 KiB) for the error message.
    body: bytes


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the parser of the answer in flight on it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._answer: asyncio.Future[Response] | None = None
        self._sink: BodySink | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self._buf = b""
        self._state = _HEAD
        self._status = 0
        self._remaining = 0  # bytes left of the current chunk or of a Content-Length body
        self._error_body = bytearray()
        self._keep_alive = True
        self._got_bytes = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio.Transport in practice (uvloop's is not a subclass of it).
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._answer is None or self._answer.done():
            return
        if self._state == _UNTIL_CLOSE:
            self._finish()
        elif not self._got_bytes:
            self._fail(_StaleConnection(f"the server closed the connection before answering "
                                        f"({exc or 'EOF'})"))
        else:
            self._fail(HTTPError(f"the server closed the connection mid-answer "
                                 f"({exc or 'EOF'})"))

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self._answer is None or self._answer.done():
            self._keep_alive = False  # bytes nobody asked for: the connection is unusable
            self._close()
            return
        self._got_bytes = True
        try:
            self._parse(data, now)
        except Exception as e:  # a framing error or the sink's: the exchange fails with it
            self._fail(e)

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost settles the answer

    # one exchange

    async def exchange(self, request: bytes, sink: BodySink | None,
                       timeout_s: float) -> Response:
        assert self.transport is not None and self._answer is None
        loop = asyncio.get_running_loop()
        self._reset()
        self._answer = answer = loop.create_future()
        self._sink = sink
        self._timer = loop.call_later(timeout_s, self._fail,
                                      TimeoutError(f"no complete answer in {timeout_s:.0f} s"))
        self.transport.write(request)
        try:
            return await answer
        except asyncio.CancelledError:
            self._close()
            raise
        finally:
            self._timer.cancel()
            self._answer = self._sink = self._timer = None

    @property
    def reusable(self) -> bool:
        return (self._keep_alive and not self.closed and self.transport is not None
                and not self.transport.is_closing())

    def _finish(self) -> None:
        self._state = _DONE
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(Response(self._status, bytes(self._error_body)))
        if not self._keep_alive:
            self._close()

    def _fail(self, error: BaseException) -> None:
        self._keep_alive = False
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(error)
        self._close()

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _body(self, piece: bytes, now: float) -> None:
        if self._status == 200:
            assert self._sink is not None
            if self._sink(piece, now):
                self._keep_alive = False
                self._finish()
        elif len(self._error_body) < _MAX_ERROR_BODY_BYTES:
            self._error_body += piece[:_MAX_ERROR_BODY_BYTES - len(self._error_body)]

    def _parse(self, data: bytes, now: float) -> None:
        buf = self._buf + data if self._buf else data
        pos, end = 0, len(buf)
        while pos < end:
            state = self._state
            if state == _CHUNK_DATA:
                n = min(end - pos, self._remaining)
                self._remaining -= n
                if self._remaining == 0:
                    self._state = _CHUNK_CRLF
                # The common read is one whole chunk: hand it on without a copy where it can.
                self._body(buf if n == end else buf[pos:pos + n], now)
                pos += n
            elif state == _CHUNK_SIZE:
                pos = self._whole_chunks(buf, pos, now)
                if self._state == _CHUNK_SIZE:
                    break  # an incomplete chunk-size line: wait for the next read
            elif state == _CHUNK_CRLF:
                if end - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise HTTPError(f"a chunk ran past its size: {buf[pos:pos + 20]!r}")
                pos += 2
                self._state = _CHUNK_SIZE
            elif state == _TRAILERS:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                trailer_empty = eol == pos
                pos = eol + 2
                if trailer_empty:
                    self._finish()
            elif state == _LENGTH:
                n = min(end - pos, self._remaining)
                self._remaining -= n
                self._body(buf if n == end else buf[pos:pos + n], now)
                pos += n
                if self._remaining == 0 and self._state == _LENGTH:
                    self._finish()
            elif state == _UNTIL_CLOSE:
                self._body(buf[pos:] if pos else buf, now)
                pos = end
            elif state == _HEAD:
                eoh = buf.find(b"\r\n\r\n", pos)
                if eoh < 0:
                    if end - pos > _MAX_HEAD_BYTES:
                        raise HTTPError(f"response head longer than {_MAX_HEAD_BYTES} bytes")
                    break
                self._parse_head(buf[pos:eoh].decode("latin-1"))
                pos = eoh + 4
            else:  # _DONE: an answer ended mid-read; more bytes are a broken server
                self._keep_alive = False
                self._close()
                return
        self._buf = buf[pos:] if pos < end else b""

    def _whole_chunks(self, buf: bytes, pos: int, now: float) -> int:
        """Take the chunks that lie whole in `buf` from `pos` (a chunk-size line) and hand their
        data to the sink in one piece; move to the state of what follows. Returns the new pos.

        The fast path: a server streaming events writes one chunk per event, and a busy client
        finds many of them in one read."""
        end = len(buf)
        pieces = []
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            try:
                size = int(buf[pos:eol].split(b";", 1)[0], 16)
            except ValueError:
                raise HTTPError(f"bad chunk-size line {buf[pos:eol][:40]!r}") from None
            data_start = eol + 2
            if size == 0:
                pos, self._state = data_start, _TRAILERS
                break
            data_end = data_start + size
            if data_end + 2 > end:  # the chunk goes on in a later read
                pos, self._remaining, self._state = data_start, size, _CHUNK_DATA
                break
            if buf[data_end:data_end + 2] != b"\r\n":
                raise HTTPError(f"a chunk ran past its size: {buf[data_end:data_end + 20]!r}")
            pieces.append(buf[data_start:data_end])
            pos = data_end + 2
        if pieces:
            self._body(pieces[0] if len(pieces) == 1 else b"".join(pieces), now)
        return pos

    def _parse_head(self, head: str) -> None:
        status_line, *header_lines = head.split("\r\n")
        version, _, rest = status_line.partition(" ")
        try:
            status = int(rest[:3])
        except ValueError:
            raise HTTPError(f"bad status line {status_line[:80]!r}") from None
        if not version.startswith("HTTP/1."):
            raise HTTPError(f"not an HTTP/1.x answer: {status_line[:80]!r}")
        if 100 <= status < 200:
            return  # interim answer (100 Continue, 103 Early Hints): the real one follows
        headers: dict[str, str] = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self._status = status
        connection = headers.get("connection", "").lower()
        self._keep_alive = ("close" not in connection if version == "HTTP/1.1"
                            else "keep-alive" in connection)
        if headers.get("content-encoding", "identity").lower() != "identity":
            raise HTTPError(f"unsupported Content-Encoding {headers['content-encoding']!r}")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = _CHUNK_SIZE
        elif "content-length" in headers:
            self._remaining = int(headers["content-length"])
            self._state = _LENGTH
            if self._remaining == 0:
                self._finish()
        elif status in (204, 304):
            self._finish()
        else:
            self._state, self._keep_alive = _UNTIL_CLOSE, False


class ConnectionPool:
    """Keep-alive connections per origin, for the event loop that uses it; not thread-safe."""

    def __init__(self, connect_timeout_s: float = 60.0) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._idle: dict[Origin, list[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def request(self, origin: Origin, request: bytes, sink: BodySink | None = None,
                      timeout_s: float = 6 * 3600.0) -> Response:
        """Send `request` (see `encode_request`), return the answer's status; a 200 answer's body
        goes to `sink` as it arrives."""
        idle = self._idle.setdefault(origin, [])
        while idle:
            connection = idle.pop()
            if not connection.reusable:
                continue
            try:
                return await self._exchange(origin, connection, request, sink, timeout_s)
            except _StaleConnection:
                break  # closed while idle: the server's keep-alive timeout; retry once, fresh
        connection = await self._connect(origin)
        return await self._exchange(origin, connection, request, sink, timeout_s)

    async def _exchange(self, origin: Origin, connection: _Connection, request: bytes,
                        sink: BodySink | None, timeout_s: float) -> Response:
        response = await connection.exchange(request, sink, timeout_s)
        if connection.reusable:
            self._idle[origin].append(connection)
        return response

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        context = None
        if origin.scheme == "https":
            self._ssl = self._ssl or ssl.create_default_context()
            context = self._ssl
        _, connection = await asyncio.wait_for(
            loop.create_connection(_Connection, origin.host, origin.port, ssl=context),
            self._connect_timeout_s)
        return connection

    def close(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection._close()
        self._idle.clear()
