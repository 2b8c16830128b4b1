"""The experts of a mixture-of-experts layer (sluice.model.moe) in two grouped GEMM launches, with
static shapes, so a step can be captured in a CUDA graph:

1. `align_by_expert`: the T * top_k (token, slot) pairs sorted by expert (a stable order) and
   laid out in blocks of BLOCK_M rows, each expert's run padded to a whole number of blocks;
   every block names its expert, blocks past the last run name none (-1) and do nothing. The
   buffers are as large as the worst case (T * top_k + E * (BLOCK_M - 1) rows), so their sizes
   depend on T alone, with no host sync: one Triton program up to ALIGN_KERNEL_MAX_PAIRS pairs,
   torch's sort above.
2. `_moe_gemm_kernel` over the blocks: gate/up: [BLOCK_M, 2I] = x[token] W13[e]^T into the
   pair's row of an intermediate [T * top_k, 2I]; down: SiLU-and-mul of that row on the fly
   (rounded as silu_and_mul rounds), times W2[e]^T, times the pair's routing weight, into the
   pair's row of [T * top_k, H];
3. the top_k rows of a token summed.

Few pairs (decode at batch 1 or 2: up to PAIR_KERNEL_MAX_PAIRS) skip the alignment and its ~12
small launches: `_moe_pair_kernel` runs one program per (pair, BLOCK_N rows of the expert's
weight), multiply-adds into a [BLOCK_N, BLOCK_K] float32 accumulator summed over K once (the
one-row GEMM's design, sluice.model.triton_gemm), where the grouped GEMM would spend a 16-row
tensor-core tile on each pair.

`fused_route` is sluice.model.moe.route (softmax over the experts in float32, top k,
renormalized) in one launch, a program per token: in a Qwen3-30B-A3B decode step the torch ops
of routing and alignment were ~15 launches a layer, ~2 ms of a 7.6 ms batch-1 step on an H200
(benchmarks/journal/2026-12-02-fp8-and-moe-beside-vllm.md).

`fused_experts` is what sluice.model.moe.experts_reference computes. FP8 experts (an FP8
checkpoint's, sluice.model.moe.FusedMoE.use_fp8) take the same two paths, weight-only (W8A16:
decode reads the weights, so half their bytes is what counts; x stays in its dtype): the
`SCALES` branch of each kernel loads FP8 tiles and applies per-row or per-block scales
(`WeightScales`). The kernels run on CUDA tensors, or CPU tensors under TRITON_INTERPRET=1
(tests/kernels/test_triton_moe.py).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sluice.model.moe import ExpertScales
from sluice.model.triton_gemm import silu_mul_operand

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# The GEMM kernels' SCALES: b in a's dtype, or FP8 with float32 scales per output row (per
# channel) or per block of GROUP_N rows x GROUP_K columns.
NO_SCALES = tl.constexpr(0)
PER_ROW = tl.constexpr(1)
BLOCKWISE = tl.constexpr(2)

# Up to this many (token, expert) pairs, the pair kernel (no alignment): batch 1 and 2 of a
# model with 8 experts a token. Two pairs of one expert read its weight twice; at 16 pairs of 128
# experts about one pair in 16 shares one. On an H200 Qwen3-30B-A3B's batch-1 step runs its
# experts at 3.2 TB/s this way (benchmarks/journal/2026-12-02-moe-tiles-pd-ipc-pool-h200.md).
PAIR_KERNEL_MAX_PAIRS = 16
# Up to this many pairs the alignment is one program of ALIGN_CHUNK-pair chunks (batch 512 of 8
# experts a token); more go through torch's sort. On an H200 the chunked mode (ALIGN_MODES) beat
# it from 64 tokens up: the tuned file names the mode per pair count.
ALIGN_KERNEL_MAX_PAIRS = 4096
ALIGN_CHUNK = 128
# How align_by_expert runs: "kernel" (`_align_kernel`, one program: its chunks one after the
# other), "chunks" (three launches of a program per chunk: `_chunk_counts_kernel`,
# `_chunk_offsets_kernel`, `_chunk_scatter_kernel`) or "torch" (a stable sort); the same output.
ALIGN_MODES = ("kernel", "chunks", "torch")

# Tuned tiles of the grouped path per GPU model, written by benchmarks/tools/moe_sweep.py on that
# GPU (as vLLM ships its fused-MoE configs): `<device name, spaces as _>.json`, keyed by
# `moe_shape_key`, then by a count of (token, expert) pairs. A step takes the entry of the
# smallest count >= its pairs (else the largest); shapes, dtypes or GPUs without an entry, and
# FP8 experts, keep the heuristic tiles of `_heuristic_config`.
CONFIG_DIR = Path(__file__).parent / "moe_configs"


class GemmTiles(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


class MoeTiles(NamedTuple):
    """The grouped path's tiles: the alignment's block_m (both GEMMs), each GEMM's tiles, and
    how the alignment runs (ALIGN_MODES)."""
    block_m: int
    gate_up: GemmTiles
    down: GemmTiles
    align: str = "kernel"


def moe_shape_key(num_experts: int, hidden: int, inter: int, top_k: int,
                  dtype: torch.dtype) -> str:
    return f"E={num_experts},H={hidden},I={inter},top_k={top_k},{str(dtype).split('.')[-1]}"


def parse_tiles(entry: dict, where: str) -> MoeTiles:
    try:
        tiles = MoeTiles(int(entry["block_m"]), GemmTiles(*map(int, entry["gate_up"])),
                         GemmTiles(*map(int, entry["down"])), str(entry.get("align", "kernel")))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: a tuned MoE entry needs block_m, gate_up and down "
                         f"([block_n, block_k, num_warps, num_stages]), got {entry!r}") from exc
    if tiles.align not in ALIGN_MODES:
        raise ValueError(f"{where}: align {tiles.align!r} is none of {ALIGN_MODES}")
    return tiles


@functools.cache
def load_tuned(path: Path) -> dict[str, list[tuple[int, MoeTiles]]]:
    """{shape key: [(pairs, tiles), ...] ascending} from one tuned file; {} if there is none."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
        shapes = raw["shapes"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a tuned MoE config file ({exc})") from exc
    return {key: sorted((int(pairs), parse_tiles(entry, f"{path} [{key}][{pairs}]"))
                        for pairs, entry in buckets.items())
            for key, buckets in shapes.items()}


def tuned_file(device: torch.device) -> Path:
    return CONFIG_DIR / (torch.cuda.get_device_name(device).replace(" ", "_") + ".json")


def tuned_tiles(buckets: list[tuple[int, MoeTiles]], pairs: int) -> MoeTiles:
    for count, tiles in buckets:
        if pairs <= count:
            return tiles
    return buckets[-1][1]


def _heuristic_config(pairs: int, num_experts: int, n13: int, hidden: int, inter: int,
                      scales: WeightScales | None) -> MoeTiles:
    def tiles(n: int, k: int) -> GemmTiles:
        block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
        return GemmTiles(block_n, _block_k(k, scales), 4, 3)
    return MoeTiles(16 if pairs <= 16 * num_experts else 64, tiles(n13, hidden),
                    tiles(hidden, inter), "kernel" if pairs <= ALIGN_KERNEL_MAX_PAIRS else "torch")


def moe_tiles(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              scales: WeightScales | None) -> MoeTiles:
    """The grouped path's tiles for this call: tuned (CUDA, weights in x's dtype, an entry for
    the shape in this GPU's file) or heuristic."""
    pairs = x.shape[0] * top_k
    num_experts, n13, hidden = w13.shape
    inter = w2.shape[2]
    if x.is_cuda and scales is None:
        buckets = load_tuned(tuned_file(x.device)).get(
            moe_shape_key(num_experts, hidden, inter, top_k, x.dtype))
        if buckets:
            return tuned_tiles(buckets, pairs)
    return _heuristic_config(pairs, num_experts, n13, hidden, inter, scales)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    mode: str = "kernel") -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted pair ids [P] (pair = token * k + slot; T * k marks padding),
    each block's expert [P / block_m] (-1: no expert)), P = T * k + E * (block_m - 1) rounded
    up to block_m. Up to ALIGN_KERNEL_MAX_PAIRS pairs in one launch (`_align_kernel`), more
    through torch's sort (`align_by_expert_reference`, the same output)."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    if pairs == 0 or mode == "torch" or (mode == "kernel" and pairs > ALIGN_KERNEL_MAX_PAIRS):
        return align_by_expert_reference(topk_ids, num_experts, block_m)
    capacity = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_ids = torch.empty((capacity,), dtype=torch.int64, device=flat.device)
    block_expert = torch.empty((capacity // block_m,), dtype=torch.int64, device=flat.device)
    if mode == "chunks":
        return _align_in_chunks(flat.contiguous(), sorted_ids, block_expert, num_experts,
                                block_m)
    _align_kernel[(1,)](
        flat.contiguous(), sorted_ids, block_expert, pairs, capacity, E=num_experts,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_M=block_m, CHUNK=ALIGN_CHUNK,
        num_warps=8,
    )
    return sorted_ids, block_expert


@triton.jit
def _padding_and_block_experts(sorted_ptr, block_expert_ptr, padded_end, num_pairs, capacity,
                               E: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Every row of the sorted pairs marked padding (num_pairs), and each block's expert: the
    first whose padded run ends past the block's first row (a searchsorted), -1 past the last."""
    lanes = tl.arange(0, CHUNK)
    for start in range(0, capacity, CHUNK):
        tl.store(sorted_ptr + start + lanes, num_pairs, mask=start + lanes < capacity)
    num_blocks = capacity // BLOCK_M
    for start in range(0, num_blocks, CHUNK):
        blocks = start + lanes
        expert = tl.sum((padded_end[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32),
                        axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(expert < E, expert, -1),
                 mask=blocks < num_blocks)


@triton.jit(do_not_specialize=["num_pairs", "capacity"])
def _align_kernel(
    ids_ptr,  # [num_pairs] each pair's expert
    sorted_ptr,  # [capacity] int64
    block_expert_ptr,  # [capacity / BLOCK_M] int64
    num_pairs,
    capacity,
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """align_by_expert_reference in one program: each expert's pair count (a histogram), its
    run's start (padded to whole blocks), each block's expert, then every pair written at its
    run's start plus the number of earlier pairs of its expert (a stable order)."""
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        mask = start + lanes < num_pairs
        ids = tl.load(ids_ptr + start + lanes, mask=mask, other=0).to(tl.int32)
        counts += tl.histogram(ids, BLOCK_E, mask=mask)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)  # experts past E: nothing, so the total
    padded_start = padded_end - padded
    _padding_and_block_experts(sorted_ptr, block_expert_ptr, padded_end, num_pairs, capacity,
                               E, BLOCK_M, CHUNK)
    tl.debug_barrier()  # the padding is written before the pairs overwrite it
    seen = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        mask = start + lanes < num_pairs
        ids = tl.load(ids_ptr + start + lanes, mask=mask, other=BLOCK_E).to(tl.int32)
        mine = ids[:, None] == experts[None, :]
        base = tl.sum(tl.where(mine, (padded_start + seen)[None, :], 0), axis=1)
        earlier = tl.sum(((ids[None, :] == ids[:, None])
                          & (lanes[None, :] < lanes[:, None])).to(tl.int32), axis=1)
        tl.store(sorted_ptr + base + earlier, start + lanes, mask=mask)
        seen += tl.sum(mine.to(tl.int32), axis=0)


def align_by_expert_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """align_by_expert through torch ops (a stable sort): many pairs, and the kernel's test."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    device = flat.device
    capacity = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    run_start = torch.cumsum(counts, 0) - counts
    experts_sorted = flat[order]
    rank = torch.arange(pairs, device=device) - run_start[experts_sorted]
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int64, device=device)
    sorted_ids[(padded_end - padded)[experts_sorted] + rank] = order
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_ids, block_expert


def _align_in_chunks(flat: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                     num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """align_by_expert with a program per ALIGN_CHUNK pairs: each chunk's histogram; one
    program's prefix over chunks (every chunk's first row per expert, the blocks' experts, the
    padding); each chunk's pairs written at their row."""
    pairs = flat.numel()
    chunks = triton.cdiv(pairs, ALIGN_CHUNK)
    block_e = triton.next_power_of_2(num_experts)
    counts = torch.empty((chunks, block_e), dtype=torch.int32, device=flat.device)
    _chunk_counts_kernel[(chunks,)](flat, counts, pairs, BLOCK_E=block_e, CHUNK=ALIGN_CHUNK)
    _chunk_offsets_kernel[(1,)](counts, sorted_ids, block_expert, pairs, chunks,
                                sorted_ids.numel(), E=num_experts, BLOCK_E=block_e,
                                BLOCK_M=block_m, CHUNK=ALIGN_CHUNK, num_warps=8)
    _chunk_scatter_kernel[(chunks,)](flat, counts, sorted_ids, pairs, BLOCK_E=block_e,
                                     CHUNK=ALIGN_CHUNK)
    return sorted_ids, block_expert


@triton.jit(do_not_specialize=["num_pairs"])
def _chunk_counts_kernel(ids_ptr, counts_ptr, num_pairs, BLOCK_E: tl.constexpr,
                         CHUNK: tl.constexpr):
    chunk = tl.program_id(0)
    lanes = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = lanes < num_pairs
    ids = tl.load(ids_ptr + lanes, mask=mask, other=0).to(tl.int32)
    tl.store(counts_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E),
             tl.histogram(ids, BLOCK_E, mask=mask))


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "capacity"])
def _chunk_offsets_kernel(counts_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_chunks,
                          capacity, E: tl.constexpr, BLOCK_E: tl.constexpr,
                          BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Per expert, its padded run's start; then counts[c, e] is overwritten with chunk c's first
    row of expert e (the run's start plus the pairs of e in chunks before c)."""
    experts = tl.arange(0, BLOCK_E)
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c in range(0, num_chunks):
        total += tl.load(counts_ptr + c * BLOCK_E + experts)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    row = padded_end - padded
    for c in range(0, num_chunks):
        here = tl.load(counts_ptr + c * BLOCK_E + experts)
        tl.store(counts_ptr + c * BLOCK_E + experts, row)
        row += here
    _padding_and_block_experts(sorted_ptr, block_expert_ptr, padded_end, num_pairs, capacity,
                               E, BLOCK_M, CHUNK)


@triton.jit(do_not_specialize=["num_pairs"])
def _chunk_scatter_kernel(ids_ptr, rows_ptr, sorted_ptr, num_pairs, BLOCK_E: tl.constexpr,
                          CHUNK: tl.constexpr):
    chunk = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    lanes = chunk * CHUNK + offs
    mask = lanes < num_pairs
    ids = tl.load(ids_ptr + lanes, mask=mask, other=BLOCK_E).to(tl.int32)
    # (Padding lanes name expert BLOCK_E: no column, and they are not stored.)
    base = tl.load(rows_ptr + chunk * BLOCK_E + ids, mask=mask, other=0)
    earlier = tl.sum(((ids[None, :] == ids[:, None])
                      & (offs[None, :] < offs[:, None])).to(tl.int32), axis=1)
    tl.store(sorted_ptr + base + earlier, lanes, mask=mask)


class WeightScales(NamedTuple):
    """One FP8 expert stack's scales as sluice.model.moe.FusedMoE holds them: `scale` [E, N]
    per row (`block` None), or per block [E, halves * ceil(N / halves / GN), ceil(K / GK)]:
    w13 stacks gate rows then up rows (halves 2), each part's blocks counted from its own first
    row, so a part of rows not a multiple of GN keeps its blocks; w2 is one part."""
    scale: torch.Tensor
    block: tuple[int, int] | None
    halves: int


def _fp8_scale_args(b: torch.Tensor, scales: WeightScales | None
                    ) -> tuple[torch.Tensor, tuple[int, int, int, int], dict[str, int]]:
    """The GEMM kernels' scale arguments for weight `b` [E, N, K]: (s_ptr, (stride_se,
    stride_sn, HALF_N, HALF_BLOCKS), constexprs); b itself as an unread s_ptr without scales."""
    e, n, k = b.shape
    if scales is None:
        return b, (0, 0, n, 1), dict(SCALES=NO_SCALES.value, GROUP_N=1, GROUP_K=1)
    if b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"FP8 expert weights expected with scales, got {b.dtype}")
    scale, block, halves = scales
    half_n = n // halves
    if block is None:
        expected = (e, n)
        half_blocks = 1
    else:
        half_blocks = triton.cdiv(half_n, block[0])
        expected = (e, halves * half_blocks, triton.cdiv(k, block[1]))
    if tuple(scale.shape) != expected or scale.dtype != torch.float32 or scale.stride(-1) != 1:
        raise ValueError(f"scales of shape {list(scale.shape)} ({scale.dtype}) do not fit FP8 "
                         f"experts {list(b.shape)} per {block or 'row'}: {list(expected)} "
                         "float32 expected")
    if block is None:
        return scale, (scale.stride(0), 0, half_n, 1), dict(SCALES=PER_ROW.value, GROUP_N=1,
                                                            GROUP_K=1)
    return scale, (scale.stride(0), scale.stride(1), half_n, half_blocks), dict(
        SCALES=BLOCKWISE.value, GROUP_N=block[0], GROUP_K=block[1])


@triton.jit
def _scale_rows(rows, HALF_N, HALF_BLOCKS, GROUP_N: tl.constexpr):
    """Weight rows -> their block rows of the scales (WeightScales: each part's own blocks)."""
    return (rows // HALF_N) * HALF_BLOCKS + (rows % HALF_N) // GROUP_N


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(
    a_ptr,  # [rows, K] (SILU_MUL: [rows, 2K], gate then up)
    b_ptr,  # [E, N, K]
    c_ptr,  # [num_pairs, N]
    weights_ptr,  # [num_pairs] routing weights (MUL_WEIGHT)
    sorted_ids_ptr,  # [P]
    block_expert_ptr,  # [P / BLOCK_M]
    s_ptr,  # FP8 b's float32 scales (SCALES: _fp8_scale_args), else unread
    num_pairs,
    N,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    stride_se,
    stride_sn,
    HALF_N,
    HALF_BLOCKS,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    A_ROW_PER_PAIR: tl.constexpr,  # a's rows are pairs (the intermediate), else tokens (x)
    SILU_MUL: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # SCALES == BLOCKWISE: divides GROUP_K
    UPCAST: tl.constexpr,  # the CPU interpreter: its 16-bit dot products are wrong
    DOT_PRECISION: tl.constexpr,
    SCALES: tl.constexpr,  # NO_SCALES (b in a's dtype), PER_ROW or BLOCKWISE (b FP8)
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= 0:
        ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = ids < num_pairs
        if A_ROW_PER_PAIR:
            rows = ids
        else:
            rows = ids // TOP_K
        rows = tl.where(valid, rows, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
        b_ptrs = (b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
                  + offs_k[:, None])
        dtype = c_ptr.dtype.element_ty
        s_ptrs = s_ptr + expert.to(tl.int64) * stride_se
        if SCALES == BLOCKWISE:
            s_ptrs += _scale_rows(offs_n, HALF_N, HALF_BLOCKS, GROUP_N) * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_start in range(0, K, BLOCK_K):
            k_mask = k_start + offs_k < K
            a_mask = valid[:, None] & k_mask[None, :]
            if SILU_MUL:
                gate = tl.load(a_ptrs, mask=a_mask, other=0.0).to(tl.float32)
                up = tl.load(a_ptrs + K, mask=a_mask, other=0.0).to(tl.float32)
                a = silu_mul_operand(gate, up, dtype)
            else:
                a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if SCALES != NO_SCALES:  # FP8 values are exact in 16 bits: the scale comes after
                b = b.to(dtype)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if SCALES == BLOCKWISE:  # the K step lies in one block column
                scale = tl.load(s_ptrs + k_start // GROUP_K, mask=n_mask, other=0.0)
                acc += tl.dot(a, b, input_precision=DOT_PRECISION) * scale[None, :]
            else:
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if SCALES == PER_ROW:
            acc *= tl.load(s_ptrs + offs_n, mask=n_mask, other=0.0)[None, :]
        if MUL_WEIGHT:
            acc *= tl.load(weights_ptr + ids, mask=valid, other=0.0).to(tl.float32)[:, None]
        c_ptrs = c_ptr + tl.where(valid, ids, 0).to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(dtype), mask=valid[:, None] & n_mask[None, :])


def _block_k(k: int, scales: WeightScales | None = None) -> int:
    block_k = max(16, min(64, triton.next_power_of_2(k)))
    if scales is not None and scales.block is not None:  # a K step in one block column
        block_k = min(block_k, scales.block[1] & -scales.block[1])
    return block_k


def _gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, weights: torch.Tensor,
          sorted_ids: torch.Tensor, block_expert: torch.Tensor, top_k: int, block_m: int,
          a_row_per_pair: bool, silu_mul: bool, mul_weight: bool,
          scales: WeightScales | None = None, tiles: GemmTiles | None = None) -> None:
    n, k = b.shape[1], b.shape[2]
    if tiles is None:
        tiles = GemmTiles(64 if n >= 64 else max(16, triton.next_power_of_2(n)),
                          _block_k(k, scales), 4, 3)
    grid = (block_expert.numel(), triton.cdiv(n, tiles.block_n))
    s, s_args, s_consts = _fp8_scale_args(b, scales)
    _moe_gemm_kernel[grid](
        a, b, out, weights, sorted_ids, block_expert, s, out.shape[0], n,
        a.stride(0), b.stride(0), b.stride(1), out.stride(0), *s_args,
        K=k, TOP_K=top_k, A_ROW_PER_PAIR=a_row_per_pair, SILU_MUL=silu_mul,
        MUL_WEIGHT=mul_weight, BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        UPCAST=_INTERPRET, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **s_consts,
    )


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E]
    weights_ptr,  # [T, TOP_K] (the logits' dtype)
    ids_ptr,  # [T, TOP_K] int64
    E,
    stride_t,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOP: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    x = tl.load(logits_ptr + t * stride_t + offs, mask=mask, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(mask, p, 0.0)
    p = p / tl.sum(p, axis=0)
    slots = tl.arange(0, BLOCK_TOP)
    picked = tl.zeros((BLOCK_TOP,), dtype=tl.float32)
    picked_ids = tl.zeros((BLOCK_TOP,), dtype=tl.int64)
    for i in tl.static_range(TOP_K):  # the largest left, the lowest id among equals
        best = tl.max(p, axis=0)
        best_id = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)
        picked = tl.where(slots == i, best, picked)
        picked_ids = tl.where(slots == i, best_id, picked_ids)
        p = tl.where(offs == best_id, -1.0, p)
    if RENORMALIZE:
        picked = picked / tl.sum(picked, axis=0)
    top = slots < TOP_K
    tl.store(weights_ptr + t * TOP_K + slots, picked.to(weights_ptr.dtype.element_ty), mask=top)
    tl.store(ids_ptr + t * TOP_K + slots, picked_ids, mask=top)


def fused_route(router_logits: torch.Tensor, top_k: int, renormalize: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """sluice.model.moe.route in one launch: router_logits [T, E] -> (weights [T, top_k] in the
    logits' dtype, expert ids [T, top_k] int64), largest first."""
    t, experts = router_logits.shape
    if not 0 < top_k <= experts:
        raise ValueError(f"top_k must be in 1..{experts} (the experts), got {top_k}")
    weights = torch.empty((t, top_k), dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=router_logits.device)
    if t:
        if router_logits.stride(1) != 1:
            router_logits = router_logits.contiguous()
        _route_kernel[(t,)](
            router_logits, weights, ids, experts, router_logits.stride(0), TOP_K=top_k,
            BLOCK_E=triton.next_power_of_2(experts), BLOCK_TOP=triton.next_power_of_2(top_k),
            RENORMALIZE=renormalize, num_warps=1 if experts <= 256 else 4,
        )
    return weights, ids


@triton.jit
def _moe_pair_kernel(
    a_ptr,  # [rows, K] (SILU_MUL: [rows, 2K], gate then up)
    b_ptr,  # [E, N, K]
    c_ptr,  # [num_pairs, N]
    weights_ptr,  # [num_pairs] routing weights (MUL_WEIGHT)
    ids_ptr,  # [num_pairs] each pair's expert
    s_ptr,  # FP8 b's float32 scales (SCALES: _fp8_scale_args), else unread
    N,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    stride_se,
    stride_sn,
    HALF_N,
    HALF_BLOCKS,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    A_ROW_PER_PAIR: tl.constexpr,  # a's rows are pairs (the intermediate), else tokens (x)
    SILU_MUL: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALES: tl.constexpr,  # NO_SCALES (b in a's dtype), PER_ROW or BLOCKWISE (b FP8)
    GROUP_N: tl.constexpr,
    GROUP_K: tl.constexpr,
    ROWS_IN_ONE_BLOCK: tl.constexpr,  # BLOCKWISE: a program's BLOCK_N rows share a block row
):
    pid_n = tl.program_id(0)
    pair = tl.program_id(1).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    row = pair if A_ROW_PER_PAIR else pair // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    b_ptrs = b_ptr + expert * stride_be + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :]
    a_ptrs = a_ptr + row * stride_am + offs_k
    dtype = c_ptr.dtype.element_ty
    s_ptrs = s_ptr + expert * stride_se
    if SCALES == BLOCKWISE:
        if ROWS_IN_ONE_BLOCK:  # one scale row: it scales a's K slice, not the weight tile
            s_ptrs += _scale_rows(pid_n * BLOCK_N, HALF_N, HALF_BLOCKS, GROUP_N) * stride_sn
        else:
            s_ptrs += _scale_rows(offs_n, HALF_N, HALF_BLOCKS, GROUP_N)[:, None] * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_mask = k_start + offs_k < K
        w = tl.load(b_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        if SILU_MUL:
            gate = tl.load(a_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            up = tl.load(a_ptrs + K, mask=k_mask, other=0.0).to(tl.float32)
            a = silu_mul_operand(gate, up, dtype).to(tl.float32)
        else:
            a = tl.load(a_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        if SCALES == BLOCKWISE:
            columns = (k_start + offs_k) // GROUP_K
            if ROWS_IN_ONE_BLOCK:
                a *= tl.load(s_ptrs + columns, mask=k_mask, other=0.0)
            else:
                w *= tl.load(s_ptrs + columns[None, :], mask=n_mask[:, None] & k_mask[None, :],
                             other=0.0)
        acc += w * a[None, :]
        b_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if SCALES == PER_ROW:
        y *= tl.load(s_ptrs + offs_n, mask=n_mask, other=0.0)
    if MUL_WEIGHT:
        y *= tl.load(weights_ptr + pair).to(tl.float32)
    tl.store(c_ptr + pair * stride_cm + offs_n, y.to(dtype), mask=n_mask)


def _pair_block_k(k: int) -> int:
    """All of K up to 2,048 a step where a power of two divides it so (no masked lanes: 768 takes
    256), else the next power of two up to 2,048."""
    for block_k in (2048, 1024, 512, 256):
        if k % block_k == 0:
            return block_k
    return min(2048, triton.next_power_of_2(k))


def _pair_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, weights: torch.Tensor,
               ids: torch.Tensor, top_k: int, a_row_per_pair: bool, silu_mul: bool,
               mul_weight: bool, scales: WeightScales | None = None) -> None:
    n, k = b.shape[1], b.shape[2]
    block_k = _pair_block_k(k)
    block_n = 4
    grid = (triton.cdiv(n, block_n), ids.numel())
    s, s_args, s_consts = _fp8_scale_args(b, scales)
    half_n = s_args[2]
    one_block = (scales is not None and scales.block is not None
                 and scales.block[0] % block_n == 0 and half_n % block_n == 0)
    _moe_pair_kernel[grid](
        a, b, out, weights, ids, s, n, a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        *s_args, K=k, TOP_K=top_k, A_ROW_PER_PAIR=a_row_per_pair, SILU_MUL=silu_mul,
        MUL_WEIGHT=mul_weight, BLOCK_N=block_n, BLOCK_K=block_k, ROWS_IN_ONE_BLOCK=one_block,
        num_warps=8 if block_k >= 2048 else 4, **s_consts,
    )


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  scales: ExpertScales | None = None, tiles: MoeTiles | None = None,
                  local_only: bool = False) -> torch.Tensor:
    """sluice.model.moe.experts_reference in two grouped GEMM launches (the module's
    docstring): x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_* [T, k] -> [T, H]. With `scales`
    the weights are float8_e4m3fn (sluice.model.moe.fp8_experts_reference's product): W8A16,
    each FP8 tile widened to x's dtype in registers and its scale applied in the kernel.

    `local_only` (expert parallelism, FusedMoE.local_pairs): an id -1 is another rank's pair,
    at weight 0. The pair kernel runs it through expert 0 (it adds 0); the grouped path aligns
    it into one bucket past the last expert whose blocks are marked -1, so the GEMMs skip it
    and its output row stays 0. The shapes stay static (one more bucket's padding)."""
    t, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, two_inter, _ = w13.shape
    if t == 0:
        return torch.zeros_like(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    inter = torch.empty((t * top_k, two_inter), dtype=x.dtype, device=x.device)
    out = torch.empty((t * top_k, hidden), dtype=x.dtype, device=x.device)
    s13 = s2 = None
    if scales is not None:
        s13 = WeightScales(scales.w13, scales.block, 2)
        s2 = WeightScales(scales.w2, scales.block, 1)
    if t * top_k <= PAIR_KERNEL_MAX_PAIRS:
        ids = topk_ids.reshape(-1).contiguous()
        if local_only:
            ids = ids.clamp_min(0)
        _pair_gemm(x, w13, inter, weights, ids, top_k, a_row_per_pair=False, silu_mul=False,
                   mul_weight=False, scales=s13)
        _pair_gemm(inter, w2, out, weights, ids, top_k, a_row_per_pair=True, silu_mul=True,
                   mul_weight=True, scales=s2)
        return out.view(t, top_k, hidden).sum(dim=1)
    if tiles is None:  # (`tiles`: benchmarks/tools/moe_sweep.py's candidates)
        tiles = moe_tiles(x, w13, w2, top_k, s13)
    if local_only:
        topk_ids = torch.where(topk_ids < 0, num_experts, topk_ids)
        sorted_ids, block_expert = align_by_expert(topk_ids, num_experts + 1, tiles.block_m,
                                                   tiles.align)
        block_expert = torch.where(block_expert == num_experts, -1, block_expert)
        out.zero_()
    else:
        sorted_ids, block_expert = align_by_expert(topk_ids, num_experts, tiles.block_m,
                                                   tiles.align)
    _gemm(x, w13, inter, weights, sorted_ids, block_expert, top_k, tiles.block_m,
          a_row_per_pair=False, silu_mul=False, mul_weight=False, scales=s13,
          tiles=tiles.gate_up)
    _gemm(inter, w2, out, weights, sorted_ids, block_expert, top_k, tiles.block_m,
          a_row_per_pair=True, silu_mul=True, mul_weight=True, scales=s2, tiles=tiles.down)
    return out.view(t, top_k, hidden).sum(dim=1)
