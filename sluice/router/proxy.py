"""The PD router's request path: pick a pair, send both halves at once, hand the client the
decode's answer, and retry what a prefill failure broke.

Per request (POST /v1/completions, /v1/chat/completions; one prompt, n = 1):

1. pick a prefill and a decode (each role's policy, among healthy instances, avoiding those
   that already failed this request while others are healthy), a random 63-bit room;
2. send the prefill the request with `stream: false` and kv_transfer_params
   {do_remote_decode, bootstrap_room} (its engine computes the prompt and one token), and at
   the same time the decode the request as the client sent it with kv_transfer_params
   {do_remote_prefill, bootstrap_host, bootstrap_port, bootstrap_room};
3. commit to the decode's answer at its first token: a stream is buffered until an event that
   carries a token (or ends the choice) and then passed through; a whole answer is checked;
4. a prefill failure before the commit cancels the pair (both connections closed, so both
   engines abort and free their blocks) and starts over with a new room, up to `max_retries`
   times: the prefill cannot be reached or answers 5xx (or dies mid-request), or the decode
   reports a lost prefill. That signal is the decode ending the request with finish_reason
   "error" before any token (in PD the first token comes from the prefill, so only the
   transfer can fail then: a lost prefill, a failed or timed-out transfer, a layout mismatch);
   its stop_reason says why. A decode that cannot be reached or answers 5xx is retried the
   same way on another decode. 4xx answers are the client's and are passed on.

The client sees an error only when no attempt succeeded (503 with the last reason), so while a
healthy prefill exists, a dead one costs a retry, not a failed request. `usage` is the decode's,
with `prompt_tokens_details.cached_tokens` taken from the prefill (the prompt tokens it did not
compute), so it reads as a colocated server's would.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sluice.entrypoints.openai.connection import run_until_disconnected
from sluice.entrypoints.openai.errors import error_response
from sluice.router.metrics import RouterMetrics
from sluice.router.policies import Policy
from sluice.router.workers import Worker, WorkerPool

logger = logging.getLogger("sluice")


class _Failure(Exception):
    """An attempt failed for a reason a retry may get past."""

    def __init__(self, role: str, worker: Worker, reason: str, drop: bool = False) -> None:
        super().__init__(reason)
        self.role = role
        self.worker = worker
        self.reason = reason
        self.drop = drop  # stop routing to the worker until a health check re-admits it


class _ClientError(Exception):
    """An instance refused the request (4xx): the client's answer, as is."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


class _NoWorker(Exception):
    pass


def _client_error(status: int, content: bytes) -> _ClientError:
    return _ClientError(Response(content, status_code=status, media_type="application/json"))


def prompt_key(path: str, body: dict[str, Any]) -> str:
    """The text the cache-aware policy matches prefixes on."""
    if path.endswith("/chat/completions"):
        return "\n".join(f"{m.get('role')}:{m.get('content')}" for m in body.get("messages") or []
                         if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    return str(prompt)


def refusal(path: str, body: dict[str, Any]) -> str | None:
    """Why the router cannot serve this request, or None."""
    if body.get("kv_transfer_params") is not None:
        return "kv_transfer_params are the router's to set; leave them out"
    if body.get("n", 1) not in (1, None) or body.get("best_of") not in (1, None):
        return "n and best_of must be 1 through the PD router (one room per request)"
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs are not supported through the PD router (the prefill has them)"
    if not path.endswith("/chat/completions"):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                return "one prompt per request through the PD router"
        if body.get("echo") and body.get("logprobs") is not None:
            return "echo with logprobs is not supported through the PD router (the prompt's " \
                   "logprobs are computed on the prefill)"
    return None


def _failed_before_first_token(choice: dict[str, Any], completion_tokens: int | None) -> bool:
    return choice.get("finish_reason") == "error" and not completion_tokens


def _carries_token(choice: dict[str, Any]) -> bool:
    if choice.get("finish_reason") is not None or choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content")
                or delta.get("tool_calls"))


