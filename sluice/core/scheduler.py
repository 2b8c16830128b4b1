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

from sluice import stage_trace
from sluice.config import KVTransferConfig, SchedulerConfig
from sluice.core.drafts import Drafts
from sluice.core.grammar_gate import GrammarBackend, GrammarGate, is_constrained
from sluice.core.hybrid_kv_cache_manager import HybridKVCacheManager
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.kv_connector import KVConnectorScheduler
from sluice.core.kv_transfers import KVTransfers
from sluice.core.outputs import (
    EngineCoreOutput,
    FirstToken,
    KVConnectorOutput,
    ModelRunnerOutput,
    PositionLogprobs,
    SchedulerOutput,
)
from sluice.core.request import Request, RequestStatus
from sluice.core.step_plan import StepPlan

logger = logging.getLogger("sluice")


def _output(request: Request, new_token_ids: list[int], kv_transfer_params: dict | None,
            logprobs: list[PositionLogprobs] | None = None,
            prompt_logprobs: list[PositionLogprobs | None] | None = None) -> EngineCoreOutput:
    """What the front end hears of a request: its new tokens, how it ended (if it did)."""
    return EngineCoreOutput(
        req_id=request.request_id, new_token_ids=new_token_ids,
        finish_reason=request.get_finished_reason(), stop_reason=request.stop_reason,
        new_logprobs=logprobs, new_prompt_logprobs=prompt_logprobs,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        first_scheduled_time=request.first_scheduled_time, kv_transfer_params=kv_transfer_params)


