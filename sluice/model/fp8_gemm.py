"""FP8 matmuls for the projections of FP8 checkpoints (sluice.model.quantization) on GPUs with
FP8 tensor cores (compute capability 8.9 and up: Ada, Hopper): y = x W^T for W float8_e4m3fn
[N, K] with its float32 scales, x and y in the model dtype.

Scales as a layer stores them (sluice.model.linear): "block": [ceil(N / GN), ceil(K / GK)], the
checkpoint's `weight_scale_inv` (GN x GK = 128 x 128 in every checkpoint seen); "channel": [N],
one per output row (a per-tensor scale is stored repeated per row, so q/k/v or gate/up merged
from per-tensor checkpoints keep one layout). W ~= fp8 * scale, element by element.

By the number of rows M (`fp8_linear`; tiles from benchmarks/tools/fp8_gemm_sweep.py on an
H200, Qwen3-8B's shapes: benchmarks/journal/2026-12-02-fp8-matmuls.md):

- **One row (decode at batch 1): weight-only.** The step is bound by reading W, so the
  kernel reads the FP8 weights (half the bf16 bytes), widens each tile in registers and
  multiplies it with x as it is: no activation quantization (no launch, no rounding of x).
  That is `_w8a16_kernel`'s one-row branch (no PDL, no split-K, no fused prologue or
  epilogues), which the sweep measured at 2.8-3.8 TB/s of FP8 weights, the 36 layers'
  products 2.11 ms against bf16 cuBLAS's 4.02. With SLUICE_FP8_ROW_KERNEL=1 (and K a
  multiple of 16) it is sluice.model.triton_gemm's one-row kernel instead (`fp8_row_mm`:
  `_row_mm_kernel` with a weight-scale mode, per output row or per block; PDL weight
  prefetch, split-K, the SiLU-and-mul prologue for the down projection
  (`fp8_silu_mul_linear`, LlamaMLP.fp8_act_down_op) and its epilogues; tiles from
  `fp8_row_config`): off by default, slower on the H200 (ROW_KERNEL below).
  Both: CUDA-core multiply-adds into a [BLOCK_N, BLOCK_K] float32 accumulator summed over K
  once; block scales scale x's K slice, since a program's rows lie in one block row.
- **More rows: W8A8.** x is quantized to FP8 at run time (`quantize_activations`: per token,
  and per GK-channel group for block-scaled weights, each group's largest magnitude mapped to
  448) and the product runs on the FP8 tensor cores: `_w8a8_kernel` up to 64 rows (where it
  beats cuBLAS's row-wise _scaled_mm per channel by 1.3-1.8x); above, per channel
  `torch._scaled_mm` with row-wise scales (cuBLAS), per block `_w8a8_kernel` (each K step's
  product times its row and column scales, added into float32), or `torch._scaled_mm` with
  block scales where `block_scaled_mm_supported` finds its product right and the weight has
  a multiple of 4 blocks along K (`block_scaled_mm_fits`). At 4 rows the
  weight-only kernel (one row a program, each row's programs reading W) is 1.3-2.8x slower
  than W8A8. Its tensor-core tiles (a tile dequantized, then 16-bit MMAs) are kept as an
  option (SLUICE_FP8_BLOCK_PREFILL=w8a16): slower than the W8A8 kernel's best tiles at 64 and
  3,000 rows.

Hopper's FP8 tensor cores keep fewer bits than float32 while summing a chain of MMAs, so the
per-channel Triton kernel (chained over all of K) differs from a float32 sum by ~2^-10
relative; the block kernel adds every K step into float32.

`fp8_linear_reference` (sluice.model.quantization.fp8_linear_reference) is the CPU reference:
the weight dequantized to x's dtype, then F.linear.

The functions take CUDA tensors, or CPU tensors under `TRITON_INTERPRET=1` (the tests). The
grids depend only on python ints, so launches can be captured in CUDA graphs.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sluice.model.quantization import FP8_MAX
from sluice.model.triton_gemm import GemmConfig
from sluice.model.triton_ops import norm_row

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# SLUICE_FP8_ROW_KERNEL=1: one-row products on triton_gemm's one-row kernel (fp8_row_mm), off by
# default: on an H200 its best tiles tie _w8a16_kernel's on q/k/v and o and lose on gate_up and
# down (29.0 / 17.6 against 26.5 / 15.5 us), and its untuned rule made the 8B batch-1 ITL
# 4.09 against 3.00 ms (benchmarks/journal/2026-12-02-pool-direct-fp8-row-pd-mps-h200.md).
ROW_KERNEL = os.environ.get("SLUICE_FP8_ROW_KERNEL", "0") == "1"

# Batches of at most this many rows run weight-only; larger ones quantize their activations.
WEIGHT_ONLY_MAX_ROWS = 1
# Smallest scale of an activation group (an all-zero row quantizes to zeros, not NaN).
_MIN_SCALE = 1e-10


class QuantizedActivations(NamedTuple):
    """Activations quantized by the op that produced them (rms_norm_quant, silu_and_mul_quant),
    for an FP8 projection that takes them (takes_quantized): float8_e4m3fn values [M, K],
    float32 scales per token [M] or per token and group [M, groups] (row-major), and the
    dtype they were computed in (the product's)."""
    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


class Fp8GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # W8A8: tiles of GROUP_M rows of tiles ordered together (L2 reuse)


@triton.jit(do_not_specialize=["M"])
def _w8a16_kernel(
    x_ptr,  # [M, K] (the model dtype)
    w_ptr,  # [N, K] float8_e4m3fn
    s_ptr,  # BLOCKWISE: [ceil(N / GROUP_N), ceil(K / GROUP_K)]; else [N] (float32)
    y_ptr,  # [M, N]
    M,
    N,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    K: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,  # BLOCKWISE: divides GROUP_N (a program's rows share a block row)
    BLOCK_M: tl.constexpr,  # 1: CUDA-core multiply-adds; else tensor-core tiles
    BLOCK_K: tl.constexpr,  # BLOCKWISE with BLOCK_M > 1: divides GROUP_K
    BLOCKWISE: tl.constexpr,
    UPCAST: tl.constexpr,  # the CPU interpreter: its 16-bit dot products are wrong
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 x: no TF32 rounding
    STAGES: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    dtype = y_ptr.dtype.element_ty
    block_row = (pid_n * BLOCK_N) // GROUP_N
    if BLOCK_M == 1:
        x_ptrs = x_ptr + pid_m.to(tl.int64) * stride_xm + offs_k
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k_start in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            k_mask = k_start + offs_k < K
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            if BLOCKWISE:
                x *= tl.load(s_ptr + block_row * stride_sn + (k_start + offs_k) // GROUP_K,
                             mask=k_mask, other=0.0)
            acc += w.to(tl.float32) * x[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        y = tl.sum(acc, axis=1)
        if not BLOCKWISE:
            y *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
        tl.store(y_ptr + pid_m.to(tl.int64) * stride_ym + offs_n, y.to(dtype), mask=n_mask)
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k_start in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            k_mask = k_start + offs_k < K
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if BLOCKWISE:  # the tile dequantized as the load-time path does: fp8 * scale,
                # rounded to the dtype (then the dot chains into one accumulator)
                scale = tl.load(s_ptr + block_row * stride_sn + k_start // GROUP_K)
                w = (w.to(tl.float32) * scale).to(dtype)
            else:
                w = w.to(dtype)
            if UPCAST:
                w = w.to(tl.float32)
                x = x.to(tl.float32)
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if not BLOCKWISE:
            acc *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
        y_ptrs = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, acc.to(dtype), mask=n_mask[:, None] & m_mask[None, :])


@triton.jit(do_not_specialize=["M"])
def _quantize_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] float8_e4m3fn
    s_ptr,  # [M, ceil(K / GROUP)] float32, at strides (stride_sm, stride_sg)
    M,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_sg,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # a power of two >= GROUP
    FP8_MAX_VALUE: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    """One program a (row, group): scale = max |x| / 448 over the group, q = x / scale."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP_PAD)
    mask = (tl.arange(0, GROUP_PAD) < GROUP) & (offs < K)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX_VALUE, MIN_SCALE)
    q = tl.clamp(x / scale, -FP8_MAX_VALUE, FP8_MAX_VALUE)
    tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + group * stride_sg, scale)


@triton.jit(do_not_specialize=["M"])
def _w8a8_kernel(
    a_ptr,  # [M, K] float8_e4m3fn (the quantized activations)
    b_ptr,  # [N, K] float8_e4m3fn (the weight)
    as_ptr,  # BLOCKWISE: [M, ceil(K / GROUP_K)]; else [M] (float32)
    bs_ptr,  # BLOCKWISE: [ceil(N / GROUP_N), ceil(K / GROUP_K)]; else [N] (float32)
    y_ptr,  # [M, N]
    M,
    N,
    stride_am,
    stride_bn,
    stride_asm,
    stride_bsn,
    stride_ym,
    K: tl.constexpr,
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # BLOCKWISE: divides GROUP_K
    GROUP_M: tl.constexpr,
    BLOCKWISE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """[BLOCK_M, BLOCK_N] of y a program, tiles ordered GROUP_M tile rows at a time."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_m, M - 1).to(tl.int64)  # out-of-range rows and columns read the last
    cols = tl.minimum(offs_n, N - 1).to(tl.int64)  # ones, and are never stored
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + cols[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_mask = k_start + offs_k < K
        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if BLOCKWISE:
            a_scale = tl.load(as_ptr + rows * stride_asm + k_start // GROUP_K)
            b_scale = tl.load(bs_ptr + (cols // GROUP_N) * stride_bsn + k_start // GROUP_K)
            acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not BLOCKWISE:
        acc *= tl.load(as_ptr + rows)[:, None] * tl.load(bs_ptr + cols)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


# ---- the launches ----------------------------------------------------------------------------


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
           block: tuple[int, int] | None) -> None:
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 weight expected, got {weight.dtype}")
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x of shape {tuple(x.shape)} (strides {x.stride()}) does not fit a "
                         f"weight of shape {tuple(weight.shape)}")
    expected = (triton.cdiv(n, block[0]), triton.cdiv(k, block[1])) if block else (n,)
    if tuple(scale.shape) != expected or scale.dtype != torch.float32:
        raise ValueError(f"scale of shape {tuple(scale.shape)} ({scale.dtype}) does not fit a "
                         f"{tuple(weight.shape)} weight scaled per "
                         f"{f'{block[0]}x{block[1]} block' if block else 'row'}: "
                         f"float32 {list(expected)} expected")


def w8a16_config(m: int, n: int, k: int, block: tuple[int, int] | None) -> Fp8GemmConfig:
    """Tiles of the weight-only kernel (benchmarks/tools/fp8_gemm_sweep.py, Qwen3-8B's shapes
    on an H200): one row a program, 8 weight rows (within a block row), all of K up to 4,096
    an iteration with 8 warps, 1,024 with 4 above (the down projection's 12,288)."""
    block_n = 8
    if block is not None:
        while block[0] % block_n:
            block_n //= 2
    if k <= 4096:
        block_k = triton.next_power_of_2(k)
        return Fp8GemmConfig(1, block_n, block_k, 8 if block_k >= 2048 else 4, 1)
    return Fp8GemmConfig(1, block_n, 1024, 4, 1)


def w8a8_config(m: int, n: int, k: int, block: tuple[int, int] | None) -> Fp8GemmConfig:
    """Tiles of the W8A8 kernel (the same sweep): up to 64 rows, tiles as tall as the batch
    (16 at least), 64 columns for wide weights (N > 4,096) else 32, 256 of K a step per
    channel and 128 per block (the block's K or less, 32 at least: the FP8 tensor cores' K);
    above, 128 by 256 by 128 of K with 8 warps (per block: 64 by 128, 4 warps)."""
    block_k = 256 if block is None else min(128, _largest_power_of_two_dividing(block[1]))
    block_k = max(block_k, 32)
    if m <= 64:
        block_m = max(16, triton.next_power_of_2(m))
        return Fp8GemmConfig(block_m, 64 if n > 4096 else 32, block_k, 4, 5)
    if block is not None:  # each K step's product is scaled into float32: smaller tiles win
        return Fp8GemmConfig(64, 128, block_k, 4, 3)
    # 128 of K a step: 3 stages of 128 x 256 tiles with 256 of K need 288 KiB of shared
    # memory, over an H200's 227 (found on one; this path runs where _scaled_mm does not:
    # fp16 / fp32 activations, dimensions not multiples of 16)
    return Fp8GemmConfig(128, 256, 128, 8, 3)


def w8a16_tile_config(m: int, n: int, k: int, block: tuple[int, int] | None
                      ) -> Fp8GemmConfig:
    """Tensor-core tiles of the weight-only kernel for many rows (block-scaled weights where
    _scaled_mm takes no block scales): 128 x 128, 64 of K (within a block), 8 warps."""
    block_k = 64 if block is None else min(64, _largest_power_of_two_dividing(block[1]))
    block_n = 128 if block is None else min(128, _largest_power_of_two_dividing(block[0]))
    return Fp8GemmConfig(128, max(block_n, 16), max(block_k, 16), 8, 3)


def _largest_power_of_two_dividing(value: int) -> int:
    return value & -value


def w8a16_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             block: tuple[int, int] | None, config: Fp8GemmConfig | None = None
             ) -> torch.Tensor:
    """x [M, K] (the model dtype) times the FP8 weight [N, K] (scaled per block or row)
    transposed -> [M, N] in x's dtype, the weight widened in registers."""
    _check(x, weight, scale, block)
    m, (n, k) = x.shape[0], weight.shape
    config = config or (w8a16_config(m, n, k, block) if m <= 64
                        else w8a16_tile_config(m, n, k, block))
    if block is not None:
        if block[0] % config.block_n or (config.block_m > 1 and block[1] % config.block_k):
            raise ValueError(f"{config} does not fit {block[0]}x{block[1]} scale blocks")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m))
    _w8a16_kernel[grid](
        x, weight, scale, out, m, n, x.stride(0), weight.stride(0),
        scale.stride(0), out.stride(0),
        K=k, GROUP_N=block[0] if block else 1, GROUP_K=block[1] if block else k,
        BLOCK_N=config.block_n, BLOCK_M=config.block_m, BLOCK_K=config.block_k,
        BLOCKWISE=block is not None, UPCAST=_INTERPRET,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", STAGES=config.num_stages,
        num_warps=config.num_warps,
    )
    return out


def fp8_row_config(n: int, k: int, block: tuple[int, int] | None, silu_mul: bool = False,
                   split_k: int = 1) -> GemmConfig | None:
    """The one-row kernel's tiles (sluice.model.triton_gemm._row_mm_kernel) for an FP8 weight
    [n, k], or None where it does not run (K not a multiple of 16: the weight-only kernel
    then). UNTUNED, a small explicit rule until a GPU sweep (benchmarks/tools/
    fp8_gemm_sweep.py times it beside _w8a16_kernel): triton_gemm.choose_config's one-row
    rule with BLOCK_K doubled, as an FP8 element is half a bf16 one's bytes (up to 4,096 of K
    an iteration, the largest power of two dividing K), 4 weight rows a program (2 with the
    SiLU prologue; halved until they divide the scale block's rows), 8 warps from 2,048 of K
    an iteration, the next tile loaded ahead by hand (num_stages 2), K not split unless
    `split_k` says (a power of two; K must then be a multiple of split_k * block_k)."""
    if k % 16 or k % split_k:
        return None
    part = k // split_k
    block_k = next((b for b in (4096, 2048, 1024, 512, 256, 128, 64, 32, 16) if part % b == 0),
                   None)
    if block_k is None:
        return None
    block_n = 2 if silu_mul else 4
    if block is not None:
        while block[0] % block_n:
            block_n //= 2
    return GemmConfig(block_n, 1, block_k, 8 if block_k >= 2048 else 4, 2, split_k, fma=True)


def fp8_row_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None, config: GemmConfig | None = None, *,
               silu_mul: bool = False, out: torch.Tensor | None = None,
               accumulate: bool = False, inv_rms_eps: float | None = None,
               gain: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (silu_mul: [M, 2K] gate and up; M is 1 in the model) times the FP8 weight [N, K]
    transposed in sluice.model.triton_gemm's one-row kernel (PDL weight prefetch, split-K, the
    SiLU-and-mul prologue and the ACCUMULATE / 1 / rms epilogues of triton_gemm.skinny_mm),
    the weight widened in registers and scaled per row or block; `gain` [K]: of x * gain
    (with `inv_rms_eps`: rms_norm(x, gain) W^T, the norm's weight kept out of the FP8
    weight). `config`: fp8_row_config's by default (ValueError where none fits)."""
    from sluice.model.triton_gemm import skinny_mm

    n, k = weight.shape
    config = config or fp8_row_config(n, k, block, silu_mul)
    if config is None:
        raise ValueError(f"no one-row FP8 tiles for a {tuple(weight.shape)} weight")
    return skinny_mm(x, weight, config, silu_mul=silu_mul, out=out, accumulate=accumulate,
                     inv_rms_eps=inv_rms_eps, weight_scale=scale, scale_block=block,
                     gain=gain)


