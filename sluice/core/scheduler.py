"""The token-budget scheduler: continuous batching, chunked prefill, preemption by recompute.

There are no prefill and decode phases. Each request has `num_computed_tokens` catching up to
`num_tokens`; every step hands each request some tokens under `max_num_batched_tokens` and
`max_num_seqs`. Decode is the case of one token. Running requests are served first, in admission
order; then waiting ones in arrival order. When blocks run out, the most recently admitted
running request is preempted: its blocks are freed and it goes back to the head of the queue, to
be recomputed later (its full blocks usually still sit in the prefix cache).

Speculative decoding: a request carries the draft tokens the runner proposed after its last step
(`spec_token_ids`); it is scheduled with 1 + k tokens inside the token budget (drafts cut first
when the budget or max_model_len is short), and model-based proposers get k lookahead slots for
the KV of their next drafts. The drafts are not the request's tokens: only tokens already known
enter the prefix cache, and after verification `num_computed_tokens` rolls back over the rejected
drafts, whose KV is then overwritten.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from sluice.config import SchedulerConfig
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SpecDecodingStats,
)
from sluice.core.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Ended since the last schedule(): the runner drops their state next step.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0
        spec = config.speculative_config
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        # A draft model (or EAGLE head) writes the KV of its next drafts past the verified tokens.
        self.num_lookahead_tokens = (self.num_spec_tokens
                                     if spec is not None and spec.method != "ngram" else 0)
        self.spec_decoding_stats = None
        if spec is not None:
            self.spec_decoding_stats = SpecDecodingStats(
                self.num_spec_tokens, num_accepted_tokens_per_pos=[0] * self.num_spec_tokens)

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
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

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        token_budget = cfg.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: set[str] = set()
        num_partial_prefills = 0
        spec_tokens: dict[str, list[int]] = {}
        now = time.time()

        # Running requests first, in admission order.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new = self._num_tokens_to_schedule(request, token_budget)
            if num_new == 0:
                req_index += 1
                continue
            is_partial = request.num_computed_tokens + num_new < request.num_tokens
            if is_partial and num_partial_prefills >= cfg.max_num_partial_prefills:
                req_index += 1
                continue
            lookahead = self._num_lookahead(request.num_computed_tokens + num_new)
            while (new_blocks := self.kv_cache_manager.allocate_slots(
                    request, num_new, num_lookahead_tokens=lookahead)) is None:
                # Out of blocks: preempt the most recently admitted request (maybe this one).
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            if new_blocks is None:
                break
            num_partial_prefills += is_partial
            if request.spec_token_ids:
                # The drafts that fit are the tail of the scheduled tokens.
                num_spec = num_new - (request.num_tokens - request.num_computed_tokens)
                if num_spec > 0:
                    spec_tokens[request.request_id] = request.spec_token_ids[:num_spec]
            cached_reqs.append(CachedRequestData(
                req_id=request.request_id,
                resumed_from_preemption=False,
                new_block_ids=[b.block_id for b in new_blocks],
                num_computed_tokens=request.num_computed_tokens,
            ))
            num_scheduled_tokens[request.request_id] = num_new
            token_budget -= num_new
            req_index += 1

        # Then waiting requests in arrival order, unless this step had to preempt.
        while (self.waiting and not preempted and token_budget > 0
               and len(self.running) < cfg.max_num_seqs):
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted with a token in flight: it comes back before resuming
            computed_blocks, num_computed = [], 0
            if request.num_computed_tokens == 0:
                computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
            request_num_computed = request.num_computed_tokens + num_computed
            num_new = request.num_tokens - request_num_computed
            if cfg.long_prefill_token_threshold > 0:
                num_new = min(num_new, cfg.long_prefill_token_threshold)
            if not cfg.enable_chunked_prefill and num_new > token_budget:
                break
            num_new = min(num_new, token_budget)
            is_partial = request_num_computed + num_new < request.num_tokens
            if is_partial and num_partial_prefills >= cfg.max_num_partial_prefills:
                break
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new, computed_blocks,
                num_lookahead_tokens=self._num_lookahead(request_num_computed + num_new))
            if new_blocks is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            request.num_computed_tokens = request_num_computed
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            if request.status == RequestStatus.PREEMPTED:
                cached_reqs.append(CachedRequestData(
                    req_id=request.request_id,
                    resumed_from_preemption=True,
                    new_block_ids=block_ids,
                    num_computed_tokens=request_num_computed,
                ))
            else:
                new_reqs.append(NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params,
                    block_ids=block_ids,
                    num_computed_tokens=request_num_computed,
                ))
            request.status = RequestStatus.RUNNING
            num_partial_prefills += is_partial
            num_scheduled_tokens[request.request_id] = num_new
            token_budget -= num_new

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - token_budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
            scheduled_spec_decode_tokens=spec_tokens,
        )
        self.finished_req_ids = set()
        # The tokens are as good as computed once handed to the runner (the runner writes their
        # KV before anyone reads it), which is also what the prefix cache assumed above. A chunk
        # that reaches the end of the known tokens samples one more: a placeholder until then.
        for req_id, num_new in num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += num_new
            num_spec = len(spec_tokens.get(req_id, ()))
            if (request.num_computed_tokens
                    == request.num_tokens + request.num_output_placeholders + num_spec):
                request.num_output_placeholders += 1
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        spec_token_ids = runner_output.spec_token_ids
        for i, (req_id, sampled) in enumerate(zip(runner_output.req_ids,
                                                  runner_output.sampled_token_ids)):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # aborted while the step ran
            request.num_output_placeholders -= min(len(sampled), 1)  # one sampling position
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts:
                # Verified: the target's token at every accepted draft, plus one. The KV of the
                # rejected drafts is garbage: forget it (it is overwritten later).
                num_accepted = len(sampled) - 1
                request.num_computed_tokens -= len(drafts) - num_accepted
                self.spec_decoding_stats.observe(len(drafts), num_accepted)
            new_token_ids: list[int] = []
            for token_id in sampled:
                request.append_output_token_ids([token_id])
                new_token_ids.append(token_id)
                if self._check_stop(request, token_id):
                    break
            if drafts and new_token_ids:
                # The accepted drafts are tokens now: their full blocks can be shared.
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            request.spec_token_ids = []
            if spec_token_ids is not None and not request.is_finished():
                request.spec_token_ids = self._trim_drafts(request, spec_token_ids[i])
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            if not new_token_ids and prompt_logprobs is None:
                continue
            logprobs = runner_output.logprobs.get(req_id)
            if logprobs is not None:
                logprobs = logprobs[: len(new_token_ids)]
            outputs.append(EngineCoreOutput(
                req_id=req_id,
                new_token_ids=new_token_ids,
                finish_reason=request.get_finished_reason(),
                stop_reason=request.stop_reason,
                new_logprobs=logprobs,
                new_prompt_logprobs=prompt_logprobs,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                first_scheduled_time=request.first_scheduled_time,
            ))
            if request.is_finished():
                # Preempted while its token was in flight, it waits in the queue.
                (self.running if request in self.running else self.waiting).remove(request)
                self._free_request(request)
        return outputs

    # ---- internals -----------------------------------------------------------------------

    def _num_tokens_to_schedule(self, request: Request, token_budget: int) -> int:
        placeholders = request.num_output_placeholders
        if placeholders and (request.num_output_tokens + placeholders >= request.max_tokens
                             or request.num_tokens + placeholders >= self.config.max_model_len):
            return 0  # the token in flight is its last one
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

    def _trim_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """Drafts worth verifying: all accepted plus the bonus token must stay within
        max_tokens, and their KV within max_model_len."""
        room = min(request.max_tokens - request.num_output_tokens - 1,
                   self.config.max_model_len - request.num_tokens)
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
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
