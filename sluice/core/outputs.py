"""The typed messages of one engine step: scheduler -> workers, workers -> scheduler, and the
engine core's per-request output to the front end.

Every message here is a msgspec struct and the only definition of what it carries: the same
objects pass in-process (the uniprocess executor), and are encoded for worker processes (the
multiprocess executor) and for the front end (the engine-core process), where the channels stamp
`SCHEMA_VERSION` on every frame and refuse another. No pickle anywhere.

The scheduler sends a diff each step: requests the runner has not seen (or that resume after
preemption) carry their whole state; requests already running carry only new block ids. The
runner keeps per-request state (token ids, block table, sampling generator) until a request
shows up in `finished_req_ids`.

KV connectors (see sluice/core/kv_connector.py) ride along: the scheduler side's plan for the
step travels down in `kv_connector_metadata` (a struct of the connector's own type, so
`SchedulerOutput` is generic in it), and the workers' reports come up in `kv_connector_output`.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from sluice.sampling_params import SamplingParams

# Bump when any message of the step or front-end channels changes shape.
# 3: one definition per message (sampling parameters and core outputs travel as themselves),
#    KV connector fields, kv_transfer_params.
# 4: structured outputs and logit_bias in SamplingParams, grammar_bitmask in SchedulerOutput.
# 5: a connector's load may bring the request's first token (KVConnectorOutput.first_tokens,
#    NewRequestData.output_token_ids), connector counters in SchedulerStats.
# 6: SchedulerStats carries the scheduled-token total.
# 9: KVCacheSpec carries the model's KV heads; PD TransferRequest carries decode's TP size and
#    heads (prefill and decode of different TP sizes).
# 10: speculative decoding's drafting policy: SchedulerOutput.propose_drafts, the policy's step
#    counters in SpecDecodingStats and SchedulerStats; n-gram drafts come from the scheduler.
# 11: n-gram drafts proposed on the device (SchedulerOutput.scheduled_device_drafts,
#    ModelRunnerOutput.num_device_drafts).
# 12: SchedulerStats carries the KV cache's peaks and the blocks freed behind sliding windows.
# 13: a hybrid model's other KV cache groups' block ids (NewRequestData.group_block_ids,
#     CachedRequestData.new_group_block_ids).
# 14: KVConnectorOutput.ready_requests (the PD prefill's bootstrap queue; PDMetadata.held).
SCHEMA_VERSION = 14

# A connector's per-step plan (its own msgspec struct type).
ConnectorMetadataT = TypeVar("ConnectorMetadataT")


class NewRequestData(msgspec.Struct):
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Output tokens the request already has when the runner first sees it (the first token a
    # prefill instance sampled, delivered with the KV by a connector).
    output_token_ids: list[int] = msgspec.field(default_factory=list)
    # Of num_computed_tokens, those a KV connector loaded (after the local prefix-cache hit).
    num_loaded_tokens: int = 0
    # A hybrid model's KV cache groups 1.. (sluice/core/kv_cache_groups.py): each group's
    # block ids, as many as block_ids (group 0's); empty for a model of one group.
    group_block_ids: list[list[int]] = msgspec.field(default_factory=list)


class CachedRequestData(msgspec.Struct):
    req_id: str
    # True: `new_block_ids` replaces the block table (the request was preempted and resumed).
    resumed_from_preemption: bool
    new_block_ids: list[int]
    num_computed_tokens: int
    # A resumed request's: of num_computed_tokens, those a KV connector loaded.
    num_loaded_tokens: int = 0
    # Groups 1.. of a hybrid model, as NewRequestData.group_block_ids (new or replacing).
    new_group_block_ids: list[list[int]] = msgspec.field(default_factory=list)


class GrammarBitmask(msgspec.Struct):
    """The tokens each constrained request may sample this step (structured outputs): for
    `req_ids[i]`, row i of `bitmask`, ceil(V / 32) little-endian int32 words per row, rows
    packed one after another; bit v of a row set means token v is allowed. Requests of the step
    that are not listed sample unconstrained."""

    req_ids: list[str]
    bitmask: bytes


class SchedulerOutput(msgspec.Struct, Generic[ConnectorMetadataT]):
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> number of tokens to compute this step.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that ended since the last step: the runner drops their state.
    finished_req_ids: set[str] = msgspec.field(default_factory=set)
    preempted_req_ids: set[str] = msgspec.field(default_factory=set)
    # req_id -> draft tokens to verify this step (speculative decoding); they are the last
    # len(drafts) of the request's num_scheduled_tokens.
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # A model proposer (draft model, EAGLE) drafts after this step for the next one; False: it
    # only writes its KV (the drafting policy turned drafting off). N-gram drafts are the
    # scheduler's own.
    propose_drafts: bool = False
    # req_id -> draft slots k' of a request whose drafts the workers propose on the device,
    # after the last token (n-gram with async scheduling: sluice/spec_decode/device_ngram.py);
    # they are the last k' of its num_scheduled_tokens. 0: a request that decodes one token
    # while draft slots of it are in flight (the device knows where its tokens end).
    scheduled_device_drafts: dict[str, int] = msgspec.field(default_factory=dict)
    # The KV connector's plan for this step (loads, saves), None without a connector.
    kv_connector_metadata: ConnectorMetadataT | None = None
    # Structured outputs: the grammar masks of the step's constrained requests that sample
    # (sluice/structured_output/manager.py); None when none does.
    grammar_bitmask: GrammarBitmask | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


# Top-N logprobs for one position: token id -> (logprob, rank). The chosen token is included.
PositionLogprobs = dict[int, tuple[float, int]]


class FirstToken(msgspec.Struct):
    """A request's first output token, sampled by the instance that computed its prompt."""

    token_id: int
    logprobs: PositionLogprobs | None = None  # present when the request asked for logprobs


