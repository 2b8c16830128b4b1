"""A request as the scheduler sees it: token ids, how many have KV computed, its status."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sluice.core.kv_cache_utils import BlockHash
    from sluice.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: every status above PREEMPTED is finished."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
}


class Request:
    """One sequence to generate. `n > 1` is fanned out into several Requests upstream."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: set[int] | None = None,
        arrival_time: float | None = None,
        max_tokens: int = 16,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids or set()
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.max_tokens = max_tokens
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None

        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        # Tokens whose KV is in the cache (computed, or found in the prefix cache).
        self.num_computed_tokens = 0
        # Tokens scheduled to be sampled whose ids have not come back yet (async scheduling:
        # the next step is scheduled while the GPU still computes this one).
        self.num_output_placeholders = 0
        # Draft tokens proposed to follow all_token_ids (speculative decoding): scheduled with
        # the next step for verification, never part of all_token_ids until accepted.
        self.spec_token_ids: list[int] = []
        # Prefix-cache hit at first scheduling (reported as RequestOutput.num_cached_tokens).
        self.num_cached_tokens = -1
        # Chained hashes of this request's full blocks, extended by the KV cache manager.
        self.block_hashes: list[BlockHash] = []
        self.num_preemptions = 0
        # prompt_logprobs need logits of every prompt token: such requests skip cache hits.
        self.skip_prefix_cache = sampling_params.prompt_logprobs is not None
        # Timestamps (time.time()) for RequestOutput.metrics.
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
