"""The Triton kernels that lay out a model proposer's passes over decode batches against their
torch reference (sluice/spec_decode/proposer_inputs.py), and the reference against what the pass
means: each row's positions from its first one in the step, the step's input ids then the
tokens it emitted, KV stored only for the verified positions within the row's blocks."""

from __future__ import annotations

import pytest
import torch

from sluice.spec_decode.proposer_inputs import pass_inputs_torch, step_inputs_torch
from sluice.spec_decode.proposer_inputs_kernel import _step_inputs_kernel, pass_inputs_triton

PAGE = 4


def _batch(seed: int, size: int, k: int):
    generator = torch.Generator().manual_seed(seed)
    num_positions = size * (k + 1) + 3
    positions = torch.randint(0, 60, (num_positions,), generator=generator)
    input_ids = torch.randint(0, 1000, (num_positions,), generator=generator)
    # Rows laid out every k + 1 tokens; padding rows' starts point anywhere (even past the end).
    query_start_loc = (torch.arange(size, dtype=torch.int32) * (k + 1))
    query_start_loc[-1] = num_positions + 5
    counts = torch.randint(1, k + 2, (size,), generator=generator)
    emitted = torch.randint(0, 1000, (size, k + 1), generator=generator)
    emitted[torch.arange(k + 1)[None, :] >= counts[:, None]] = -1
    num_blocks = torch.randint(0, 20, (size,), generator=generator)
    block_tables = torch.randint(1, 99, (size, 24), generator=generator, dtype=torch.int32)
    return query_start_loc, input_ids, positions, emitted, counts, num_blocks, block_tables


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("known", [0, 1])  # EAGLE, a draft model
def test_pass_inputs_kernel_matches_torch_reference(seed: int, known: int) -> None:
    k = 3
    length = k + 1 + known
    args = _batch(seed, 7, k)
    want = pass_inputs_torch(*args, length, known, PAGE, 20)
    got = pass_inputs_triton(*args, length, known, PAGE, 20)
    names = ("ids", "positions", "slots", "seq_lens", "valid", "first_pos", "hidden_rows")
    for name, w, g in zip(names, want, got):
        assert torch.equal(w, g), name


def test_pass_inputs_reference_lays_out_each_row() -> None:
    k, known = 3, 1
    length = k + 1 + known
    qsl, input_ids, positions, emitted, counts, num_blocks, tables = _batch(0, 6, k)
    ids, pos, slots, seq_lens, valid, first_pos, _ = pass_inputs_torch(
        qsl, input_ids, positions, emitted, counts, num_blocks, tables, length, known, PAGE, 20)
    for r in range(6):
        first = min(max(int(qsl[r]), 0), len(positions) - 1)
        start = int(positions[first])
        assert int(first_pos[r]) == start
        assert int(seq_lens[r]) == start + length
        assert int(valid[r]) == known + int(counts[r])
        row = slice(r * length, (r + 1) * length)
        tokens = [int(input_ids[first])] + emitted[r].tolist()
        assert ids[row].tolist() == [max(tok, 0) for tok in tokens]
        assert pos[row].tolist() == list(range(start, start + length))
        for t, p in enumerate(range(start, start + length)):
            kept = t < int(valid[r]) and p // PAGE < int(num_blocks[r])
            want = int(tables[r, p // PAGE]) * PAGE + p % PAGE if kept else -1
            assert int(slots[r * length + t]) == want


@pytest.mark.parametrize("seed", range(3))
def test_step_inputs_kernel_matches_torch_reference(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    size, max_model_len = 150, 70  # two programs; some rows past max_model_len
    next_pos = torch.randint(0, 80, (size,), generator=generator)
    num_blocks = torch.randint(0, 20, (size,), generator=generator)
    tables = torch.randint(1, 99, (size, 24), generator=generator, dtype=torch.int32)
    want = step_inputs_torch(next_pos, num_blocks, tables, max_model_len, PAGE)
    pos, slots = torch.empty_like(next_pos), torch.empty_like(next_pos)
    seq_lens = torch.empty(size, dtype=torch.int32)
    _step_inputs_kernel[(2,)](next_pos, num_blocks, tables, tables.stride(0), tables.shape[1],
                              size, max_model_len, pos, slots, seq_lens, PAGE_SIZE=PAGE,
                              BLOCK=128)
    for name, w, g in zip(("positions", "slots", "seq_lens"), want, (pos, slots, seq_lens)):
        assert torch.equal(w, g), name
    kept = (next_pos < max_model_len) & (want[0] // PAGE < num_blocks)
    assert torch.equal(want[1] >= 0, kept)
