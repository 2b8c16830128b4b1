"""The PD router's request path: pick a pair, send both halves at once, hand the client the
decode's answer, and retry what a prefill failure broke (the retry loop, the commit at the
first token and the errors are relay.py's, shared with the replica router).

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
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, Response

from sluice.router.relay import (
    TRANSPORT_ERRORS,
    ClientError,
    CommittedStream,
    Failure,
    Relay,
    UpstreamLines,
    cancel,
    failed_before_first_token,
    open_stream,
    post_whole,
    read_to_first_token,
    sse_event,
)
from sluice.router.workers import Worker


def refusal(path: str, body: dict[str, Any]) -> str | None:
    """Why the PD router cannot serve this request, or None."""
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


def _patch_usage(usage: dict[str, Any] | None, prefill: dict[str, Any] | None) -> None:
    if not isinstance(usage, dict) or not isinstance(prefill, dict):
        return
    cached = ((prefill.get("usage") or {}).get("prompt_tokens_details") or {}).get(
        "cached_tokens")
    details = usage.get("prompt_tokens_details")
    if cached is not None and isinstance(details, dict):
        details["cached_tokens"] = cached


def _lost_prefill(prefill: Worker) -> Callable[[dict[str, Any]], Failure]:
    """A decode that ends a choice with "error" before its first token reports a lost prefill:
    the prefill's failure (the attempt is retried with another pair)."""
    return lambda choice: Failure("prefill", prefill, f"the decode instance reported: "
                                                      f"{choice.get('stop_reason')}")


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


class Proxy(Relay[_Pair]):
    def refusal(self, path: str, body: dict[str, Any]) -> str | None:
        return refusal(path, body)

    def _choose(self, key: str, avoid: dict[str, set[Worker]]) -> _Pair:
        return _Pair(self._pick("prefill", key, avoid["prefill"]),
                     self._pick("decode", key, avoid["decode"]), secrets.randbits(63))

    def _describe(self, pair: _Pair) -> str:
        return f"room {pair.room}"

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
        # Any transport error drops a prefill (its rooms are lost with it).
        response = await post_whole(self.session, "prefill", worker, f"{worker.url}{path}",
                                    body, drop_on=TRANSPORT_ERRORS)
        data = response.json()
        for choice in data.get("choices") or []:
            if choice.get("finish_reason") in ("error", "abort"):
                raise Failure("prefill", worker, f"the prefill ended the request with "
                                                 f"{choice.get('finish_reason')}: "
                                                 f"{choice.get('stop_reason')}")
        return data

    async def _attempt_full(self, path: str, body: dict[str, Any], pair: _Pair) -> Response:
        prefill_body, decode_body = self._bodies(body, pair)
        p, d = pair.prefill, pair.decode
        pair.begin()
        p_task = asyncio.ensure_future(self._prefill(p, path, prefill_body))
        d_task = asyncio.ensure_future(post_whole(self.session, "decode", d, f"{d.url}{path}",
                                                  decode_body))
        try:
            done, _ = await asyncio.wait((p_task, d_task), return_when=asyncio.FIRST_COMPLETED)
            if p_task in done:
                p_task.result()  # a failed prefill ends the attempt now
            data = (await d_task).json()
            usage = data.get("usage") or {}
            for choice in data.get("choices") or []:
                if failed_before_first_token(choice, usage.get("completion_tokens")):
                    raise _lost_prefill(p)(choice)
            try:
                prefill = await asyncio.wait_for(asyncio.shield(p_task), 5.0)
            except (asyncio.TimeoutError, Failure, ClientError):
                prefill = None
            _patch_usage(data.get("usage"), prefill)
            return JSONResponse(data)
        finally:
            await cancel(p_task, d_task)
            pair.end()

    async def _attempt_stream(self, path: str, body: dict[str, Any], pair: _Pair
                              ) -> CommittedStream:
        prefill_body, decode_body = self._bodies(body, pair)
        p, d = pair.prefill, pair.decode
        pair.begin()
        p_task = asyncio.ensure_future(self._prefill(p, path, prefill_body))
        response = None
        try:
            response = await open_stream(self.session, "decode", d, f"{d.url}{path}",
                                         decode_body)
            lines = UpstreamLines(response)
            buffered = await read_to_first_token("decode", d, lines, _lost_prefill(p), p_task)
        except BaseException:
            await cancel(p_task)
            if response is not None:
                response.close()
            pair.end()
            raise

        async def on_close() -> None:
            await cancel(p_task)
            pair.end()

        def patched(line: bytes) -> bytes:
            if b'"usage"' not in line:
                return line
            event = sse_event(line)
            if not isinstance(event, dict) or not event.get("usage"):
                return line
            prefill = None
            if p_task.done() and not p_task.cancelled() and p_task.exception() is None:
                prefill = p_task.result()
            _patch_usage(event["usage"], prefill)
            return f"data: {json.dumps(event)}".encode()

        return CommittedStream("decode", d, response, lines, buffered, on_close, patched)
