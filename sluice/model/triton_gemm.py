"""A Triton GEMM for the decoder's projections at small decode batches: y = x W^T for x [M, K]
with M at most MAX_ROWS, W [N, K] a layer's weight (nn.Linear layout).

At these sizes a projection is bound by reading W once, and cuBLAS's kernels for them are slow
to reach the bandwidth (benchmarks/journal/2026-11-22-small-batch-gemm.md). Each program
computes one [BLOCK_N, BLOCK_M] tile of y^T = W x^T: the weight rows are the tensor cores' long
side, the few batch rows the short one. When the output has too few tiles to fill the GPU, K is
split over programs (serial split-K): every split stores a float32 partial, and the last split of
a tile to arrive sums them in split order (deterministic, no second launch) and resets the
tile's arrival counter.

`silu_mul_linear` reads x as SwiGLU's [M, 2K] (gate, up) and computes `silu(gate) * up` on the
fly, rounded to the dtype as `silu_and_mul` rounds it: the down projection then needs no
activation launch and no [M, K] intermediate.

For the layers with their norms folded into the projections (LlamaModel.fold_norms) two
epilogues remove the norm launches at these sizes too: `linear_add` accumulates into its output
(the residual stream: cuBLAS's addmm with beta 1, for o_proj and down_proj), and
`inv_rms_linear` scales each output row by 1 / rms of its input row, whose squares the program
sums as it streams the row through its K loop (gate_up_proj reads the raw residual).

Which tiles (`choose_config`): at one row `_row_mm_kernel` (`GemmConfig.fma` with block_m 1:
CUDA-core multiply-adds, 4 weight rows a program, 2 under the SiLU prologue, 2,048 of K an
iteration where K has that factor, K never split), faster than the tensor-core tiles and than
cuBLAS on Qwen3-0.6B's projections and on Qwen3-8B's q/k/v and o, within 6% of cuBLAS on 8B's
gate_up and down; the tensor-core tiles up to MAX_ROWS = 16 rows, where they beat cuBLAS;
cuBLAS above, because at 32 rows the tiles that won a chain of projections lost in the model, and
at 8B's shapes they lose outright at 32 and 64 rows
(benchmarks/journal/2026-11-22-small-batch-gemm.md, 2026-11-25-short-context-decode-graphs.md,
2026-12-02-8b-prefill-and-decode.md; `benchmarks/tools/gemm_sweep.py` sweeps them).

With PDL (sluice.model.pdl) each program asks for its weight slice in L2 before it waits for the
kernel before; the CUDA-core tiles of one row also load their first weight tile into registers
then (about 1.5% at batch 1: benchmarks/journal/2026-11-27-ttft-host-work-and-gemm-preload.md).
The tensor-core tiles do not: loading ahead by hand undoes Triton's pipelining of their loop.

The one-row kernel accumulates products in a [BLOCK_N, BLOCK_K] float32 tile and sums it over K
once, after its loop: the CUDA-core tiles of `_skinny_mm_kernel` reduce across the program's
threads every iteration, which held Qwen3-8B's one-row projections to about 1.9 TB/s (the
one-row kernel: 3.2-4.0 TB/s; benchmarks/journal/2026-12-02-8b-prefill-and-decode.md).

The one-row kernel also takes FP8 weights (float8_e4m3fn) with their float32 scales, per output
row or per block (skinny_mm's weight_scale and scale_block): FP8 checkpoints' one-row products
(sluice.model.fp8_gemm.fp8_row_mm, its own tiles: fp8_gemm.fp8_row_config).

The functions take CUDA tensors, or CPU tensors under `TRITON_INTERPRET=1` (the tests). The grid
depends only on python ints, so a launch can be captured in a CUDA graph. The split-K counters
are one buffer per device: launches that split K must not run concurrently on two streams.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sluice.model.pdl import line_elems, lines_pad, pdl_wait, prefetch_l2, use_pdl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Batches of at most this many rows run here; larger ones in cuBLAS.
MAX_ROWS = 16
# K is split until the launch has about this many programs (the H200 has 132 SMs).
TARGET_PROGRAMS = 128
MAX_SPLIT_K = 8
# Arrival counters: one per output tile of a split launch.
MAX_SPLIT_TILES = 4096


class GemmConfig(NamedTuple):
    block_n: int
    block_m: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    # Products on the CUDA cores (float32 multiply-adds) instead of the tensor cores: tiles
    # narrower than tl.dot's 16 (block_n 4 over o_proj's 1024 weight rows is 256 programs
    # without splitting K), for a few batch rows (block_m 1 to 4). With block_m 1 the one-row
    # kernel runs (_row_mm_kernel), and num_stages says how its loop loads the weights: 1
    # plainly, 2 each next tile ahead by hand (the first before the PDL wait), 3 or more
    # through Triton's pipelining over that many stages.
    fma: bool = False



@triton.jit
def silu_mul_operand(gate, up, dtype: tl.constexpr):
    """A GEMM's operand from float32 gate and up as silu_and_mul rounds it: silu(gate) rounded
    to `dtype`, times up, rounded again (the prologue of every kernel that fuses SiLU-and-mul
    into its down projection)."""
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype)

@triton.jit(do_not_specialize=["M"])  # one compiled variant for every batch size
def _skinny_mm_kernel(
    x_ptr,  # [M, K], or [M, 2K] (gate, up) with SILU_MUL
    w_ptr,  # [N, K]
    y_ptr,  # [M, N]
    partial_ptr,  # [SPLIT_K, M, N] float32 (SPLIT_K > 1)
    counter_ptr,  # [>= tiles] int32, zero between launches (SPLIT_K > 1)
    M,
    N,
    eps,  # INV_RMS: the folded norm's epsilon
    stride_xm,
    stride_wn,
    stride_ym,
    K: tl.constexpr,  # a model dimension: one compiled variant per layer shape
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SILU_MUL: tl.constexpr,
    ACCUMULATE: tl.constexpr,  # y += x W^T (y holds the residual stream)
    INV_RMS: tl.constexpr,  # y = (x W^T) / rms(x) per row (SPLIT_K 1: a program sees all of K)
    UPCAST: tl.constexpr,  # the CPU interpreter: its 16-bit dot products are wrong
    FMA: tl.constexpr,  # multiply-adds in float32 on the CUDA cores, not tl.dot (GemmConfig.fma)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs: no TF32 rounding
    USE_PDL: tl.constexpr,  # programmatic dependent launch (sluice.model.pdl)
    LINE_ELEMS: tl.constexpr,  # USE_PDL: weight elements per L2 line
    LINES_PAD: tl.constexpr,  # USE_PDL: a power of two >= the L2 lines of a row's K_PART
    PRELOAD: tl.constexpr,  # weight tiles loaded one iteration ahead, the first before the wait
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    K_PART: tl.constexpr = K // SPLIT_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * K_PART + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    if USE_PDL:
        # This program's weight slice, on its way to L2 while the kernel before still runs
        # (weights are written by no kernel); the loop below then reads it from L2.
        line_k = tl.minimum(tl.arange(0, LINES_PAD) * LINE_ELEMS, K_PART - 1)
        rows = tl.minimum(offs_n, N - 1).to(tl.int64) * stride_wn
        prefetch_l2(w_ptr + rows[:, None] + (pid_k * K_PART + line_k)[None, :])
    if PRELOAD:
        # The CUDA-core tiles (GemmConfig.fma): the first weight tile into registers before the
        # wait too, so that with PDL its bytes arrive while the kernel before still runs; the
        # loop then loads each next tile one iteration ahead. (With the tensor-core tiles this
        # defeats Triton's pipelining of the loop: slower, see the module's docstring.)
        w_next = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
    pdl_wait(USE_PDL)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    dtype = y_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    sum_squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k_start in range(0, K_PART, BLOCK_K):
        if PRELOAD:
            w = w_next
            w_next = tl.load(w_ptrs + BLOCK_K,
                             mask=n_mask[:, None] & (k_start + BLOCK_K < K_PART), other=0.0)
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        if SILU_MUL:
            gate = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0).to(tl.float32)
            up = tl.load(x_ptrs + K, mask=m_mask[:, None], other=0.0).to(tl.float32)
            x = silu_mul_operand(gate, up, dtype)
        else:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        if INV_RMS:
            x32 = x.to(tl.float32)
            sum_squares += tl.sum(x32 * x32, axis=1)
        if FMA:
            products = w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :]
            acc += tl.sum(products, axis=2)
        else:
            if UPCAST:
                w = w.to(tl.float32)
                x = x.to(tl.float32)
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out_mask = n_mask[:, None] & m_mask[None, :]
    y_ptrs = y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    if INV_RMS:  # rms_norm's 1 / rms: mean of the squares over the row, in float32
        acc = acc * (1.0 / tl.sqrt(sum_squares / K + eps))[None, :]
    if SPLIT_K == 1:
        if ACCUMULATE:
            acc += tl.load(y_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, acc.to(dtype), mask=out_mask)
    else:
        tile_offs = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        tl.store(partial_ptr + pid_k * M * N + tile_offs, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is stored before the release below
        counter = counter_ptr + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last split of this tile: the others are visible
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for split in range(SPLIT_K):
                total += tl.load(partial_ptr + split * M * N + tile_offs, mask=out_mask,
                                 cache_modifier=".cg")
            if ACCUMULATE:
                total += tl.load(y_ptrs, mask=out_mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, total.to(dtype), mask=out_mask)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["M"])
def _row_mm_kernel(
    x_ptr,  # [M, K], or [M, 2K] (gate, up) with SILU_MUL
    w_ptr,  # [N, K]
    y_ptr,  # [M, N]
    partial_ptr,  # [SPLIT_K, M, N] float32 (SPLIT_K > 1)
    counter_ptr,  # [>= tiles] int32, zero between launches (SPLIT_K > 1)
    M,
    N,
    eps,
    stride_xm,
    stride_wn,
    stride_ym,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SILU_MUL: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    INV_RMS: tl.constexpr,
    USE_PDL: tl.constexpr,
    LINE_ELEMS: tl.constexpr,
    LINES_PAD: tl.constexpr,
    PRELOAD: tl.constexpr,  # each next weight tile loaded one iteration ahead by hand, the
                            # first before the PDL wait (num_stages 2)
    STAGES: tl.constexpr,  # num_stages 3 or more: the loop pipelined by Triton instead
    s_ptr=None,  # SCALE_MODE 1: [N]; 2: [ceil(N / GROUP_N), ceil(K / GROUP_K)] (float32)
    stride_sn=0,
    SCALE_MODE: tl.constexpr = 0,  # FP8 weights: 0 none, 1 per output row, 2 per block
    GROUP_N: tl.constexpr = 1,  # SCALE_MODE 2: rows of a scale block (BLOCK_N divides it)
    GROUP_K: tl.constexpr = 1,  # SCALE_MODE 2: columns of a scale block
    g_ptr=None,  # GAIN: [K], an input-side gain (an RMSNorm's weight not folded into W)
    GAIN: tl.constexpr = False,  # x[k] * g[k] (after INV_RMS's squares, which are of x)
):
    """One batch row a program (GemmConfig.fma with block_m 1): BLOCK_N weight rows times the
    row, multiply-adds in float32 into a [BLOCK_N, BLOCK_K] accumulator that is summed over K
    once, after the loop (no reduction across threads per iteration).

    FP8 weights (float8_e4m3fn, sluice.model.fp8_gemm): each tile widened to float32 in
    registers. SCALE_MODE 1 scales each output row's sum by its row's scale (before the split-K
    partial or the ACCUMULATE add); SCALE_MODE 2 scales x's element k by the scale of
    (the program's block row, k // GROUP_K) inside the loop (a program's BLOCK_N rows lie in one
    block row; any BLOCK_K: the scales are gathered per element)."""
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    pid_k = tl.program_id(2)
    K_PART: tl.constexpr = K // SPLIT_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * K_PART + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    if USE_PDL:
        line_k = tl.minimum(tl.arange(0, LINES_PAD) * LINE_ELEMS, K_PART - 1)
        rows = tl.minimum(offs_n, N - 1).to(tl.int64) * stride_wn
        prefetch_l2(w_ptr + rows[:, None] + (pid_k * K_PART + line_k)[None, :])
    if PRELOAD:
        w_next = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
    pdl_wait(USE_PDL)
    x_ptrs = x_ptr + row.to(tl.int64) * stride_xm + offs_k
    dtype = y_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    block_row = (pid_n * BLOCK_N) // GROUP_N  # SCALE_MODE 2
    for k_start in tl.range(0, K_PART, BLOCK_K, num_stages=1 if STAGES < 3 else STAGES):
        if PRELOAD:
            w = w_next
            w_next = tl.load(w_ptrs + BLOCK_K,
                             mask=n_mask[:, None] & (k_start + BLOCK_K < K_PART), other=0.0)
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        if SILU_MUL:
            gate = tl.load(x_ptrs).to(tl.float32)
            up = tl.load(x_ptrs + K).to(tl.float32)
            x = silu_mul_operand(gate, up, dtype).to(tl.float32)
        else:
            x = tl.load(x_ptrs).to(tl.float32)
        if INV_RMS:
            squares += x * x
        if GAIN:
            x *= tl.load(g_ptr + offs_k + k_start).to(tl.float32)
        if SCALE_MODE == 2:
            x *= tl.load(s_ptr + block_row * stride_sn + (offs_k + k_start) // GROUP_K)
        acc += w.to(tl.float32) * x[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    y_ptrs = y_ptr + row.to(tl.int64) * stride_ym + offs_n
    if SCALE_MODE == 1:
        y *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)
    if INV_RMS:
        y = y * (1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps))
    if SPLIT_K == 1:
        if ACCUMULATE:
            y += tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, y.to(dtype), mask=n_mask)
    else:
        tile_offs = row.to(tl.int64) * N + offs_n
        tl.store(partial_ptr + pid_k * M * N + tile_offs, y, mask=n_mask)
        tl.debug_barrier()
        counter = counter_ptr + row * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for split in range(SPLIT_K):
                total += tl.load(partial_ptr + split * M * N + tile_offs, mask=n_mask,
                                 cache_modifier=".cg")
            if ACCUMULATE:
                total += tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, total.to(dtype), mask=n_mask)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """The split-K arrival counters of a device: zero between launches (each launch's last
    programs reset their tiles'), so one buffer serves every launch on the stream. Allocated on
    first use, outside any CUDA graph's pool when a warm-up runs before capture."""
    counters = _COUNTERS.get(device)
    if counters is None:
        counters = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def choose_config(m: int, n: int, k: int, silu_mul: bool = False,
                  split_k: bool = True) -> GemmConfig | None:
    """The configuration for an [m, k] x [n, k]^T product, or None to leave it to cuBLAS (more
    than MAX_ROWS rows, or K not a multiple of 16).

    One row (_row_mm_kernel): 4 weight rows a program (2 with the SiLU prologue), up to 2,048
    of K an iteration (8 warps at 2,048, else 4), the next tile loaded ahead by hand, K never
    split.
    More rows: 16-row tiles; 64-wide weight tiles, 32-wide when fewer than 96 tiles would
    leave SMs idle (not with the SiLU prologue, whose cost grows with the number of tiles);
    128 of K per iteration (less where K has no such factor: tiny test models); then, unless
    `split_k` is False, K split in two until about TARGET_PROGRAMS programs, each over at
    least 256 of K."""
    if m > MAX_ROWS or m < 1 or k % 16:
        return None
    if m == 1:
        block_k = next(b for b in (2048, 1024, 512, 256, 128, 64, 32, 16) if k % b == 0)
        block_n = 2 if silu_mul else 4
        return GemmConfig(block_n, 1, block_k, 8 if block_k >= 2048 else 4, 2, 1, fma=True)
    block_k = next(b for b in (128, 64, 32, 16) if k % b == 0)
    block_m = 16
    m_tiles = triton.cdiv(m, block_m)
    block_n = 64
    if not silu_mul and triton.cdiv(n, 64) * m_tiles < 96:
        block_n = 32
    programs = triton.cdiv(n, block_n) * m_tiles
    split = 1
    while (split_k and programs * split * 2 <= TARGET_PROGRAMS and split < MAX_SPLIT_K
           and k % (2 * split * block_k) == 0 and k // (2 * split) >= 256):
        split *= 2
    return GemmConfig(block_n, block_m, block_k, 4, 5, split)


def skinny_mm(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig,
              silu_mul: bool = False, out: torch.Tensor | None = None,
              accumulate: bool = False, inv_rms_eps: float | None = None,
              weight_scale: torch.Tensor | None = None,
              scale_block: tuple[int, int] | None = None,
              gain: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (silu_mul: [M, 2K] gate and up), weight [N, K] -> x W^T [M, N] in x's dtype;
    into `out` (its first M rows) when given, added to what it holds with `accumulate`; with
    `inv_rms_eps`, each row scaled by 1 / sqrt(mean(x_row^2) + eps) (a split-K config cannot:
    no program sees the whole row).

    FP8 weights (float8_e4m3fn, one-row configs only: _row_mm_kernel) take `weight_scale`:
    float32 [N] per output row (`scale_block` None), or [ceil(N / GN), ceil(K / GK)] per
    `scale_block` (GN, GK) block (config.block_n must divide GN); W ~= fp8 * scale.

    `gain` [K] (one-row configs, no SiLU-and-mul): the product of x * gain, gain an RMSNorm's
    weight kept out of W (FP8 weights cannot take it without quantizing again); with
    `inv_rms_eps` the rms is of x itself: rms_norm(x, gain) W^T in one launch."""
    m = x.shape[0]
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"x of shape {tuple(x.shape)} does not fit a weight of shape "
                         f"{tuple(weight.shape)}{' with SiLU-and-mul' if silu_mul else ''}")
    if gain is not None and (not (config.fma and config.block_m == 1) or silu_mul
                             or tuple(gain.shape) != (k,) or gain.stride(0) != 1):
        raise ValueError(f"a gain takes a contiguous [{k}] vector, a one-row config and no "
                         f"SiLU-and-mul, not {tuple(gain.shape)} with {config}")
    fp8 = weight.dtype == torch.float8_e4m3fn
    if fp8:
        if not (config.fma and config.block_m == 1):
            raise ValueError(f"FP8 weights run only in the one-row kernel, not with {config}")
        expected = ((n,) if scale_block is None else
                    (triton.cdiv(n, scale_block[0]), triton.cdiv(k, scale_block[1])))
        if (weight_scale is None or tuple(weight_scale.shape) != expected
                or weight_scale.dtype != torch.float32 or weight_scale.stride(-1) != 1):
            raise ValueError(f"an FP8 weight of shape {tuple(weight.shape)} needs float32 "
                             f"scales {list(expected)}")
        if scale_block is not None and scale_block[0] % config.block_n:
            raise ValueError(f"{config} does not fit {scale_block[0]}x{scale_block[1]} scale "
                             "blocks (block_n must divide the block's rows)")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"x is {x.dtype}: FP8 weights multiply 16- or 32-bit activations")
    elif weight_scale is not None:
        raise ValueError(f"scales given for a {weight.dtype} weight")
    elif x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but the weight is {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("skinny_mm needs the rows of x and of the weight contiguous")
    if k % (config.split_k * config.block_k):
        raise ValueError(f"K={k} is not a multiple of split_k * block_k of {config}")
    if not config.fma and min(config.block_n, config.block_m, config.block_k) < 16:
        raise ValueError(f"tensor-core tiles are at least 16 wide: {config} (or set fma)")
    if inv_rms_eps is not None and (config.split_k > 1 or silu_mul):
        raise ValueError(f"1 / rms needs whole plain rows: not with {config}"
                         f"{' and SiLU-and-mul' if silu_mul else ''}")
    if out is None:
        if accumulate:
            raise ValueError("accumulate needs an out tensor to add to")
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif (out.dim() != 2 or out.shape[0] < m or out.shape[1] != n or out.stride(1) != 1
          or out.dtype != x.dtype or out.device != x.device):
        raise ValueError(f"out of shape {tuple(out.shape)} ({out.dtype}) cannot take the "
                         f"[{m}, {n}] {x.dtype} product")
    if m == 0:
        return out
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), config.split_k)
    if config.split_k > 1:
        if grid[0] * grid[1] > MAX_SPLIT_TILES:
            raise ValueError(f"{grid[0] * grid[1]} output tiles: more than {MAX_SPLIT_TILES}")
        partial = torch.empty((config.split_k, m, n), dtype=torch.float32, device=x.device)
        counters = _counters(x.device)
    else:
        partial = counters = out  # not read
    pdl = use_pdl(x, "gemm")
    if config.fma and config.block_m == 1:
        _row_mm_kernel[grid](
            x, weight, out, partial, counters, m, n,
            0.0 if inv_rms_eps is None else inv_rms_eps,
            x.stride(0), weight.stride(0), out.stride(0),
            K=k, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
            SILU_MUL=silu_mul, ACCUMULATE=accumulate, INV_RMS=inv_rms_eps is not None,
            USE_PDL=pdl, LINE_ELEMS=line_elems(weight),
            LINES_PAD=lines_pad(k // config.split_k, weight),
            PRELOAD=config.num_stages == 2, STAGES=max(1, config.num_stages),
            s_ptr=weight_scale if fp8 else out,
            stride_sn=weight_scale.stride(0) if fp8 else 0,
            SCALE_MODE=0 if not fp8 else (1 if scale_block is None else 2),
            GROUP_N=scale_block[0] if fp8 and scale_block else 1,
            GROUP_K=scale_block[1] if fp8 and scale_block else 1,
            g_ptr=gain if gain is not None else out, GAIN=gain is not None,
            num_warps=config.num_warps, launch_pdl=pdl,
        )
        return out if out.shape[0] == m else out[:m]
    _skinny_mm_kernel[grid](
        x, weight, out, partial, counters, m, n, 0.0 if inv_rms_eps is None else inv_rms_eps,
        x.stride(0), weight.stride(0), out.stride(0),
        K=k, BLOCK_N=config.block_n, BLOCK_M=config.block_m, BLOCK_K=config.block_k,
        SPLIT_K=config.split_k, SILU_MUL=silu_mul, ACCUMULATE=accumulate,
        INV_RMS=inv_rms_eps is not None, UPCAST=_INTERPRET, FMA=config.fma,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        USE_PDL=pdl, LINE_ELEMS=line_elems(weight),
        LINES_PAD=lines_pad(k // config.split_k, weight),
        PRELOAD=config.fma,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
    )
    return out if out.shape[0] == m else out[:m]


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) for x [..., K]: here for small batches, else cuBLAS."""
    rows = x.reshape(-1, x.shape[-1])
    config = choose_config(rows.shape[0], weight.shape[0], weight.shape[1])
    if config is None or rows.stride(-1) != 1:
        return F.linear(x, weight)
    return skinny_mm(rows, weight, config).reshape(*x.shape[:-1], weight.shape[0])


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(silu_and_mul(x), weight) for x [T, 2K] (gate, up): in one launch for small
    batches, else the SiLU-and-mul kernel and cuBLAS."""
    config = choose_config(x.shape[0], weight.shape[0], weight.shape[1], silu_mul=True)
    if config is None or x.dim() != 2 or x.stride(1) != 1:
        from sluice.model.triton_ops import silu_and_mul

        return F.linear(silu_and_mul(x), weight)
    return skinny_mm(x, weight, config, silu_mul=True)


def linear_add(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, accumulate: bool = True,
               silu_mul: bool = False) -> None:
    """out = x W^T, or out += x W^T with `accumulate`, in place, for x [T, K] (silu_mul: x is
    [T, 2K] gate and up, and the product is of silu_and_mul(x)): the folded layers' o_proj and
    down_proj adding into the residual stream (RowParallelLinear.add_to). Small batches in one
    launch here, others in cuBLAS (addmm, beta 1 or 0)."""
    config = choose_config(x.shape[0], weight.shape[0], weight.shape[1], silu_mul=silu_mul)
    if config is not None and x.dim() == 2 and x.stride(1) == 1:
        skinny_mm(x, weight, config, silu_mul=silu_mul, out=out, accumulate=accumulate)
        return
    if silu_mul:
        from sluice.model.triton_ops import silu_and_mul

        x = silu_and_mul(x)
    out[: x.shape[0]].addmm_(x, weight.t(), beta=1 if accumulate else 0)


def inv_rms_linear(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """(x W^T) / rms(x) per row for a small batch x [T, K] (the folded layers' gate_up_proj on
    the raw residual: rms_norm(x) (W diag g)^T with g in W), or None where this kernel does not
    run (more than MAX_ROWS rows): the caller then applies 1 / rms in the SiLU kernel."""
    config = choose_config(x.shape[0], weight.shape[0], weight.shape[1], split_k=False)
    if config is None or x.dim() != 2 or x.stride(1) != 1:
        return None
    return skinny_mm(x, weight, config, inv_rms_eps=eps)