class Scheduler:
    def __init__(self, config: SchedulerConfig,
                 kv_cache_manager: KVCacheManager | HybridKVCacheManager,
                 connector: KVConnectorScheduler | None = None,
                 kv_transfer_config: KVTransferConfig | None = None,
                 structured_output: GrammarBackend | None = None) -> None:
        self.config = config
        self.grammar = GrammarGate(structured_output)
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
        # Speculative decoding's drafting decisions (None: speculation off).
        spec = config.speculative_config
        self.drafts = Drafts(spec, config) if spec is not None else None
        self.spec_decoding_stats = self.drafts.stats if self.drafts is not None else None

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.grammar.add_request(request)
        if self.drafts is not None:
            self.drafts.add_request(request)
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
        return self.grammar.token_in_flight(self.running)

    def drafts_need_tokens_in_flight(self) -> bool:
        """Whether the drafting policy wants n-gram drafts in the next step for requests whose
        last token is still in flight (async scheduling): drafts continue from that token, so
        the engine core takes the step in flight first."""
        return self.drafts is not None and self.drafts.needs_tokens_in_flight(self.running)

    def runs_synchronously(self, output: SchedulerOutput) -> bool:
        """Whether the step must be taken before the next is scheduled, even with async
        scheduling: one with host drafts (how many are accepted decides where each request's
        next step starts), and without device drafts every step of a model proposer (its KV
        pass and drafts read the step's tokens on the host)."""
        return bool(output.scheduled_spec_decode_tokens) or (
            self.drafts is not None and self.drafts.model_drafts_on_host())

    def has_requests_to_schedule(self) -> bool:
        """Whether a step could compute anything or carries a connector's plans: False while
        every unfinished request waits for a remote load (the engine then polls the workers
        instead of spinning)."""
        if self.connector is not None and self.connector.has_plans():
            return True
        num_parked = 0 if self.kv_transfers is None else (self.kv_transfers.num_parked()
                                                          + self.connector.num_held())
        return bool(self.running) or len(self.waiting) > num_parked

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's blocks in token order (for connectors)."""
        return self.kv_cache_manager.get_block_ids(request_id)

    def take_outputs_without_step(self) -> list[EngineCoreOutput]:
        """Outputs of requests that ended in schedule() (a grammar that did not compile)."""
        outputs, self._outputs_without_step = self._outputs_without_step, []
        return outputs

    # ---- one step ------------------------------------------------------------------------

    def cache_scheduled_blocks(self) -> None:
        """Enter the blocks the last schedule() filled into the prefix cache, where the KV cache
        manager defers that (see KVCacheManager.defer_caching): the engine calls this once the
        step is on its way to the device. schedule() does it first too."""
        self.kv_cache_manager.flush_pending_cache()

    def schedule(self) -> SchedulerOutput:
        self.kv_cache_manager.flush_pending_cache()
        plan = StepPlan(token_budget=self.config.max_num_batched_tokens, now=time.time())
        if self.kv_transfers is not None:
            self.kv_transfers.free_expired(plan.now)
        if self.drafts is not None:
            self.drafts.begin_step(len(self.running))
        self._schedule_running(plan)
        # Then waiting requests in arrival order, unless this step had to preempt.
        if not plan.preempted:
            self._schedule_waiting(plan)
        if self.drafts is not None:
            self.drafts.keep_device_drafts_verifiable(plan, self.requests)

        output = plan.to_output(self.config.max_num_batched_tokens, self.finished_req_ids,
                                self.drafts is not None and self.drafts.proposes_drafts())
        self.finished_req_ids = set()
        self.num_scheduled_tokens_total += output.total_num_scheduled_tokens
        if self.connector is not None:
            for req_id in plan.num_scheduled_tokens:
                self.kv_cache_manager.update_block_hashes(self.requests[req_id])
            output.kv_connector_metadata = self.connector.build_connector_meta(output, self)
        output.grammar_bitmask = self.grammar.bitmask(plan.hand_over(self.requests))
        return output

    def _schedule_running(self, plan: StepPlan) -> None:
        """Running requests first, in admission order; preempts from the back for blocks."""
        cfg = self.config
        req_index = 0
        while req_index < len(self.running) and plan.token_budget > 0:
            request = self.running[req_index]
            num_new = 0
            if (self.kv_transfers is None  # else not while its load's step is out
                    or not self.kv_transfers.in_step_load(request.request_id)):
                if self.drafts is not None:
                    self.drafts.prepare(request)
                num_new = plan.num_tokens_for_running(request, self.config)
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
            if self.drafts is not None:
                self.drafts.take_scheduled(request, num_new, plan)
            plan.add_running(request, *self.kv_cache_manager.block_ids_of(new_blocks), num_new,
                             is_partial)
            req_index += 1

    def _schedule_waiting(self, plan: StepPlan) -> None:
        """Admit waiting requests in arrival order while budget, sequences and blocks last.
        Requests that cannot go yet for a connector's reason (KV still loading, the connector
        not sure yet) are passed over and keep their place."""
        if self.kv_transfers is not None and self.kv_transfers.loaded:
            self._loaded_first()
        passed_over: list[Request] = []
        while (self.waiting and plan.token_budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if not self.kv_transfers.load_done(request.request_id):
                    passed_over.append(self.waiting.popleft())
                    continue
                self.kv_transfers.end_async_load(request)
            if not self.grammar.admits(request, self._fail_outside_step):
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

    def _loaded_first(self) -> None:
        """Requests whose asynchronous load ended go to the head of the queue: they hold their
        blocks, and a request ahead of them (one preempted meanwhile) may need exactly those,
        which they give back only once they have run (behind it: a deadlock)."""
        loaded = self.kv_transfers.loaded
        first = [r for r in self.waiting if r.request_id in loaded]
        rest = [r for r in self.waiting if r.request_id not in loaded]
        self.waiting.clear()
        self.waiting.extend(first + rest)

    def _admit(self, request: Request, plan: StepPlan) -> bool | None:
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
        if self.kv_transfers is not None:
            self.kv_transfers.admitted(request.request_id)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = plan.now
        plan.add_admitted(request, block_ids,
                          self.kv_cache_manager.get_group_block_ids(request.request_id),
                          num_new, is_partial)
        request.status = RequestStatus.RUNNING
        return True

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []

        def fail(request: Request, message: str) -> None:
            self._fail_request(request, message, outputs)

        failed_loads: set[str] = set()
        if self.kv_transfers is not None:
            if runner_output.kv_connector_output is not None:  # None: taken at launch
                failed_loads = self._apply_connector_output(runner_output.kv_connector_output,
                                                            outputs)
            self.kv_transfers.end_sync_loads(scheduler_output, failed_loads)
        proposed = runner_output.spec_token_ids
        # Per request: a model proposer's drafts, or the drafting policy's n-gram probes (to
        # settle, to start).
        after_new_tokens = self.drafts is not None and self.drafts.begin_update(
            len(self.running), proposed)
        any_constrained = self.grammar.active()
        for i, (req_id, sampled) in enumerate(zip(runner_output.req_ids,
                                                  runner_output.sampled_token_ids)):
            request = self.requests.get(req_id)
            if request is None or request.is_finished() or req_id in failed_loads:
                continue  # aborted while the step ran, or recomputing after a failed load
            request.num_output_placeholders -= min(len(sampled), 1)  # one sampling position
            num_slots = 0 if self.drafts is None else self.drafts.settle_verified(
                request, sampled, scheduler_output, runner_output)
            constrained = any_constrained and is_constrained(request)
            if constrained and sampled and not self.grammar.accept(request, sampled, fail):
                continue
            new_token_ids: list[int] = []
            for token_id in sampled:
                request.append_output_token_ids([token_id])
                new_token_ids.append(token_id)
                if self._check_stop(request, token_id):
                    break
            if constrained and new_token_ids:
                self.grammar.stop_if_terminated(request)
            if num_slots and new_token_ids:
                # The accepted drafts are tokens now: their full blocks can be shared.
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            request.spec_token_ids = []
            if after_new_tokens and not request.is_finished():
                self.drafts.after_new_tokens(request, new_token_ids,
                                             None if proposed is None else proposed[i])
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
            outputs.append(_output(request, new_token_ids, kv_transfer_params, logprobs,
                                   prompt_logprobs))
        return outputs

    # ---- KV connector ----------------------------------------------------------------

    def update_connector_output(self, kv_output: KVConnectorOutput) -> list[EngineCoreOutput]:
        """Apply a connector report taken at a step's launch, before its tokens are ready
        (StepHandle.take_connector_output: one without failed blocks): finished loads' first
        tokens go out now, and their requests can be scheduled in the next step, one step
        sooner than through update_from_output."""
        outputs: list[EngineCoreOutput] = []
        if self.kv_transfers is not None:
            self._apply_connector_output(kv_output, outputs)
        return outputs

    def _apply_connector_output(self, kv_output: KVConnectorOutput,
                                outputs: list[EngineCoreOutput]) -> set[str]:
        """The workers' transfer report into the bookkeeping; returns the requests whose
        synchronous load failed in the step."""
        failed_loads, first_tokens = self.kv_transfers.update(
            kv_output, lambda request, message: self._fail_request(request, message, outputs))
        for req_id, first_token in first_tokens:
            self._take_first_token(self.requests[req_id], first_token, outputs)
        return failed_loads

    def _take_first_token(self, request: Request, first_token: FirstToken,
                          outputs: list[EngineCoreOutput]) -> None:
        """An asynchronous load that brought the whole prompt's KV and the first token the
        peer sampled after it: the token is the request's first output (sent now); the
        request waits at its place in the queue with the prompt computed, and its next step
        computes the token's KV and samples the second. A load cut short by failed blocks
        keeps recomputing instead."""
        stage_trace.mark("d_first")
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
        outputs.append(_output(request, [first_token.token_id], kv_transfer_params, logprobs))

    def _fail_outside_step(self, request: Request, message: str) -> None:
        self._fail_request(request, message, self._outputs_without_step)

    def _fail_request(self, request: Request, message: str,
                      outputs: list[EngineCoreOutput]) -> None:
        logger.error("%s", message)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ERROR
        request.stop_reason = message
        outputs.append(_output(request, [], self._free_request(request)))

    # ---- internals -----------------------------------------------------------------------

    def _num_lookahead(self, num_tokens_after_step: int) -> int:
        """KV slots past the step's tokens for a model proposer's next drafts (Drafts)."""
        return 0 if self.drafts is None else self.drafts.num_lookahead(num_tokens_after_step)

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
        if self.drafts is not None:
            self.drafts.remove_request(request_id)
        self.grammar.remove(request_id)
        if self.kv_transfers is None:
            self.kv_cache_manager.free(request)
            return None
        return self.kv_transfers.free(request)
