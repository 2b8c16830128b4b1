"""Pieces the paged attention kernels share: tile shapes, request lookup on the device, and the
online-softmax step over one tile of keys.

Softmax runs in the log2 domain (`qk_scale = scale * log2(e)`, then `exp2`), in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sluice.attention.kv_layout import FP8_E4M3_MAX, FP8_E5M2_MAX, is_fp8

LOG2_E = math.log2(math.e)
_E4M3_MAX: tl.constexpr = tl.constexpr(FP8_E4M3_MAX)
_E5M2_MAX: tl.constexpr = tl.constexpr(FP8_E5M2_MAX)


@dataclass(frozen=True, slots=True)
class TileConfig:
    block_m: int  # rows of a query tile: query tokens x the query heads of one KV head
    block_n: int  # keys per KV tile; independent of the cache's block size
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")


# Shared memory a tile set may plan on: an H100 / H200 block gets 227 KiB, an A100 163 KiB.
SHARED_MEMORY_BUDGET = 160 * 1024


def fit_tiles(tiles: TileConfig, block_m: int, head_dim_pad: int, elem_size: int,
              min_block_m: int) -> tuple[TileConfig, int]:
    """(tiles, block_m) for float32 tiles (`elem_size` 4: a float32 cache, or a float32 model
    over an 8-bit cache, whose K/V tiles enter the dots as float32), shrunk until the query tile
    plus the pipelined K and V tiles (a rough, generous count) fit SHARED_MEMORY_BUDGET: fewer
    stages first, then narrower KV tiles, then fewer query rows. The prefill tiles of 16-bit
    caches are tuned and fit; float32 with large heads does not (128 x 128 tiles of head_dim 128
    asked 256 KiB on an H200, over its 227 KiB)."""
    if elem_size < 4:
        return tiles, block_m

    def need(m: int, n: int, stages: int) -> int:
        return (m + 2 * max(stages - 1, 1) * n) * head_dim_pad * elem_size

    m, n, stages = block_m, tiles.block_n, tiles.num_stages
    while need(m, n, stages) > SHARED_MEMORY_BUDGET:
        if stages > 2:
            stages -= 1
        elif n > 16:
            n //= 2
        elif m > min_block_m:
            m //= 2
        else:
            break
    if (m, n, stages) == (block_m, tiles.block_n, tiles.num_stages):
        return tiles, block_m
    return TileConfig(max(m, 16), n, tiles.num_warps, stages), m


@dataclass(frozen=True, slots=True)
class KernelDtypes:
    """Compile-time choices that follow from the tensors' dtypes and device."""

    # The interpreter multiplies bfloat16 bit patterns as integers, so on the CPU dot operands
    # go through float32 (values rounded exactly as on the GPU first).
    upcast_dot: bool
    # float32 models: exact products rather than TF32, so float32 matches the reference
    # tightly (whatever the cache holds: an 8-bit cache's K/V enter the dots as float32).
    dot_precision: str
    # An 8-bit cache under a 16-bit model on an NVIDIA GPU: the dots run in float16 (see
    # attend_tile), V converted by `fp8_to_fp16` as it is loaded.
    fp16_dots: bool

    @staticmethod
    def of(compute_dtype: torch.dtype, cache_dtype: torch.dtype,
           device: torch.device) -> KernelDtypes:
        """`compute_dtype`: the model's (the queries'), in which the dots run; `cache_dtype`:
        the KV cache's (or the keys', unpaged)."""
        return KernelDtypes(
            upcast_dot=device.type == "cpu",
            dot_precision="ieee" if compute_dtype == torch.float32 else "tf32",
            fp16_dots=(device.type == "cuda" and torch.version.hip is None
                       and is_fp8(cache_dtype)
                       and compute_dtype in (torch.bfloat16, torch.float16)),
        )


