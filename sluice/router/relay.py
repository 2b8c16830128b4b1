"""What both router modes do with one request, whatever they send it to: the retry loop, the
commit at the first token, and the errors the client sees.

A mode (proxy.py: a prefill and a decode; replicas.py: one colocated worker) says what it
refuses, which instances an attempt uses (`_choose`), and how one attempt runs; `Relay` does the
rest:

1. the body is read and checked (400 with an OpenAI-shaped body if the mode refuses it);
2. an attempt is chosen among healthy instances, avoiding those that already failed this
   request while others are healthy; an attempt that raises `Failure` is retried after a short
   backoff (0.1 s doubling, at most 1 s), up to `max_retries` times, and its instance is
   avoided (and, for `Failure(drop=True)`, dropped until a health check re-admits it);
   `ClientError` (a 4xx from an instance) ends the request with that answer as is;
3. a stream is read up to its first event that carries a token (or ends a choice, or carries
   usage): until then any failure is retried; from then on the client owns it, and a failure
   ends it with an OpenAI-shaped error event and `[DONE]` (`CommittedStream`);
4. no attempt succeeded: 503 naming the number of attempts and the last reason.

A client that goes away cancels the attempt in flight: its connections close, so the engines
abort the request and free its blocks.

The instances are called through one aiohttp session per router (`make_session`: created in the
running loop, unbounded pool, kept-alive connections), bodies written once with msgspec; a
connection that cannot be made (`aiohttp.ClientConnectorError`) drops the instance, any other
transport error (`TRANSPORT_ERRORS`) is a plain failure. Streams are read as bytes and relayed
as they came, line by line (lines end at "\n"; a "\r" before it is dropped).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
from abc import ABC, abstractmethod
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Generic, TypeVar

import aiohttp
import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from sluice import stage_trace
from sluice.entrypoints.openai.connection import run_until_disconnected
from sluice.entrypoints.openai.errors import error_body, error_response
from sluice.router.metrics import RouterMetrics
from sluice.router.policies import Policy
from sluice.router.workers import Worker, WorkerPool

logger = logging.getLogger("sluice")

# The client's headers an instance is sent with each call made for its request: the API key of
# instances started with --api-key, and the request id (both modes).
FORWARDED_HEADERS = ("authorization", "x-request-id")
_forwarded: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "forwarded", default=None)


def forward_headers(request: Request) -> dict[str, str]:
    """FORWARDED_HEADERS of `request`, kept for the calls made in its context (tasks started
    from it copy the context)."""
    headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
    _forwarded.set(headers)
    return headers


class Failure(Exception):
    """An attempt failed for a reason a retry may get past."""

    def __init__(self, role: str, worker: Worker, reason: str, drop: bool = False) -> None:
        super().__init__(reason)
        self.role = role
        self.worker = worker
        self.reason = reason
        self.drop = drop  # stop routing to the worker until a health check re-admits it


class ClientError(Exception):
    """An instance refused the request (4xx): the client's answer, as is."""

    def __init__(self, status: int, content: bytes) -> None:
        super().__init__(status)
        self.response = Response(content, status_code=status, media_type="application/json")


class NoWorker(Exception):
    pass


def prompt_key(path: str, body: dict[str, Any]) -> str:
    """The text the cache-aware policy matches prefixes on."""
    if path.endswith("/chat/completions"):
        return "\n".join(f"{m.get('role')}:{m.get('content')}" for m in body.get("messages") or []
                         if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return " ".join(map(str, prompt))
    return str(prompt)


def carries_token(choice: dict[str, Any]) -> bool:
    if choice.get("finish_reason") is not None or choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content")
                or delta.get("tool_calls"))


def failed_before_first_token(choice: dict[str, Any], completion_tokens: int | None) -> bool:
    return choice.get("finish_reason") == "error" and not completion_tokens


def sse_event(line: bytes | str) -> dict[str, Any] | str | None:
    """A parsed `data:` line: its JSON object, "[DONE]", or None for anything else."""
    if isinstance(line, str):
        line = line.encode()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return "[DONE]"
    try:
        event = json.loads(data)
    except ValueError:  # not JSON, or not UTF-8
        return None
    return event if isinstance(event, dict) else None


def _is_done(line: bytes) -> bool:
    """`sse_event(line) == "[DONE]"`, without parsing every event of a stream."""
    return line.startswith(b"data:") and line[5:].strip() == b"[DONE]"


def failed_mid_stream(role: str, worker: Worker, why: str) -> bytes:
    """The events that end a committed stream whose instance failed: an error the `openai`
    client raises (APIError with this message), then [DONE]."""
    message = f"the {role} instance {worker.url} failed mid-stream: {why}"
    logger.warning("router: %s", message)
    return f"data: {json.dumps(error_body(502, message))}\n\ndata: [DONE]\n\n".encode()


