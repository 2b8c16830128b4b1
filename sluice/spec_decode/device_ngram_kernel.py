"""The device n-gram fix-up as one Triton kernel (sluice/spec_decode/device_ngram.py says what
it computes; `fix_up_torch` there is its reference). A program per request row of the step:
append what the step in flight emitted to the row's history, look up the longest recurring
suffix n-gram (one scan of the history in blocks for every n), write the row's inputs.

Runs on CUDA tensors, and on CPU tensors under `TRITON_INTERPRET=1` (the tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from sluice.spec_decode.device_ngram import PreviousTokens, StepBuffers

_SCAN_BLOCK = 256


# Strides that change from step to step (a plain step's one token per row or a verification's
# k + 1; the block tables' width) would compile a variant each when 1 or a multiple of 16.
@triton.jit(do_not_specialize=["stride_prev", "stride_block_tables"])
def _fix_up_kernel(
    meta_ptr,  # [B, 6] int64: history row, source row, start, draft slots, is device row,
    # shift without a source row
    prev_tokens_ptr,  # [P, S] int64
    stride_prev,
    prev_counts_ptr,  # [P] int64
    prev_offsets_ptr,  # [P] int64
    input_ids_ptr,  # [T] int64
    positions_ptr,  # [T] int64
    slot_mapping_ptr,  # [T] int64
    seq_lens_ptr,  # [B] int32
    block_tables_ptr,  # [B, width] int32
    stride_block_tables,
    history_ptr,  # [rows, W] int32
    stride_history,
    history_len_ptr,  # [rows] int64
    draft_ids_ptr,  # [>= B, k] int64
    stride_drafts,
    num_drafts_ptr,  # [>= B] int64
    model_ids_ptr,  # [rows, k] int64: a model proposer's drafts per history row (FROM_MODEL)
    stride_model,
    model_counts_ptr,  # [rows] int64
    FROM_MODEL: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,  # >= K + 1
    PREV_PAD: tl.constexpr,  # >= S
    MIN_N: tl.constexpr,
    MAX_N: tl.constexpr,
    N_PAD: tl.constexpr,  # >= MAX_N
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    hrow = tl.load(meta_ptr + row * 6)
    src = tl.load(meta_ptr + row * 6 + 1)
    start = tl.load(meta_ptr + row * 6 + 2)
    slots = tl.load(meta_ptr + row * 6 + 3)
    is_device = tl.load(meta_ptr + row * 6 + 4)
    offset = tl.load(meta_ptr + row * 6 + 5)
    q = tl.arange(0, K_PAD)
    if is_device == 0:
        tl.store(draft_ids_ptr + row * stride_drafts + q, tl.full((K_PAD,), -1, tl.int64),
                 mask=q < K)
        tl.store(num_drafts_ptr + row, 0)
        return
    history = history_ptr + hrow * stride_history
    length = tl.load(history_len_ptr + hrow)
    if src >= 0:
        count = tl.load(prev_counts_ptr + src)
        p = tl.arange(0, PREV_PAD)
        emitted = tl.load(prev_tokens_ptr + src * stride_prev + p, mask=p < count, other=0)
        tl.store(history + length + p, emitted.to(tl.int32), mask=p < count)
        length += count
        tl.store(history_len_ptr + hrow, length)
        offset = tl.load(prev_offsets_ptr + src)
    tl.debug_barrier()  # the appended tokens are visible to the whole program
    last = tl.load(history + length - 1)

    in_row = q <= slots
    if FROM_MODEL:
        # A model proposer left the row's drafts after the step before (its device pass).
        model = model_ids_ptr + hrow * stride_model
        num = tl.minimum(tl.minimum(tl.load(model_counts_ptr + hrow), slots), K)
        is_draft = q < num
        drafts = tl.load(model + q, mask=is_draft, other=0)
        after = tl.load(model + q - 1, mask=(q >= 1) & (q <= num), other=0)
    else:
        # The longest n whose suffix n-gram ends earlier (at e <= length - 2), earliest e:
        # one scan, the match of n + 1 tokens extending that of n; firsts[n - 1] the
        # earliest end.
        none: tl.constexpr = 1 << 30  # past any history position
        sizes = tl.arange(0, N_PAD)  # n - 1
        firsts = tl.full((N_PAD,), none, tl.int64)
        scan_end = tl.where(slots > 0, length - 1, 0)
        for e0 in range(0, scan_end, BLOCK):
            e = e0 + tl.arange(0, BLOCK).to(tl.int64)
            match = e <= length - 2
            for t in tl.static_range(0, MAX_N):
                match = match & (e >= t)
                earlier = tl.load(history + e - t, mask=match, other=-1)
                suffix = tl.load(history + length - 1 - t, mask=length - 1 - t >= 0, other=-2)
                match = match & (earlier == suffix)
                first = tl.min(tl.where(match, e, none), axis=0)
                firsts = tl.where(sizes == t, tl.minimum(firsts, first), firsts)
        found = (firsts < none) & (sizes >= MIN_N - 1)
        longest = tl.max(tl.where(found, sizes, -1), axis=0)
        best = tl.where(longest >= 0, tl.sum(tl.where(sizes == longest, firsts, 0), axis=0),
                        none)
        num = tl.where(best == none, 0,
                       tl.minimum(tl.minimum(length - best - 1, slots), K))
        is_draft = q < num
        drafts = tl.load(history + best + 1 + q, mask=is_draft, other=0).to(tl.int64)
        after = tl.load(history + best + q, mask=(q >= 1) & (q <= num), other=0).to(tl.int64)

    tl.store(draft_ids_ptr + row * stride_drafts + q, tl.where(is_draft, drafts, -1),
             mask=q < K)
    tl.store(num_drafts_ptr + row, num)
    # The row's tokens: its last one, then the drafts, 0 in slots without one.
    tokens = tl.where(q == 0, last.to(tl.int64), after)
    tl.store(input_ids_ptr + start + q, tokens, mask=in_row)
    positions = tl.load(positions_ptr + start + q, mask=in_row, other=0) + offset
    tl.store(positions_ptr + start + q, positions, mask=in_row)
    real = in_row & (q <= num)
    block = tl.load(block_tables_ptr + row * stride_block_tables + positions // PAGE_SIZE,
                    mask=real, other=0).to(tl.int64)
    slot = tl.where(real, block * PAGE_SIZE + positions % PAGE_SIZE, -1)
    tl.store(slot_mapping_ptr + start + q, slot, mask=in_row)
    seq_len = tl.load(seq_lens_ptr + row)
    tl.store(seq_lens_ptr + row, seq_len + offset.to(tl.int32))


def launch_fix_up(meta: torch.Tensor, previous: PreviousTokens, buffers: StepBuffers,
                  history: torch.Tensor, history_len: torch.Tensor, draft_ids: torch.Tensor,
                  num_drafts: torch.Tensor, k: int, min_n: int, max_n: int, block_size: int,
                  model_drafts: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """model_drafts: a model proposer's ([rows, k] ids, [rows] counts) per history row, taken
    as the drafts instead of a prompt lookup."""
    num_reqs = meta.shape[0]
    if num_reqs == 0:
        return
    tokens = previous.tokens
    model_ids, model_counts = (model_drafts if model_drafts is not None
                               else (draft_ids, num_drafts))  # not read
    k_pad = triton.next_power_of_2(k + 1)
    _fix_up_kernel[(num_reqs,)](
        meta, tokens, tokens.stride(0), previous.counts, previous.offsets,
        buffers.input_ids, buffers.positions, buffers.slot_mapping, buffers.seq_lens,
        buffers.block_tables, buffers.block_tables.stride(0),
        history, history.stride(0), history_len, draft_ids, draft_ids.stride(0), num_drafts,
        model_ids, model_ids.stride(0), model_counts, FROM_MODEL=model_drafts is not None,
        K=k, K_PAD=k_pad,
        # At least K_PAD whatever the step in flight emitted (one token a row, or k + 1): one
        # compiled variant for both, so the first verification after plain steps compiles
        # nothing mid-run (the warm-up runs the k + 1 shape).
        PREV_PAD=max(k_pad, triton.next_power_of_2(tokens.shape[1])), MIN_N=min_n, MAX_N=max_n,
        N_PAD=triton.next_power_of_2(max_n),
        PAGE_SIZE=block_size, BLOCK=_SCAN_BLOCK,
    )
