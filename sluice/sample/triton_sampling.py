"""Fused temperature / greedy sampling: one read of the [B, V] logits, in their own dtype.

Per row, the sampled token is
- greedy rows (temperature < 1e-5): argmax_v logits[v], ties to the lowest index (torch.argmax);
- random rows: a draw from softmax(logits / T), by the exponential race (Gumbel-max) in two
  levels. The vocabulary is cut into chunks of BLOCK columns, with softmax masses
  S_c = sum_{v in c} exp(logits[v] / T). First the chunks race: c* = argmax_c ln S_c - ln E_c;
  then the columns of c* alone: argmax_{v in c*} logits[v] / T - ln E_v, with every E ~ Exp(1)
  i.i.d. The first race picks c with probability S_c / sum S, the second v with S_v / S_c*
  (S_v = exp(logits[v] / T)), so v comes out with probability exactly softmax(logits / T)_v:
  the one-level race over all V columns, for V / BLOCK + BLOCK exponentials instead of V. (The
  one-level race, one Philox word per column, was bound by the Philox integer work:
  benchmarks/journal/2026-11-22-two-level-sampling.md.) A -inf logit has no mass and scores -inf
  whatever its noise, so a masked token is never drawn; a NaN logit is taken as -inf.

Kernels. `_chunk_kernel`, one program per (row, chunk): the chunk's log2 S_c (random rows) or
its maximum and lowest argmax column (greedy rows), the one read of the logits; as many programs
as chunks per row (38 for Qwen3) keeps the GPU busy at batch 1 too. `_pick_kernel`, one per row:
the chunk race (or the greedy rows' best chunk), then the race over the chosen chunk's columns,
which reads those BLOCK logits again.

Randomness. Every E comes from Philox keyed by the row's 64-bit seed (the host builds one per
row and launch, see sampling_inputs.build_row_seeds). Column v's: one Philox call gives four
32-bit words, so a chunk's columns are four quarters of Q = BLOCK / 4: the call at counter c (a
column of the chunk's first quarter) feeds columns c, c + Q, c + 2Q and c + 3Q. Chunk c's: the
first word of the call at counter CHUNK_COUNTER + c, above every column's counter. A draw
depends only on (seed, column or chunk, BLOCK), never on the batch.

Logs. Scores are in base 2 (log2(e) * (x / T - ln E), the same order), so only base-2 logs and
exponentials appear: on the GPU libdevice's approximate log2 (one MUFU op, where the exact log
costs ~40 instructions) for the exponentials' logs.

Ties: each lane takes a strictly better score only, visiting its columns in increasing order, so
it keeps its lowest column among equal scores; each reduction takes the lowest column (or chunk)
among those holding the maximum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# Columns per chunk: four Philox quarters of 1024 (8 bf16 per thread with 4 warps: 16-byte loads).
BLOCK = 4096
# Greedy is temperature below this (as SamplingParams.greedy).
GREEDY_BELOW = 1e-5
# Philox counters of the chunks' draws: above every column's counter (columns < 2^30).
MAX_VOCAB = 1 << 30
CHUNK_COUNTER = tl.constexpr(MAX_VOCAB)
_NO_COLUMN = tl.constexpr(2**31 - 1)
LOG2_E = tl.constexpr(1.4426950408889634)


@triton.jit
def _log2(x, FAST: tl.constexpr):
    if FAST:
        y = libdevice.fast_log2f(x)  # one MUFU op, where the exact log2 takes ~40 instructions
    else:
        y = tl.log2(x)
    return y


@triton.jit
def _neg_log2_uniform(bits, FAST: tl.constexpr):
    """-log2(u) = E / ln 2 (E ~ Exp(1)) from 32 random bits: u = (k + 1/2) / 2^23, k the top 23
    bits, so 0 < u < 1 exactly in float32 (u = 1 would give E = 0 and an infinite score). Near
    u = 1 an approximate log2 has no relative accuracy left (log2 u ~ 0), so there the result comes
    from the series -ln(1 - w) = w + w^2/2 + w^3/3 (times log2 e) with w = 1 - u exact (truncation
    below float32 rounding for w < 2^-7)."""
    k = (bits >> 9).to(tl.float32)
    u = (k + 0.5) * (1.0 / 8388608.0)
    w = (8388607.5 - k) * (1.0 / 8388608.0)
    series = w * (1.0 + w * (0.5 + w * (1.0 / 3.0))) * LOG2_E
    return tl.where(w < 0.0078125, series, -_log2(u, FAST))


@triton.jit
def _take_quarter(row_logits, cols, vocab_size, bits, scale, best, best_col,
                  RANDOM: tl.constexpr, FAST_LOG: tl.constexpr):
    """Lane-wise: score columns `cols` and keep the strictly better of (score, best). Random
    rows score log2(e) * (logits / T - ln E) (scale = log2(e) / T), which orders the columns as
    the race does, in base-2 logs only."""
    score = tl.load(row_logits + cols, mask=cols < vocab_size, other=float("-inf"),
                    eviction_policy="evict_first").to(tl.float32)
    if RANDOM:
        score = score * scale - _log2(_neg_log2_uniform(bits, FAST_LOG), FAST_LOG)
    better = score > best
    return tl.where(better, score, best), tl.where(better, cols, best_col)


@triton.jit
def _race_run(row_logits, first_col, num_chunks, vocab_size, seed, scale,
              RANDOM: tl.constexpr, FAST_LOG: tl.constexpr, BLOCK: tl.constexpr):
    """Lane-wise best (score, column) over `num_chunks` chunks from `first_col`."""
    QUARTER: tl.constexpr = BLOCK // 4
    lanes = tl.arange(0, QUARTER)
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    best_col = tl.zeros([QUARTER], tl.int32) + first_col
    for chunk in range(num_chunks):
        cols = first_col + chunk * BLOCK + lanes
        if RANDOM:
            bits0, bits1, bits2, bits3 = tl.randint4x(seed, cols)
        else:
            bits0, bits1, bits2, bits3 = cols, cols, cols, cols  # unused
        best, best_col = _take_quarter(row_logits, cols, vocab_size, bits0, scale,
                                       best, best_col, RANDOM, FAST_LOG)
        best, best_col = _take_quarter(row_logits, cols + QUARTER, vocab_size, bits1, scale,
                                       best, best_col, RANDOM, FAST_LOG)
        best, best_col = _take_quarter(row_logits, cols + 2 * QUARTER, vocab_size, bits2, scale,
                                       best, best_col, RANDOM, FAST_LOG)
        best, best_col = _take_quarter(row_logits, cols + 3 * QUARTER, vocab_size, bits3, scale,
                                       best, best_col, RANDOM, FAST_LOG)
    return best, best_col


@triton.jit(do_not_specialize=["num_chunks"])
def _chunk_kernel(
    logits_ptr,  # [B, V] float32 / bfloat16 / float16, unit column stride
    temperature_ptr,  # [B] float32
    chunk_score_ptr,  # [B, num_chunks] float32
    chunk_col_ptr,  # [B, num_chunks] int32 (greedy rows)
    vocab_size,
    stride_logits_row,
    num_chunks,
    GREEDY_BELOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One chunk of one row: a greedy row's chunk maximum and its lowest column; a random
    row's log2 of the chunk's softmax mass, log2(sum_v 2^(log2(e) x_v / T)), -inf when the
    chunk is all -inf."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_logits_row + cols,
                mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("-inf"))  # a NaN logit is never drawn
    out = row * num_chunks + chunk
    temperature = tl.load(temperature_ptr + row)
    if temperature < GREEDY_BELOW:
        best = tl.max(x, axis=0)
        tl.store(chunk_score_ptr + out, best)
        tl.store(chunk_col_ptr + out, tl.min(tl.where(x == best, cols, _NO_COLUMN), axis=0))
    else:
        y = x * (LOG2_E / temperature)
        peak = tl.max(y, axis=0)
        # All -inf: no mass; a +inf logit: all of it (y - peak would be NaN for both).
        infinite = tl.abs(peak) == float("inf")
        mass = tl.sum(tl.exp2(y - tl.where(infinite, 0.0, peak)), axis=0)
        weight = tl.where(infinite, peak, peak + tl.log2(tl.where(infinite, 1.0, mass)))
        tl.store(chunk_score_ptr + out, weight)


@triton.jit(do_not_specialize=["num_chunks"])
def _pick_kernel(
    logits_ptr,  # [B, V]
    temperature_ptr,  # [B] float32
    seeds_ptr,  # [B] int64
    chunk_score_ptr,  # [B, num_chunks] float32
    chunk_col_ptr,  # [B, num_chunks] int32
    sampled_ptr,  # [B] int64
    vocab_size,
    stride_logits_row,
    num_chunks,
    GREEDY_BELOW: tl.constexpr,
    FAST_LOG: tl.constexpr,  # libdevice's approximate log2 (GPU); the interpreter has none
    BLOCK: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
):
    """One row: the greedy row's best chunk (the lowest among equal maxima) gives its column;
    a random row races its chunks by their masses, then the columns of the winning chunk."""
    row = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS_PAD)
    scores = tl.load(chunk_score_ptr + row * num_chunks + chunks, mask=chunks < num_chunks,
                     other=float("-inf"))
    temperature = tl.load(temperature_ptr + row)
    if temperature < GREEDY_BELOW:
        best = tl.max(scores, axis=0)
        chunk = tl.min(tl.where(scores == best, chunks, _NO_COLUMN), axis=0)
        col = tl.load(chunk_col_ptr + row * num_chunks + chunk)
    else:
        seed = tl.load(seeds_ptr + row)
        bits, _, _, _ = tl.randint4x(seed, chunks + CHUNK_COUNTER)
        scores = scores - _log2(_neg_log2_uniform(bits, FAST_LOG), FAST_LOG)
        best = tl.max(scores, axis=0)
        chunk = tl.min(tl.where(scores == best, chunks, _NO_COLUMN), axis=0)
        row_logits = logits_ptr + row.to(tl.int64) * stride_logits_row
        lane_best, lane_col = _race_run(row_logits, chunk * BLOCK, 1, vocab_size, seed,
                                        LOG2_E / temperature, True, FAST_LOG, BLOCK)
        top = tl.max(lane_best, axis=0)
        col = tl.min(tl.where(lane_best == top, lane_col, _NO_COLUMN), axis=0)
    tl.store(sampled_ptr + row, col.to(tl.int64))


def sample_tokens(
    logits: torch.Tensor,  # [B, V] float32 / bfloat16 / float16
    temperature: torch.Tensor,  # [B] float32; < 1e-5 = greedy
    seeds: torch.Tensor,  # [B] int64 Philox keys (random rows)
    block: int = BLOCK,
) -> torch.Tensor:
    """[B] int64 sampled token ids (see the module docstring). `block` (a power of two, at
    least 4) sets the columns per chunk, and so the draws: rows sample the same tokens for the
    same block whatever their batch."""
    num_rows, vocab_size = logits.shape
    if vocab_size >= MAX_VOCAB:
        raise ValueError(f"vocabulary size must be below {MAX_VOCAB}, got {vocab_size}")
    assert logits.stride(1) == 1, "logits need unit column stride"
    assert block >= 4 and block & (block - 1) == 0, block
    sampled = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return sampled
    temperature = temperature.to(torch.float32).contiguous()
    seeds = seeds.to(torch.int64).contiguous()
    num_chunks = triton.cdiv(vocab_size, block)
    chunk_score = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_col = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    _chunk_kernel[(num_rows, num_chunks)](
        logits, temperature, chunk_score, chunk_col, vocab_size, logits.stride(0), num_chunks,
        GREEDY_BELOW=GREEDY_BELOW, BLOCK=block, num_warps=4,
    )
    _pick_kernel[(num_rows,)](
        logits, temperature, seeds, chunk_score, chunk_col, sampled, vocab_size,
        logits.stride(0), num_chunks, GREEDY_BELOW=GREEDY_BELOW, FAST_LOG=logits.is_cuda,
        BLOCK=block, CHUNKS_PAD=max(16, triton.next_power_of_2(num_chunks)), num_warps=4,
    )
    return sampled
