"""The Triton kernels of sluice/spec_decode/proposer_inputs.py (which says what they compute;
its torch functions are their reference). Runs on CUDA tensors, and on CPU tensors under
`TRITON_INTERPRET=1` (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_positions", "num_hidden_rows", "stride_emitted",
                               "stride_block_tables"])
def _pass_inputs_kernel(
    query_start_loc_ptr,  # [>= R] int32
    input_ids_ptr,  # [num_positions] int64
    positions_ptr,  # [num_positions] int64
    num_positions,
    emitted_ptr,  # [>= R, W] int64
    stride_emitted,
    counts_ptr,  # [>= R] int64
    num_blocks_ptr,  # [>= R] int64
    block_tables_ptr,  # [R, width] int32
    stride_block_tables,
    width,
    num_hidden_rows,
    ids_ptr,  # out [R * L] int64
    pos_ptr,  # out [R * L] int64
    slots_ptr,  # out [R * L] int64
    seq_lens_ptr,  # out [R] int32
    valid_ptr,  # out [R] int64
    first_pos_ptr,  # out [R] int64
    hidden_rows_ptr,  # out [R * L] int64
    LENGTH: tl.constexpr,
    L_PAD: tl.constexpr,
    KNOWN: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, L_PAD)
    in_row = t < LENGTH
    first = tl.load(query_start_loc_ptr + row).to(tl.int64)
    first = tl.minimum(tl.maximum(first, 0), num_positions - 1)
    first_pos = tl.load(positions_ptr + first)
    first_id = tl.load(input_ids_ptr + first)
    tokens = tl.load(emitted_ptr + row * stride_emitted + tl.maximum(t - KNOWN, 0), mask=in_row,
                     other=0)
    ids = tl.maximum(tl.where(t < KNOWN, first_id, tokens), 0)
    pos = first_pos + t
    valid = KNOWN + tl.load(counts_ptr + row)
    index = pos // PAGE_SIZE
    store = in_row & (t < valid) & (index < tl.load(num_blocks_ptr + row))
    block = tl.load(block_tables_ptr + row * stride_block_tables + tl.minimum(index, width - 1),
                    mask=store, other=0).to(tl.int64)
    slots = tl.where(store, block * PAGE_SIZE + pos % PAGE_SIZE, -1)
    out = row * LENGTH + t
    tl.store(ids_ptr + out, ids, mask=in_row)
    tl.store(pos_ptr + out, pos, mask=in_row)
    tl.store(slots_ptr + out, slots, mask=in_row)
    hidden_rows = tl.minimum(first + t, tl.maximum(num_hidden_rows - 1, 0))
    tl.store(hidden_rows_ptr + out, hidden_rows, mask=in_row)
    tl.store(seq_lens_ptr + row, (first_pos + LENGTH).to(tl.int32))
    tl.store(valid_ptr + row, valid)
    tl.store(first_pos_ptr + row, first_pos)


def pass_inputs_triton(query_start_loc: torch.Tensor, input_ids: torch.Tensor,
                        positions: torch.Tensor, emitted: torch.Tensor, counts: torch.Tensor,
                        num_blocks: torch.Tensor, block_tables: torch.Tensor, length: int,
                        known: int, block_size: int, num_hidden_rows: int
                        ) -> tuple[torch.Tensor, ...]:
    size, width = block_tables.shape
    dev = block_tables.device
    i64 = dict(dtype=torch.int64, device=dev)
    ids = torch.empty(size * length, **i64)
    pos = torch.empty(size * length, **i64)
    slots = torch.empty(size * length, **i64)
    hidden_rows = torch.empty(size * length, **i64)
    seq_lens = torch.empty(size, dtype=torch.int32, device=dev)
    valid = torch.empty(size, **i64)
    first_pos = torch.empty(size, **i64)
    _pass_inputs_kernel[(size,)](
        query_start_loc, input_ids, positions, len(positions), emitted, emitted.stride(0),
        counts, num_blocks, block_tables, block_tables.stride(0), width, num_hidden_rows,
        ids, pos, slots, seq_lens, valid, first_pos, hidden_rows,
        LENGTH=length, L_PAD=triton.next_power_of_2(length), KNOWN=known,
        PAGE_SIZE=block_size)
    return ids, pos, slots, seq_lens, valid, first_pos, hidden_rows


def step_inputs_triton(next_pos: torch.Tensor, num_blocks: torch.Tensor,
                       block_tables: torch.Tensor, max_model_len: int, block_size: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    size, width = block_tables.shape
    pos = torch.empty_like(next_pos)
    slots = torch.empty_like(next_pos)
    seq_lens = torch.empty(size, dtype=torch.int32, device=next_pos.device)
    _step_inputs_kernel[(triton.cdiv(size, 128),)](
        next_pos, num_blocks, block_tables, block_tables.stride(0), width, size,
        max_model_len, pos, slots, seq_lens, PAGE_SIZE=block_size, BLOCK=128)
    return pos, slots, seq_lens


@triton.jit(do_not_specialize=["stride_block_tables", "width", "size", "max_model_len"])
def _step_inputs_kernel(next_pos_ptr, num_blocks_ptr, block_tables_ptr, stride_block_tables,
                        width, size, max_model_len, pos_ptr, slots_ptr, seq_lens_ptr,
                        PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_batch = row < size
    next_pos = tl.load(next_pos_ptr + row, mask=in_batch, other=0)
    pos = tl.minimum(next_pos, max_model_len - 1)
    index = pos // PAGE_SIZE
    store = in_batch & (next_pos < max_model_len) & (
        index < tl.load(num_blocks_ptr + row, mask=in_batch, other=0))
    block = tl.load(block_tables_ptr + row * stride_block_tables + tl.minimum(index, width - 1),
                    mask=store, other=0).to(tl.int64)
    tl.store(pos_ptr + row, pos, mask=in_batch)
    tl.store(slots_ptr + row, tl.where(store, block * PAGE_SIZE + pos % PAGE_SIZE, -1),
             mask=in_batch)
    tl.store(seq_lens_ptr + row, (pos + 1).to(tl.int32), mask=in_batch)
