"""The device n-gram fix-up kernel against its torch reference, and the reference against the
host proposer (sluice/spec_decode/device_ngram.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from sluice.spec_decode.device_ngram import (
    PreviousTokens,
    StepBuffers,
    fix_up_torch,
)
from sluice.spec_decode.ngram_proposer import find_longest_ngram_match

K, MIN_N, MAX_N, PAGE = 4, 2, 4, 4
WIDTH = 96


def _case(seed: int):
    """A step of 6 request rows over 8 history rows: device rows with and without a step in
    flight, rows with 0..k draft slots, and one row that is not a device row."""
    rng = random.Random(seed)
    num_rows, num_reqs = 8, 6
    history = torch.zeros((num_rows, WIDTH), dtype=torch.int32)
    history_len = torch.zeros(num_rows, dtype=torch.int64)
    for r in range(num_rows):
        # Short alphabets so that n-grams recur; some rows a repeated segment.
        alphabet = rng.choice([3, 5, 50])
        length = rng.randrange(1, 60)
        tokens = [rng.randrange(alphabet) for _ in range(length)]
        history[r, :length] = torch.tensor(tokens, dtype=torch.int32)
        history_len[r] = length
    prev_tokens = torch.full((num_reqs, K + 1), -1, dtype=torch.int64)
    prev_counts = torch.ones(num_reqs, dtype=torch.int64)
    prev_offsets = torch.zeros(num_reqs, dtype=torch.int64)
    meta, layout, seq_lens = [], [], []
    hrows = rng.sample(range(num_rows), num_reqs)
    start = 0
    for i in range(num_reqs):
        slots = rng.randrange(0, K + 1)
        src = rng.choice([-1, num_reqs - 1 - i])
        is_device = int(i != 2)
        if src >= 0:
            count = rng.randrange(1, K + 2)
            prev_tokens[src, :count] = torch.tensor([rng.randrange(5) for _ in range(count)])
            prev_counts[src] = count
            prev_offsets[src] = -rng.randrange(0, K + 1)
        offset = 0 if src >= 0 else -rng.randrange(0, K + 1)
        meta.append([hrows[i], src, start, slots, is_device, offset])
        layout.append(slots + 1)
        seq_lens.append(int(history_len[hrows[i]]) + 20)
        start += slots + 1
    num_tokens = start
    block_tables = torch.randint(1, 50, (num_reqs, 40), dtype=torch.int32)
    buffers = StepBuffers(
        input_ids=torch.full((num_tokens,), 7, dtype=torch.int64),
        positions=torch.arange(num_tokens, dtype=torch.int64) + 30,
        slot_mapping=torch.full((num_tokens,), 99, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables)
    previous = PreviousTokens(prev_tokens, prev_counts, prev_offsets)
    return torch.tensor(meta, dtype=torch.int64), previous, buffers, history, history_len


def _run(fn, case, min_n: int = MIN_N, max_n: int = MAX_N, model_drafts=None):
    meta, previous, buffers, history, history_len = case
    buffers = StepBuffers(*(t.clone() for t in (buffers.input_ids, buffers.positions,
                                                buffers.slot_mapping, buffers.seq_lens,
                                                buffers.block_tables)))
    history, history_len = history.clone(), history_len.clone()
    draft_ids = torch.zeros((meta.shape[0], K), dtype=torch.int64)
    num_drafts = torch.zeros(meta.shape[0], dtype=torch.int64)
    fn(meta, previous, buffers, history, history_len, draft_ids, num_drafts, K, min_n, max_n,
       PAGE, model_drafts)
    return buffers, history, history_len, draft_ids, num_drafts


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ngram_sizes", [(MIN_N, MAX_N), (1, 3), (3, 3)])
def test_fix_up_kernel_matches_torch_reference(seed: int, ngram_sizes: tuple[int, int]) -> None:
    from sluice.spec_decode.device_ngram_kernel import launch_fix_up

    case = _case(seed)
    want = _run(fix_up_torch, case, *ngram_sizes)
    got = _run(launch_fix_up, case, *ngram_sizes)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        assert torch.equal(getattr(want[0], name), getattr(got[0], name)), name
    for name, w, g in zip(("history_len", "draft_ids", "num_drafts"), want[2:], got[2:]):
        assert torch.equal(w, g), name
    lengths = want[2]
    for r in range(case[3].shape[0]):
        n = int(lengths[r])
        assert torch.equal(want[1][r, :n], got[1][r, :n]), f"history row {r}"


def test_fix_up_after_a_plain_step_is_the_warm_ups_variant(monkeypatch) -> None:
    """The first verification after plain decode steps reads a step in flight that emitted one
    token a row ([P, 1] tokens), where the warm-up and later verifications read k + 1: the
    launch's compile-time constants are the same for both, so that step compiles nothing (on an
    H200 it compiled a variant mid-run, 0.24 s), and it fixes the rows as the reference does."""
    from sluice.spec_decode import device_ngram_kernel

    kernel = device_ngram_kernel._fix_up_kernel
    constants = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                constants.append({key: value for key, value in kwargs.items()
                                  if key.isupper()})
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(device_ngram_kernel, "_fix_up_kernel", Recorder())
    meta, previous, buffers, history, history_len = _case(3)
    plain = PreviousTokens(previous.tokens[:, :1].clone(), torch.ones_like(previous.counts),
                           torch.zeros_like(previous.offsets))
    for prev in (previous, plain):
        case = (meta, prev, buffers, history, history_len)
        want = _run(fix_up_torch, case)
        got = _run(device_ngram_kernel.launch_fix_up, case)
        for w, g in zip((want[0].input_ids, want[0].slot_mapping, *want[2:]),
                        (got[0].input_ids, got[0].slot_mapping, *got[2:])):
            assert torch.equal(w, g)
    assert len(constants) == 2 and constants[0] == constants[1]


@pytest.mark.parametrize("seed", range(6))
def test_fix_up_reference_drafts_what_the_host_proposer_drafts(seed: int) -> None:
    """Per device row: the history gets what the step in flight emitted, the drafts are the
    host proposer's over that history, capped by the row's slots; inputs, positions, slots and
    the context length follow."""
    meta, previous, buffers, history, history_len = case = _case(seed)
    out, new_history, new_len, draft_ids, num_drafts = _run(fix_up_torch, case)
    for i, (hrow, src, start, slots, is_device, host_offset) in enumerate(meta.tolist()):
        span = slice(start, start + slots + 1)
        if not is_device:
            assert int(num_drafts[i]) == 0
            assert torch.equal(out.input_ids[span], buffers.input_ids[span])
            assert torch.equal(out.positions[span], buffers.positions[span])
            continue
        tokens = history[hrow, :int(history_len[hrow])].tolist()
        offset = host_offset
        if src >= 0:
            tokens += previous.tokens[src, :int(previous.counts[src])].tolist()
            offset = int(previous.offsets[src])
        assert new_history[hrow, :len(tokens)].tolist() == tokens
        assert int(new_len[hrow]) == len(tokens)
        match = find_longest_ngram_match(np.array(tokens), MIN_N, MAX_N)
        drafts = [] if match is None or slots == 0 else tokens[match[1]:match[1] + min(K, slots)]
        nd = len(drafts)
        assert int(num_drafts[i]) == nd
        assert draft_ids[i].tolist() == drafts + [-1] * (K - nd)
        assert out.input_ids[span].tolist() == [tokens[-1]] + drafts + [0] * (slots - nd)
        positions = (buffers.positions[span] + offset).tolist()
        assert out.positions[span].tolist() == positions
        slot_ids = [int(buffers.block_tables[i, p // PAGE]) * PAGE + p % PAGE if t <= nd else -1
                    for t, p in enumerate(positions)]
        assert out.slot_mapping[span].tolist() == slot_ids
        assert int(out.seq_lens[i]) == int(buffers.seq_lens[i]) + offset


@pytest.mark.parametrize("seed", range(4))
def test_fix_up_takes_a_model_proposers_drafts(seed: int) -> None:
    """With a model proposer's drafts (per history row) the fix-up takes them instead of a
    prompt lookup, as many as the row's slots and the count allow; kernel and reference
    agree."""
    from sluice.spec_decode.device_ngram_kernel import launch_fix_up

    case = _case(seed)
    meta = case[0]
    num_rows = case[3].shape[0]
    generator = torch.Generator().manual_seed(seed)
    model_ids = torch.randint(0, 1000, (num_rows, K), generator=generator)
    model_counts = torch.randint(0, K + 1, (num_rows,), generator=generator)
    want = _run(fix_up_torch, case, model_drafts=(model_ids, model_counts))
    got = _run(launch_fix_up, case, model_drafts=(model_ids, model_counts))
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        assert torch.equal(getattr(want[0], name), getattr(got[0], name)), name
    for name, w, g in zip(("history_len", "draft_ids", "num_drafts"), want[2:], got[2:]):
        assert torch.equal(w, g), name
    out, _, _, draft_ids, num_drafts = want
    for i, (hrow, _src, start, slots, is_device, _offset) in enumerate(meta.tolist()):
        num = min(int(model_counts[hrow]), slots, K) if is_device else 0
        drafts = model_ids[hrow, :num].tolist()
        assert int(num_drafts[i]) == num
        assert draft_ids[i].tolist() == drafts + [-1] * (K - num)
        if is_device:
            assert out.input_ids[start + 1:start + slots + 1].tolist() == (
                drafts + [0] * (slots - num))
