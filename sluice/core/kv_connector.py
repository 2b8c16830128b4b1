"""The scheduler's side of a KV connector (vLLM's KVConnectorBase_V1, scheduler role).

A KV connector moves KV blocks between this instance's paged cache and somewhere else: a CPU
tier, a pool shared by instances, another instance (prefill/decode disaggregation). It has two
halves built from one KVTransferConfig: this one, in the engine core next to the scheduler (no
torch), and a worker half (sluice/worker/kv_connector.py) next to the model runner on every
rank. They talk only through the step messages: the plan goes down in
`SchedulerOutput.kv_connector_metadata` (built by `build_connector_meta`), the reports come up
in `ModelRunnerOutput.kv_connector_output` (given to `update_connector_output`).

Lifecycle of a request (the scheduler calls, in this order):

1. `get_num_new_matched_tokens(request, num_computed_tokens)` while the request waits: how many
   tokens past the local prefix-cache hit the connector can load (the longest run actually
   present, and never the prompt's last token, whose logits must be computed), and whether the
   load is asynchronous. `None` = cannot tell yet: ask again next step (the request is passed
   over, the others go ahead). No side effects: it may be called several times.
2. `update_state_after_alloc(request, block_ids, num_external_tokens)` once the blocks exist
   (`request.num_computed_tokens` already counts the external tokens, which are the last
   `num_external_tokens` of them): the connector notes which blocks to load into. A
   synchronous load happens in the step that computes the request's first new tokens (layer
   by layer); an asynchronous one parks the request in WAITING_FOR_REMOTE_KVS until a worker
   reports it in `finished_recving`.
3. `build_connector_meta(scheduler_output, scheduler)` every step: the step's plan (loads and
   saves) as the connector's own msgspec struct (`metadata_type`); resets the per-step state.
4. `update_connector_output(output)` with what the workers reported (and, for requests that
   carry kv_transfer_params, `update_request_output` with each step's sampled tokens).
5. `request_finished(request, block_ids)` exactly once, when the request ends (finished,
   aborted, failed), before its blocks are freed: `(delay_free, kv_transfer_params)`. With
   `delay_free` the scheduler keeps the blocks until a worker reports the request in
   `finished_sending`; the params travel back to the client with the last output.

Blocks a connector loads into are entered into the prefix cache only once the load is known to
have succeeded; a failed load (`invalid_block_ids`) truncates the request at the first bad block
and recomputes from there, or fails it (KVTransferConfig.kv_load_failure_policy).

Loads that bring the first token (prefill/decode disaggregation). The instance that computed a
prompt has also sampled the token after it; recomputing the prompt's last token on the decode
side would waste a step and, with sampling, could draw another token. So:

- an asynchronous load may cover the whole prompt, last token included (a synchronous one never
  does): `get_num_new_matched_tokens` may return `request.num_tokens - num_computed_tokens`;
- the worker that ends such a load reports the peer's token with it, in
  `KVConnectorOutput.first_tokens[req_id]` (a FirstToken: id and, if the request asked, its
  logprobs), in the same report as `finished_recving` (a failed load brings none);
- the scheduler then appends it as the request's first output token, sends it to the client,
  and checks the stop conditions (it may be the last token); otherwise the request waits with
  its prompt computed, and its next step computes the token's KV and samples the second (the
  runner gets the token in `NewRequestData.output_token_ids`). An async load that covered the
  whole prompt but ended without a first token recomputes the prompt's last token, as before.
- On the sending side, `update_request_output(request, new_token_ids, new_logprobs)` gives the
  connector each step's tokens and logprobs of requests that carry kv_transfer_params, before
  `request_finished` when that step ends them: the first token and its logprobs to hand on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from sluice.config import KVTransferConfig
    from sluice.core.outputs import KVConnectorOutput, PositionLogprobs, SchedulerOutput
    from sluice.core.request import Request


@dataclass(frozen=True)
class KVCacheSpec:
    """What a connector needs to know of one rank's paged KV cache. Layout of each layer's
    tensor: [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V)."""

    model: str  # the model's identity (its folder or hub id)
    dtype: str  # "bfloat16", "float32", ...
    block_size: int
    num_kv_heads: int  # on this rank
    head_dim: int
    layer_names: tuple[str, ...]  # in layer order
    tp_rank: int = 0
    tp_size: int = 1
    layout: str = "2.nb.bs.h.d"  # names the layout above in keys that must never mix layouts
    max_tokens_per_step: int = 0  # max_num_batched_tokens (0: unknown): a step's KV at most
    # The model's KV heads over every rank (0: num_kv_heads * tp_size, no head replicated).
    # Rank r holds heads [r * H // tp_size, ... + num_kv_heads) (sluice.distributed.tp).
    model_num_kv_heads: int = 0

    def __post_init__(self) -> None:
        if not self.model_num_kv_heads:
            object.__setattr__(self, "model_num_kv_heads", self.num_kv_heads * self.tp_size)

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of one token, K or V."""
        return self.head_dim * _DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block_layer(self) -> int:
        """Bytes of one block of one layer (K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * _DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over every layer."""
        return self.bytes_per_block_layer * self.num_layers