def _event(line: str) -> dict[str, Any] | str | None:
    """A parsed `data:` line: its JSON object, "[DONE]", or None for anything else."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return data
    try:
        event = json.loads(data)
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) else None


def _patch_usage(usage: dict[str, Any] | None, prefill: dict[str, Any] | None) -> None:
    if not isinstance(usage, dict) or not isinstance(prefill, dict):
        return
    cached = ((prefill.get("usage") or {}).get("prompt_tokens_details") or {}).get(
        "cached_tokens")
    details = usage.get("prompt_tokens_details")
    if cached is not None and isinstance(details, dict):
        details["cached_tokens"] = cached


@dataclass
class _Pair:
    prefill: Worker
    decode: Worker
    room: int

    def begin(self) -> None:
        """An attempt starts on both instances (the policies count what is in flight)."""
        for worker in (self.prefill, self.decode):
            worker.in_flight += 1
            worker.num_requests += 1

    def end(self) -> None:
        self.prefill.in_flight -= 1
        self.decode.in_flight -= 1


class Proxy:
    def __init__(self, pool: WorkerPool, prefill_policy: Policy, decode_policy: Policy,
                 max_retries: int, request_timeout_s: float, metrics: RouterMetrics) -> None:
        self.pool = pool
        self.policies = {"prefill": prefill_policy, "decode": decode_policy}
        self.max_retries = max_retries
        self.metrics = metrics
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(request_timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

    async def close(self) -> None:
        await self.client.aclose()

    # ---- the route -------------------------------------------------------------------------

    async def generate(self, path: str, request: Request) -> Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._done(path, error_response(400, "the request body is not JSON"))
        if not isinstance(body, dict):
            return self._done(path, error_response(400, "the request body must be an object"))
        problem = refusal(path, body)
        if problem is not None:
            return self._done(path, error_response(400, problem))
        key = prompt_key(path, body)
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
                   ) -> Response | _DecodeStream:
        avoid: dict[str, set[Worker]] = {"prefill": set(), "decode": set()}
        last_reason = "no attempt was made"
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0))
            try:
                pair = _Pair(self._pick("prefill", key, avoid["prefill"]),
                             self._pick("decode", key, avoid["decode"]), secrets.randbits(63))
            except _NoWorker as exc:
                last_reason = str(exc)
                continue  # a health check may re-admit one meanwhile
            self.metrics.attempts.inc()
            try:
                if stream:
                    return await self._attempt_stream(path, body, pair)
                return await self._attempt_full(path, body, pair)
            except _ClientError as exc:
                return exc.response
            except _Failure as failure:
                last_reason = f"{failure.role} {failure.worker.url}: {failure.reason}"
                avoid[failure.role].add(failure.worker)
                if failure.drop:
                    self.pool.drop(failure.worker, failure.reason)
                else:
                    failure.worker.num_errors += 1
                    failure.worker.last_error = failure.reason
                self.metrics.retries.labels(role=failure.role).inc()
                logger.warning("router: attempt %d (room %d) failed: %s", attempt + 1,
                               pair.room, last_reason)
        return error_response(503, f"the request failed on every attempt "
                                   f"({self.max_retries + 1}); last: {last_reason}")

    def _pick(self, role: str, key: str, avoid: set[Worker]) -> Worker:
        healthy = self.pool.healthy(role)
        candidates = [w for w in healthy if w not in avoid] or healthy
        if not candidates:
            raise _NoWorker(f"no healthy {role} instance")
        return self.policies[role].pick(candidates, key)

    def _bodies(self, body: dict[str, Any], pair: _Pair) -> tuple[dict, dict]:
        prefill = {k: v for k, v in body.items() if k != "stream_options"}
        prefill.update(stream=False, kv_transfer_params={"do_remote_decode": True,
                                                         "bootstrap_room": pair.room})
        decode = dict(body)
        decode["kv_transfer_params"] = {
            "do_remote_prefill": True, "bootstrap_host": pair.prefill.host,
            "bootstrap_port": pair.prefill.bootstrap_port, "bootstrap_room": pair.room}
        return prefill, decode

    # ---- the halves ------------------------------------------------------------------------

    async def _prefill(self, worker: Worker, path: str, body: dict[str, Any]) -> dict:
        try:
            response = await self.client.post(f"{worker.url}{path}", json=body)
        except httpx.HTTPError as exc:
            raise _Failure("prefill", worker, f"{type(exc).__name__}: {exc}", drop=True) from None
        if response.status_code >= 500:
            raise _Failure("prefill", worker, f"HTTP {response.status_code}: "
                                              f"{response.text[:300]}")
        if response.status_code >= 400:
            raise _client_error(response.status_code, response.content)
        data = response.json()
        for choice in data.get("choices") or []:
            if choice.get("finish_reason") in ("error", "abort"):
                raise _Failure("prefill", worker, f"the prefill ended the request with "
                                                  f"{choice.get('finish_reason')}: "
                                                  f"{choice.get('stop_reason')}")
        return data

    async def _attempt_full(self, path: str, body: dict[str, Any], pair: _Pair) -> Response:
        prefill_body, decode_body = self._bodies(body, pair)
        p, d = pair.prefill, pair.decode
        pair.begin()
        p_task = asyncio.ensure_future(self._prefill(p, path, prefill_body))
        d_task = asyncio.ensure_future(self.client.post(f"{d.url}{path}", json=decode_body))
        try:
            done, _ = await asyncio.wait((p_task, d_task), return_when=asyncio.FIRST_COMPLETED)
            if p_task in done:
                p_task.result()  # a failed prefill ends the attempt now
            try:
                response = await d_task
            except httpx.HTTPError as exc:
                raise _Failure("decode", d, f"{type(exc).__name__}: {exc}",
                               drop=isinstance(exc, httpx.ConnectError)) from None
            if response.status_code >= 500:
                raise _Failure("decode", d, f"HTTP {response.status_code}: "
                                            f"{response.text[:300]}")
            if response.status_code >= 400:
                raise _client_error(response.status_code, response.content)
            data = response.json()
            usage = data.get("usage") or {}
            for choice in data.get("choices") or []:
                if _failed_before_first_token(choice, usage.get("completion_tokens")):
                    raise _Failure("prefill", p, f"the decode instance reported: "
                                                 f"{choice.get('stop_reason')}")
            try:
                prefill = await asyncio.wait_for(asyncio.shield(p_task), 5.0)
            except (asyncio.TimeoutError, _Failure, _ClientError):
                prefill = None
            _patch_usage(data.get("usage"), prefill)
            return JSONResponse(data)
        finally:
            await _cancel(p_task, d_task)
            pair.end()

    async def _attempt_stream(self, path: str, body: dict[str, Any], pair: _Pair
                              ) -> _DecodeStream:
        """Open the decode's stream and read it up to its first token."""
        prefill_body, decode_body = self._bodies(body, pair)
        p, d = pair.prefill, pair.decode
        pair.begin()
        p_task = asyncio.ensure_future(self._prefill(p, path, prefill_body))
        response: httpx.Response | None = None
        line_task: asyncio.Future | None = None
        committed = False
        try:
            try:
                response = await self.client.send(
                    self.client.build_request("POST", f"{d.url}{path}", json=decode_body),
                    stream=True)
            except httpx.HTTPError as exc:
                raise _Failure("decode", d, f"{type(exc).__name__}: {exc}",
                               drop=isinstance(exc, httpx.ConnectError)) from None
            if response.status_code >= 400:
                content = await response.aread()
                if response.status_code >= 500:
                    raise _Failure("decode", d, f"HTTP {response.status_code}: "
                                                f"{content[:300]!r}")
                raise _client_error(response.status_code, content)
            lines = response.aiter_lines()
            buffered: list[str] = []
            while True:
                line_task = asyncio.ensure_future(anext(lines, None))
                if not p_task.done():
                    await asyncio.wait((p_task, line_task), return_when=asyncio.FIRST_COMPLETED)
                    if p_task.done() and p_task.exception() is not None:
                        raise p_task.exception()
                try:
                    line = await line_task
                except httpx.HTTPError as exc:
                    raise _Failure("decode", d, f"{type(exc).__name__}: {exc}") from None
                line_task = None
                if line is None:
                    raise _Failure("decode", d, "the stream ended before its first token")
                buffered.append(line)
                event = _event(line)
                if event == "[DONE]":
                    raise _Failure("decode", d, "the stream ended before its first token")
                if not isinstance(event, dict):
                    continue
                if "error" in event:
                    raise _Failure("decode", d, f"error event: {event['error']}")
                choices = event.get("choices") or []
                failed = [c for c in choices if _failed_before_first_token(c, 0)]
                if failed:
                    raise _Failure("prefill", p, f"the decode instance reported: "
                                                 f"{failed[0].get('stop_reason')}")
                if any(_carries_token(c) for c in choices) or event.get("usage"):
                    committed = True
                    return _DecodeStream(self, pair, p_task, response, lines, buffered)
        finally:
            if not committed:
                await _cancel(p_task, line_task)
                if response is not None:
                    await response.aclose()
                pair.end()