# What a call to an instance may raise that is the transport's fault (httpx.HTTPError's part
# before): aiohttp's errors (ClientConnectorError: no connection could be made; ClientPayloadError:
# the body broke off; ServerTimeoutError: a read timed out, ...), and the OS's.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, OSError,
                                                      asyncio.TimeoutError)
CONNECT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientConnectorError,)


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def make_session(request_timeout_s: float) -> aiohttp.ClientSession:
    """The router's client of its instances; call it in the running loop.

    No limit on connections (in total or per instance); idle ones are kept 4 s, under the
    engine servers' 5 s keep-alive (uvicorn's timeout_keep_alive), so the router never reuses
    a connection the server is closing. Timeouts as httpx.Timeout(request_timeout_s,
    connect=5) had them: 5 s to connect, `request_timeout_s` for any one read (a long stream
    is not cut while it moves). No cookies, no proxies from the environment, no redirects
    followed (per call), bodies as sent: the router asks for no compression
    (`accept-encoding: identity`) and decodes none."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=4.0)
    timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=5.0,
                                    sock_read=request_timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout,
                                 cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False)


class UpstreamLines:
    """The lines of an instance's streamed answer, as they come: bytes, without their "\n"
    (nor a "\r" before it); at the end, a last line that had no "\n". `next_line` takes one,
    `batches` the rest, a read's worth at a time (what arrived together is relayed together)."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._content = response.content
        self._pending: deque[bytes] = deque()
        self._rest: list[bytes] = []  # the start of a line whose end has not come
        self._eof = False

    async def _fill(self) -> bool:
        """Read until a whole line is pending; False once the stream has ended and none is."""
        while not self._pending:
            if self._eof:
                return False
            data = await self._content.readany()
            if not data:
                self._eof = True
                if self._rest:
                    self._pending.append(_unterminated(b"".join(self._rest)))
                    self._rest.clear()
                continue
            if b"\n" not in data:
                self._rest.append(data)
                continue
            if self._rest:
                self._rest.append(data)
                data = b"".join(self._rest)
                self._rest.clear()
            *lines, rest = data.split(b"\n")
            if rest:
                self._rest.append(rest)
            self._pending.extend(map(_unterminated, lines))
        return True

    def pending(self) -> bytes | None:
        """A line already read, or None."""
        return self._pending.popleft() if self._pending else None

    async def next_line(self) -> bytes | None:
        """The next line; None at the end."""
        if not self._pending and not await self._fill():
            return None
        return self._pending.popleft()

    async def batches(self) -> AsyncIterator[list[bytes]]:
        while self._pending or await self._fill():
            batch = list(self._pending)
            self._pending.clear()
            yield batch


def _unterminated(line: bytes) -> bytes:
    return line[:-1] if line.endswith(b"\r") else line


async def cancel(*tasks: asyncio.Future | None) -> None:
    pending = [t for t in tasks if t is not None and not t.done()]
    for task in pending:
        task.cancel()
    for task in tasks:
        if task is not None:
            try:
                await task
            except BaseException:  # noqa: BLE001 - its outcome no longer matters
                pass


class CommittedStream:
    """A stream past its first token: the buffered lines, then the rest as they come (each
    through `patch`). An instance that fails now, or whose stream ends without [DONE], ends
    the client's stream with an error event. Closing it (the client went away) closes the
    instance's connection, which aborts the request there; `on_close` then runs."""

    def __init__(self, role: str, worker: Worker, response: aiohttp.ClientResponse,
                 lines: UpstreamLines, buffered: list[bytes],
                 on_close: Callable[[], Any], patch: Callable[[bytes], bytes] | None = None
                 ) -> None:
        self.role = role
        self.worker = worker
        self.response = response
        self.lines = lines
        self.buffered = buffered
        self.on_close = on_close
        self.patch = patch
        worker.streaming += 1

    def _relayed(self, lines: list[bytes]) -> tuple[bytes, bool]:
        """The lines as the client gets them, and whether [DONE] is among them."""
        done = any(_is_done(line) for line in lines)
        if self.patch is not None:
            lines = [self.patch(line) for line in lines]
        return b"\n".join(lines) + b"\n", done

    async def events(self) -> AsyncIterator[bytes]:
        try:
            data, done = self._relayed(self.buffered)
            yield data
            async for batch in self.lines.batches():
                data, last = self._relayed(batch)
                done = done or last
                yield data
            if not done:
                yield failed_mid_stream(self.role, self.worker,
                                        "its stream ended without [DONE]")
        except TRANSPORT_ERRORS as exc:
            yield failed_mid_stream(self.role, self.worker, _why(exc))
        finally:
            self.worker.streaming -= 1
            # Closes the connection unless the answer was read to its end (then it is back in
            # the pool already): the instance sees the client go.
            self.response.close()
            await self.on_close()


