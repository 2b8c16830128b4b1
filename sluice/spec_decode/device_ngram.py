"""N-gram drafts proposed on the device, so that speculative steps overlap like any other.

With async scheduling the host schedules step N + 1 before step N's tokens are back. A request
that verified drafts in step N got 1 to k + 1 tokens there, a number only the device knows; its
next drafts continue from them. So the host schedules each drafting request optimistically
(as if step N accepted every draft: 1 + k' tokens at the positions that follow) and the device
fixes the step's inputs before the model runs (`fix_up`), per request row:

1. append the tokens step N emitted for it to the row's token history (device memory, one row
   per block-table row: `history` [rows, width] int32, `history_len` [rows]);
2. propose up to k' drafts from that history by prompt lookup, exactly as the host proposer
   (sluice/spec_decode/ngram_proposer.py): the longest n in [min_n, max_n] whose suffix n-gram
   occurs earlier, its earliest occurrence, the tokens that followed it;
3. write the step's input ids (the last token emitted, then the drafts; 0 for slots without a
   draft), shift its positions and context length by what step N did not accept
   (accepted - draft slots, <= 0), and recompute its slots from the block table (-1, nothing
   stored, for a slot without a draft). A row whose last step is no longer in flight (the
   worker took its tokens before the host scheduled on them) gets that shift from the host.

The step's drafts and their counts stay on the device for the rejection sampler. A row's history
is uploaded from the host (`upload`) when it is not known to be current: a new request, or one
whose last steps did not go through the fix-up; the runner tracks that (CachedRequestState.
history_step).

`fix_up` is one Triton kernel on a GPU (a program per request row) and torch operations
elsewhere (`fix_up_torch`, also the kernel's reference in the tests).

With a model proposer (a draft model, an EAGLE head) the same fix-up takes the drafts that the
proposer's device pass left after the step before (`model_draft_ids` / `model_num_drafts`, per
history row: sluice/spec_decode/model_proposer.py) instead of a prompt lookup.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sluice.spec_decode.ngram_proposer import find_longest_ngram_match

# Columns of the per-row metadata of `fix_up` ([B, 6] int64).
META_COLUMNS = 6


@dataclass(slots=True)
class PreviousTokens:
    """What the step in flight emitted per row (device tensors): `tokens` [P, S] (a row's first
    `counts` entries; the last of them is the row's last token), `counts` [P] >= 1, `offsets`
    [P] <= 0 (accepted - draft slots: how far the row's next position falls behind the
    optimistic one)."""

    tokens: torch.Tensor
    counts: torch.Tensor
    offsets: torch.Tensor


@dataclass(slots=True)
class StepBuffers:
    """The step's input buffers on the device, fixed in place."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, width] int32


class DeviceNgram:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int, max_model_len: int,
                 num_rows: int, block_size: int, device: torch.device,
                 from_model: bool = False) -> None:
        self.k = num_speculative_tokens
        self.from_model = from_model
        self.min_n, self.max_n = min_n, max_n
        self.block_size = block_size
        self.device = device
        # Appends land past a row's length: room for a step's k + 1 beyond max_model_len.
        self.width = max_model_len + num_speculative_tokens + 1
        self.history = torch.zeros((num_rows, self.width), dtype=torch.int32, device=device)
        self.history_len = torch.zeros(num_rows, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self._pin = pin
        # Grown on demand; pinning memory can wait for the device, so start with room for
        # 256 histories of 2,048 tokens (8 MiB) rather than pin mid-run.
        self._upload_host = torch.zeros(2 * 256 * 2048, dtype=torch.int64, pin_memory=pin)
        self._upload_done: torch.cuda.Event | None = None
        self._meta_host = torch.zeros((num_rows, META_COLUMNS), dtype=torch.int64, pin_memory=pin)
        self._meta_done: torch.cuda.Event | None = None
        self._meta_device = torch.zeros((num_rows, META_COLUMNS), dtype=torch.int64, device=device)
        # [rows, k] draft ids (-1 past a row's count) and [rows] counts of the last fix_up.
        self.draft_ids = torch.full((num_rows, max(self.k, 1)), -1, dtype=torch.int64,
                                    device=device)
        self.num_drafts = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self._new_model_drafts(num_rows)
        self.use_triton = device.type == "cuda"

    def _new_model_drafts(self, num_rows: int) -> None:
        # A model proposer's drafts per history row (from_model): [rows, k] ids, [rows] counts.
        self.model_draft_ids = torch.zeros((num_rows, max(self.k, 1)), dtype=torch.int64,
                                           device=self.device)
        self.model_num_drafts = torch.zeros(num_rows, dtype=torch.int64, device=self.device)

    def warm_up(self) -> None:
        """Run the fix-up once on scratch inputs (on a GPU: compile the kernel before the
        first request), leaving the histories as they were."""
        dev = self.device
        k = self.k
        tokens = torch.zeros((1, k + 1), dtype=torch.int64, device=dev)
        counts = torch.ones(1, dtype=torch.int64, device=dev)
        buffers = StepBuffers(torch.zeros(k + 1, dtype=torch.int64, device=dev),
                              torch.zeros(k + 1, dtype=torch.int64, device=dev),
                              torch.zeros(k + 1, dtype=torch.int64, device=dev),
                              torch.zeros(1, dtype=torch.int32, device=dev),
                              torch.zeros((1, 1), dtype=torch.int32, device=dev))
        self.fix_up(np.array([[0, 0, 0, k, 1, 0]], dtype=np.int64),
                    PreviousTokens(tokens, counts, counts - 1), buffers)
        self.history_len.zero_()

    def ensure_rows(self, num_rows: int) -> None:
        """Room for block-table rows below `num_rows` (preempted requests keep their rows, so
        there may be more than max_num_seqs)."""
        old = self.history.shape[0]
        if num_rows <= old:
            return
        new = max(num_rows, 2 * old)
        grow = new - old
        dev = self.device
        self.history = torch.cat([self.history, torch.zeros((grow, self.width),
                                                            dtype=torch.int32, device=dev)])
        self.history_len = torch.cat([self.history_len,
                                      torch.zeros(grow, dtype=torch.int64, device=dev)])
        self._wait(self._meta_done)
        self._meta_host = torch.zeros((new, META_COLUMNS), dtype=torch.int64, pin_memory=self._pin)
        self._meta_device = torch.zeros((new, META_COLUMNS), dtype=torch.int64, device=dev)
        self.draft_ids = torch.full((new, max(self.k, 1)), -1, dtype=torch.int64, device=dev)
        self.num_drafts = torch.zeros(new, dtype=torch.int64, device=dev)
        model_ids, model_counts = self.model_draft_ids, self.model_num_drafts
        self._new_model_drafts(new)
        self.model_draft_ids[:old] = model_ids
        self.model_num_drafts[:old] = model_counts

    @staticmethod
    def _wait(event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()

    def upload(self, rows: list[int], token_lists: list[list[int]]) -> None:
        """Set each history row to the tokens given (queued on the device, never blocking on
        the step in flight)."""
        if not rows:
            return
        lengths = np.fromiter(map(len, token_lists), np.int64, len(rows))
        total = int(lengths.sum())
        needed = 2 * total + 2 * len(rows)
        self._wait(self._upload_done)  # the last upload has left the pinned buffer
        if self._upload_host.numel() < needed:
            self._upload_host = torch.zeros(max(needed, 2 * self._upload_host.numel()),
                                            dtype=torch.int64, pin_memory=self._pin)
        host = self._upload_host.numpy()
        row_array = np.asarray(rows, dtype=np.int64)
        starts = np.repeat(row_array * self.width, lengths)
        within = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        host[:total] = starts + within
        host[total:2 * total] = np.fromiter(
            (t for tokens in token_lists for t in tokens), np.int64, total)
        host[2 * total:2 * total + len(rows)] = row_array
        host[2 * total + len(rows):needed] = lengths
        staged = self._upload_host[:needed].to(self.device, non_blocking=True)
        if total:
            self.history.view(-1).index_copy_(0, staged[:total],
                                              staged[total:2 * total].to(torch.int32))
        self.history_len.index_copy_(0, staged[2 * total:2 * total + len(rows)],
                                     staged[2 * total + len(rows):])
        if self.device.type == "cuda":
            self._upload_done = torch.cuda.Event()
            self._upload_done.record()

    def fix_up(self, meta: np.ndarray, previous: PreviousTokens | None,
               buffers: StepBuffers) -> tuple[torch.Tensor, torch.Tensor]:
        """Fix the step's inputs for its device rows (see the module docstring).

        meta: [B, 6] per request row of the step: history row, row in `previous` (-1: none in
        flight), where its tokens start in the step, its draft slots k', whether it is a
        device row at all (others are left alone and get no drafts), and the shift of its
        positions when none is in flight. Returns (draft ids [B, k], -1 past each row's count;
        counts [B]) on the device."""
        num_reqs = meta.shape[0]
        self._wait(self._meta_done)
        self._meta_host[:num_reqs].numpy()[:] = meta
        meta_dev = self._meta_device[:num_reqs]
        meta_dev.copy_(self._meta_host[:num_reqs], non_blocking=True)
        if self.device.type == "cuda":
            self._meta_done = torch.cuda.Event()
            self._meta_done.record()
        draft_ids, num_drafts = self.draft_ids[:num_reqs], self.num_drafts[:num_reqs]
        if previous is None:  # rows read nothing from it: any tensors of the right types
            empty = self.num_drafts[:1]
            previous = PreviousTokens(empty[:, None], empty, empty)
        fn = fix_up_triton if self.use_triton else fix_up_torch
        model_drafts = ((self.model_draft_ids, self.model_num_drafts) if self.from_model
                        else None)
        fn(meta_dev, previous, buffers, self.history, self.history_len, draft_ids, num_drafts,
           self.k, self.min_n, self.max_n, self.block_size, model_drafts)
        return draft_ids, num_drafts


def fix_up_torch(meta: torch.Tensor, previous: PreviousTokens, buffers: StepBuffers,
                 history: torch.Tensor, history_len: torch.Tensor, draft_ids: torch.Tensor,
                 num_drafts: torch.Tensor, k: int, min_n: int, max_n: int, block_size: int,
                 model_drafts: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """The fix-up in torch operations, row by row (CPU engines, and the kernel's reference).
    model_drafts: a model proposer's ([rows, k] ids, [rows] counts), taken as the drafts."""
    draft_ids.fill_(-1)
    num_drafts.zero_()
    for i, (hrow, src, start, slots, is_device, offset) in enumerate(meta.tolist()):
        if not is_device:
            continue
        length = int(history_len[hrow])
        if src >= 0:
            count = int(previous.counts[src])
            history[hrow, length:length + count] = previous.tokens[src, :count].to(torch.int32)
            length += count
            history_len[hrow] = length
            offset = int(previous.offsets[src])
        tokens = history[hrow, :length].to(torch.int64).numpy(force=True)
        drafts = []
        if model_drafts is not None:
            num = min(int(model_drafts[1][hrow]), slots, k)
            drafts = model_drafts[0][hrow, :num].tolist()
        elif slots > 0:
            drafts = _ngram_drafts(tokens, min_n, max_n, min(k, slots))
        nd = len(drafts)
        row_ids = [int(tokens[-1])] + drafts + [0] * (slots - nd)
        buffers.input_ids[start:start + slots + 1] = torch.tensor(row_ids)
        positions = buffers.positions[start:start + slots + 1] + offset
        buffers.positions[start:start + slots + 1] = positions
        blocks = buffers.block_tables[i, (positions[:nd + 1] // block_size)].to(torch.int64)
        slot_ids = torch.full((slots + 1,), -1, dtype=torch.int64)
        slot_ids[:nd + 1] = blocks * block_size + positions[:nd + 1] % block_size
        buffers.slot_mapping[start:start + slots + 1] = slot_ids
        buffers.seq_lens[i] += offset
        if nd:
            draft_ids[i, :nd] = torch.tensor(drafts)
        num_drafts[i] = nd


def _ngram_drafts(tokens: np.ndarray, min_n: int, max_n: int, num: int) -> list[int]:
    match = find_longest_ngram_match(tokens, min_n, max_n)
    if match is None:
        return []
    return tokens[match[1]:match[1] + num].tolist()


def fix_up_triton(meta: torch.Tensor, previous: PreviousTokens, buffers: StepBuffers,
                  history: torch.Tensor, history_len: torch.Tensor, draft_ids: torch.Tensor,
                  num_drafts: torch.Tensor, k: int, min_n: int, max_n: int, block_size: int,
                  model_drafts: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """The fix-up as one Triton launch, a program per request row."""
    from sluice.spec_decode.device_ngram_kernel import launch_fix_up

    launch_fix_up(meta, previous, buffers, history, history_len, draft_ids, num_drafts, k,
                  min_n, max_n, block_size, model_drafts)
