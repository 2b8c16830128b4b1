"""One step as the scheduler puts it together (StepPlan): the tokens it gives each request
under the token budget left (`num_tokens_for_running`; a waiting request's at admission), the
requests it sends the runner new or again, and the SchedulerOutput made of it. `hand_over` then
counts the scheduled tokens as computed (the runner writes their KV before anyone reads it) and
gives each request that samples in the step a placeholder for its token."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.config import SchedulerConfig
from sluice.core.grammar_gate import is_constrained
from sluice.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from sluice.core.request import Request, RequestStatus


@dataclass(slots=True)
class StepPlan:
    """One step being put together: what is scheduled so far and what budget is left."""

    token_budget: int
    now: float
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    device_drafts: dict[str, int] = field(default_factory=dict)  # req_id -> draft slots
    num_partial_prefills: int = 0

    def add(self, request: Request, num_new: int, is_partial: bool) -> None:
        self.num_scheduled_tokens[request.request_id] = num_new
        self.token_budget -= num_new
        self.num_partial_prefills += is_partial

    def num_tokens_for_running(self, request: Request, config: SchedulerConfig) -> int:
        """The tokens a running request gets in the step: the rest of its known tokens and its
        drafts, after those in flight (every draft slot counted as accepted), within the budget
        left, the long-prefill chunk cap and max_model_len."""
        placeholders = request.num_output_placeholders + request.num_draft_slots_in_flight
        if placeholders and (request.num_output_tokens + placeholders >= request.max_tokens
                             or request.num_tokens + placeholders >= config.max_model_len
                             or is_constrained(request)):
            # The token in flight is its last one, or its grammar must see it first.
            return 0
        num_new = (request.num_tokens + placeholders + len(request.spec_token_ids)
                   - request.num_computed_tokens)
        if config.long_prefill_token_threshold > 0:
            num_new = min(num_new, config.long_prefill_token_threshold)
        # KV never goes past max_model_len positions.
        num_new = min(num_new, self.token_budget,
                      config.max_model_len - request.num_computed_tokens)
        return max(num_new, 0)

    def add_running(self, request: Request, new_block_ids: list[int],
                    new_group_block_ids: list[list[int]], num_new: int,
                    is_partial: bool) -> None:
        """A running request's next tokens, with the blocks it got for them (group 0's, and
        the other KV cache groups' of a hybrid model)."""
        self.cached_reqs.append(CachedRequestData(
            req_id=request.request_id,
            resumed_from_preemption=False,
            new_block_ids=new_block_ids,
            num_computed_tokens=request.num_computed_tokens,
            new_group_block_ids=new_group_block_ids,
        ))
        self.add(request, num_new, is_partial)

    def add_admitted(self, request: Request, block_ids: list[int],
                     group_block_ids: list[list[int]], num_new: int, is_partial: bool) -> None:
        """A waiting request admitted with `request.num_computed_tokens` already in its
        blocks: the runner's state of it anew (new) or with a fresh block table (resumed
        after preemption)."""
        if request.status == RequestStatus.PREEMPTED:
            self.cached_reqs.append(CachedRequestData(
                req_id=request.request_id,
                resumed_from_preemption=True,
                new_block_ids=block_ids,
                num_computed_tokens=request.num_computed_tokens,
                num_loaded_tokens=request.num_loaded_tokens,
                new_group_block_ids=group_block_ids,
            ))
        else:
            self.new_reqs.append(NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                block_ids=block_ids,
                num_computed_tokens=request.num_computed_tokens,
                output_token_ids=list(request.output_token_ids),
                num_loaded_tokens=request.num_loaded_tokens,
                group_block_ids=group_block_ids,
            ))
        self.add(request, num_new, is_partial)

    def to_output(self, max_num_batched_tokens: int, finished_req_ids: set[str],
                  propose_drafts: bool) -> SchedulerOutput:
        return SchedulerOutput(
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=self.cached_reqs,
            num_scheduled_tokens=self.num_scheduled_tokens,
            total_num_scheduled_tokens=max_num_batched_tokens - self.token_budget,
            finished_req_ids=finished_req_ids,
            preempted_req_ids=self.preempted,
            scheduled_spec_decode_tokens=self.spec_tokens,
            scheduled_device_drafts=self.device_drafts,
            propose_drafts=propose_drafts,
        )

    def hand_over(self, requests: dict[str, Request]) -> list[Request]:
        """The scheduled tokens are as good as computed once handed to the runner, which is
        also what the prefix cache assumed. A chunk that reaches the end of the known tokens
        (and of those in flight, drafts and draft slots counted as accepted) samples one more:
        a placeholder until then. Returns the requests that sample in the step."""
        sampling: list[Request] = []
        for req_id, num_new in self.num_scheduled_tokens.items():
            request = requests[req_id]
            request.num_computed_tokens += num_new
            num_spec = len(self.spec_tokens.get(req_id, ())) or self.device_drafts.get(req_id, 0)
            if request.num_computed_tokens == (request.num_tokens + request.num_output_placeholders
                                               + request.num_draft_slots_in_flight + num_spec):
                request.num_output_placeholders += 1
                request.num_draft_slots_in_flight += num_spec
                sampling.append(request)
        return sampling