# Bodies are parsed and written with msgspec: an 8k-token prompt costs ~0.2 ms instead of
# stdlib json's ~1.4 ms (a parse and the two halves' writes), on the path to every first token.
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def _json_headers() -> dict[str, str]:
    return {**(_forwarded.get() or {}), "content-type": "application/json",
            "accept-encoding": "identity"}


class Answer:
    """An instance's whole answer: its status, body and content type."""

    __slots__ = ("status_code", "content", "content_type")

    def __init__(self, status_code: int, content: bytes, content_type: str | None) -> None:
        self.status_code = status_code
        self.content = content
        self.content_type = content_type

    def json(self) -> Any:
        return _decode(self.content)


def _text(content: bytes) -> str:
    return content[:300].decode("utf-8", "replace")


async def open_stream(session: aiohttp.ClientSession, role: str, worker: Worker, url: str,
                      body: dict[str, Any]) -> aiohttp.ClientResponse:
    """POST a streamed request; its response once the status is 200. An instance that cannot
    be reached (dropped: it refused the connection) or answers 5xx is a Failure, 4xx the
    client's answer."""
    try:
        response = await session.post(url, data=_encode(body), headers=_json_headers(),
                                      allow_redirects=False)
    except TRANSPORT_ERRORS as exc:
        raise Failure(role, worker, _why(exc), drop=isinstance(exc, CONNECT_ERRORS)) from None
    if response.status >= 400:
        try:
            content = await response.read()
        except TRANSPORT_ERRORS as exc:
            raise Failure(role, worker, f"HTTP {response.status}, then {_why(exc)}") from None
        finally:
            response.close()
        if response.status >= 500:
            raise Failure(role, worker, f"HTTP {response.status}: {content[:300]!r}")
        raise ClientError(response.status, content)
    return response


async def post_whole(session: aiohttp.ClientSession, role: str, worker: Worker, url: str,
                     body: dict[str, Any],
                     drop_on: tuple[type[BaseException], ...] = CONNECT_ERRORS) -> Answer:
    """POST a request and read its whole answer; failures as in `open_stream`, the instance
    dropped for an error of `drop_on`."""
    try:
        async with session.post(url, data=_encode(body), headers=_json_headers(),
                                allow_redirects=False) as response:
            answer = Answer(response.status, await response.read(),
                            response.headers.get("content-type"))
    except TRANSPORT_ERRORS as exc:
        raise Failure(role, worker, _why(exc), drop=isinstance(exc, drop_on)) from None
    if answer.status_code >= 500:
        raise Failure(role, worker, f"HTTP {answer.status_code}: {_text(answer.content)}")
    if answer.status_code >= 400:
        raise ClientError(answer.status_code, answer.content)
    return answer


async def _next_line(role: str, worker: Worker, lines: UpstreamLines,
                     watch: asyncio.Future | None) -> bytes:
    """The stream's next line, its transport errors as a Failure, its end before the first
    token a Failure; with `watch` still running, whichever comes first (a failed watch raises
    its exception). Without one, no task is made per line."""
    line = lines.pending()
    if line is None:
        if watch is None or watch.done():
            waiting = lines.next_line()
        else:
            line_task = asyncio.ensure_future(lines.next_line())
            try:
                await asyncio.wait((watch, line_task), return_when=asyncio.FIRST_COMPLETED)
                if watch.done() and watch.exception() is not None:
                    raise watch.exception()
                waiting = line_task
            except BaseException:
                await cancel(line_task)
                raise
        try:
            line = await waiting
        except TRANSPORT_ERRORS as exc:
            raise Failure(role, worker, _why(exc)) from None
    if line is None:
        raise Failure(role, worker, "the stream ended before its first token")
    return line


async def read_to_first_token(role: str, worker: Worker, lines: UpstreamLines,
                              early_failure: Callable[[dict[str, Any]], Failure | None],
                              watch: asyncio.Future | None = None) -> list[bytes]:
    """Read a stream up to its first event that carries a token, ends a choice or carries
    usage; the lines read, that one included. A stream that ends, fails or sends an error
    before that is a Failure, and so is a choice for which `early_failure` returns one; `watch`
    (a task running beside the stream) that fails first raises its exception."""
    buffered: list[bytes] = []
    while True:
        line = await _next_line(role, worker, lines, watch)
        buffered.append(line)
        if not line.startswith(b"data:"):
            continue
        event = sse_event(line)
        if event == "[DONE]":
            raise Failure(role, worker, "the stream ended before its first token")
        if not isinstance(event, dict):
            continue
        if "error" in event:
            raise Failure(role, worker, f"error event: {event['error']}")
        choices = event.get("choices") or []
        for choice in choices:
            if failed_before_first_token(choice, 0) and (failure := early_failure(choice)):
                raise failure
        if any(carries_token(c) for c in choices) or event.get("usage"):
            stage_trace.mark("router_first")
            return buffered