class KVConnectorOutput(msgspec.Struct, omit_defaults=True):
    """What a worker's connector reports after a step (see KVConnectorWorker.get_finished).

    finished_sending: requests whose delayed free may happen now (their KV left this instance);
    finished_recving: requests whose asynchronous load ended (successfully or not: failed blocks
    are in invalid_block_ids); invalid_block_ids: blocks whose load failed this step or in a load
    that ended now; first_tokens: for loads in finished_recving that brought the whole prompt's
    KV and the first token sampled after it (see sluice/core/kv_connector.py); load_errors: why
    loads failed; stats: counters since the last report (bytes, latencies, errors by kind);
    ready_requests: of the requests the connector holds back while waiting
    (get_num_new_matched_tokens -> None), those that may go now (merged across ranks: those
    every rank reported in the step)."""

    finished_sending: set[str] = msgspec.field(default_factory=set)
    finished_recving: set[str] = msgspec.field(default_factory=set)
    invalid_block_ids: set[int] = msgspec.field(default_factory=set)
    first_tokens: dict[str, FirstToken] = msgspec.field(default_factory=dict)
    # Why a load in finished_recving failed (its blocks are in invalid_block_ids): the
    # request's error message says so.
    load_errors: dict[str, str] = msgspec.field(default_factory=dict)
    stats: dict[str, float] = msgspec.field(default_factory=dict)
    ready_requests: set[str] = msgspec.field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids
                    or self.first_tokens or self.load_errors or self.stats
                    or self.ready_requests)


class ModelRunnerOutput(msgspec.Struct):
    req_ids: list[str]
    # One list per request in `req_ids`; empty while a prompt is still being prefilled in chunks.
    sampled_token_ids: list[list[int]]
    # req_id -> per sampled token; present only for requests that asked for logprobs.
    logprobs: dict[str, list[PositionLogprobs]] = msgspec.field(default_factory=dict)
    # req_id -> logprobs of the prompt positions computed this step (first prompt token: None).
    prompt_logprobs: dict[str, list[PositionLogprobs | None]] = msgspec.field(
        default_factory=dict)
    # Speculative decoding with a model proposer: drafts proposed to follow each request's
    # tokens (aligned with req_ids; [] for none); None when it did not propose.
    spec_token_ids: list[list[int]] | None = None
    # req_id -> drafts the device proposed and verified this step (scheduled_device_drafts)
    num_device_drafts: dict[str, int] = msgspec.field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


class EngineCoreOutput(msgspec.Struct, omit_defaults=True):
    """What one step produced for one request, sent from the engine core to the front end."""

    req_id: str
    new_token_ids: list[int]
    # "stop" | "length" | "abort" | "error" once finished
    finish_reason: str | None = None
    # The stop token id (or stop string) that ended it; for "error", what went wrong.
    stop_reason: int | str | None = None
    new_logprobs: list[PositionLogprobs] | None = None
    new_prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    # Set on the last output of a request a KV connector handed on (how a prefill instance tells
    # the decode side where the KV is).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct):
    """Cumulative speculative-decoding counters of one engine core (all zero without it)."""

    num_spec_tokens: int = 0  # k: drafts proposed per request per step at most
    num_drafts: int = 0  # verified rows that carried at least one draft token
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of those, accepted
    # [k]: accepted drafts at each draft position (position 0 is the first draft)
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)
    # Scheduled steps by the drafting policy's decision (sluice/spec_decode/policy.py): drafting
    # on, off for the batch size (disable_by_batch_size), off for low acceptance. Steps without
    # a request that can speculate are not counted.
    num_steps_drafting: int = 0
    num_steps_off_batch_size: int = 0
    num_steps_off_acceptance: int = 0

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