def fp8_silu_mul_linear(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor | None:
    """layer(silu_and_mul(x)) for the FP8 down projection `layer` (a RowParallelLinear, no
    bias) in one launch, the SiLU-and-mul in the one-row kernel's prologue, for x [1, 2K]
    (LlamaMLP.fp8_act_down_op); None at other row counts or shapes (the caller then runs
    SiLU-and-mul and fp8_linear). This rank's partial sum: the caller all-reduces it."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1 or layer.bias is not None:
        return None
    n, k = layer.weight.shape
    config = fp8_row_config(n, k, layer.fp8_block, silu_mul=True) if ROW_KERNEL else None
    if config is None:
        return None
    return fp8_row_mm(x, layer.weight, layer.weight_scale, layer.fp8_block, config,
                      silu_mul=True)


def quantize_activations(x: torch.Tensor, group: int | None, column_major: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales) with x ~= q * scale: per token
    (`group` None: scales [M]) or per token and `group` channels ([M, ceil(K / group)]; with
    `column_major` stored group by group, the layout torch._scaled_mm's block scales take)."""
    m, k = x.shape
    size = k if group is None else group
    groups = triton.cdiv(k, size)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if column_major:
        scales = torch.empty((groups, m), dtype=torch.float32, device=x.device).t()
    else:
        scales = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        pad = triton.next_power_of_2(size)
        _quantize_kernel[(m, groups)](
            x, q, scales, m, x.stride(0), q.stride(0), scales.stride(0), scales.stride(1),
            K=k, GROUP=size, GROUP_PAD=pad, FP8_MAX_VALUE=FP8_MAX, MIN_SCALE=_MIN_SCALE,
            num_warps=4 if pad <= 2048 else 8,
        )
    return q, (scales.reshape(m) if group is None else scales)


def quantize_activations_reference(x: torch.Tensor, group: int | None
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations in torch ops (the tests' and gpu_check's reference)."""
    m, k = x.shape
    size = k if group is None else group
    groups = -(-k // size)
    padded = torch.zeros((m, groups * size), dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    parts = padded.reshape(m, groups, size)
    scales = (parts.abs().amax(dim=2) / FP8_MAX).clamp(min=_MIN_SCALE)
    q = (parts / scales[:, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(m, -1)[:, :k]
    q = q.to(torch.float8_e4m3fn)
    return q, (scales.reshape(m) if group is None else scales)


# ---- activations quantized by the op that computes them ------------------------------------
# An FP8 layer's W8A8 product quantizes its input in a launch of its own (read 2 bytes, write
# 1 a value), right after the RMSNorm or SiLU-and-mul that wrote it (2 bytes a value). These
# kernels compute the norm or the activation exactly as sluice.model.triton_ops does, round it
# to the activation dtype as that op's output would be, and quantize it as _quantize_kernel
# does: the same FP8 values and scales, with one launch and two passes over memory fewer.


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr,  # [T, N]
    residual_ptr,  # [T, N] (read only with HAS_RESIDUAL)
    weight_ptr,  # [N]
    q_ptr,  # [T, N] float8_e4m3fn
    s_ptr,  # [T, NUM_GROUPS] float32
    sum_ptr,  # [T, N]: x + residual (written only with HAS_RESIDUAL)
    stride_x,
    stride_residual,
    hidden_size,
    eps,
    BLOCK: tl.constexpr,  # a power of two >= N, = GROUPS_PAD * GROUP
    GROUP: tl.constexpr,  # channels a scale covers (BLOCK for one a token)
    GROUPS_PAD: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    FP8_MAX_VALUE: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    # the norm's output as triton_ops.rms_norm rounds it, then quantized group by group
    normed = norm_row(x_ptr, residual_ptr, weight_ptr, sum_ptr, row, stride_x, stride_residual,
                      hidden_size, eps, BLOCK, HAS_RESIDUAL)
    normed = normed.to(sum_ptr.dtype.element_ty).to(tl.float32)
    groups = tl.reshape(normed, (GROUPS_PAD, GROUP))
    scale = tl.maximum(tl.max(tl.abs(groups), axis=1) / FP8_MAX_VALUE, MIN_SCALE)
    q = tl.clamp(groups / scale[:, None], -FP8_MAX_VALUE, FP8_MAX_VALUE)
    q_cols = tl.reshape(cols, (GROUPS_PAD, GROUP))
    tl.store(q_ptr + row * hidden_size + q_cols, q.to(q_ptr.dtype.element_ty),
             mask=q_cols < hidden_size)
    group_ids = tl.arange(0, GROUPS_PAD)
    tl.store(s_ptr + row * NUM_GROUPS + group_ids, scale, mask=group_ids < NUM_GROUPS)


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr,  # [T, 2 * I]: gate, up
    q_ptr,  # [T, I] float8_e4m3fn
    s_ptr,  # [T, NUM_GROUPS] float32
    stride_x,
    intermediate_size,
    GROUP: tl.constexpr,  # channels a scale covers (I for one a token)
    GROUP_PAD: tl.constexpr,  # a power of two >= GROUP
    GROUPS_PER_PROGRAM: tl.constexpr,  # a power of two
    NUM_GROUPS: tl.constexpr,
    FP8_MAX_VALUE: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    """One program a (token, GROUPS_PER_PROGRAM groups)."""
    token = tl.program_id(0).to(tl.int64)
    group_ids = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    lanes = tl.arange(0, GROUP_PAD)
    cols = group_ids[:, None] * GROUP + lanes[None, :]
    mask = (lanes[None, :] < GROUP) & (cols < intermediate_size)
    dtype = x_ptr.dtype.element_ty
    gate_ptr = x_ptr + token * stride_x + cols
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + intermediate_size, mask=mask, other=0.0).to(tl.float32)
    # as triton_ops.silu_and_mul computes and rounds it
    activation = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
    y = (activation * up).to(dtype).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y), axis=1) / FP8_MAX_VALUE, MIN_SCALE)
    q = tl.clamp(y / scale[:, None], -FP8_MAX_VALUE, FP8_MAX_VALUE)
    tl.store(q_ptr + token * intermediate_size + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + token * NUM_GROUPS + group_ids, scale, mask=group_ids < NUM_GROUPS)


# Widest row quantized per token in one program (its values held in registers).
MAX_FUSED_QUANT_WIDTH = 16384


def _acts(rows: int, width: int, group: int | None, like: torch.Tensor
          ) -> QuantizedActivations:
    groups = 1 if group is None else triton.cdiv(width, group)
    return QuantizedActivations(
        torch.empty((rows, width), dtype=torch.float8_e4m3fn, device=like.device),
        torch.empty((rows, groups), dtype=torch.float32, device=like.device), like.dtype)


def _scales_shaped(acts: QuantizedActivations, group: int | None) -> QuantizedActivations:
    return acts if group is not None else acts._replace(scale=acts.scale.reshape(-1))


def rms_norm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                   eps: float, group: int | None
                   ) -> tuple[QuantizedActivations, torch.Tensor | None]:
    """triton_ops.rms_norm (residual None) or add_rms_norm's (rms_norm(x + residual),
    x + residual), the norm's output quantized as quantize_activations(., group) quantizes it:
    (QuantizedActivations, the sum or None). x: [T, N] contiguous rows."""
    rows, hidden = x.shape
    block = triton.next_power_of_2(hidden)
    size = block if group is None else group
    if block > MAX_FUSED_QUANT_WIDTH or block % size or size & (size - 1):
        raise ValueError(f"no fused norm and quantization for {hidden} channels in groups of "
                         f"{group}")
    acts = _acts(rows, hidden, group, x)
    summed = torch.empty_like(x) if residual is not None else None
    if rows:
        _rms_norm_quant_kernel[(rows,)](
            x, residual if residual is not None else x, weight, acts.q, acts.scale,
            summed if summed is not None else x, x.stride(0),
            residual.stride(0) if residual is not None else 0, hidden, eps,
            BLOCK=block, GROUP=size, GROUPS_PAD=block // size,
            NUM_GROUPS=acts.scale.shape[1], HAS_RESIDUAL=residual is not None,
            FP8_MAX_VALUE=FP8_MAX, MIN_SCALE=_MIN_SCALE,
            num_warps=max(1, min(16, block // 256)),
        )
    return _scales_shaped(acts, group), summed


def silu_and_mul_quant(x: torch.Tensor, group: int | None) -> QuantizedActivations:
    """triton_ops.silu_and_mul(x) quantized as quantize_activations(., group) quantizes it.
    x: [T, 2 * I] (gate, up) with contiguous rows."""
    rows, width = x.shape
    intermediate = width // 2
    size = intermediate if group is None else group
    pad = triton.next_power_of_2(size)
    if pad > MAX_FUSED_QUANT_WIDTH:
        raise ValueError(f"no fused SiLU and quantization for {intermediate} channels a token")
    acts = _acts(rows, intermediate, group, x)
    num_groups = acts.scale.shape[1]
    per_program = 1 if group is None else min(triton.next_power_of_2(num_groups),
                                              max(1, 1024 // pad))
    if rows:
        _silu_and_mul_quant_kernel[(rows, triton.cdiv(num_groups, per_program))](
            x, acts.q, acts.scale, x.stride(0), intermediate, GROUP=size, GROUP_PAD=pad,
            GROUPS_PER_PROGRAM=per_program, NUM_GROUPS=num_groups, FP8_MAX_VALUE=FP8_MAX,
            MIN_SCALE=_MIN_SCALE, num_warps=4 if pad * per_program <= 2048 else 8,
        )
    return _scales_shaped(acts, group)


def norm_for_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, *, target: torch.nn.Module
                 ) -> torch.Tensor | QuantizedActivations | tuple:
    """RMSNorm.quant_norm_op for a norm feeding the FP8 projection `target` (a Linear):
    the fused norm and quantization at the row counts where it pays (fuses_quantization),
    else triton_ops' norm. Returns what RMSNorm.forward does."""
    from sluice.model import triton_ops

    rows = x.reshape(-1, x.shape[-1])
    block, group = triton.next_power_of_2(x.shape[-1]), _group(target)
    # the kernel cuts its row into groups of a power of two (any block width 32 and up fits)
    fits = block <= MAX_FUSED_QUANT_WIDTH and (group is None or (
        group & (group - 1) == 0 and block % group == 0))
    if fits and fuses_quantization(rows.shape[0], target.weight, target.fp8_block, x):
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        res = None if residual is None else residual.reshape(rows.shape).contiguous()
        acts, summed = rms_norm_quant(rows, res, weight, eps, group)
        return acts if residual is None else (acts, summed.reshape(x.shape))
    if residual is None:
        return triton_ops.rms_norm(x, weight, eps)
    return triton_ops.add_rms_norm(x, residual, weight, eps)


def silu_for_fp8(x: torch.Tensor, *, target: torch.nn.Module
                 ) -> torch.Tensor | QuantizedActivations:
    """SiluAndMul.quant_op for the activation feeding the FP8 down projection `target`."""
    from sluice.model import triton_ops

    width = x.shape[-1] // 2 if target.fp8_block is None else target.fp8_block[1]
    if (fuses_quantization(x.shape[0], target.weight, target.fp8_block, x)
            and triton.next_power_of_2(width) <= MAX_FUSED_QUANT_WIDTH and x.stride(1) == 1):
        return silu_and_mul_quant(x, _group(target))
    return triton_ops.silu_and_mul(x)


def _group(target: torch.nn.Module) -> int | None:
    return None if target.fp8_block is None else target.fp8_block[1]


_BLOCK_SCALED_MM: dict[torch.device, bool] = {}


def block_scaled_mm_fits(n: int, k: int) -> bool:
    """Whether torch._scaled_mm's block scales give the right product for an [n, k] weight:
    128 x 128 blocks, and a whole number of 4 blocks along K. torch 2.11 accepts any number of
    K blocks, but on an H200 a product with 2 or 3 of them was wrong even with every scale 1
    (relative errors 0.5 and 7: cuBLAS reads the scale rows 16 bytes apart;
    benchmarks/tools/scaled_mm_block_probe.py), while 4 and 8 were right in every block."""
    return n % 128 == 0 and k % 512 == 0


def block_scaled_mm_supported(device: torch.device) -> bool:
    """Whether this torch's _scaled_mm multiplies with DeepSeek-style block scales on `device`
    (1 x 128 for the activations, 128 x 128 for the weight: cuBLAS 12.9 and up on Hopper);
    tried once per device on a small product and checked against the Triton kernel. Shapes
    must also pass block_scaled_mm_fits."""
    if device not in _BLOCK_SCALED_MM:
        ok = False
        if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
            try:
                from sluice.model.quantization import quantize_fp8

                generator = torch.Generator(device=device).manual_seed(0)
                # blocks of magnitudes 1e-2 to 10 down N and across K, and activations whose
                # 128-groups differ as much: scales read in the wrong order give a wrong
                # product (uniform ones would hide it)
                dense = torch.randn(512, 1024, device=device, generator=generator)
                dense *= torch.logspace(-2, 1, 4, device=device).repeat_interleave(128)[:, None]
                dense *= torch.logspace(1, -1, 8, device=device).repeat_interleave(128)[None]
                w, s = quantize_fp8(dense, "block")
                x = torch.randn(200, 1024, device=device, generator=generator)
                x *= torch.logspace(-1, 1, 8, device=device).repeat_interleave(128)[None]
                x *= torch.logspace(1, -1, 200, device=device)[:, None]
                x = x.to(torch.bfloat16)
                got = _block_scaled_mm(x, w, s).float()
                want = w8a16_mm(x, w, s, (128, 128)).float()
                ok = bool(((got - want).norm() / want.norm()) < 0.06)
            except RuntimeError:  # "Invalid scaling configuration" and the like
                ok = False
        _BLOCK_SCALED_MM[device] = ok
    return _BLOCK_SCALED_MM[device]


def _block_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor
                     ) -> torch.Tensor:
    """cuBLAS's block-scaled product (shapes that pass block_scaled_mm_fits); its column-major
    activation scales take whole 16-byte rows, so M is padded to a multiple of 4 (cuBLAS
    refuses 17 rows: CUBLAS_STATUS_NOT_SUPPORTED on an H200, torch 2.11)."""
    if not block_scaled_mm_fits(*weight.shape):
        raise ValueError(f"torch._scaled_mm's block scales need N a multiple of 128 and K of "
                         f"512, not a {tuple(weight.shape)} weight")
    m = x.shape[0]
    if m % 4:
        x = torch.cat([x, x.new_zeros(4 - m % 4, x.shape[1])])
    q, q_scale = quantize_activations(x, 128, column_major=True)
    y = torch._scaled_mm(q, weight.t(), scale_a=q_scale, scale_b=scale.t(), out_dtype=x.dtype)
    return y[:m] if y.shape[0] != m else y


