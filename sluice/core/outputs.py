"""The typed messages between the scheduler and the model runner.

The scheduler sends a diff each step: requests the runner has not seen (or that resume after
preemption) carry their whole state; requests already running carry only new block ids. The
runner keeps per-request state (token ids, block table, sampling generator) until a request
shows up in `finished_req_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sluice.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class CachedRequestData:
    req_id: str
    # True: `new_block_ids` replaces the block table (the request was preempted and resumed).
    resumed_from_preemption: bool
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> number of tokens to compute this step.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that ended since the last step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # req_id -> draft tokens to verify this step (speculative decoding); they are the last
    # len(drafts) of the request's num_scheduled_tokens.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


# Top-N logprobs for one position: token id -> (logprob, rank). The chosen token is included.
PositionLogprobs = dict[int, tuple[float, int]]


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    # One list per request in `req_ids`; empty while a prompt is still being prefilled in chunks.
    sampled_token_ids: list[list[int]]
    # req_id -> per sampled token; present only for requests that asked for logprobs.
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # req_id -> logprobs of the prompt positions computed this step (first prompt token: None).
    prompt_logprobs: dict[str, list[PositionLogprobs | None]] = field(default_factory=dict)
    # Speculative decoding: drafts proposed to follow each request's tokens (aligned with
    # req_ids; [] for none); None when speculation is off.
    spec_token_ids: list[list[int]] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request, sent from the engine core to the front end."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None = None  # the stop token id (or stop string) that ended it
    new_logprobs: list[PositionLogprobs] | None = None
    new_prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class SpecDecodingStats:
    """Cumulative speculative-decoding counters of one engine core (all zero without it)."""

    num_spec_tokens: int = 0  # k: drafts proposed per request per step at most
    num_drafts: int = 0  # verified rows that carried at least one draft token
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    # [k]: accepted drafts at each draft position (position 0 is the first draft)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified draft: 1 (the target's own token) + accepted drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