async def _cancel(*tasks: asyncio.Future | None) -> None:
    pending = [t for t in tasks if t is not None and not t.done()]
    for task in pending:
        task.cancel()
    for task in tasks:
        if task is not None:
            try:
                await task
            except BaseException:  # noqa: BLE001 - its outcome no longer matters
                pass


class _DecodeStream:
    """A decode stream past its first token: the buffered events, then the rest as they
    come. Closing it (the client went away) closes the decode's connection, which aborts the
    request there."""

    def __init__(self, proxy: Proxy, pair: _Pair, p_task: asyncio.Future,
                 response: httpx.Response, lines: AsyncIterator[str], buffered: list[str]
                 ) -> None:
        self.proxy = proxy
        self.pair = pair
        self.p_task = p_task
        self.response = response
        self.lines = lines
        self.buffered = buffered

    async def events(self) -> AsyncIterator[str]:
        try:
            for line in self.buffered:
                yield self._patched(line) + "\n"
            async for line in self.lines:
                yield self._patched(line) + "\n"
        except httpx.HTTPError as exc:
            message = f"the decode instance {self.pair.decode.url} failed mid-stream: {exc}"
            logger.warning("router: %s", message)
            yield f"data: {json.dumps({'error': {'message': message, 'code': 502}})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await _cancel(self.p_task)
            await self.response.aclose()
            self.pair.end()

    def _patched(self, line: str) -> str:
        if '"usage"' not in line:
            return line
        event = _event(line)
        if not isinstance(event, dict) or not event.get("usage"):
            return line
        prefill = None
        if self.p_task.done() and not self.p_task.cancelled() and self.p_task.exception() is None:
            prefill = self.p_task.result()
        _patch_usage(event["usage"], prefill)
        return f"data: {json.dumps(event)}"