def _w8a8_backend(x_is_cuda: bool, dtype: torch.dtype, m: int, n: int, k: int,
                  block: tuple[int, int] | None, device: torch.device) -> str:
    """w8a8_mm's default backend (its docstring)."""
    runs = (x_is_cuda and dtype == torch.bfloat16 and m > 0
            and torch.cuda.get_device_capability(device) >= (9, 0))
    if block is None:
        return "scaled_mm" if runs and k % 16 == 0 and n % 16 == 0 else "triton"
    return "scaled_mm" if (runs and block == (128, 128) and block_scaled_mm_fits(n, k)
                           and block_scaled_mm_supported(device)) else "triton"


def w8a8_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
            block: tuple[int, int] | None, config: Fp8GemmConfig | None = None,
            backend: str | None = None) -> torch.Tensor:
    """x [M, K] quantized to FP8 (per token; per token and block[1] channels with block
    scales), times the FP8 weight transposed on the FP8 tensor cores -> [M, N] in x's dtype.
    `backend` "scaled_mm" (torch._scaled_mm: cuBLAS; row-wise scales, or 128 x 128 blocks
    where block_scaled_mm_supported and block_scaled_mm_fits; bf16 out), "triton"
    (_w8a8_kernel), or None: scaled_mm where it runs (CUDA, bf16 x, dimensions multiples of
    16, or block_scaled_mm_fits with blocks), else Triton."""
    _check(x, weight, scale, block)
    m, (n, k) = x.shape[0], weight.shape
    if block is not None and block[1] < 32:
        raise ValueError(f"W8A8 needs scale blocks at least 32 wide along K, not {block[1]} "
                         "(the FP8 tensor cores multiply 32 of K at a time)")
    if backend is None:
        backend = _w8a8_backend(x.is_cuda, x.dtype, m, n, k, block, x.device)
    if backend == "scaled_mm" and block is not None:
        return _block_scaled_mm(x, weight, scale)
    q, q_scale = quantize_activations(x, block[1] if block else None)
    return _w8a8_quantized(QuantizedActivations(q, q_scale, x.dtype), weight, scale, block,
                           config, backend)


