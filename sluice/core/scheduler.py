"""The token-budget scheduler: continuous batching, chunked prefill, preemption by recompute.

No prefill and decode phases: each request's `num_computed_tokens` catches up to its
`num_tokens`, every step handing out tokens under `max_num_batched_tokens` and `max_num_seqs`
(decode is the case of one token). Running requests go first in admission order, then waiting
ones in arrival order. When blocks run out the most recently admitted running request is
preempted: its blocks are freed and it is recomputed later (its full blocks usually still sit in
the prefix cache).

Beside that, each feature keeps to its own collaborator:
- Speculative decoding: a request is scheduled with 1 + k tokens (drafts cut first when the budget
  or max_model_len is short); only known tokens enter the prefix cache, and rejected drafts roll
  `num_computed_tokens` back. With async scheduling the drafts are proposed on the device and
  their slots counted as accepted while the step is in flight (`num_draft_slots_in_flight`), so
  such steps overlap like any other; without it, drafting steps run synchronously. Whether a step
  drafts: sluice/spec_decode/policy.py.
- KV connectors (sluice/core/kv_connector.py, bookkeeping in sluice/core/kv_transfers.py): a
  prefix loaded synchronously in the step that computes the next tokens, or asynchronously with
  the request parked in WAITING_FOR_REMOTE_KVS (never head-of-line); blocks enter the prefix
  cache only once the load is known good, and blocks a transfer may still touch are not freed.
- Structured outputs (sluice/structured_output/manager.py): a constrained request waits, passed
  over, until its grammar compiles, and is never scheduled while its last token is in flight
  (its next mask depends on it).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sluice.config import KVTransferConfig, SchedulerConfig
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.kv_connector import KVConnectorScheduler
from sluice.core.kv_transfers import KVTransfers
from sluice.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    FirstToken,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SpecDecodingStats,
)
from sluice.core.request import Request, RequestStatus
from sluice.spec_decode.ngram_proposer import NgramProposer
from sluice.spec_decode.policy import Drafting, DraftingPolicy, can_speculate

if TYPE_CHECKING:
    from sluice.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("sluice")


@dataclass(slots=True)
class _StepPlan:
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


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 connector: KVConnectorScheduler | None = None,
                 kv_transfer_config: KVTransferConfig | None = None,
                 structured_output: StructuredOutputManager | None = None) -> None:
        self.config = config
        self.structured_output = structured_output
        # Requests that ended outside a step (a grammar that did not compile): their outputs
        # go out with the next (take_outputs_without_step).
        self._outputs_without_step: list[EngineCoreOutput] = []
        self.kv_cache_manager = kv_cache_manager
        self.connector = connector
        self.kv_transfer_config = kv_transfer_config
        if connector is not None and kv_transfer_config is None:
            raise ValueError("a KV connector needs its kv_transfer_config")
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Ended since the last schedule(): the runner drops their state next step.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0
        self.num_scheduled_tokens_total = 0  # tokens run through the model, for metrics
        # The connector's transfers: loads in flight, delayed frees, aborted loads.
        self.kv_transfers = (KVTransfers(connector, kv_transfer_config, kv_cache_manager)
                             if connector is not None else None)
        spec = config.speculative_config
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        # A draft model (or EAGLE head) writes the KV of its next drafts past the verified tokens.
        self.num_lookahead_tokens = (self.num_spec_tokens
                                     if spec is not None and spec.method != "ngram" else 0)
        self.spec_decoding_stats = None
        self.drafting: DraftingPolicy | None = None
        # n-gram drafts are proposed here, from the tokens known; a model's on the workers.
        self.ngram: NgramProposer | None = None
        # With async scheduling, drafts are proposed on the workers' device instead, after the
        # tokens still in flight (sluice/spec_decode/device_ngram.py; a model proposer's by its
        # device pass after each step): steps that draft overlap like any other.
        self.device_drafts = False
        self._drafting_now = False  # the policy's decision for the step being scheduled
        if spec is not None:
            self.spec_decoding_stats = SpecDecodingStats(
                self.num_spec_tokens, num_accepted_tokens_per_pos=[0] * self.num_spec_tokens)
            self.drafting = DraftingPolicy(spec)
            if spec.method == "ngram":
                self.ngram = NgramProposer(spec)
            self.device_drafts = config.async_scheduling

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.sampling_params.structured_outputs is not None:
            if self.structured_output is None:
                raise ValueError("structured_outputs: this engine has no structured-output "
                                 "backend")
            self.structured_output.add_request(request)
        if self.drafting is not None and can_speculate(request.sampling_params):
            self.drafting.add_request(request.request_id)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string). Unknown ids are ignored."""
        assert RequestStatus.is_finished(status)
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_kv_transfers(self) -> bool:
        """Finished requests whose blocks still wait on a connector (a send, an aborted load):
        the engine keeps stepping, so the workers can report them done."""
        return self.kv_transfers is not None and self.kv_transfers.has_pending()

    def has_constrained_token_in_flight(self) -> bool:
        """Whether a running constrained request's last token is still in flight (async
        scheduling): it cannot be scheduled until its grammar has seen that token."""
        return any(request.num_output_placeholders
                   and request.sampling_params.structured_outputs is not None
                   for request in self.running)

    def drafts_need_tokens_in_flight(self) -> bool:
        """Whether the drafting policy wants n-gram drafts in the next step for requests whose
        last token is still in flight (async scheduling): drafts continue from that token, so
        the engine core takes the step in flight first."""
        return (self.ngram is not None and not self.device_drafts
                and self.drafting.wants_drafts(len(self.running))
                and any(request.num_output_placeholders for request in self.running))

    def runs_synchronously(self, output: SchedulerOutput) -> bool:
        """Whether the step must be taken before the next is scheduled, even with async
        scheduling: one with host drafts (how many are accepted decides where each request's
        next step starts), and without device drafts every step of a model proposer (its KV
        pass and drafts read the step's tokens on the host)."""
        return bool(output.scheduled_spec_decode_tokens) or (
            self.drafting is not None and self.ngram is None and not self.device_drafts)

    def has_requests_to_schedule(self) -> bool:
        """Whether a step could compute anything: False while every unfinished request waits
        for a remote load (the engine then polls the workers instead of spinning)."""
        num_parked = 0 if self.kv_transfers is None else self.kv_transfers.num_parked()
        return bool(self.running) or len(self.waiting) > num_parked

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in token order (for connectors)."""
        return self.kv_cache_manager.get_block_ids(request_id)

    # ---- one step ------------------------------------------------------------------------

    def cache_scheduled_blocks(self) -> None:
        """Enter the blocks the last schedule() filled into the prefix cache, where the KV cache
        manager defers that (see KVCacheManager.defer_caching): the engine calls this once the
        step is on its way to the device. schedule() does it first too."""
        self.kv_cache_manager.flush_pending_cache()

    def schedule(self) -> SchedulerOutput:
        self.kv_cache_manager.flush_pending_cache()
        plan = _StepPlan(token_budget=self.config.max_num_batched_tokens, now=time.time())
        if self.kv_transfers is not None:
            self.kv_transfers.free_expired(plan.now)
        if self.drafting is not None:
            self._drafting_now = self._begin_drafting_step()
        self._schedule_running(plan)
        # Then waiting requests in arrival order, unless this step had to preempt.
        if not plan.preempted:
            self._schedule_waiting(plan)
        if any(plan.device_drafts.values()):
            self._keep_device_drafts_verifiable(plan)

        output = SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=plan.cached_reqs,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - plan.token_budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=plan.preempted,
            scheduled_spec_decode_tokens=plan.spec_tokens,
            scheduled_device_drafts=plan.device_drafts,
            propose_drafts=self._proposes_drafts(),
        )
        self.finished_req_ids = set()
        self.num_scheduled_tokens_total += output.total_num_scheduled_tokens
        if self.connector is not None:
            for req_id in plan.num_scheduled_tokens:
                self.kv_cache_manager.update_block_hashes(self.requests[req_id])
            output.kv_connector_metadata = self.connector.build_connector_meta(output, self)
        # The tokens are as good as computed once handed to the runner (the runner writes their
        # KV before anyone reads it), which is also what the prefix cache assumed above. A chunk
        # that reaches the end of the known tokens samples one more: a placeholder until then.
        any_constrained = self._has_constrained_requests()
        constrained: list[str] = []
        for req_id, num_new in plan.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += num_new
            num_spec = len(plan.spec_tokens.get(req_id, ())) or plan.device_drafts.get(req_id, 0)
            if request.num_computed_tokens == (request.num_tokens + request.num_output_placeholders
                                               + request.num_draft_slots_in_flight + num_spec):
                request.num_output_placeholders += 1
                request.num_draft_slots_in_flight += num_spec
                if any_constrained and request.sampling_params.structured_outputs is not None:
                    constrained.append(req_id)
        if constrained:
            output.grammar_bitmask = self.structured_output.grammar_bitmask(constrained)
        return output

    def _has_constrained_requests(self) -> bool:
        """Whether any request has structured outputs (else their per-request checks are
        skipped: steps without them do no extra work)."""
        return self.structured_output is not None and bool(self.structured_output.requests)

    def take_outputs_without_step(self) -> list[EngineCoreOutput]:
        """Outputs of requests that ended in schedule() (a grammar that did not compile)."""
        outputs, self._outputs_without_step = self._outputs_without_step, []
        return outputs

    def _grammar_ready(self, request: Request) -> bool:
        """Whether a constrained waiting request's grammar is compiled; one whose compile
        failed is failed (its output waits in take_outputs_without_step)."""
        if not self.structured_output.is_ready(request.request_id):
            return False
        error = self.structured_output.compile_error(request.request_id)
        if error is None:
            return True
        self._fail_request(request, error, self._outputs_without_step)
        return False

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Running requests first, in admission order; preempts from the back for blocks."""
        cfg = self.config
        req_index = 0
        while req_index < len(self.running) and plan.token_budget > 0:
            request = self.running[req_index]
            num_new = 0
            if (self.kv_transfers is None  # else not while its load's step is out
                    or not self.kv_transfers.in_step_load(request.request_id)):
                if self._drafting_now:
                    if self.device_drafts:
                        self._device_draft_slots(request)
                    elif self.ngram is not None:
                        self._propose_ngram(request)
                num_new = self._num_tokens_to_schedule(request, plan.token_budget)
            if num_new == 0:
                req_index += 1
                continue
            is_partial = request.num_computed_tokens + num_new < request.num_tokens
            if is_partial and plan.num_partial_prefills >= cfg.max_num_partial_prefills:
                req_index += 1
                continue
            lookahead = self._num_lookahead(request.num_computed_tokens + num_new)
            while (new_blocks := self.kv_cache_manager.allocate_slots(
                    request, num_new, num_lookahead_tokens=lookahead)) is None:
                # Out of blocks: preempt the most recently admitted request (maybe this one).
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.add(victim.request_id)
                if victim is request:
                    break
            if new_blocks is None:
                break
            # The drafts that fit are the tail of the scheduled tokens.
            num_spec = num_new - (request.num_tokens + request.num_output_placeholders
                                  + request.num_draft_slots_in_flight
                                  - request.num_computed_tokens)
            if self.device_drafts:
                # A request with draft slots in flight is on the device's count of its tokens
                # until they come back, drafting or not: its row is fixed there.
                if request.spec_token_ids or request.num_draft_slots_in_flight:
                    plan.device_drafts[request.request_id] = max(num_spec, 0)
                request.spec_token_ids = []
            elif request.spec_token_ids and num_spec > 0:
                plan.spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
            plan.cached_reqs.append(CachedRequestData(
                req_id=request.request_id,
                resumed_from_preemption=False,
                new_block_ids=[b.block_id for b in new_blocks],
                num_computed_tokens=request.num_computed_tokens,
            ))
            plan.add(request, num_new, is_partial)
            req_index += 1

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Admit waiting requests in arrival order while budget, sequences and blocks last.
        Requests that cannot go yet for a connector's reason (KV still loading, the connector
        not sure yet) are passed over and keep their place."""
        passed_over: list[Request] = []
        while (self.waiting and plan.token_budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if not self.kv_transfers.load_done(request.request_id):
                    passed_over.append(self.waiting.popleft())
                    continue
                self.kv_transfers.end_async_load(request)
            if (request.sampling_params.structured_outputs is not None
                    and not self._grammar_ready(request)):
                if self.waiting and self.waiting[0] is request:
                    passed_over.append(self.waiting.popleft())
                continue
            if request.num_output_placeholders:
                break  # preempted with a token in flight: it comes back before resuming
            admitted = self._admit(request, plan)
            if admitted is None:
                passed_over.append(self.waiting.popleft())
            elif not admitted:
                break
        self.waiting.extendleft(reversed(passed_over))

    def _admit(self, request: Request, plan: _StepPlan) -> bool | None:
        """Schedule the waiting request at the head of the queue, or park it while its KV
        loads: True (taken off the queue), False (no room: stop admitting), None (pass it
        over this step)."""
        cfg = self.config
        computed_blocks, num_local = [], 0
        num_external, load_async = 0, False
        if (request.num_computed_tokens == 0
                and request.request_id not in self.kv_cache_manager.req_to_blocks):
            computed_blocks, num_local = self.kv_cache_manager.get_computed_blocks(request)
            if self.connector is not None and not request.skip_prefix_cache:
                self.kv_cache_manager.update_block_hashes(request)
                num_external, load_async = self.connector.get_num_new_matched_tokens(
                    request, num_local)
                if num_external is None:
                    return None
                # A load in the step itself never covers the last token (its logits must be
                # computed here) and stops at the last full block before it, so the step's own
                # KV writes never share a block with a load still in flight. An asynchronous
                # load may cover the whole prompt: its last token is computed again when the
                # load ends, unless the load brings the first output token (_take_first_token).
                limit = request.num_tokens
                if not load_async:
                    block_size = self.kv_cache_manager.block_size
                    limit = (limit - 1) // block_size * block_size
                num_external = max(0, min(num_external, limit - num_local))
                load_async = load_async and num_external > 0
            request.num_loaded_tokens = num_external
        request_num_computed = request.num_computed_tokens + num_local + num_external
        num_new = 0
        if not load_async:
            num_new = request.num_tokens - request_num_computed
            if cfg.long_prefill_token_threshold > 0:
                num_new = min(num_new, cfg.long_prefill_token_threshold)
            if not cfg.enable_chunked_prefill and num_new > plan.token_budget:
                return False
            num_new = min(num_new, plan.token_budget)
        is_partial = request_num_computed + num_new < request.num_tokens
        if (not load_async and is_partial
                and plan.num_partial_prefills >= cfg.max_num_partial_prefills):
            return False
        new_blocks = self.kv_cache_manager.allocate_slots(
            request, num_new, computed_blocks,
            num_lookahead_tokens=self._num_lookahead(request_num_computed + num_new),
            num_external_computed_tokens=num_external,
            delay_cache_blocks=num_external > 0)
        if new_blocks is None:
            return False
        request.num_computed_tokens = request_num_computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_local + num_external
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        if num_external:
            self.kv_transfers.start_load(request, block_ids, num_external, load_async)
        if load_async:
            return None  # passed over until a worker reports the load done
        self.waiting.popleft()
        self.running.append(request)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = plan.now
        if request.status == RequestStatus.PREEMPTED:
            plan.cached_reqs.append(CachedRequestData(
                req_id=request.request_id,
                resumed_from_preemption=True,
                new_block_ids=block_ids,
                num_computed_tokens=request_num_computed,
                num_loaded_tokens=request.num_loaded_tokens,
            ))
        else:
            plan.new_reqs.append(NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                block_ids=block_ids,
                num_computed_tokens=request_num_computed,
                output_token_ids=list(request.output_token_ids),
                num_loaded_tokens=request.num_loaded_tokens,
            ))
        request.status = RequestStatus.RUNNING
        plan.add(request, num_new, is_partial)
        return True

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        failed_loads: set[str] = set()
        if self.kv_transfers is not None and runner_output.kv_connector_output is not None:
            failed_loads, first_tokens = self.kv_transfers.update(
                runner_output.kv_connector_output,
                lambda request, message: self._fail_request(request, message, outputs))
            for req_id, first_token in first_tokens:
                self._take_first_token(self.requests[req_id], first_token, outputs)
            self.kv_transfers.end_sync_loads(scheduler_output, failed_loads)
        spec_token_ids = runner_output.spec_token_ids
        # Per request: a model proposer's drafts, or the drafting policy's n-gram probes (to
        # settle, to start).
        start_probes = self.ngram is not None and self.drafting.probes_wanted(len(self.running))
        after_new_tokens = self.drafting is not None and (
            spec_token_ids is not None or start_probes or self.drafting.has_probes())
        any_constrained = self._has_constrained_requests()
        for i, (req_id, sampled) in enumerate(zip(runner_output.req_ids,
                                                  runner_output.sampled_token_ids)):
            request = self.requests.get(req_id)
            if request is None or request.is_finished() or req_id in failed_loads:
                continue  # aborted while the step ran, or recomputing after a failed load
            request.num_output_placeholders -= min(len(sampled), 1)  # one sampling position
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            num_slots = (len(drafts) if drafts
                         else scheduler_output.scheduled_device_drafts.get(req_id, 0))
            if num_slots and sampled:
                # Verified: the target's token at every accepted draft, plus one. The KV of the
                # rejected drafts is garbage: forget it (it is overwritten later).
                num_accepted = len(sampled) - 1
                request.num_draft_slots_in_flight -= num_slots
                num_drafts = (len(drafts) if drafts
                              else runner_output.num_device_drafts.get(req_id, 0))
                if num_drafts:
                    self.spec_decoding_stats.observe(num_drafts, num_accepted)
                if num_drafts or self.ngram is not None:
                    # (A model proposer's slots hold no drafts when the step before did not
                    # propose: nothing to measure. An n-gram proposer that found none: 0.)
                    self.drafting.observe(req_id, num_accepted)
                if request.status == RequestStatus.PREEMPTED:
                    num_slots = 0  # preempted in flight: its KV is gone, nothing to roll back
                else:
                    request.num_computed_tokens -= num_slots - num_accepted
            constrained = (any_constrained
                           and request.sampling_params.structured_outputs is not None)
            if constrained and sampled and not self._advance_grammar(request, sampled, outputs):
                continue
            new_token_ids: list[int] = []
            for token_id in sampled:
                request.append_output_token_ids([token_id])
                new_token_ids.append(token_id)
                if self._check_stop(request, token_id):
                    break
            if (constrained and new_token_ids and not request.is_finished()
                    and self.structured_output.is_terminated(req_id)):
                request.status = RequestStatus.FINISHED_STOPPED  # the grammar ended (no EOS)
            if num_slots and new_token_ids:
                # The accepted drafts are tokens now: their full blocks can be shared.
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            request.spec_token_ids = []
            if after_new_tokens and not request.is_finished():
                self._after_new_tokens(request, new_token_ids,
                                       None if spec_token_ids is None else spec_token_ids[i],
                                       start_probes)
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            if not new_token_ids and prompt_logprobs is None:
                continue
            logprobs = runner_output.logprobs.get(req_id)
            if logprobs is not None:
                logprobs = logprobs[: len(new_token_ids)]
            if self.connector is not None and request.kv_transfer_params is not None:
                self.connector.update_request_output(request, new_token_ids, logprobs)
            kv_transfer_params = None
            if request.is_finished():
                # Preempted while its token was in flight, it waits in the queue.
                (self.running if request in self.running else self.waiting).remove(request)
                kv_transfer_params = self._free_request(request)
            outputs.append(EngineCoreOutput(
                req_id=req_id,
                new_token_ids=new_token_ids,
                finish_reason=request.get_finished_reason(),
                stop_reason=request.stop_reason,
                new_logprobs=logprobs,
                new_prompt_logprobs=prompt_logprobs,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                first_scheduled_time=request.first_scheduled_time,
                kv_transfer_params=kv_transfer_params,
            ))
        return outputs

    def _advance_grammar(self, request: Request, sampled: list[int],
                         outputs: list[EngineCoreOutput]) -> bool:
        """The matcher accepts the new tokens; False (the request failed) if one breaks the
        grammar, which the step's mask should have made impossible."""
        accepted = self.structured_output.accept_tokens(request.request_id, sampled)
        if accepted == len(sampled):
            return True
        self._fail_request(request, f"structured_outputs: token {sampled[accepted]} does not "
                                    f"match the grammar of request {request.request_id!r}",
                           outputs)
        return False

    # ---- KV connector ----------------------------------------------------------------

    def _take_first_token(self, request: Request, first_token: FirstToken,
                          outputs: list[EngineCoreOutput]) -> None:
        """An asynchronous load that brought the whole prompt's KV and the first token the
        peer sampled after it: the token is the request's first output (sent now); the
        request waits at its place in the queue with the prompt computed, and its next step
        computes the token's KV and samples the second. A load cut short by failed blocks
        keeps recomputing instead."""
        if request.num_computed_tokens != request.num_tokens or request.num_output_tokens:
            return
        request.append_output_token_ids([first_token.token_id])
        self.kv_transfers.end_async_load(request)  # num_computed_tokens: the prompt, all of it
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.time()
        kv_transfer_params = None
        if self._check_stop(request, first_token.token_id):
            self.waiting.remove(request)
            kv_transfer_params = self._free_request(request)
        logprobs = None
        if first_token.logprobs is not None and request.sampling_params.logprobs is not None:
            logprobs = [first_token.logprobs]
        outputs.append(EngineCoreOutput(
            req_id=request.request_id, new_token_ids=[first_token.token_id],
            finish_reason=request.get_finished_reason(), stop_reason=request.stop_reason,
            new_logprobs=logprobs, num_cached_tokens=max(request.num_cached_tokens, 0),
            first_scheduled_time=request.first_scheduled_time,
            kv_transfer_params=kv_transfer_params))


    def _fail_request(self, request: Request, message: str,
                      outputs: list[EngineCoreOutput]) -> None:
        logger.error("%s", message)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ERROR
        request.stop_reason = message
        kv_transfer_params = self._free_request(request)
        outputs.append(EngineCoreOutput(
            req_id=request.request_id, new_token_ids=[], finish_reason="error",
            stop_reason=message, num_cached_tokens=max(request.num_cached_tokens, 0),
            first_scheduled_time=request.first_scheduled_time,
            kv_transfer_params=kv_transfer_params))

    # ---- internals -----------------------------------------------------------------------

    def _num_tokens_to_schedule(self, request: Request, token_budget: int) -> int:
        # Tokens in flight, counting every draft slot as accepted.
        placeholders = request.num_output_placeholders + request.num_draft_slots_in_flight
        if placeholders and (request.num_output_tokens + placeholders >= request.max_tokens
                             or request.num_tokens + placeholders >= self.config.max_model_len
                             or request.sampling_params.structured_outputs is not None):
            # The token in flight is its last one, or its grammar must see it first.
            return 0
        num_new = (request.num_tokens + placeholders + len(request.spec_token_ids)
                   - request.num_computed_tokens)
        if self.config.long_prefill_token_threshold > 0:
            num_new = min(num_new, self.config.long_prefill_token_threshold)
        # KV never goes past max_model_len positions.
        num_new = min(num_new, token_budget,
                      self.config.max_model_len - request.num_computed_tokens)
        return max(num_new, 0)

    def _num_lookahead(self, num_tokens_after_step: int) -> int:
        """Lookahead slots for a request that will have this many tokens' KV after the step:
        up to k, never past max_model_len (a block-table row holds no more)."""
        return max(0, min(self.num_lookahead_tokens,
                          self.config.max_model_len - num_tokens_after_step))

    # ---- speculative decoding ------------------------------------------------------------

    def _begin_drafting_step(self) -> bool:
        """The drafting policy's decision for the step being scheduled, counted."""
        decision = self.drafting.begin_step(len(self.running))
        stats = self.spec_decoding_stats
        if decision is Drafting.ON:
            stats.num_steps_drafting += 1
        elif decision is Drafting.OFF_BATCH_SIZE:
            stats.num_steps_off_batch_size += 1
        elif decision is Drafting.OFF_ACCEPTANCE:
            stats.num_steps_off_acceptance += 1
        return decision is Drafting.ON

    def _proposes_drafts(self) -> bool:
        """Whether a model proposer drafts after the step being scheduled: when it drafts
        (synchronous steps: for the next one), and with device drafts also when the policy's
        next step is a probe (the drafts must be there by then)."""
        if self.drafting is None or self.ngram is not None:
            return False
        return self._drafting_now or (self.device_drafts and self.drafting.probes_next_step())

    def _propose_ngram(self, request: Request) -> None:
        """N-gram drafts for a request about to decode from a known last token (none while a
        token of it is in flight, or while it still prefills)."""
        if (request.num_output_placeholders
                or request.num_computed_tokens != request.num_tokens - 1
                or not request.num_output_tokens
                or not self.drafting.tracks(request.request_id)):
            return
        drafts = self.ngram.propose(request.tokens_as_array())
        if not drafts:
            self.drafting.observe(request.request_id, 0)  # a drafting step that gains nothing
        request.spec_token_ids = self._trim_drafts(request, drafts)

    def _device_draft_slots(self, request: Request) -> None:
        """Draft slots for a request about to decode, proposed on the device after its last
        token (known or in flight): k, fewer near max_tokens and max_model_len counting every
        draft in flight as accepted; none while it still prefills. The slots stand in
        spec_token_ids until _schedule_running moves them to the plan."""
        in_flight = request.num_output_placeholders + request.num_draft_slots_in_flight
        if (request.num_computed_tokens != request.num_tokens + in_flight - 1
                or not (request.num_output_tokens or request.num_output_placeholders)
                or not self.drafting.tracks(request.request_id)):
            return
        request.spec_token_ids = self._trim_drafts(request, [-1] * self.num_spec_tokens,
                                                   in_flight)

    def _keep_device_drafts_verifiable(self, plan: _StepPlan) -> None:
        """A step with device drafts verifies every row it samples with the rejection sampler,
        which applies no penalties, min_tokens or logprobs: if a request of the step needs one
        of those, the step drafts nothing (each request decodes its one token)."""
        if all(can_speculate(self.requests[req_id].sampling_params)
               for req_id in plan.num_scheduled_tokens):
            return
        for req_id, num_slots in plan.device_drafts.items():
            plan.num_scheduled_tokens[req_id] -= num_slots
            plan.token_budget += num_slots
            plan.device_drafts[req_id] = 0

    def _after_new_tokens(self, request: Request, new_token_ids: list[int],
                          proposed: list[int] | None, start_probe: bool) -> None:
        """A request's tokens of a step are in: a model proposer's drafts for the next step;
        the drafting policy's n-gram probes settled, and started while drafting is off for
        acceptance."""
        if proposed is not None:
            request.spec_token_ids = self._trim_drafts(request, proposed)
            return
        if self.ngram is None:
            return
        req_id = request.request_id
        self.drafting.observe_tokens(req_id, new_token_ids)
        if start_probe and new_token_ids and self.drafting.wants_probe(req_id):
            # Not trimmed to max_tokens: a probe the request's end leaves unsettled is dropped.
            self.drafting.start_probe(req_id, self.ngram.propose(request.tokens_as_array()))

    def _trim_drafts(self, request: Request, drafts: list[int],
                     num_in_flight: int = 0) -> list[int]:
        """Drafts worth verifying: all accepted plus the bonus token must stay within
        max_tokens, and their KV within max_model_len, after `num_in_flight` tokens still in
        flight (their draft slots counted as accepted)."""
        room = min(request.max_tokens - request.num_output_tokens - num_in_flight - 1,
                   self.config.max_model_len - request.num_tokens - num_in_flight)
        return drafts[:max(room, 0)]

    def _check_stop(self, request: Request, token_id: int) -> bool:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
        if (request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.config.max_model_len):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _preempt(self, request: Request) -> None:
        if self.kv_transfers is not None:
            self.kv_transfers.forget(request.request_id)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def _free_request(self, request: Request) -> dict | None:
        """Forget a finished request and free its blocks, unless a connector still needs them
        (a send in progress, a load still writing them); returns the connector's
        kv_transfer_params for the client."""
        request_id = request.request_id
        self.finished_req_ids.add(request_id)
        del self.requests[request_id]
        if self.drafting is not None:
            self.drafting.remove_request(request_id)
        if self.structured_output is not None:
            self.structured_output.remove(request_id)
        if self.kv_transfers is None:
            self.kv_cache_manager.free(request)
            return None
        return self.kv_transfers.free(request)