class SchedulerView(Protocol):
    """What a connector may read of the scheduler when it plans a step."""

    requests: Mapping[str, Request]  # live requests by id (block_hashes kept up to date)

    def get_block_ids(self, request_id: str) -> list[int]: ...


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1,
                "float8_e5m2": 1}


class KVConnectorScheduler(ABC):
    """The scheduler-side half of a connector; see the module docstring for the call order."""

    # The struct type of this connector's per-step plan (a msgspec.Struct subclass); worker
    # processes decode SchedulerOutput[metadata_type].
    metadata_type: type = type(None)

    def __init__(self, config: KVTransferConfig, kv_cache_spec: KVCacheSpec) -> None:
        self.config = config
        self.kv_cache_spec = kv_cache_spec

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens loadable after the first `num_computed_tokens`, whether the load is
        asynchronous); (None, False): ask again next step. The count is a multiple of the
        block size and leaves at least the request's last token to compute."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """The request now owns `block_ids` (all of its blocks, in token order); the
        `num_external_tokens` after its local hit are to be loaded into them."""
        return None

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput,
                             scheduler: SchedulerView) -> Any:
        """This step's plan for the workers (an instance of `metadata_type`). Called once per
        step, before the scheduled requests' num_computed_tokens advance by their
        num_scheduled_tokens; every step's workers' report comes back to
        update_connector_output, in step order."""

    def update_request_output(self, request: Request, new_token_ids: list[int],
                              new_logprobs: list[PositionLogprobs] | None) -> None:
        """What a step sampled for a request that carries kv_transfer_params (its logprobs
        when asked for); called before request_finished when the step ended the request."""
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """What the workers reported after a step (merged across ranks). With async scheduling
        and in-process workers this comes at the step's launch, before the device has run it
        (StepHandle.take_connector_output): time a step in `step_finished`, not here."""
        return None

    def step_finished(self) -> None:
        """A step's result is back: called once per step built by `build_connector_meta`, in
        step order, after its report (if any) was applied."""
        return None

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The request ended (any reason) and is about to free `block_ids`. Returns whether to
        delay the free until a worker reports the request in `finished_sending`, and the
        kv_transfer_params for the client (or None)."""
        return False, None

    def num_held(self) -> int:
        """Waiting requests this connector holds back for now (get_num_new_matched_tokens
        answered None for a reason a worker will report, in `ready_requests`): while every
        waiting request is held or loading, the engine polls the workers instead of spinning."""
        return 0

    def has_plans(self) -> bool:
        """Whether the next step's metadata carries work for the workers (a send planned as a
        request finished): the engine steps at once instead of waiting for input."""
        return False

    def get_stats(self) -> dict[str, float]:
        """Cumulative counters for metrics (names without a prefix)."""
        return {}

    def shutdown(self) -> None:
        """Release what the connector holds (connections, memory)."""
        return None
