"""Streaming requests to an OpenAI-compatible server, timed on the client.

One request: POST with `stream: true` and `stream_options: {include_usage: true}`, read the
server-sent events line by line, and stamp every content chunk with `time.perf_counter()` as it
arrives. A content chunk is one that carries generated text, or a token with no text (a special
token) that is not the closing chunk; role-only chat deltas and the final usage chunk are not
tokens. Usage, when the server sends it, gives the prompt and completion token counts.

Any failure (connection, HTTP status, an `error` event, a stream with no content) becomes a
`RequestTiming` with `success=False` and the error as text, so one bad request never stops a run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from sluice.bench.serve_metrics import RequestTiming

# A benchmark of long outputs at a low rate can legitimately hold a stream open for hours.
_TIMEOUT = httpx.Timeout(6 * 3600.0, connect=60.0)
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


def make_client(max_concurrency: int | None, api_key: str | None) -> httpx.AsyncClient:
    """One client for the run; the pool is sized so requests never wait on a connection."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=None)
    return httpx.AsyncClient(timeout=_TIMEOUT, limits=limits, headers=headers)


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


def _chunk_text(choice: dict[str, Any], chat: bool) -> tuple[str, bool]:
    """(text of this choice chunk, whether it stands for a generated token)."""
    finished = choice.get("finish_reason") is not None
    if not chat:
        text = choice.get("text") or ""
        return text, bool(text) or not finished
    delta = choice.get("delta") or {}
    text = delta.get("content") or delta.get("reasoning_content") or ""
    return text, bool(text) or not (finished or "role" in delta)


async def send_request(client: httpx.AsyncClient, request: RequestInput,
                       t0: float = 0.0) -> RequestTiming:
    """Send one streaming request; `t0` is the benchmark's start on the perf_counter clock."""
    timing = RequestTiming(prompt_len=request.prompt_len)
    text_parts: list[str] = []
    start = time.perf_counter()
    timing.start_time = start - t0
    last = start
    received_token = False
    try:
        async with client.stream("POST", request.api_url, json=build_payload(request)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                timing.error = f"HTTP {resp.status_code}: {body[:_MAX_ERROR_CHARS]}"
                return timing
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments (keep-alive pings), event names
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                event = json.loads(data)
                if "error" in event:
                    timing.error = f"error event: {json.dumps(event['error'])[:_MAX_ERROR_CHARS]}"
                    return timing
                if choices := event.get("choices"):
                    text, is_token = _chunk_text(choices[0], request.chat)
                    text_parts.append(text)
                    if is_token:
                        if received_token:
                            timing.itl.append(now - last)
                        else:
                            timing.ttft = now - start
                            received_token = True
                        last = now
                if usage := event.get("usage"):
                    timing.output_tokens = int(usage.get("completion_tokens") or 0)
                    if usage.get("prompt_tokens") is not None:
                        timing.prompt_len = int(usage["prompt_tokens"])
    except Exception as e:  # any failure is recorded on the request, never raised
        timing.error = f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]
        return timing
    timing.generated_text = "".join(text_parts)
    if not received_token:
        timing.error = "the stream ended without a content chunk (no TTFT)"
        return timing
    timing.latency = last - start
    timing.success = True
    return timing


async def first_model(client: httpx.AsyncClient, base_url: str) -> tuple[str, str]:
    """(id, root) of the first model GET /v1/models lists; root is the served folder or name."""
    url = f"{base_url}/v1/models"
    try:
        resp = await client.get(url)
        resp.raise_for_status()
        models = resp.json().get("data") or []
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot list models at {url} (is the server running?): {e}") from None
    if not models:
        raise ValueError(f"the server at {base_url} lists no models")
    return models[0]["id"], models[0].get("root") or models[0]["id"]
