"""One request's outputs on their way from the output handler to the caller of generate().

The output handler puts each step's RequestOutput here; the caller takes what is waiting. When
the caller is behind (a busy server writing many streams), the outputs waiting are merged into
one, so a slow consumer gets fewer, larger deltas rather than a growing backlog: a server that
cannot write one SSE chunk per token per stream writes one per several tokens, and stays as
far behind as one step, not as far as its queue. A caller that keeps up sees every step.

DELTA outputs merge by concatenation, per sample: text, token ids and logprobs join; the
finish reason, the cumulative logprob, the prompt logprobs (whole, not deltas) and the request's
other fields come from the newer. CUMULATIVE and FINAL_ONLY outputs hold everything so far, so
the newer replaces the older.
"""

from __future__ import annotations

import asyncio

from sluice.engine.processors import RequestOutputKind
from sluice.outputs import CompletionOutput, RequestOutput


class EngineDiedInFlight(Exception):
    """Raised by RequestOutputStream.get once the engine died and nothing is left to take."""


def merge_delta(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """`older` followed by `newer` as one DELTA output (`older` is updated and returned)."""
    by_index = {sample.index: sample for sample in older.outputs}
    for sample in newer.outputs:
        merged = by_index.get(sample.index)
        if merged is None:
            older.outputs.append(sample)
            continue
        merged.text += sample.text
        merged.token_ids.extend(sample.token_ids)
        if sample.logprobs is not None:
            if merged.logprobs is None:
                merged.logprobs = []
            merged.logprobs.extend(sample.logprobs)
        merged.cumulative_logprob = sample.cumulative_logprob
        merged.finish_reason = sample.finish_reason
        merged.stop_reason = sample.stop_reason
    older.finished = newer.finished
    older.prompt_logprobs = newer.prompt_logprobs
    older.num_cached_tokens = newer.num_cached_tokens
    older.metrics = newer.metrics
    older.kv_transfer_params = newer.kv_transfer_params
    return older


def _own_samples(output: RequestOutput) -> RequestOutput:
    """A copy whose samples (and their lists) a merge may change: the caller keeps the ones it
    was given."""
    samples = [CompletionOutput(s.index, s.text, list(s.token_ids), s.cumulative_logprob,
                                None if s.logprobs is None else list(s.logprobs),
                                s.finish_reason, s.stop_reason) for s in output.outputs]
    return RequestOutput(output.request_id, output.prompt, output.prompt_token_ids,
                         output.prompt_logprobs, samples, output.finished,
                         output.num_cached_tokens, output.metrics, output.kv_transfer_params)


class RequestOutputStream:
    """What the output handler has for one request and its caller has not taken yet."""

    __slots__ = ("_kind", "_pending", "_ready", "_dead", "_owned")

    def __init__(self, kind: RequestOutputKind) -> None:
        self._kind = kind
        self._pending: RequestOutput | None = None
        self._owned = False  # whether _pending is a copy a merge may change
        self._ready = asyncio.Event()
        self._dead = False

    def put(self, output: RequestOutput) -> None:
        pending = self._pending
        if pending is None or self._kind != RequestOutputKind.DELTA:
            self._pending, self._owned = output, False
        else:
            if not self._owned:
                pending, self._owned = _own_samples(pending), True
            self._pending = merge_delta(pending, output)
        self._ready.set()

    def put_dead(self) -> None:
        """The engine died: get() raises once the outputs already here are taken."""
        self._dead = True
        self._ready.set()

    async def get(self) -> RequestOutput:
        while self._pending is None:
            if self._dead:
                raise EngineDiedInFlight
            self._ready.clear()
            await self._ready.wait()
        output, self._pending = self._pending, None
        return output
