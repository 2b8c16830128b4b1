"""The model runner's side of speculative decoding: verify this step's drafts, propose the next.

A request scheduled with drafts has them as the last tokens of its scheduled tokens; the target's
logits at those positions and the one after the last draft go to the rejection sampler, which
emits the accepted drafts and one token of the target's own. Requests without drafts go through
it too (no drafts: it samples the token as the sampler does), unless a request of the step needs
the sampler itself. Then a model proposer (draft model, EAGLE) runs its KV pass over the step's
tokens and, when the scheduler asks (`propose_drafts`: the drafting policy has drafting on),
drafts up to k tokens for every request that just got tokens, unless its sampling needs what the
rejection sampler does not apply (penalties and min_tokens count the tokens before each position,
logprobs are per token): those decode one token at a time. N-gram drafts are proposed by the
scheduler (sluice/core/scheduler.py), from the tokens it knows.

Without async scheduling, steps that verify drafts, and every step of a model proposer, run
synchronously: the next step's drafts depend on this step's tokens. With it, drafts are proposed
on the device and no step waits: n-gram drafts by the next step's input fix-up
(sluice/spec_decode/device_ngram.py), after the tokens this step emits; a model proposer's by its
device pass right after the step (`propose_on_device`: ModelProposer.propose_on_device, or for
decode batches the fixed-shape DecodeBatches, CUDA graphs on a GPU), which the next step's fix-up
takes. `verify_on_device` verifies either without the host waiting for anything. While drafting is
off a model proposer's pass is skipped and caught up when drafting resumes (`propose_on_device`),
so enabling one costs little where it does not draft (for the batch size, or for acceptance
between probes); the blocks its KV fills are tracked, so a prefix-cache hit on blocks computed
while passes were skipped is caught up too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from sluice.spec_decode.config import SpeculativeConfig
from sluice.spec_decode.device_ngram import DeviceNgram
from sluice.spec_decode.model_proposer import (
    DecodeBatches,
    DeviceStep,
    DraftModelProposer,
    EagleProposer,
    ModelProposer,
    StepSources,
)
from sluice.spec_decode.policy import can_speculate
from sluice.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from sluice.worker.cuda_graphs import capture_sizes
from sluice.worker.input_batch import StagedBuffer
from sluice.worker.sampling_inputs import build_sampling_metadata

if TYPE_CHECKING:
    from sluice.attention import AttentionMetadata
    from sluice.core.outputs import ModelRunnerOutput, SchedulerOutput
    from sluice.sample.metadata import SamplingMetadata
    from sluice.worker.input_batch import CachedRequestState
    from sluice.worker.model_runner import ModelRunner
    from sluice.worker.step_handle import StepHandle
    from sluice.worker.step_inputs import StepInputs


class SpecDecoder:
    def __init__(self, runner: ModelRunner, config: SpeculativeConfig) -> None:
        self.runner = runner
        self.config = config
        self.k = config.num_speculative_tokens
        self.query_len = 1 + self.k  # tokens per request in a verification step
        self.rejection_sampler = RejectionSampler(runner.sampler.default_generator)
        # One pinned buffer for verification's inputs (logit rows, draft ids, draft counts):
        # one copy that never blocks the host.
        max_rows = runner.scheduler_config.max_num_seqs
        self.staged = StagedBuffer((max_rows * (2 * self.k + 2),), torch.int64, runner.device)
        self.draft_fix_up: DeviceNgram | None = None
        if runner.scheduler_config.async_scheduling:
            # Drafts on the device: found by prompt lookup in the fix-up, or a model
            # proposer's from its device pass after each step.
            from_model = config.method != "ngram"
            self.draft_fix_up = DeviceNgram(  # (n-gram sizes unused with a model's drafts)
                self.k, 1 if from_model else config.prompt_lookup_min,
                1 if from_model else config.prompt_lookup_max,
                runner.scheduler_config.max_model_len, max_rows, runner.block_size,
                runner.device, from_model=from_model)
            # Per sampling launch parity (the host writes one launch's while the device may
            # not have copied the last one's yet): verification's inputs, and the emitted
            # tokens and draft counts read back.
            pin = runner.device.type == "cuda"
            self._verify_staged = [StagedBuffer((max_rows * (self.k + 3),), torch.int64,
                                                runner.device) for _ in range(2)]
            self._verified_host = [torch.zeros(max_rows * (self.k + 2), dtype=torch.int64,
                                               pin_memory=pin) for _ in range(2)]
        self.model_proposer: ModelProposer | None = None
        if config.method != "ngram":
            cls = DraftModelProposer if config.method == "draft_model" else EagleProposer
            self.model_proposer = cls(
                config, runner.model, runner.hf_config, runner.dtype, runner.device,
                runner.attn_backend, runner.block_size, runner.scheduler_config.max_model_len)
            # EAGLE's catch-up passes read the target's hidden states of skipped steps.
            self.model_proposer.keeps_hidden = (self.draft_fix_up is not None
                                                and config.method == "eagle")
        # Device passes skipped (drafting off, no slots): propose_on_device.
        self.num_passes_skipped = 0
        self.num_catch_ups = 0
        # Per block-table row: where the proposer's KV gap starts (-1: none), whether drafts
        # of an earlier pass may sit on the device for it, how many of its blocks the
        # proposer's KV fills; per KV block: whether it does (prefix-cache hits trust it).
        self._gap = np.zeros(0, dtype=np.int64)
        self._stale = np.zeros(0, dtype=bool)
        self._ok_blocks = np.zeros(0, dtype=np.int64)
        self.proposer_ok: np.ndarray | None = None
        self._last_skipped: np.ndarray | None = None  # the rows of the last skip (same: no-op)

    def kv_bytes_per_block(self) -> int:
        return self.model_proposer.kv_bytes_per_block() if self.model_proposer else 0

    def initialize_kv_cache(self, num_blocks: int, capture_graphs: bool = False) -> None:
        """capture_graphs: the device pass of a model proposer's decode batches as CUDA
        graphs (with async scheduling)."""
        if self.model_proposer is not None:
            self.model_proposer.initialize_kv_cache(num_blocks)
            if self.draft_fix_up is not None:
                self.proposer_ok = np.zeros(num_blocks, dtype=bool)
                if self.runner.device.type == "cuda":
                    self.model_proposer.warm_up_catch_up(
                        self.runner.block_tables.max_blocks_per_req)
        runner = self.runner
        hidden = torch.zeros((2 * self.query_len, runner.hf_config.hidden_size),
                             dtype=runner.dtype, device=runner.device)
        self.rejection_sampler.warm_up(
            runner.model.compute_logits(hidden).view(2, self.query_len, -1))
        if self.draft_fix_up is not None:
            self.draft_fix_up.warm_up()
            if self.model_proposer is not None:
                builder = self.runner.input_builder
                sources = StepSources(builder.buf_input_ids.device, builder.buf_positions.device,
                                      builder.buf_query_start_loc.device,
                                      builder.graph_block_tables)
                max_size = self.runner.scheduler_config.max_num_seqs
                capture = capture_graphs and builder.graph_block_tables is not None
                self.model_proposer.decode_batches = DecodeBatches(
                    self.model_proposer, max_size, sources,
                    graph_sizes=capture_sizes(max_size) if capture else None)

    def sample_step(self, step: StepInputs, hidden: torch.Tensor, sample_rows: list[int],
                    handle: StepHandle, scheduler_output: SchedulerOutput) -> None:
        """The tokens of a launched step whose runner speculates (the one way out of
        ModelRunner.launch with speculation on): its drafts verified, on the device or on the
        host, or its rows sampled; then a model proposer's pass over the step."""
        runner = self.runner
        grammar = scheduler_output.grammar_bitmask
        verifies_on_device = bool(sample_rows) and any(
            scheduler_output.scheduled_device_drafts.values())
        if self.draft_fix_up is not None and self.model_proposer is not None:
            # A model proposer's drafts on the device: verify (or sample), then its pass.
            self.store_hidden(step, hidden)
            if verifies_on_device:
                self.verify_on_device(step, hidden, sample_rows, handle)
            else:
                runner.sample(step, hidden, sample_rows, handle, grammar)
            self.propose_on_device(step, hidden, handle, sample_rows,
                                   scheduler_output.propose_drafts)
        elif verifies_on_device:
            self.verify_on_device(step, hidden, sample_rows, handle)
        elif self.model_proposer is not None or step.drafts:
            if handle.previous is not None:
                handle.previous.result()  # verification appends this step's tokens after those
            # Rows with drafts are verified by the rejection sampler, and so are the others
            # (as rows of no drafts: one read-back for the step) unless one needs what only
            # the sampler applies (penalties, min_tokens, logprobs).
            verify_rows = sample_rows
            if not all(can_speculate(step.states[i].sampling_params) for i in sample_rows):
                verify_rows = [i for i in sample_rows if step.num_drafts[i]]
                runner.sample(step, hidden, [i for i in sample_rows if not step.num_drafts[i]],
                              handle, grammar)
                handle.result()
            self.verify(step, hidden, verify_rows, handle.output)
            if self.model_proposer is not None:
                self.propose(step, hidden, handle.output, scheduler_output.propose_drafts)
        else:
            # An n-gram step without drafts (the scheduler proposes them) samples as any step.
            runner.sample(step, hidden, sample_rows, handle, grammar)

    def verify(self, step: StepInputs, hidden: torch.Tensor, rows: list[int],
               output: ModelRunnerOutput) -> None:
        """Rejection-sample the drafts of `rows` (a row without drafts samples its one token,
        as the sampler would); append the emitted tokens to their states."""
        if not rows:
            return
        num_drafts = step.num_drafts[rows]
        max_drafts = int(num_drafts.max())
        positions = _logit_positions(step, rows, num_drafts)
        num_rows = len(rows)
        num_positions = num_rows * (max_drafts + 1)
        num_ids = num_rows * max_drafts
        host = self.staged.np
        host[:num_positions] = positions.reshape(-1)
        draft_ids = host[num_positions:num_positions + num_ids].reshape(num_rows, max_drafts)
        draft_ids[:] = PLACEHOLDER_TOKEN_ID
        for r, i in enumerate(rows):
            if num_drafts[r]:
                draft_ids[r, :num_drafts[r]] = step.drafts[i]
        host[num_positions + num_ids:num_positions + num_ids + num_rows] = num_drafts
        staged = self.staged.to_device(num_positions + num_ids + num_rows)
        states = [step.states[i] for i in rows]
        logits, metadata = self._target_logits(hidden, staged[:num_positions], states)
        result = self.rejection_sampler(
            staged[num_positions:num_positions + num_ids].view(num_rows, max_drafts),
            staged[num_positions + num_ids:], None, logits, metadata)
        emitted = result.output_token_ids.tolist()
        for r, i in enumerate(rows):
            tokens = emitted[r][:emitted[r].index(PLACEHOLDER_TOKEN_ID)] if (
                PLACEHOLDER_TOKEN_ID in emitted[r]) else emitted[r]
            step.states[i].token_ids.extend(tokens)
            output.sampled_token_ids[i] = tokens

    def verify_on_device(self, step: StepInputs, hidden: torch.Tensor, rows: list[int],
                         handle: StepHandle) -> None:
        """Rejection-sample the device drafts of `rows` (every row the step samples; rows
        without draft slots sample their one token), without waiting: the emitted tokens stay
        on the device for the next step's fix-up and come back to the host with `handle`."""
        parity = self.runner.next_launch_parity()
        slots = step.draft_slots[rows]
        max_slots = int(slots.max())
        positions = _logit_positions(step, rows, slots)
        num_rows = len(rows)
        num_positions = num_rows * (max_slots + 1)
        buffer = self._verify_staged[parity]
        host = buffer.np
        host[:num_positions] = positions.reshape(-1)
        host[num_positions:num_positions + num_rows] = slots
        host[num_positions + num_rows:num_positions + 2 * num_rows] = rows
        staged = buffer.to_device(num_positions + 2 * num_rows)
        states = [step.states[i] for i in rows]
        logits, metadata = self._target_logits(hidden, staged[:num_positions], states)
        draft_ids, num_drafts = step.device_drafts
        if num_rows == len(step.states):
            draft_ids, num_drafts = draft_ids[:num_rows], num_drafts[:num_rows]
        else:
            index = staged[num_positions + num_rows:]
            draft_ids, num_drafts = draft_ids[index], num_drafts[index]
        result = self.rejection_sampler(draft_ids[:, :max_slots], num_drafts, None, logits,
                                        metadata)
        handle.set_verified(rows, states, result.output_token_ids, result.num_accepted,
                            staged[num_positions:num_positions + num_rows], num_drafts,
                            self._verified_host[parity])

    def _target_logits(self, hidden: torch.Tensor, positions: torch.Tensor,
                       states: list[CachedRequestState]
                       ) -> tuple[torch.Tensor, SamplingMetadata]:
        """The target's logits at `positions` ([R * (d + 1)] on the device, row-major) as
        [R, d + 1, V], and the rows' sampling metadata."""
        runner = self.runner
        logits = runner.model.compute_logits(hidden[positions])
        logits = logits.view(len(states), -1, logits.shape[-1])
        metadata = build_sampling_metadata(states, runner.sampling_staging,
                                           runner.hf_config.vocab_size)
        return logits, metadata

    def propose(self, step: StepInputs, hidden: torch.Tensor, output: ModelRunnerOutput,
                draft: bool) -> None:
        """The model proposer's KV pass over the step's tokens, and with `draft` its drafts
        for the next step, in output.spec_token_ids."""
        max_model_len = self.runner.scheduler_config.max_model_len
        states = step.states
        sampled = [bool(tokens) for tokens in output.sampled_token_ids]
        num_wanted = [min(self.k, max_model_len - len(s.token_ids))
                      if draft and sampled[i] and can_speculate(s.sampling_params) else 0
                      for i, s in enumerate(states)]
        rows = np.fromiter((s.row for s in states), np.int64, len(states))
        drafts = self.model_proposer.propose(
            [s.token_ids for s in states], step.num_computed, step.num_scheduled,
            step.query_start_loc, sampled, num_wanted, self.runner.block_tables.table[rows],
            hidden)
        output.spec_token_ids = drafts if draft else None

    def hidden_store(self) -> Callable[[torch.Tensor, AttentionMetadata], None] | None:
        """What the target's CUDA graphs capture after the model (GraphRunner.after_forward):
        EAGLE with drafts on the device stores the step's hidden states at its KV slots, for
        a later catch-up (ModelProposer.store_hidden); None for other proposers."""
        proposer = self.model_proposer
        if proposer is None or not proposer.keeps_hidden:
            return None
        return lambda hidden, metadata: proposer.store_hidden(metadata.slot_mapping, hidden)

    def store_hidden(self, step: StepInputs, hidden: torch.Tensor) -> None:
        """The same for a step that ran without a graph (a graph's replay did it)."""
        proposer = self.model_proposer
        if proposer is not None and proposer.keeps_hidden and step.graph is None:
            num_layout = int(step.query_start_loc[-1])
            slots = self.runner.input_builder.buf_slot_mapping.device[:num_layout]
            proposer.store_hidden(slots, hidden)

    def propose_on_device(self, step: StepInputs, hidden: torch.Tensor, handle: StepHandle,
                          sample_rows: list[int], draft: bool) -> None:
        """The model proposer's device pass over the step just launched (its KV, and with
        `draft` the next drafts of every row that sampled and can speculate), queued without
        waiting: the next step's fix-up takes the drafts.

        Skipped when the next step does not draft and this one had no draft slots: the
        proposer's KV then lacks the step's positions (a gap, per block-table row), and the
        next pass that runs over the request first catches them up from the tokens the host
        knows by then (EAGLE: and the target's hidden states stored at their slots,
        `store_hidden`). A gap's steps have no slots, so their tokens are the inputs the host
        scheduled; the catch-up starts k positions early, since the host's count of the step
        before a gap may include slots it did not accept (recomputing a verified position
        rewrites the same KV)."""
        states = step.states
        num_reqs = len(states)
        rows = step.rows
        self._ensure_rows(int(rows.max()) + 1)
        slots = step.draft_slots
        if not draft and (slots is None or not slots.any()):
            self._skip_pass(step)
            return
        self._last_skipped = None
        gaps = self._catch_up(step)
        self._stale[rows] = False
        if draft:
            self._stale[rows[sample_rows]] = True
        decode = self.model_proposer.decode_batches
        if (decode is not None and len(sample_rows) == num_reqs <= decode.max_size
                and (step.num_scheduled == 1 + (0 if slots is None else slots)).all()):
            # A decode batch: the fixed-shape pass (a CUDA graph's replay).
            wanted = np.fromiter(
                (self.k if draft and can_speculate(s.sampling_params) else 0 for s in states),
                np.int64, num_reqs)
            verified = handle.verified
            decode.propose(
                rows, wanted, self.runner.block_tables.num_blocks[rows],
                handle.sampled.view(-1, 1) if verified is None else verified.tokens,
                None if verified is None else verified.counts, hidden, step.block_tables,
                step.graph is not None, self.draft_fix_up.model_draft_ids,
                self.draft_fix_up.model_num_drafts)
            self._mark_covered(step, slots, gaps)
            return
        sample_index = np.full(num_reqs, -1, dtype=np.int64)
        sample_index[sample_rows] = np.arange(len(sample_rows))
        if sample_rows:
            previous = handle.previous_tokens()
            emitted, counts = previous.tokens, previous.counts
        else:
            emitted = torch.zeros((0, 1), dtype=torch.int64, device=self.runner.device)
            counts = emitted[:, 0]
        slots = slots if slots is not None else np.zeros(num_reqs, dtype=np.int64)
        # EAGLE's pass over a chunk that samples nothing ends with the prompt token after it.
        end = step.num_computed + step.num_scheduled
        next_tokens = np.fromiter(
            (s.token_ids[e] if i < 0 and e < len(s.token_ids) else 0
             for s, e, i in zip(states, end.tolist(), sample_index.tolist())),
            np.int64, num_reqs)
        num_wanted = np.fromiter(
            (self.k if draft and i >= 0 and can_speculate(s.sampling_params) else 0
             for s, i in zip(states, sample_index.tolist())), np.int64, num_reqs)
        builder = self.runner.input_builder
        num_layout = int(step.query_start_loc[-1])
        fix_up = self.draft_fix_up
        self.model_proposer.propose_on_device(
            DeviceStep(
                rows=rows, query_start_loc=step.query_start_loc,
                num_scheduled=step.num_scheduled, num_slots=slots,
                num_computed=step.num_computed,
                num_blocks=self.runner.block_tables.num_blocks[rows].astype(np.int64),
                sample_index=sample_index, next_tokens=next_tokens, num_wanted=num_wanted,
                input_ids=builder.buf_input_ids.device[:num_layout],
                positions=builder.buf_positions.device[:num_layout],
                block_tables=step.block_tables, hidden=hidden, emitted=emitted,
                counts=counts),
            fix_up.model_draft_ids, fix_up.model_num_drafts)
        self._mark_covered(step, slots, gaps)

    # ---- which positions the proposer's KV holds (device passes) ---------------------------

    def start_request(self, state: CachedRequestState, num_loaded: int = 0) -> None:
        """A request (new, or resumed after preemption) took its block-table row with
        `num_computed_tokens` already in its blocks (prefix-cache hits, then `num_loaded` a
        KV connector loaded): its blocks past the hits are fresh or hold loaded target KV
        only, and its proposer KV starts at the first hit block a pass never completed (a
        gap there), the row's old drafts are stale."""
        if self.proposer_ok is None:
            return
        self._last_skipped = None
        row = state.row
        self._ensure_rows(row + 1)
        table = self.runner.block_tables
        blocks = table.table[row, :table.num_blocks[row]]
        block_size = self.runner.block_size
        num_hit = min(state.num_computed_tokens // block_size, len(blocks))
        num_local = min((state.num_computed_tokens - num_loaded) // block_size, num_hit)
        self.proposer_ok[blocks[num_local:]] = False
        ok = self.proposer_ok[blocks[:num_hit]]
        first_bad = num_hit if ok.all() else int(np.argmin(ok))
        self._ok_blocks[row] = first_bad
        self._gap[row] = first_bad * block_size if first_bad < num_hit else -1
        self._stale[row] = True

    def fresh_blocks(self, block_ids: list[int]) -> None:
        """Blocks newly given to a running request: no proposer KV in them yet."""
        if self.proposer_ok is not None and block_ids:
            self.proposer_ok[block_ids] = False

    def _ensure_rows(self, num_rows: int) -> None:
        self.draft_fix_up.ensure_rows(num_rows)
        old = len(self._gap)
        if num_rows > old:
            grow = max(num_rows, 2 * old) - old
            self._gap = np.concatenate([self._gap, np.full(grow, -1, dtype=np.int64)])
            self._stale = np.concatenate([self._stale, np.ones(grow, dtype=bool)])
            self._ok_blocks = np.concatenate([self._ok_blocks, np.zeros(grow, dtype=np.int64)])

    def _skip_pass(self, step: StepInputs) -> None:
        """No pass after this step: each request's gap starts (or goes on) here, and drafts
        an earlier pass left for its row are dropped (the fix-up must not take them later)."""
        self.num_passes_skipped += 1
        rows = step.rows
        last = self._last_skipped
        if last is not None and len(last) == len(rows) and (last == rows).all():
            return  # the same rows as the last skip: their gaps are open, no drafts stale
        self._last_skipped = rows
        starting = self._gap[rows] < 0
        if starting.any():
            self._gap[rows[starting]] = np.maximum(step.num_computed[starting] - self.k, 0)
        stale = self._stale[rows]
        if stale.any():
            stale = rows[stale]
            self._stale[stale] = False
            num_drafts = self.draft_fix_up.model_num_drafts
            num_drafts[torch.from_numpy(stale).to(num_drafts.device)] = 0

    def _catch_up(self, step: StepInputs) -> np.ndarray:
        """The proposer's KV over the positions each request of the step lacks before the
        step's first (its gap), from the tokens the host knows by now (EAGLE's pass at
        position p takes the token at p + 1: a gap's last is the step's first input id);
        returns the gap lengths [B] (0: none)."""
        rows = step.rows
        starts = self._gap[rows]
        gaps = np.where(starts < 0, 0, np.maximum(step.num_computed - starts, 0))
        if not gaps.any():
            return gaps
        self._gap[rows] = -1
        offset = self.model_proposer.token_offset
        which = np.flatnonzero(gaps)
        tokens: list[int] = []
        for i in which:
            s = step.states[i]
            start, computed = int(starts[i]), int(step.num_computed[i])
            known = s.token_ids[start + offset:computed]
            assert len(known) == computed - start - offset, (
                f"request {s.req_id}: the host lacks tokens of its proposer catch-up "
                f"({len(known)} of positions {start} .. {computed})")
            tokens.extend(known)
        first_inputs = None
        if offset:
            firsts = torch.from_numpy(step.query_start_loc[which].astype(np.int64))
            first_inputs = self.runner.input_builder.buf_input_ids.device[
                firsts.to(self.runner.device)]
        self.num_catch_ups += 1
        self.model_proposer.catch_up(starts[which], gaps[which],
                                     np.array(tokens, dtype=np.int64),
                                     self.runner.block_tables.table[rows[which]], first_inputs)
        return gaps

    def _mark_covered(self, step: StepInputs, slots: np.ndarray | None,
                      gaps: np.ndarray) -> None:
        """After a pass: the blocks each request's KV now fills for the proposer, up to what
        the host knows the step verified (a row's count may include slots of the step before
        it did not accept, unless a gap made it exact: k positions fewer)."""
        rows = step.rows
        self._gap[rows] = -1
        verified = step.num_computed + step.num_scheduled - (0 if slots is None else slots)
        verified -= np.where(gaps > 0, 0, self.k)
        filled = verified // self.runner.block_size
        done = self._ok_blocks[rows]
        table = self.runner.block_tables
        for i in np.flatnonzero(filled > done):
            row = rows[i]
            self.proposer_ok[table.table[row, done[i]:filled[i]]] = True
            self._ok_blocks[row] = filled[i]


def _logit_positions(step: StepInputs, rows: list[int], num_drafts: np.ndarray) -> np.ndarray:
    """[R, d + 1] rows of the step's hidden states to verify `rows` at: each draft's position
    and the one after the last (row r's are last - n .. last for its n drafts or draft slots;
    shorter rows repeat their last position, ignored)."""
    last = (step.query_start_loc[:-1] + step.num_scheduled - 1)[rows]
    offsets = np.minimum(np.arange(int(num_drafts.max()) + 1)[None, :], num_drafts[:, None])
    return (last - num_drafts)[:, None] + offsets
