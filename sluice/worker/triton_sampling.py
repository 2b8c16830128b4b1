"""Fused temperature / greedy sampling: one read of the [B, V] logits, in their own dtype.

Per row, the sampled token is
- greedy rows (temperature < 1e-5): argmax_v logits[v], ties to the lowest index (torch.argmax);
- random rows: argmax_v logits[v] / T - log(E_v) with E_v ~ Exp(1) i.i.d., the exponential race
  (Gumbel-max: -log E is Gumbel), which draws exactly from softmax(logits / T). A -inf logit
  scores -inf whatever its noise, so a masked token is never drawn.

Randomness. E_v comes from Philox keyed by the row's 64-bit seed (the host builds one per row and
launch, see sampling_inputs.build_row_seeds). One Philox call gives four 32-bit words, so a chunk
of BLOCK columns is read as four quarters of Q = BLOCK / 4 columns: the call at counter c (a
column of the chunk's first quarter) feeds columns c, c + Q, c + 2Q and c + 3Q. That is a quarter
of the integer work of one call per column, which would otherwise bound the kernel (10 rounds of
~10 integer ops per call, against 2 bytes read per bf16 column). A column's draw depends only on
(seed, column, BLOCK): never on the batch, nor on how the row is split below.

Logs. Random rows score log2(e) * (logits / T - ln E), the same order as the race, so that only
base-2 logs appear: on the GPU libdevice's approximate log2 (one MUFU op, where the exact log
costs ~40 instructions). With two logs and a quarter Philox call per column, arithmetic rather
than the one read of the logits is what bounds the kernel.

Grid. One program per (row, split): a row's chunks are cut into `num_splits` runs of whole chunks
(so the draws above do not move), each program keeping a running (score, column) per lane; with
more than one split, a second tiny kernel merges the runs' maxima per row. At large batch one
program per row fills the GPU, but at B = 1..8 a row of 151,936 columns (38 chunks) on one SM
would run all its Philox work in sequence while the other SMs idle: `choose_num_splits` aims at
about four programs per SM (B = 1..14: a chunk per program; B = 256: three per row; B >= 528:
one). Chunks per split is a run-time argument, so batch sizes compile no new variants.

Ties: each lane takes a strictly better score only, visiting its columns in increasing order, so
it keeps its lowest column among equal scores; the final reduction takes the lowest column among
the lanes (and the splits) holding the maximum. NaN logits are never taken (every comparison with
NaN is false), where torch.argmax would return them.
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
_PROGRAMS_PER_SM = 4
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


@triton.jit(do_not_specialize=["chunks_per_split", "num_splits"])
def _race_kernel(
    logits_ptr,  # [B, V] float32 / bfloat16 / float16, unit column stride
    temperature_ptr,  # [B] float32
    seeds_ptr,  # [B] int64
    sampled_ptr,  # [B] int64 (one split)
    partial_score_ptr,  # [B, num_splits] float32 (several splits)
    partial_col_ptr,  # [B, num_splits] int32
    vocab_size,
    stride_logits_row,
    chunks_per_split,
    num_splits,
    SPLIT: tl.constexpr,
    GREEDY_BELOW: tl.constexpr,
    FAST_LOG: tl.constexpr,  # libdevice's approximate log2 (GPU); the interpreter has none
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_logits = logits_ptr + row.to(tl.int64) * stride_logits_row
    first_col = split * chunks_per_split * BLOCK
    num_chunks = tl.minimum(chunks_per_split, tl.cdiv(vocab_size - first_col, BLOCK))
    temperature = tl.load(temperature_ptr + row)
    if temperature < GREEDY_BELOW:
        best, best_col = _race_run(row_logits, first_col, num_chunks, vocab_size, 0, 1.0,
                                   False, FAST_LOG, BLOCK)
    else:
        seed = tl.load(seeds_ptr + row)
        best, best_col = _race_run(row_logits, first_col, num_chunks, vocab_size, seed,
                                   LOG2_E / temperature, True, FAST_LOG, BLOCK)
    score = tl.max(best, axis=0)
    col = tl.min(tl.where(best == score, best_col, _NO_COLUMN), axis=0)
    if SPLIT:
        tl.store(partial_score_ptr + row * num_splits + split, score)
        tl.store(partial_col_ptr + row * num_splits + split, col)
    else:
        tl.store(sampled_ptr + row, col.to(tl.int64))


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    partial_score_ptr,  # [B, num_splits] float32
    partial_col_ptr,  # [B, num_splits] int32
    sampled_ptr,  # [B] int64
    num_splits,
    SPLITS_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    splits = tl.arange(0, SPLITS_PAD)
    mask = splits < num_splits
    score = tl.load(partial_score_ptr + row * num_splits + splits, mask=mask,
                    other=float("-inf"))
    col = tl.load(partial_col_ptr + row * num_splits + splits, mask=mask, other=_NO_COLUMN)
    best = tl.max(score, axis=0)
    tl.store(sampled_ptr + row, tl.min(tl.where(score == best, col, _NO_COLUMN), axis=0)
             .to(tl.int64))


def choose_num_splits(num_rows: int, vocab_size: int, num_sms: int, block: int = BLOCK) -> int:
    """Programs per row: enough that the batch gives about _PROGRAMS_PER_SM programs per SM,
    each with a whole number of chunks (at least one)."""
    num_chunks = triton.cdiv(vocab_size, block)
    wanted = triton.cdiv(_PROGRAMS_PER_SM * num_sms, max(num_rows, 1))
    return _split_evenly(num_chunks, wanted)[1]


def _split_evenly(num_chunks: int, wanted: int) -> tuple[int, int]:
    """(chunks per split, splits) for at most `wanted` splits, none of them empty."""
    chunks_per_split = triton.cdiv(num_chunks, max(1, min(wanted, num_chunks)))
    return chunks_per_split, triton.cdiv(num_chunks, chunks_per_split)


def sample_tokens(
    logits: torch.Tensor,  # [B, V] float32 / bfloat16 / float16
    temperature: torch.Tensor,  # [B] float32; < 1e-5 = greedy
    seeds: torch.Tensor,  # [B] int64 Philox keys (random rows)
    num_splits: int = 1,
    block: int = BLOCK,
) -> torch.Tensor:
    """[B] int64 sampled token ids (see the module docstring). `block` (a power of two, at
    least 4) sets the columns per chunk and so the columns each Philox call feeds: rows sample
    the same tokens for the same block, whatever num_splits."""
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1, "logits need unit column stride"
    assert block >= 4 and block & (block - 1) == 0, block
    sampled = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return sampled
    temperature = temperature.to(torch.float32).contiguous()
    seeds = seeds.to(torch.int64).contiguous()
    chunks_per_split, num_splits = _split_evenly(triton.cdiv(vocab_size, block), num_splits)
    split = num_splits > 1
    partial_score = partial_col = sampled  # unused with one split
    if split:
        partial_score = torch.empty(num_rows, num_splits, dtype=torch.float32,
                                    device=logits.device)
        partial_col = torch.empty(num_rows, num_splits, dtype=torch.int32, device=logits.device)
    _race_kernel[(num_rows, num_splits)](
        logits, temperature, seeds, sampled, partial_score, partial_col,
        vocab_size, logits.stride(0), chunks_per_split, num_splits,
        SPLIT=split, GREEDY_BELOW=GREEDY_BELOW, FAST_LOG=logits.is_cuda, BLOCK=block,
        num_warps=4,
    )
    if split:
        _merge_kernel[(num_rows,)](partial_score, partial_col, sampled, num_splits,
                                   SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=1)
    return sampled
