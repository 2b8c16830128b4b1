"""The scheduler's drafting decisions for speculative decoding: whether a step drafts, which
requests get drafts or draft slots and how many, and what the verified tokens teach the drafting
policy. The rules are in sluice/core/scheduler.py's docstring; the policy's own in
sluice/spec_decode/policy.py.

Lifecycle, driven by the scheduler: `add_request` / `remove_request`; per step `begin_step`,
then per running request `prepare` (before its tokens are counted) and `take_scheduled` (once
its blocks are allocated), and `keep_device_drafts_verifiable` over the whole plan; per update
`begin_update`, then per request `settle_verified` and `after_new_tokens`. Host-only, no torch.
"""

from __future__ import annotations

from sluice.config import SchedulerConfig
from sluice.core.outputs import ModelRunnerOutput, SchedulerOutput, SpecDecodingStats
from sluice.core.request import Request, RequestStatus
from sluice.core.step_plan import StepPlan
from sluice.spec_decode.config import SpeculativeConfig
from sluice.spec_decode.ngram_proposer import NgramProposer
from sluice.spec_decode.policy import Drafting, DraftingPolicy, can_speculate


class Drafts:
    def __init__(self, spec: SpeculativeConfig, config: SchedulerConfig) -> None:
        self.max_model_len = config.max_model_len
        self.num_spec_tokens = spec.num_speculative_tokens
        # A draft model (or EAGLE head) writes the KV of its next drafts past the verified tokens.
        self.num_lookahead_tokens = self.num_spec_tokens if spec.method != "ngram" else 0
        self.stats = SpecDecodingStats(
            self.num_spec_tokens, num_accepted_tokens_per_pos=[0] * self.num_spec_tokens)
        self.policy = DraftingPolicy(spec)
        # n-gram drafts are proposed here, from the tokens known; a model's on the workers.
        self.ngram = NgramProposer(spec) if spec.method == "ngram" else None
        # With async scheduling, drafts are proposed on the workers' device instead, after the
        # tokens still in flight (sluice/spec_decode/device_ngram.py; a model proposer's by its
        # device pass after each step): steps that draft overlap like any other.
        self.on_device = config.async_scheduling
        self.drafting_now = False  # the policy's decision for the step being scheduled
        self._start_probes = False  # the policy's wish for the update under way

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if can_speculate(request.sampling_params):
            self.policy.add_request(request.request_id)

    def remove_request(self, request_id: str) -> None:
        self.policy.remove_request(request_id)

    # ---- the engine's questions ----------------------------------------------------------

    def needs_tokens_in_flight(self, running: list[Request]) -> bool:
        """Whether the policy wants n-gram drafts in the next step for requests whose last
        token is still in flight (async scheduling): drafts continue from that token."""
        return (self.ngram is not None and not self.on_device
                and self.policy.wants_drafts(len(running))
                and any(request.num_output_placeholders for request in running))

    def model_drafts_on_host(self) -> bool:
        """Whether a model proposer's drafts come back to the host with each step (no device
        drafts): its KV pass and drafts read the step's tokens, so every step is synchronous."""
        return self.ngram is None and not self.on_device

    # ---- one step ------------------------------------------------------------------------

    def begin_step(self, num_running: int) -> None:
        """The drafting policy's decision for the step being scheduled, counted."""
        decision = self.policy.begin_step(num_running)
        if decision is Drafting.ON:
            self.stats.num_steps_drafting += 1
        elif decision is Drafting.OFF_BATCH_SIZE:
            self.stats.num_steps_off_batch_size += 1
        elif decision is Drafting.OFF_ACCEPTANCE:
            self.stats.num_steps_off_acceptance += 1
        self.drafting_now = decision is Drafting.ON

    def num_lookahead(self, num_tokens_after_step: int) -> int:
        """Lookahead slots for a request that will have this many tokens' KV after the step:
        up to k, never past max_model_len (a block-table row holds no more)."""
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - num_tokens_after_step))

    def prepare(self, request: Request) -> None:
        """A running request's drafts (or device draft slots) for the step being scheduled,
        in spec_token_ids, where the step drafts."""
        if not self.drafting_now:
            return
        if self.on_device:
            self._device_draft_slots(request)
        elif self.ngram is not None:
            self._propose_ngram(request)

    def take_scheduled(self, request: Request, num_new: int, plan: StepPlan) -> None:
        """A running request got `num_new` tokens (its blocks allocated): the drafts that fit
        are the tail of them, into the plan."""
        num_spec = num_new - (request.num_tokens + request.num_output_placeholders
                              + request.num_draft_slots_in_flight - request.num_computed_tokens)
        if self.on_device:
            # A request with draft slots in flight is on the device's count of its tokens
            # until they come back, drafting or not: its row is fixed there.
            if request.spec_token_ids or request.num_draft_slots_in_flight:
                plan.device_drafts[request.request_id] = max(num_spec, 0)
            request.spec_token_ids = []
        elif request.spec_token_ids and num_spec > 0:
            plan.spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]

    def keep_device_drafts_verifiable(self, plan: StepPlan, requests: dict[str, Request]) -> None:
        """A step with device drafts verifies every row it samples with the rejection sampler,
        which applies no penalties, min_tokens or logprobs: if a request of the step needs one
        of those, the step drafts nothing (each request decodes its one token)."""
        if not any(plan.device_drafts.values()) or all(
                can_speculate(requests[req_id].sampling_params)
                for req_id in plan.num_scheduled_tokens):
            return
        for req_id, num_slots in plan.device_drafts.items():
            plan.num_scheduled_tokens[req_id] -= num_slots
            plan.token_budget += num_slots
            plan.device_drafts[req_id] = 0

    def proposes_drafts(self) -> bool:
        """Whether a model proposer drafts after the step being scheduled: when it drafts
        (synchronous steps: for the next one), and with device drafts also when the policy's
        next step is a probe (the drafts must be there by then)."""
        if self.ngram is not None:
            return False
        return self.drafting_now or (self.on_device and self.policy.probes_next_step())

    def _propose_ngram(self, request: Request) -> None:
        """N-gram drafts for a request about to decode from a known last token (none while a
        token of it is in flight, or while it still prefills)."""
        if (request.num_output_placeholders
                or request.num_computed_tokens != request.num_tokens - 1
                or not request.num_output_tokens
                or not self.policy.tracks(request.request_id)):
            return
        drafts = self.ngram.propose(request.tokens_as_array())
        if not drafts:
            self.policy.observe(request.request_id, 0)  # a drafting step that gains nothing
        request.spec_token_ids = self._trim(request, drafts)

    def _device_draft_slots(self, request: Request) -> None:
        """Draft slots for a request about to decode, proposed on the device after its last
        token (known or in flight): k, fewer near max_tokens and max_model_len counting every
        draft in flight as accepted; none while it still prefills. The slots stand in
        spec_token_ids until take_scheduled moves them to the plan."""
        in_flight = request.num_output_placeholders + request.num_draft_slots_in_flight
        if (request.num_computed_tokens != request.num_tokens + in_flight - 1
                or not (request.num_output_tokens or request.num_output_placeholders)
                or not self.policy.tracks(request.request_id)):
            return
        request.spec_token_ids = self._trim(request, [-1] * self.num_spec_tokens, in_flight)

    def _trim(self, request: Request, drafts: list[int], num_in_flight: int = 0) -> list[int]:
        """Drafts worth verifying: all accepted plus the bonus token must stay within
        max_tokens, and their KV within max_model_len, after `num_in_flight` tokens still in
        flight (their draft slots counted as accepted)."""
        room = min(request.max_tokens - request.num_output_tokens - num_in_flight - 1,
                   self.max_model_len - request.num_tokens - num_in_flight)
        return drafts[:max(room, 0)]

    # ---- a step's tokens come back -------------------------------------------------------

    def begin_update(self, num_running: int, proposed: list[list[int]] | None) -> bool:
        """A step's tokens are coming in: whether after_new_tokens wants each request's (a
        model proposer's drafts came with them, or the policy's n-gram probes are to settle
        or to start)."""
        self._start_probes = self.ngram is not None and self.policy.probes_wanted(num_running)
        return proposed is not None or self._start_probes or self.policy.has_probes()

    def settle_verified(self, request: Request, sampled: list[int],
                        scheduler_output: SchedulerOutput,
                        runner_output: ModelRunnerOutput) -> int:
        """A request's drafts (or draft slots) of the step are verified: the target's token at
        every accepted draft, plus one. The KV of the rejected drafts is garbage: forgotten
        (it is overwritten later). Returns the draft slots the step had for the request (0:
        none, or preempted in flight, its KV gone and nothing to roll back)."""
        req_id = request.request_id
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
        num_slots = (len(drafts) if drafts
                     else scheduler_output.scheduled_device_drafts.get(req_id, 0))
        if not (num_slots and sampled):
            return num_slots
        num_accepted = len(sampled) - 1
        request.num_draft_slots_in_flight -= num_slots
        num_drafts = len(drafts) if drafts else runner_output.num_device_drafts.get(req_id, 0)
        if num_drafts:
            self.stats.observe(num_drafts, num_accepted)
        if num_drafts or self.ngram is not None:
            # (A model proposer's slots hold no drafts when the step before did not propose:
            # nothing to measure. An n-gram proposer that found none: 0.)
            self.policy.observe(req_id, num_accepted)
        if request.status == RequestStatus.PREEMPTED:
            return 0
        request.num_computed_tokens -= num_slots - num_accepted
        return num_slots

    def after_new_tokens(self, request: Request, new_token_ids: list[int],
                         proposed: list[int] | None) -> None:
        """A request's tokens of a step are in: a model proposer's drafts for the next step;
        the drafting policy's n-gram probes settled, and started while drafting is off for
        acceptance."""
        if proposed is not None:
            request.spec_token_ids = self._trim(request, proposed)
            return
        if self.ngram is None:
            return
        req_id = request.request_id
        self.policy.observe_tokens(req_id, new_token_ids)
        if self._start_probes and new_token_ids and self.policy.wants_probe(req_id):
            # Not trimmed to max_tokens: a probe the request's end leaves unsettled is dropped.
            self.policy.start_probe(req_id, self.ngram.propose(request.tokens_as_array()))