def group_padded(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(query heads per KV head, that rounded up to a power of two for `tl.arange`)."""
    group = num_heads // num_kv_heads
    return group, triton.next_power_of_2(group)


@triton.jit
def to_cache_dtype(x, CACHE_DTYPE: tl.constexpr):
    """`x` as the KV cache stores it (sluice.attention.kv_layout.to_cache_dtype): an 8-bit
    cache saturates at its largest finite value (float8_e4m3fn +-448, float8_e5m2 +-57344) and
    rounds to nearest even, as torch converts; any other cache dtype is a plain conversion."""
    if CACHE_DTYPE == tl.float8e4nv:
        x = _round_to_e4m3(tl.clamp(x.to(tl.float32), -_E4M3_MAX, _E4M3_MAX))
    elif CACHE_DTYPE == tl.float8e5:
        x = _round_to_e5m2(tl.clamp(x.to(tl.float32), -_E5M2_MAX, _E5M2_MAX))
    return x.to(CACHE_DTYPE)


@triton.jit
def _round_to_e4m3(x):
    """float32 within +-448 rounded to the nearest float8_e4m3fn value (ties to even), still
    float32, so the conversion after it is exact whatever route the compiler takes for it."""
    # normal values: 3 of the 23 mantissa bits kept; under 2**-6, steps of 2**-9
    normal = _keep_mantissa_bits(x, 20)
    return tl.where(tl.abs(x) < 0.015625, _round_to_step(x, 512.0, 0.001953125), normal)


@triton.jit
def _round_to_e5m2(x):
    """float32 within +-57344 rounded to the nearest float8_e5m2 value (ties to even), still
    float32 (see _round_to_e4m3)."""
    # normal values: 2 of the 23 mantissa bits kept; under 2**-14, steps of 2**-16
    normal = _keep_mantissa_bits(x, 21)
    return tl.where(tl.abs(x) < 6.103515625e-05, _round_to_step(x, 65536.0, 1.52587890625e-05),
                    normal)


@triton.jit
def _keep_mantissa_bits(x, DROPPED: tl.constexpr):
    """float32 `x` with its lowest DROPPED mantissa bits rounded away (to nearest, ties to
    even), for values whose rounding stays normal."""
    bits = x.to(tl.int32, bitcast=True)
    half: tl.constexpr = (1 << (DROPPED - 1)) - 1
    kept = (bits + half + ((bits >> DROPPED) & 1)) & -(1 << DROPPED)
    return kept.to(tl.float32, bitcast=True)


@triton.jit
def _round_to_step(x, INVERSE_STEP: tl.constexpr, STEP: tl.constexpr):
    """`x` rounded to a multiple of STEP (a power of two), ties to even: the subnormal range of
    an 8-bit format. Adding and subtracting 1.5 * 2**23 rounds to an integer, ties to even; the
    sign is put back (-0 stays -0, as torch keeps it)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((tl.abs(x) * INVERSE_STEP + 12582912.0) - 12582912.0) * STEP
    return tl.where(bits < 0, rounded * -1.0, rounded)  # -x is 0 - x: +0


@triton.jit
def fp8_to_fp16(x):
    """float8_e4m3fn or float8_e5m2 `x` as float16, exactly (every 8-bit value is a float16
    one), in PTX on four packed values: e4m3 by sm89's conversion instruction (two values
    each); e5m2 by moving each byte to the top of a 16-bit lane, where it is its float16.

    Why not `x.to(tl.float16)`: Triton moves that conversion after the tile is staged in shared
    memory for the dot, where the P @ V operand must be read transposed, and sm90 has no 8-bit
    transposing ldmatrix, so an 8-bit V tile was read back one byte at a time (128 byte loads
    per thread for a 128-key tile). This asm is declared impure, which keeps the conversion
    where it is written, so the 16-bit tile is staged and read with ldmatrix as a 16-bit
    cache's is (256 requests x 600 keys on an H100: 156 -> 136 us,
    benchmarks/journal/2026-11-28-fp8-attention-ptx-v.md). Keys need no such care: their
    operand is read untransposed."""
    bits = x.to(tl.int8, bitcast=True)
    if x.dtype == tl.float8e5:
        return tl.inline_asm_elementwise(_E5M2_TO_F16, "=r,=r,r", [bits], dtype=tl.float16,
                                         is_pure=False, pack=4)
    else:
        return tl.inline_asm_elementwise(_E4M3_TO_F16, "=r,=r,r", [bits], dtype=tl.float16,
                                         is_pure=False, pack=4)


# Four bytes in $2 to two registers of two float16 values each ($0: bytes 0, 1; $1: 2, 3).
_E4M3_TO_F16: tl.constexpr = tl.constexpr(
    "{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, $2;\n"
    "cvt.rn.f16x2.e4m3x2 $0, lo;\ncvt.rn.f16x2.e4m3x2 $1, hi;\n}")
# prmt selectors 0x5040 and 0x7060: bytes 0, 1 (then 2, 3) to the tops of the two lanes.
_E5M2_TO_F16: tl.constexpr = tl.constexpr(
    "prmt.b32 $0, 0, $2, 0x5040;\nprmt.b32 $1, 0, $2, 0x7060;")


@triton.jit
def find_tile_owner(query_start_loc_ptr, num_reqs, tile, BLOCK_Q: tl.constexpr):
    """The request whose query tiles hold `tile`: request i's tiles start at
    `query_start_loc[i] // BLOCK_Q + i`, an upper bound that keeps requests apart without a
    prefix sum over tile counts. Index `num_reqs` stands for the padding tokens after the last
    request."""
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def find_token_owner(query_start_loc_ptr, num_reqs, token):
    """The last request whose queries start at or before `token` (so requests with no queries
    are passed over); `num_reqs` for padding tokens after the last request."""
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(query_start_loc_ptr + mid) <= token:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def load_rows(ptrs, row_mask, dim_mask, MASK_ROWS: tl.constexpr, MASK_DIMS: tl.constexpr):
    """Load a [rows, HEAD_DIM_PAD] tile, masking only what may be out of range."""
    if MASK_ROWS:
        return tl.load(ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    elif MASK_DIMS:
        return tl.load(ptrs, mask=dim_mask[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def attend_tile(
    q,  # [BLOCK_M, HEAD_DIM_PAD], COMPUTE_DTYPE (float32 when UPCAST_DOT)
    m_i,  # [BLOCK_M] running max of scores, log2 domain
    l_i,  # [BLOCK_M] running sum of exp2(score - m_i)
    acc,  # [BLOCK_M, HEAD_DIM_PAD] float32, unnormalised output
    k_base,  # key cache (or keys) + this KV head's offset
    v_base,
    block_table_row,  # the request's block table row (paged)
    first_key_row,  # the request's first key row in `key` (not paged)
    tile_start,  # position of the tile's first key in the context
    seq_len,
    query_pos,  # [BLOCK_M] context position of each row's query (causal)
    key_start,  # SLIDING: the lowest key position any row may see; keys before are not loaded
    window,  # SLIDING: a row at position p sees keys at positions > p - window
    stride_block,
    stride_slot,  # paged: between slots of a block; not paged: between tokens
    dims,  # [HEAD_DIM_PAD]
    dim_mask,
    qk_scale,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
    MASK: tl.constexpr,  # keys may lie past seq_len, in some row's future or past its window
    CAUSAL: tl.constexpr,
    SLIDING: tl.constexpr,  # a sliding window bounds each row's keys from below (MASK)
    MASK_DIMS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,  # the model's dtype: q's, and that of k, v and p in the dots
    FP16_DOTS: tl.constexpr,  # KernelDtypes.fp16_dots: the dots in float16 instead
):
    pos = tile_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    in_seq = pos < seq_len
    if SLIDING:
        # Keys before the window are never read: their blocks may be freed (stale ids, another
        # request's data) or the null block, whose values need not be finite.
        in_seq = in_seq & (pos >= key_start)
    if PAGED:
        if MASK:
            block = tl.load(block_table_row + pos // PAGE_SIZE, mask=in_seq, other=0)
        else:
            block = tl.load(block_table_row + pos // PAGE_SIZE)
        rows = block.to(tl.int64) * stride_block + (pos % PAGE_SIZE) * stride_slot
    else:
        rows = (first_key_row + pos).to(tl.int64) * stride_slot
    offsets = rows[:, None] + dims[None, :]
    k = load_rows(k_base + offsets, in_seq, dim_mask, MASK, MASK_DIMS)  # [BLOCK_N, D_PAD]
    v = load_rows(v_base + offsets, in_seq, dim_mask, MASK, MASK_DIMS)
    if FP16_DOTS:
        # An 8-bit cache under a 16-bit model on a GPU: both dots in float16, which holds every
        # 8-bit value exactly and takes e4m3 in one instruction per two values (bfloat16 needs
        # three). q in float16's range converts exactly (saturated past +-65504; bfloat16
        # values under 2**-14 lose low bits, nothing next to the other products), so each
        # product in the scores is the bfloat16 dot's (exact in both; the hardware's sums may
        # differ in order); P in [0, 1] keeps 11 significant bits rather than 8. The loop runs
        # fewer instructions a key, which made a short context as fast as a bf16 cache's
        # (benchmarks/journal/2026-11-28-fp8-vs-vllm-e5m2-fp16-dots.md). q's conversion is
        # loop-invariant (hoisted).
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        k = k.to(tl.float16)
        v = fp8_to_fp16(v)
    else:
        # An 8-bit cache's keys and values in the model dtype (exact); a no-op for any other.
        k = k.to(COMPUTE_DTYPE)
        v = v.to(COMPUTE_DTYPE)
    if UPCAST_DOT:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASK:
        visible = in_seq[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= query_pos[:, None])
        if SLIDING:
            visible = visible & (pos[None, :] > query_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet keeps m = -inf; subtract 0 instead so it stays NaN-free.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)
    if UPCAST_DOT:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
