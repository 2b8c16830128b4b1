"""A request as the scheduler sees it: token ids, how many have KV computed, its status."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from sluice.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sluice.core.kv_cache_utils import BlockHash


class RequestStatus(enum.IntEnum):
    """Ordered: every status above PREEMPTED is finished."""

    WAITING = enum.auto()
    # Blocks allocated, KV being loaded by a connector; scheduled once the load ends.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()  # e.g. its KV failed to load and the policy is "fail"

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
    RequestStatus.FINISHED_ERROR: "error",
}


class EngineCoreRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One sample to generate, as the front end hands it to the engine core (in-process or
    over the wire): the one definition of what a request carries in. A request with `n > 1`
    becomes n of these."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: set[int] = msgspec.field(default_factory=set)
    arrival_time: float = 0.0
    max_tokens: int = 16
    # For a KV connector: how this request's KV moves (e.g. where a prefill instance holds it).
    kv_transfer_params: dict[str, Any] | None = None


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
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids or set()
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.max_tokens = max_tokens
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.kv_transfer_params = kv_transfer_params

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
        # Draft slots of the steps in flight (their drafts are counted in num_computed_tokens
        # as if accepted, and rolled back when the step's tokens come back).
        self.num_draft_slots_in_flight = 0
        # all_token_ids as an int64 array with room to grow (n-gram drafts read it every step;
        # converting the list each time costs more than the search)
        self._token_array: np.ndarray | None = None
        self._num_arrayed = 0
        # Prefix-cache hit at first scheduling (reported as RequestOutput.num_cached_tokens).
        self.num_cached_tokens = -1
        # Of its computed tokens when last admitted, those a KV connector loaded (after the
        # local prefix-cache hit): a model proposer's KV was never written there.
        self.num_loaded_tokens = 0
        # Chained hashes of this request's full blocks, extended by the KV cache manager.
        self.block_hashes: list[BlockHash] = []
        self.num_preemptions = 0
        # prompt_logprobs need logits of every prompt token: such requests skip cache hits.
        self.skip_prefix_cache = sampling_params.prompt_logprobs is not None
        # Timestamps (time.time()) for RequestOutput.metrics.
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @classmethod
    def from_engine_core_request(cls, message: EngineCoreRequest) -> Request:
        return cls(**msgspec.structs.asdict(message))

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

    def tokens_as_array(self) -> np.ndarray:
        """all_token_ids as an array (a view of the growing buffer; all_token_ids only grows)."""
        num_tokens = len(self.all_token_ids)
        array = self._token_array
        if array is None or array.shape[0] < num_tokens:
            array = np.empty(max(2 * num_tokens, 256), dtype=np.int64)
            array[:num_tokens] = self.all_token_ids
            self._token_array = array
        elif self._num_arrayed < num_tokens:
            array[self._num_arrayed:num_tokens] = self.all_token_ids[self._num_arrayed:]
        self._num_arrayed = num_tokens
        return array[:num_tokens]

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
