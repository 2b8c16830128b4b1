"""The inputs of a model proposer's passes over decode batches (sluice/spec_decode/
model_proposer.py, DecodeBatches), computed on the device: one Triton launch each on a GPU,
where the same in torch operations was some thirty launches a pass inside the CUDA graph; torch
elsewhere (CPU engines, and the kernels' reference in tests/kernels). The kernels are in
proposer_inputs_kernel.py, imported only where a GPU runs them.

`pass_inputs`: per row r of a decode batch, the pass covers L positions from the row's first
position in the step (`positions[query_start_loc[r]]`): the first `known` of them take the
step's input ids there (a draft model's: the row's last token before the step), the rest the
tokens the step emitted for the row (`emitted[r]`, -1 past its count: any token, 0). Only the
first `known + counts[r]` positions (those the step verified) store KV, and only in blocks the
row holds. EAGLE also reads the target's hidden state at each position: the step's row
`query_start_loc[r] + t` (past the row's own tokens the position stores nothing).

`step_inputs`: one position per row (a draft step), storing while below max_model_len and in
the row's blocks.
"""

from __future__ import annotations

import torch


def pass_inputs(query_start_loc: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                emitted: torch.Tensor, counts: torch.Tensor, num_blocks: torch.Tensor,
                block_tables: torch.Tensor, length: int, known: int, block_size: int,
                num_hidden_rows: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, torch.Tensor]:
    """For the R = len(block_tables) rows: (input ids [R * L], positions [R * L], slots
    [R * L] (-1: not stored), seq_lens [R] int32, each row's kept positions [R], its first
    position [R], the hidden-state row of each position [R * L])."""
    if block_tables.is_cuda:
        from sluice.spec_decode.proposer_inputs_kernel import pass_inputs_triton

        return pass_inputs_triton(query_start_loc, input_ids, positions, emitted, counts,
                                  num_blocks, block_tables, length, known, block_size,
                                  num_hidden_rows)
    return pass_inputs_torch(query_start_loc, input_ids, positions, emitted, counts, num_blocks,
                             block_tables, length, known, block_size, num_hidden_rows)


def pass_inputs_torch(query_start_loc: torch.Tensor, input_ids: torch.Tensor,
                      positions: torch.Tensor, emitted: torch.Tensor, counts: torch.Tensor,
                      num_blocks: torch.Tensor, block_tables: torch.Tensor, length: int,
                      known: int, block_size: int, num_hidden_rows: int
                      ) -> tuple[torch.Tensor, ...]:
    size, width = block_tables.shape
    dev = block_tables.device
    t = torch.arange(length, device=dev)
    first = query_start_loc[:size].to(torch.int64).clamp(0, len(positions) - 1)
    tokens = emitted[:size].gather(1, (t - known).clamp(min=0).expand(size, length))
    ids = torch.where(t < known, input_ids[first][:, None], tokens).clamp(min=0)
    first_pos = positions[first]
    pos = first_pos[:, None] + t
    valid = known + counts[:size]
    index = pos // block_size
    store = (t[None, :] < valid[:, None]) & (index < num_blocks[:size, None])
    blocks = block_tables.gather(1, index.clamp(max=width - 1)).to(torch.int64)
    slots = torch.where(store, blocks * block_size + pos % block_size, -1)
    seq_lens = (first_pos + length).to(torch.int32)
    hidden_rows = (first[:, None] + t).clamp(max=max(num_hidden_rows - 1, 0))
    return (ids.reshape(-1), pos.reshape(-1), slots.reshape(-1), seq_lens, valid, first_pos,
            hidden_rows.reshape(-1))


def step_inputs(next_pos: torch.Tensor, num_blocks: torch.Tensor, block_tables: torch.Tensor,
                max_model_len: int, block_size: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draft step's one position per row at next_pos (clamped below max_model_len):
    (positions [R], slots [R] (-1: not stored), seq_lens [R] int32)."""
    if block_tables.is_cuda:
        from sluice.spec_decode.proposer_inputs_kernel import step_inputs_triton

        return step_inputs_triton(next_pos, num_blocks, block_tables, max_model_len,
                                  block_size)
    return step_inputs_torch(next_pos, num_blocks, block_tables, max_model_len, block_size)


def step_inputs_torch(next_pos: torch.Tensor, num_blocks: torch.Tensor,
                      block_tables: torch.Tensor, max_model_len: int, block_size: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = block_tables.shape[1]
    pos = next_pos.clamp(max=max_model_len - 1)
    index = pos // block_size
    store = (next_pos < max_model_len) & (index < num_blocks)
    blocks = block_tables.gather(1, index.clamp(max=width - 1)[:, None])[:, 0].to(torch.int64)
    slots = torch.where(store, blocks * block_size + pos % block_size, -1)
    return pos, slots, (pos + 1).to(torch.int32)
