"""A launched step: the GPU work is queued, the sampled tokens come back on `result()`.

With async scheduling the engine schedules and launches step N+1 before it asks for step N's
result, so the host work of both overlaps the GPU. Until then a sampled token lives only on the
device; the next step reads it from there (see InputBuilder.prepare). Results are taken
in launch order: a handle first settles the one before it, so tokens are appended in order.

A step that verified device drafts (sluice/spec_decode/device_ngram.py) emitted 1 to k + 1 tokens
per row; `previous_tokens` hands them, or a plain step's one token per row, to the next step's
fix-up on the device.
"""

from __future__ import annotations

import torch

from sluice.core.outputs import KVConnectorOutput, ModelRunnerOutput, PositionLogprobs
from sluice.sample.sampler import SamplerOutput
from sluice.spec_decode.device_ngram import PreviousTokens
from sluice.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID
from sluice.worker.input_batch import CachedRequestState


class StepHandle:
    def __init__(self, output: ModelRunnerOutput, previous: StepHandle | None = None) -> None:
        self.output = output
        self.previous = previous
        self.sample_rows: list[int] = []
        self.sample_states: list[CachedRequestState] = []
        self.sampled: torch.Tensor | None = None  # [S] int64 on the device
        self._sampled_host: torch.Tensor | None = None  # [>= S] pinned, filled asynchronously
        self._sampler_output: SamplerOutput | None = None
        self._event: torch.cuda.Event | None = None
        self._done = False
        # A verification of device drafts: per sampled row, the emitted tokens and the drafts
        # verified (host copies filled asynchronously), and what the next step's fix-up reads.
        self.verified: PreviousTokens | None = None
        self._emitted_host: torch.Tensor | None = None  # [S, k + 1], -1 past a row's tokens
        self._num_drafts_host: torch.Tensor | None = None  # [S]

    def set_samples(self, sample_rows: list[int], sample_states: list[CachedRequestState],
                    sampler_output: SamplerOutput, sampled_host: torch.Tensor) -> None:
        self.sample_rows = sample_rows
        self.sample_states = sample_states
        self.sampled = sampler_output.sampled_token_ids
        self._sampler_output = sampler_output
        num = len(sample_rows)
        self._sampled_host = sampled_host[:num]
        self._sampled_host.copy_(self.sampled, non_blocking=True)
        if self.sampled.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        for j, state in enumerate(sample_states):
            state.pending_step, state.pending_index = self, j

    def set_verified(self, sample_rows: list[int], sample_states: list[CachedRequestState],
                     emitted: torch.Tensor, num_accepted: torch.Tensor, slots: torch.Tensor,
                     num_drafts: torch.Tensor, host: torch.Tensor) -> None:
        """The rows' tokens from the rejection sampler: emitted [S, K + 1] (-1 past each row's
        num_accepted + 1), num_accepted [S], the draft slots the host counted as accepted
        [S], the drafts verified [S]; `host`: a pinned buffer of >= S * (K + 2) entries."""
        self.sample_rows = sample_rows
        self.sample_states = sample_states
        num, width = emitted.shape
        self.verified = PreviousTokens(emitted, num_accepted + 1, num_accepted - slots)
        self._emitted_host = host[:num * width].view(num, width)
        self._emitted_host.copy_(emitted, non_blocking=True)
        self._num_drafts_host = host[num * width:num * (width + 1)]
        self._num_drafts_host.copy_(num_drafts, non_blocking=True)
        if emitted.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        for j, state in enumerate(sample_states):
            state.pending_step, state.pending_index = self, j

    def previous_tokens(self) -> PreviousTokens:
        """What this step emitted per sampled row, for the next step's device fix-up."""
        if self.verified is not None:
            return self.verified
        num = self.sampled.shape[0]
        counts = torch.ones(num, dtype=torch.int64, device=self.sampled.device)
        return PreviousTokens(self.sampled.view(num, 1), counts, counts - 1)

    def is_ready(self) -> bool:
        """Whether result() would return without waiting for the device."""
        if self._done or self._event is None:
            return True
        return self._event.query() and (self.previous is None or self.previous.is_ready())

    def take_connector_output(self) -> KVConnectorOutput | None:
        """The connector's report of this step, known at launch (the worker polled its
        transfers then), for the scheduler to apply before the step's tokens are ready: a
        finished load's first token goes out one step sooner. None when there is nothing to
        take early or the report names failed blocks (those concern the step's own rows, so
        they wait for the result); the output then carries no report (a connector hears each
        report once)."""
        report = self.output.kv_connector_output
        if report is None or report.invalid_block_ids or report.is_empty():
            return None
        self.output.kv_connector_output = None
        return report

    def result(self) -> ModelRunnerOutput:
        if self._done:
            return self.output
        if self.previous is not None:
            self.previous.result()
            self.previous = None
        self._done = True
        if not self.sample_rows:
            return self.output
        if self._event is not None:
            self._event.synchronize()
        if self.verified is not None:
            self._take_verified()
            return self.output
        sampled = self._sampled_host.tolist()
        sampler_output = self._sampler_output
        if sampler_output.logprobs is not None:
            ids = sampler_output.logprob_token_ids.tolist()
            lps = sampler_output.logprobs.tolist()
            ranks = sampler_output.sampled_token_ranks.tolist()
        for j, (row, state) in enumerate(zip(self.sample_rows, self.sample_states)):
            state.token_ids.append(sampled[j])
            if state.pending_step is self:
                state.pending_step, state.pending_index = None, -1
            self.output.sampled_token_ids[row] = [sampled[j]]
            num_logprobs = state.sampling_params.logprobs
            if num_logprobs is not None:
                self.output.logprobs[state.req_id] = [
                    position_logprobs(ids[j], lps[j], ranks[j], num_logprobs)]
        self._sampler_output = None
        return self.output


    def _take_verified(self) -> None:
        emitted = self._emitted_host.tolist()
        num_drafts = self._num_drafts_host.tolist()
        for j, (row, state) in enumerate(zip(self.sample_rows, self.sample_states)):
            tokens = emitted[j]
            if PLACEHOLDER_TOKEN_ID in tokens:
                tokens = tokens[:tokens.index(PLACEHOLDER_TOKEN_ID)]
            state.token_ids.extend(tokens)
            if state.pending_step is self:
                state.pending_step, state.pending_index = None, -1
            self.output.sampled_token_ids[row] = tokens
            self.output.num_device_drafts[state.req_id] = num_drafts[j]


def position_logprobs(ids: list[int], lps: list[float], rank: int,
                      num_logprobs: int) -> PositionLogprobs:
    """The chosen token (first) with its rank, then the top-N with ranks 1..N."""
    entry: PositionLogprobs = {ids[0]: (lps[0], rank)}
    for j in range(1, num_logprobs + 1):
        entry.setdefault(ids[j], (lps[j], j))
    return entry