Chosen = TypeVar("Chosen")


class Relay(ABC, Generic[Chosen]):
    """One mode of the router: see the module's docstring for what it shares."""

    def __init__(self, pool: WorkerPool, policies: dict[str, Policy], max_retries: int,
                 request_timeout_s: float, metrics: RouterMetrics) -> None:
        self.pool = pool
        self.policies = policies  # role -> its policy
        self._uses_prompt = any(policy.uses_prompt for policy in policies.values())
        self.max_retries = max_retries
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The client of the instances (made on first use if `start` was not awaited: it
        belongs to the loop it is made in)."""
        if self._session is None:
            self._session = make_session(self.request_timeout_s)
        return self._session

    async def start(self) -> None:
        """Make the session in the running loop (the server does, before it serves)."""
        self.session  # noqa: B018 - made on access

    async def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    # ---- what a mode says ------------------------------------------------------------------

    @abstractmethod
    def refusal(self, path: str, body: dict[str, Any]) -> str | None:
        """Why this mode cannot serve the request, or None."""

    @abstractmethod
    def _choose(self, key: str, avoid: dict[str, set[Worker]]) -> Chosen:
        """The instances of one attempt (`_pick` each; NoWorker if a role has none)."""

    @abstractmethod
    def _describe(self, chosen: Chosen) -> str:
        """The attempt, for the log."""

    @abstractmethod
    async def _attempt_full(self, path: str, body: dict[str, Any], chosen: Chosen) -> Response:
        ...

    @abstractmethod
    async def _attempt_stream(self, path: str, body: dict[str, Any], chosen: Chosen
                              ) -> CommittedStream:
        """Open the stream and read it up to its first token (`read_to_first_token`)."""

    # ---- the route -------------------------------------------------------------------------

    async def generate(self, path: str, request: Request) -> Response:
        forward_headers(request)
        stage_trace.mark("router_in")
        try:
            body = _decode(await request.body())
        except msgspec.DecodeError:
            return self._done(path, error_response(400, "the request body is not JSON"))
        if not isinstance(body, dict):
            return self._done(path, error_response(400, "the request body must be an object"))
        problem = self.refusal(path, body)
        if problem is not None:
            return self._done(path, error_response(400, problem))
        # The prompt as text only for a policy that matches on it (8k token ids: ~1 ms).
        key = prompt_key(path, body) if self._uses_prompt else ""
        if body.get("stream"):
            stream = await run_until_disconnected(request, self._run(path, body, key, True))
            if stream is None:
                return self._done(path, Response(status_code=499))
            if isinstance(stream, Response):
                return self._done(path, stream)
            return StreamingResponse(stream.events(), media_type="text/event-stream")
        response = await run_until_disconnected(request, self._run(path, body, key, False))
        return self._done(path, response if response is not None else Response(status_code=499))

    def _done(self, path: str, response: Response) -> Response:
        self.metrics.requests.labels(route=path, status=str(response.status_code)).inc()
        return response

    async def _run(self, path: str, body: dict[str, Any], key: str, stream: bool
                   ) -> Response | CommittedStream:
        avoid: dict[str, set[Worker]] = defaultdict(set)
        last_reason = "no attempt was made"
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0))
            try:
                chosen = self._choose(key, avoid)
            except NoWorker as exc:
                last_reason = str(exc)
                continue  # a health check may re-admit one meanwhile
            self.metrics.attempts.inc()
            try:
                if stream:
                    return await self._attempt_stream(path, body, chosen)
                return await self._attempt_full(path, body, chosen)
            except ClientError as exc:
                return exc.response
            except Failure as failure:
                last_reason = f"{failure.role} {failure.worker.url}: {failure.reason}"
                avoid[failure.role].add(failure.worker)
                if failure.drop:
                    self.pool.drop(failure.worker, failure.reason)
                else:
                    failure.worker.num_errors += 1
                    failure.worker.last_error = failure.reason
                self.metrics.retries.labels(role=failure.role).inc()
                logger.warning("router: attempt %d (%s) failed: %s", attempt + 1,
                               self._describe(chosen), last_reason)
        return error_response(503, f"the request failed on every attempt "
                                   f"({self.max_retries + 1}); last: {last_reason}")

    def _pick(self, role: str, key: str, avoid: set[Worker]) -> Worker:
        healthy = self.pool.healthy(role)
        candidates = [w for w in healthy if w not in avoid] or healthy
        if not candidates:
            raise NoWorker(f"no healthy {role} instance")
        return self.policies[role].pick(candidates, key)
