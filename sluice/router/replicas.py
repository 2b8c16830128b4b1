"""The router over plain replicas (sgl-router's regular mode): each request goes whole to one
colocated `sluice serve` instance, the worker its policy picks among the healthy ones.

The body goes to the worker as the client sent it and the answer comes back as the worker gave
it (`n`, `usage`, `stream_options.include_usage`, logprobs, tools: whatever the worker
supports), so a request through the router reads as one sent straight to a replica. Retries,
the commit at the first token and the error shapes are relay.py's: a worker that cannot be
reached (dropped at once when it refuses the connection), answers 5xx, breaks the connection,
or ends a request with finish_reason "error" before any token is retried on another healthy
worker; once a stream's first token has gone out, a failure ends it with an error event. 4xx
answers are the worker's verdict on the request and go back unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.responses import Response

from sluice.router.relay import (
    CommittedStream,
    Failure,
    Relay,
    UpstreamLines,
    failed_before_first_token,
    open_stream,
    post_whole,
    read_to_first_token,
)
from sluice.router.workers import Worker

ROLE = "worker"


def _ended_early(worker: Worker) -> Callable[[dict[str, Any]], Failure]:
    return lambda choice: Failure(ROLE, worker, f"the worker ended the request with error "
                                                f"before its first token: "
                                                f"{choice.get('stop_reason')}")


class ReplicaProxy(Relay[Worker]):
    def refusal(self, path: str, body: dict[str, Any]) -> str | None:
        return None  # the worker judges the request

    def _choose(self, key: str, avoid: dict[str, set[Worker]]) -> Worker:
        return self._pick(ROLE, key, avoid[ROLE])

    def _describe(self, worker: Worker) -> str:
        return worker.url

    @staticmethod
    def _begin(worker: Worker) -> None:
        worker.in_flight += 1  # what least_loaded and cache_aware balance on
        worker.num_requests += 1

    async def _attempt_full(self, path: str, body: dict[str, Any], worker: Worker) -> Response:
        self._begin(worker)
        try:
            response = await post_whole(self.session, ROLE, worker, f"{worker.url}{path}", body)
        finally:
            worker.in_flight -= 1
        try:
            data = response.json()
        except ValueError:
            data = None
        if isinstance(data, dict):
            completion_tokens = (data.get("usage") or {}).get("completion_tokens")
            for choice in data.get("choices") or []:
                if failed_before_first_token(choice, completion_tokens):
                    raise _ended_early(worker)(choice)
        return Response(response.content, status_code=response.status_code,
                        media_type=response.content_type or "application/json")

    async def _attempt_stream(self, path: str, body: dict[str, Any], worker: Worker
                              ) -> CommittedStream:
        self._begin(worker)
        response = None
        try:
            response = await open_stream(self.session, ROLE, worker, f"{worker.url}{path}",
                                         body)
            lines = UpstreamLines(response)
            buffered = await read_to_first_token(ROLE, worker, lines, _ended_early(worker))
        except BaseException:
            if response is not None:
                response.close()
            worker.in_flight -= 1
            raise

        async def on_close() -> None:
            worker.in_flight -= 1

        return CommittedStream(ROLE, worker, response, lines, buffered, on_close)