def _w8a8_quantized(acts: QuantizedActivations, weight: torch.Tensor, scale: torch.Tensor,
                    block: tuple[int, int] | None, config: Fp8GemmConfig | None,
                    backend: str) -> torch.Tensor:
    """The product of activations already quantized (row-major scales: per token [M], or
    [M, groups] per token and block[1] channels) and the FP8 weight: cuBLAS's row-wise
    _scaled_mm (per channel) or _w8a8_kernel."""
    q, q_scale, out_dtype = acts
    m, (n, k) = q.shape[0], weight.shape
    if backend == "scaled_mm":
        assert block is None, "block-scaled _scaled_mm quantizes its own activations"
        return torch._scaled_mm(q, weight.t(), scale_a=q_scale.reshape(m, 1),
                                scale_b=scale.reshape(1, n), out_dtype=out_dtype)
    config = config or w8a8_config(m, n, k, block)
    if block is not None and block[1] % config.block_k:
        raise ValueError(f"{config} does not fit {block[0]}x{block[1]} scale blocks")
    out = torch.empty((m, n), dtype=out_dtype, device=q.device)
    if m == 0:
        return out
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _w8a8_kernel[grid](
        q, weight, q_scale, scale, out, m, n, q.stride(0), weight.stride(0),
        q_scale.stride(0), scale.stride(0), out.stride(0),
        K=k, GROUP_N=block[0] if block else 1, GROUP_K=block[1] if block else k,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, BLOCKWISE=block is not None, UPCAST=_INTERPRET,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


# Block-scaled products of more than 64 rows: "auto" (_scaled_mm where block_scaled_mm_supported,
# else the Triton W8A8 kernel), or one of "scaled_mm", "triton", "w8a16" (the weight-only
# tensor-core tiles), to compare them (benchmarks).
BLOCK_PREFILL = os.environ.get("SLUICE_FP8_BLOCK_PREFILL", "auto")


def _linear_backend(m: int, weight: torch.Tensor, block: tuple[int, int] | None,
                    is_cuda: bool, dtype: torch.dtype, device: torch.device) -> str:
    """What fp8_linear runs for `m` rows: "w8a16" (weight-only), "triton" or "scaled_mm"."""
    if m <= WEIGHT_ONLY_MAX_ROWS:
        return "w8a16"
    n, k = weight.shape
    if block is None:
        return _w8a8_backend(is_cuda, dtype, m, n, k, None, device) if m > 64 else "triton"
    if m <= 64:
        return "triton"
    choice = BLOCK_PREFILL
    if choice == "auto":
        choice = "triton"
        if is_cuda and dtype == torch.bfloat16 and block == (128, 128) and (
                block_scaled_mm_fits(n, k) and block_scaled_mm_supported(device)):
            choice = "scaled_mm"
    return choice


def takes_quantized(m: int, weight: torch.Tensor, block: tuple[int, int] | None,
                    like: torch.Tensor) -> bool:
    """Whether fp8_linear of `m` rows like `like` takes activations its producer quantized
    (QuantizedActivations: row-major scales per token, or per token and block[1] channels):
    W8A8 through _w8a8_kernel or the row-wise _scaled_mm. Not weight-only rows, nor cuBLAS's
    block-scaled product, which quantizes into its own layout."""
    backend = _linear_backend(m, weight, block, like.is_cuda, like.dtype, like.device)
    return backend == "triton" or (backend == "scaled_mm" and block is None)


def fuses_quantization(m: int, weight: torch.Tensor, block: tuple[int, int] | None,
                       like: torch.Tensor) -> bool:
    """Whether the op before an FP8 projection of `m` rows quantizes for it (norm_for_fp8,
    silu_for_fp8): where the product is _w8a8_kernel (up to 64 rows per channel; block scales
    where cuBLAS takes none), not before cuBLAS's row-wise _scaled_mm. Measured on an H200
    (Qwen3-8B per channel, benchmarks/journal/2026-12-02-fp8-and-moe-beside-vllm.md): fused,
    batch-64 ITL 4.24 against 4.30 ms, but TTFT 18.1 / 52.9 against 16.5 / 50.5 ms at 1,024 /
    3,000 tokens, where the one-program-a-row kernels hold 12,288-wide rows in registers."""
    return _linear_backend(m, weight, block, like.is_cuda, like.dtype, like.device) == "triton"


def fp8_linear(x: torch.Tensor | QuantizedActivations, weight: torch.Tensor,
               scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """x [..., K] (or [M, K] already quantized, where takes_quantized) times the FP8 weight
    [N, K] transposed: weight-only up to WEIGHT_ONLY_MAX_ROWS rows, W8A8 above (the module's
    docstring)."""
    if isinstance(x, QuantizedActivations):
        m = x.q.shape[0]
        backend = _linear_backend(m, weight, block, x.q.is_cuda, x.dtype, x.q.device)
        if not (backend == "triton" or (backend == "scaled_mm" and block is None)):
            raise ValueError(f"activations quantized beforehand do not fit the {backend} "
                             f"product of {m} rows")
        return _w8a8_quantized(x, weight, scale, block, None, backend)
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    backend = _linear_backend(rows.shape[0], weight, block, rows.is_cuda, rows.dtype,
                              rows.device)
    if backend == "w8a16":
        config = fp8_row_config(*weight.shape, block) if (
            ROW_KERNEL and rows.shape[0] == 1) else None
        if config is not None:
            y = fp8_row_mm(rows, weight, scale, block, config)
        else:
            y = w8a16_mm(rows, weight, scale, block)
    else:
        y = w8a8_mm(rows, weight, scale, block, backend=backend)
    return y.reshape(*x.shape[:-1], weight.shape[0])
