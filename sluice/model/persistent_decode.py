"""Every decoder layer of a small decode batch in one persistent kernel (Llama, Qwen3: the folded
path of LlamaModel, its norms folded into the projections).

Why: at one to a few rows a decode step is a chain of ~200 short launches (28 layers x 7 for
Qwen3-0.6B), and each projection there costs 4-5 us on an H200 where streaming its weight takes
1-3: the cost is the kernel boundaries (a launch, the first loads' round trips, the tail), not
the bytes (`benchmarks/README.md`, "launch boundaries, not the bytes"). Here one program per SM
runs every layer, a layer as five phases with a grid-wide barrier after each:

1. q/k/v projection of the residual rows, each output scaled by its row's 1 / rms (the input
   norm folded into the weight), into `qkv` [M, (H + 2 KVH) D];
2. attention, split-KV: a work item is (row, KV head, split of its cached keys); it norms and
   rotates its query heads, attends to its keys and writes its partial softmax; split 0 also
   norms and rotates the new k, stores k and v at the row's slot of the layer's paged cache and
   attends to them from registers; the last split of a (row, KV head) to arrive (an arrival
   counter) merges the splits into `attn` [M, H D];
3. o_proj, accumulated into the residual;
4. gate/up of the residual rows (scaled by 1 / rms: the post-attention norm folded), SiLU and
   the product, into `act` [M, I];
5. down_proj, accumulated into the residual.

A projection phase gives each program one contiguous range of weight rows. What a phase reads
that no phase of this launch writes is read before the barrier in front of it: each program
loads its weight tile for the next projection into registers, and its first tile of cached K/V
for the attention, then waits; after the barrier only the activations (from L2) remain. The
weights are also asked into L2 two phases earlier (one bulk prefetch a range,
`cp.async.bulk.prefetch.L2`), so their bytes stream from HBM while barriers and attention run.

A barrier: each program stores its arrival count to its own flag (release) and polls every
flag (plain loads past L1) until all have arrived, then fences (acquire); data written within
the launch is read back with `.cg` loads (L2, never a stale L1 line). The grid is one program
per SM, all resident at once (a barrier waits for every program); the last program out zeroes
the flags for the next launch. `benchmarks/README.md` has what a first form cost (barriers with
a shared atomic counter, every load after them: 1.5x slower than the layer-by-layer kernels).

Each value is rounded where the layer-by-layer kernels round it (sluice.model.triton_gemm,
sluice.model.triton_ops, sluice.attention.triton): the projections' float32 sums to the model
dtype, then the 1 / rms scaling, the q/k norm, the rotation, the residual sums, SiLU and its
product, each rounded as there; only the summation order differs, and the new key's softmax
weight stays in float32 (as in sluice.attention.triton.decode_qkv).

On the CPU (Triton's interpreter, the tests) the grid is one program: its barriers pass at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sluice.attention.metadata import AttentionMetadata
from sluice.attention.triton.common import LOG2_E, attend_kv, attend_tile, load_kv_tile

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Decode batches of at most this many rows run here (the decode graphs of 1, 2, 4 and 8).
MAX_ROWS = 8
# Keys per attention tile, and the most splits of one (row, KV head)'s cached keys.
ATTN_BLOCK_N = 64
MAX_SPLITS = 16
# A weight tile a program holds in registers: at most this many elements; longer rows are read
# in chunks, the first one ahead. More spilled (sm90, ptxas: 200 bytes a thread at 16,384,
# 650 at 32,768; 12 here) and ran slower (H200, one row: 858 and 1,271 us a forward against 780).
MAX_TILE_ELEMS = 8192
# Bytes of one bulk L2 prefetch instruction.
_PREFETCH_PIECE = tl.constexpr(16384)
# A layer's row of the pointer table: its weights (q/k/v, o, gate/up, down), q/k norm weights,
# key and value caches, in this order (the kernel reads them by index).
_TABLE_ENTRIES = ("qkv", "o", "gate_up", "down", "q_norm", "k_norm", "key_cache", "value_cache")
# The sync buffer of a device (int32): [0] the exit count, [_FLAGS, _FLAGS + SMs) the barrier
# flags, [_MERGE_COUNTERS, ...) the attention merge's arrival counters, one per (row, KV head).
_FLAGS = tl.constexpr(32)
_MERGE_COUNTERS = tl.constexpr(1024)
_SYNC_SIZE = 4096


@triton.jit
def _fence_acquire(x):
    """A gpu-scope fence after an acquiring poll (x: any int32 scalar; returned)."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu;\nmov.b32 $0, $1;", "=r,r", [x],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _grid_sync(flags_ptr, pid, epoch, P: tl.constexpr, P_PAD: tl.constexpr,
               USE_ASM: tl.constexpr):
    """Wait until every program has reached barrier number `epoch` of this launch."""
    tl.debug_barrier()  # every thread's writes of the phase are issued before the release
    tl.atomic_xchg(flags_ptr + pid, epoch, sem="release", scope="gpu")
    offs = tl.arange(0, P_PAD)
    mask = offs < P
    arrived = tl.min(tl.load(flags_ptr + offs, mask=mask, other=epoch, volatile=True), axis=0)
    while arrived < epoch:
        arrived = tl.min(tl.load(flags_ptr + offs, mask=mask, other=epoch, volatile=True),
                         axis=0)
    if USE_ASM:
        arrived = _fence_acquire(arrived)
    tl.debug_barrier()
    return arrived


@triton.jit
def _layer_ptr(table_ptr, layer, index: tl.constexpr, DTYPE: tl.constexpr):
    """A layer's tensor (torch allocations are 16-byte aligned: said so, or the loads through
    it would not be vectorized)."""
    return tl.multiple_of(tl.load(table_ptr + layer * 8 + index).to(tl.pointer_type(DTYPE)),
                          16)


@triton.jit
def _prefetch_rows(w_ptr, row0, row_end, K: tl.constexpr, ROWS: tl.constexpr,
                   ELEM_BYTES: tl.constexpr, PREFETCH: tl.constexpr):
    """Ask weight rows [row0, row_end) (at most ROWS of K elements, contiguous) into L2: the
    program's first thread issues a bulk prefetch per piece of _PREFETCH_PIECE bytes."""
    if PREFETCH:
        NUM_PIECES: tl.constexpr = (ROWS * K * ELEM_BYTES + _PREFETCH_PIECE - 1) // _PREFETCH_PIECE
        first = row0.to(tl.int64) * (K * ELEM_BYTES)
        end = row_end.to(tl.int64) * (K * ELEM_BYTES)
        base = w_ptr.to(tl.pointer_type(tl.int8))
        for piece in tl.static_range(NUM_PIECES):
            start = first + piece * _PREFETCH_PIECE
            size = tl.maximum(tl.minimum(end - start, _PREFETCH_PIECE), 0).to(tl.int32)
            _bulk_prefetch(base + start, size)


@triton.jit
def _bulk_prefetch(base, size):
    """cp.async.bulk.prefetch.L2 of `size` bytes (a multiple of 16, may be 0) at `base`, by the
    program's first thread."""
    return tl.inline_asm_elementwise(
        "{\n.reg .pred p;\n.reg .u32 t;\nmov.u32 t, %tid.x;\n"
        "setp.eq.u32 p, t, 0;\nsetp.ne.and.u32 p, $2, 0, p;\n"
        "@p cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.b32 $0, $2;\n}",
        "=r,l,r", [base.to(tl.int64), size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_rows(w_ptr, row0, row_end, k0, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """[BN, BK] of weight rows [row0, row_end) x [k0, k0 + BK) (zeros outside)."""
    rows = row0 + tl.arange(0, BN)
    ks = k0 + tl.arange(0, BK)
    mask = (rows < row_end)[:, None] & (ks < K)[None, :]
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=mask, other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _dot_rows(w, x_ptr, stride_x, M, k0, K: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
              FMA: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """[BN, BM] float32: the tile w ([BN, BK] of K) times columns [k0, k0 + BK) of x's rows
    [0, M) (data of this launch: read from L2)."""
    ks = k0 + tl.arange(0, BK)
    ms = tl.arange(0, BM)
    k_mask = ks < K
    if FMA:  # a few rows: multiply-adds on the CUDA cores
        w32 = w.to(tl.float32)
        acc = tl.zeros((w.shape[0], BM), tl.float32)
        for mi in tl.static_range(BM):
            x_row = tl.load(x_ptr + mi * stride_x + ks, mask=k_mask & (mi < M), other=0.0,
                            cache_modifier=".cg").to(tl.float32)
            part = tl.sum(w32 * x_row[None, :], axis=1)  # [BN]
            acc += tl.where(ms[None, :] == mi, part[:, None], 0.0)
        return acc
    x = tl.load(x_ptr + ms[:, None] * stride_x + ks[None, :],
                mask=(ms < M)[:, None] & k_mask[None, :], other=0.0, cache_modifier=".cg")
    if UPCAST:
        w = w.to(tl.float32)
        x = x.to(tl.float32)
    return tl.dot(w, tl.trans(x), input_precision=DOT_PRECISION)


@triton.jit
def _project(w_first, w_ptr, row0, row_end, x_ptr, stride_x, M, K: tl.constexpr,
             BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, FMA: tl.constexpr,
             UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """[BN, BM] float32: weight rows [row0, row_end) times x's rows, the first K chunk
    (w_first) loaded already."""
    acc = _dot_rows(w_first, x_ptr, stride_x, M, 0, K, BM, BK, FMA, UPCAST, DOT_PRECISION)
    for k0 in tl.static_range(BK, K, BK):
        w = _load_rows(w_ptr, row0, row_end, k0, K, BN, BK)
        acc += _dot_rows(w, x_ptr, stride_x, M, k0, K, BM, BK, FMA, UPCAST, DOT_PRECISION)
    return acc


@triton.jit
def _mean_square(x_ptr, stride_x, M, HIDDEN: tl.constexpr, HIDDEN_PAD: tl.constexpr,
                 BM: tl.constexpr, eps):
    """[BM] mean(x^2) + eps of rows [0, M) of x, in float32: 1 / rms is its rsqrt."""
    ms = tl.arange(0, BM)
    cols = tl.arange(0, HIDDEN_PAD)
    x = tl.load(x_ptr + ms[:, None] * stride_x + cols[None, :],
                mask=(ms < M)[:, None] & (cols < HIDDEN)[None, :], other=0.0,
                cache_modifier=".cg").to(tl.float32)
    return tl.sum(x * x, axis=1) / HIDDEN + eps


@triton.jit
def _add_to_residual(acc, residual_ptr, stride_residual, row0, row_end, M, BN: tl.constexpr,
                     BM: tl.constexpr, DTYPE: tl.constexpr):
    """residual[:M, row0:row_end] += acc^T, rounded once (the residual add in the GEMM)."""
    cols = row0 + tl.arange(0, BN)
    ms = tl.arange(0, BM)
    mask = (cols < row_end)[:, None] & (ms < M)[None, :]
    ptrs = residual_ptr + ms[None, :] * stride_residual + cols[:, None]
    acc += tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(ptrs, acc.to(DTYPE), mask=mask)


@triton.jit
def _norm_rope(x, x_partner, eps, w_ptr, dims, partner, dim_mask, cos, sin, sign,
               HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, DTYPE: tl.constexpr):
    """Heads [rows, D_PAD] (float32 values of the model dtype) RMS-normed over the head (with
    the norm's weight) and rotated neox style: x_partner holds each element's rotation partner
    (the other half of its head)."""
    if HAS_NORM:
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)
        w = tl.load(w_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
        w_partner = tl.load(w_ptr + partner, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
        # rms_norm: scale in float32, round, multiply by the weight in the model dtype.
        x = (w * (x * inv_rms[:, None]).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
        x_partner = (w_partner * (x_partner * inv_rms[:, None]).to(DTYPE).to(tl.float32)).to(
            DTYPE).to(tl.float32)
    # first half: x1 cos - x2 sin; second half: x2 cos + x1 sin
    return (x * cos + sign * x_partner * sin).to(DTYPE)


@triton.jit
def _attention_split(item, seq_lens_ptr, NUM_KV_HEADS: tl.constexpr,
                     NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Work item (row, KV head, split): (row, kv_head, split, seq_len, its cached keys' tiles
    [tile_begin, tile_end), the splits that take part)."""
    split = item % NUM_SPLITS
    kv_head = (item // NUM_SPLITS) % NUM_KV_HEADS
    row = item // (NUM_SPLITS * NUM_KV_HEADS)
    seq_len = tl.load(seq_lens_ptr + row)
    num_cached = tl.maximum(seq_len - 1, 0)  # the new key is split 0's, from registers
    num_tiles = tl.cdiv(num_cached, BLOCK_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, NUM_SPLITS), 1)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
    # Splits with a tile, and split 0 always (the new key) unless the row is padding.
    taking_part = tl.where(seq_len > 0, tl.maximum(tl.cdiv(num_tiles, tiles_per_split), 1), 0)
    return row, kv_head, split, seq_len, num_cached, tile_begin, tile_end, taking_part


@triton.jit
def _first_kv_tile(item, seq_lens_ptr, block_tables_ptr, stride_block_table, k_cache,
                   v_cache, stride_cache_block, stride_cache_slot, stride_cache_head,
                   NUM_KV_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
                   HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """The first tile of cached K/V of an attention item (zeros where it has none): what a
    program loads before the barrier in front of the attention."""
    row, kv_head, split, seq_len, num_cached, tile_begin, tile_end, taking_part = (
        _attention_split(item, seq_lens_ptr, NUM_KV_HEADS, NUM_SPLITS, BLOCK_N))
    dims = tl.arange(0, HEAD_DIM_PAD)
    k, v, _, _ = load_kv_tile(
        k_cache + kv_head * stride_cache_head, v_cache + kv_head * stride_cache_head,
        block_tables_ptr + row.to(tl.int64) * stride_block_table, 0, tile_begin * BLOCK_N,
        tl.where(tile_begin < tile_end, num_cached, 0), stride_cache_block, stride_cache_slot,
        dims, dims < HEAD_DIM, BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, PAGED=True, MASK=True,
        MASK_DIMS=HEAD_DIM != HEAD_DIM_PAD)
    return k, v


@triton.jit
def _attention_item(item, k_first, v_first, qkv_ptr, stride_qkv, positions_ptr, cos_sin_ptr,
                    stride_cos_sin, q_norm_ptr, k_norm_ptr, k_cache_ptr, v_cache_ptr,
                    slot_mapping_ptr, block_tables_ptr, stride_block_table, seq_lens_ptr,
                    attn_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, merge_ptr, qk_scale,
                    head_eps, stride_cache_block, stride_cache_slot, stride_cache_head,
                    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    NUM_SPLITS_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                    PAGE_SIZE: tl.constexpr, HAS_NORM: tl.constexpr, UPCAST: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, DTYPE: tl.constexpr):
    """Work item (row, KV head, split): its partial softmax over its cached keys (the first
    tile, k_first / v_first, loaded before the barrier), merged by the last to arrive."""
    row, kv_head, split, seq_len, num_cached, tile_begin, tile_end, taking_part = (
        _attention_split(item, seq_lens_ptr, NUM_KV_HEADS, NUM_SPLITS, BLOCK_N))
    HALF: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_rows = tl.arange(0, BLOCK_Q)
    q_row_valid = q_rows < GROUP
    head = kv_head * GROUP + q_rows
    if split < taking_part:
        partner = (dims + HALF) % HEAD_DIM
        sign = tl.where(dims < HALF, -1.0, 1.0)[None, :]
        position = tl.load(positions_ptr + row).to(tl.int64)
        freq = dims % HALF
        cos = tl.load(cos_sin_ptr + position * stride_cos_sin + freq, mask=dim_mask,
                      other=0.0)[None, :]
        sin = tl.load(cos_sin_ptr + position * stride_cos_sin + HALF + freq, mask=dim_mask,
                      other=0.0)[None, :]
        qkv_row = qkv_ptr + row * stride_qkv
        q_valid = q_row_valid[:, None] & dim_mask[None, :]
        q_cols = head[:, None] * HEAD_DIM
        x = tl.load(qkv_row + q_cols + dims[None, :], mask=q_valid, other=0.0,
                    cache_modifier=".cg").to(tl.float32)
        x_partner = tl.load(qkv_row + q_cols + partner[None, :], mask=q_valid, other=0.0,
                            cache_modifier=".cg").to(tl.float32)
        # Split 0's new k and v, loaded with the queries (one round trip to L2).
        new_mask = dim_mask[None, :] & (split == 0)
        k_cols = (NUM_HEADS + kv_head) * HEAD_DIM
        k = tl.load(qkv_row + k_cols + dims[None, :], mask=new_mask, other=0.0,
                    cache_modifier=".cg").to(tl.float32)
        k_partner = tl.load(qkv_row + k_cols + partner[None, :], mask=new_mask, other=0.0,
                            cache_modifier=".cg").to(tl.float32)
        v = tl.load(qkv_row + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + dims[None, :],
                    mask=new_mask, other=0.0, cache_modifier=".cg")
        slot = tl.load(slot_mapping_ptr + row)
        q = _norm_rope(x, x_partner, head_eps, q_norm_ptr, dims, partner, dim_mask, cos, sin,
                       sign, HEAD_DIM, HAS_NORM, DTYPE)
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], tl.float32)
        cache_head = kv_head * stride_cache_head
        if split == 0:
            # The new token: its k normed and rotated and its v (already scaled) go to the
            # cache, and its score and value start the online softmax from registers.
            k_new = _norm_rope(k, k_partner, head_eps, k_norm_ptr, dims, partner, dim_mask,
                               cos, sin, sign, HEAD_DIM, HAS_NORM, DTYPE)
            cache_offsets = ((slot // PAGE_SIZE) * stride_cache_block
                             + (slot % PAGE_SIZE) * stride_cache_slot + cache_head
                             + dims[None, :])
            store_mask = dim_mask[None, :] & (slot >= 0)
            tl.store(k_cache_ptr + cache_offsets, k_new, mask=store_mask)
            tl.store(v_cache_ptr + cache_offsets, v, mask=store_mask)
            m_i = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * qk_scale
            l_i += 1.0
            acc += v.to(tl.float32)
        block_table_row = block_tables_ptr + row.to(tl.int64) * stride_block_table
        query_pos = tl.zeros([BLOCK_Q], tl.int32) + num_cached
        if tile_begin < tile_end:
            pos = tile_begin * BLOCK_N + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = attend_kv(
                q, m_i, l_i, acc, k_first, v_first, pos, pos < num_cached, query_pos,
                qk_scale, MASK=True, CAUSAL=False, UPCAST_DOT=UPCAST,
                DOT_PRECISION=DOT_PRECISION, COMPUTE_DTYPE=DTYPE, FP16_DOTS=False)
        for t in range(tile_begin + 1, tile_end):
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, k_cache_ptr + cache_head, v_cache_ptr + cache_head,
                block_table_row, 0, t * BLOCK_N, num_cached, query_pos, stride_cache_block,
                stride_cache_slot, dims, dim_mask, qk_scale, BLOCK_N=BLOCK_N,
                PAGE_SIZE=PAGE_SIZE, PAGED=True, MASK=True, CAUSAL=False,
                MASK_DIMS=HEAD_DIM != HEAD_DIM_PAD, UPCAST_DOT=UPCAST,
                DOT_PRECISION=DOT_PRECISION, COMPUTE_DTYPE=DTYPE, FP16_DOTS=False)
        attn_rows = attn_ptr + (row * NUM_HEADS + head)[:, None] * HEAD_DIM + dims[None, :]
        out_mask = q_row_valid[:, None] & dim_mask[None, :]
        if taking_part == 1:  # one split: no partials, no merge
            tl.store(attn_rows, (acc / l_i[:, None]).to(DTYPE), mask=out_mask)
        else:
            stat = (row * NUM_HEADS + head) * NUM_SPLITS + split  # [BLOCK_Q]
            tl.store(part_max_ptr + stat, m_i, mask=q_row_valid)
            tl.store(part_sum_ptr + stat, l_i, mask=q_row_valid)
            tl.store(part_acc_ptr + stat[:, None] * HEAD_DIM_PAD + dims[None, :], acc,
                     mask=q_row_valid[:, None])
            tl.debug_barrier()  # every thread's partial is stored before the release below
            counter = merge_ptr + row * NUM_KV_HEADS + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == taking_part - 1:  # the last split: the others' partials are visible
                splits = tl.arange(0, NUM_SPLITS_PAD)
                used = splits < taking_part
                for r in tl.static_range(GROUP):  # every load of the merge at once
                    stats = (row * NUM_HEADS + kv_head * GROUP + r) * NUM_SPLITS + splits
                    m = tl.load(part_max_ptr + stats, mask=used, other=float("-inf"),
                                cache_modifier=".cg")
                    l_split = tl.load(part_sum_ptr + stats, mask=used, other=0.0,
                                      cache_modifier=".cg")
                    parts = tl.load(part_acc_ptr + stats[:, None] * HEAD_DIM_PAD + dims[None, :],
                                    mask=used[:, None], other=0.0, cache_modifier=".cg")
                    m_all = tl.max(m, 0)
                    weight = tl.exp2(m - m_all)
                    out = tl.sum(parts * weight[:, None], 0) / tl.sum(l_split * weight, 0)
                    tl.store(attn_ptr + (row * NUM_HEADS + kv_head * GROUP + r) * HEAD_DIM + dims,
                             out.to(DTYPE), mask=dim_mask)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    elif split == 0 and seq_len == 0:  # a padding row: zeros, as the layered kernels give
        tl.store(attn_ptr + (row * NUM_HEADS + head)[:, None] * HEAD_DIM + dims[None, :],
                 tl.zeros([BLOCK_Q, HEAD_DIM_PAD], DTYPE),
                 mask=q_row_valid[:, None] & dim_mask[None, :])


@triton.jit(do_not_specialize=["M", "stride_residual", "stride_block_table"])
def _decode_layers_kernel(
    residual_ptr,  # [M, HIDDEN]: the residual stream, updated in place
    positions_ptr,  # [M]
    seq_lens_ptr,  # [M] int32: context length incl. this token (0: padding row)
    slot_mapping_ptr,  # [M] int64; < 0: stores nothing
    block_tables_ptr,  # [M, width] int32
    cos_sin_ptr,  # [max_pos, HEAD_DIM] float32
    table_ptr,  # [NUM_LAYERS, 8] int64: each layer's weight and cache addresses
    qkv_ptr,  # [BM, QKV_N] scratch
    attn_ptr,  # [BM, NUM_HEADS * HEAD_DIM] scratch
    act_ptr,  # [BM, INTER] scratch
    part_acc_ptr,  # [BM, NUM_HEADS, NUM_SPLITS, HEAD_DIM_PAD] float32 scratch
    part_max_ptr,  # [BM, NUM_HEADS, NUM_SPLITS] float32 scratch
    part_sum_ptr,
    sync_ptr,  # int32 [_SYNC_SIZE]: zero between launches (see _FLAGS)
    M,
    num_layers,
    stride_residual,
    stride_block_table,
    stride_cos_sin,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    norm_eps,
    head_eps,
    qk_scale,
    HIDDEN: tl.constexpr,
    HIDDEN_PAD: tl.constexpr,
    INTER: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_SPLITS_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    P: tl.constexpr,  # programs: the grid
    P_PAD: tl.constexpr,
    BM: tl.constexpr,
    # Weight rows a program takes (R_*) and its tile's rows (BN_*, a power of two >= R_*), K
    # elements a load takes (BK_*): per projection.
    R_QKV: tl.constexpr, BN_QKV: tl.constexpr, BK_QKV: tl.constexpr,
    R_O: tl.constexpr, BN_O: tl.constexpr, BK_O: tl.constexpr,
    R_GATE_UP: tl.constexpr, BN_GATE_UP: tl.constexpr, BK_GATE_UP: tl.constexpr,
    R_DOWN: tl.constexpr, BN_DOWN: tl.constexpr, BK_DOWN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FMA: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_ASM: tl.constexpr,  # inline PTX (a GPU): the barriers' fence
    PHASES: tl.constexpr,  # bit i: phase i + 1 runs (Tiles.phases)
):
    pid = tl.program_id(0)
    DTYPE: tl.constexpr = residual_ptr.dtype.element_ty
    ELEM_BYTES: tl.constexpr = DTYPE.primitive_bitwidth // 8
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    BLOCK_Q: tl.constexpr = 16 if GROUP <= 16 else GROUP
    Q_SIZE: tl.constexpr = NUM_HEADS * HEAD_DIM
    QKV_N: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    flags_ptr = sync_ptr + _FLAGS
    merge_ptr = sync_ptr + _MERGE_COUNTERS
    ms = tl.arange(0, BM)
    m_mask = ms < M
    # This program's rows of each projection (the same in every layer).
    qkv_row0 = tl.minimum(pid * R_QKV, QKV_N)
    qkv_end = tl.minimum(qkv_row0 + R_QKV, QKV_N)
    o_row0 = tl.minimum(pid * R_O, HIDDEN)
    o_end = tl.minimum(o_row0 + R_O, HIDDEN)
    gu_row0 = tl.minimum(pid * R_GATE_UP, INTER)
    gu_end = tl.minimum(gu_row0 + R_GATE_UP, INTER)
    down_row0 = tl.minimum(pid * R_DOWN, HIDDEN)
    down_end = tl.minimum(down_row0 + R_DOWN, HIDDEN)
    # Attention items pid, pid + P, ... (one on a GPU: choose_num_splits keeps them within P).
    num_attn_items = M * NUM_KV_HEADS * NUM_SPLITS
    first_item = tl.minimum(pid, num_attn_items - 1)

    _prefetch_rows(_layer_ptr(table_ptr, 0, 1, DTYPE), o_row0, o_end, Q_SIZE, R_O, ELEM_BYTES,
                   PREFETCH)
    w_qkv = _load_rows(_layer_ptr(table_ptr, 0, 0, DTYPE), qkv_row0, qkv_end, 0, HIDDEN,
                       BN_QKV, BK_QKV)
    epoch = 0
    for layer in range(num_layers):
        qkv_w = _layer_ptr(table_ptr, layer, 0, DTYPE)
        o_w = _layer_ptr(table_ptr, layer, 1, DTYPE)
        gate_up_w = _layer_ptr(table_ptr, layer, 2, DTYPE)
        down_w = _layer_ptr(table_ptr, layer, 3, DTYPE)
        k_cache = _layer_ptr(table_ptr, layer, 6, DTYPE)
        v_cache = _layer_ptr(table_ptr, layer, 7, DTYPE)
        next_layer = tl.minimum(layer + 1, num_layers - 1)
        has_next = layer + 1 < num_layers

        # 1. qkv = (residual W_qkv^T rounded) / rms(residual), rounded.
        _prefetch_rows(gate_up_w, gu_row0, gu_end, HIDDEN, R_GATE_UP, ELEM_BYTES,
                       PREFETCH)
        _prefetch_rows(gate_up_w, INTER + gu_row0, INTER + gu_end, HIDDEN, R_GATE_UP,
                       ELEM_BYTES, PREFETCH)
        if PHASES & 1:
            inv_rms = tl.rsqrt(_mean_square(residual_ptr, stride_residual, M, HIDDEN,
                                            HIDDEN_PAD, BM, norm_eps))
            acc = _project(w_qkv, qkv_w, qkv_row0, qkv_end, residual_ptr, stride_residual, M,
                           HIDDEN, BN_QKV, BM, BK_QKV, FMA, UPCAST, DOT_PRECISION)
            out = (acc.to(DTYPE).to(tl.float32) * inv_rms[None, :]).to(DTYPE)
            cols = qkv_row0 + tl.arange(0, BN_QKV)
            tl.store(qkv_ptr + ms[None, :] * QKV_N + cols[:, None], out,
                     mask=(cols < qkv_end)[:, None] & m_mask[None, :])
        # Ahead of the barrier: this program's first tile of cached K/V.
        k_tile, v_tile = _first_kv_tile(
            first_item, seq_lens_ptr, block_tables_ptr, stride_block_table, k_cache, v_cache,
            stride_cache_block, stride_cache_slot, stride_cache_head, NUM_KV_HEADS, NUM_SPLITS,
            BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE)
        epoch += 1
        _grid_sync(flags_ptr, pid, epoch, P, P_PAD, USE_ASM)

        # 2. attention (the merge by the last split of each (row, KV head)).
        _prefetch_rows(down_w, down_row0, down_end, INTER, R_DOWN, ELEM_BYTES,
                       PREFETCH)
        for j in range(0, tl.cdiv(num_attn_items - pid, P) if PHASES & 2 else 0):
            item = pid + j * P
            if j > 0:
                k_tile, v_tile = _first_kv_tile(
                    item, seq_lens_ptr, block_tables_ptr, stride_block_table, k_cache, v_cache,
                    stride_cache_block, stride_cache_slot, stride_cache_head, NUM_KV_HEADS,
                    NUM_SPLITS, BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, PAGE_SIZE)
            _attention_item(
                item, k_tile, v_tile, qkv_ptr, QKV_N, positions_ptr, cos_sin_ptr,
                stride_cos_sin, _layer_ptr(table_ptr, layer, 4, DTYPE),
                _layer_ptr(table_ptr, layer, 5, DTYPE), k_cache, v_cache, slot_mapping_ptr,
                block_tables_ptr, stride_block_table, seq_lens_ptr, attn_ptr, part_acc_ptr,
                part_max_ptr, part_sum_ptr, merge_ptr, qk_scale, head_eps, stride_cache_block,
                stride_cache_slot, stride_cache_head, NUM_HEADS, NUM_KV_HEADS, GROUP, HEAD_DIM,
                HEAD_DIM_PAD, NUM_SPLITS, NUM_SPLITS_PAD, BLOCK_Q, BLOCK_N, PAGE_SIZE,
                HAS_NORM, UPCAST, DOT_PRECISION, DTYPE)
        w_o = _load_rows(o_w, o_row0, o_end, 0, Q_SIZE, BN_O, BK_O)
        epoch += 1
        _grid_sync(flags_ptr, pid, epoch, P, P_PAD, USE_ASM)

        # 3. residual += attn W_o^T.
        _prefetch_rows(_layer_ptr(table_ptr, next_layer, 0, DTYPE), qkv_row0,
                       tl.where(has_next, qkv_end, qkv_row0), HIDDEN, R_QKV, ELEM_BYTES,
                       PREFETCH)
        if PHASES & 4:
            acc = _project(w_o, o_w, o_row0, o_end, attn_ptr, Q_SIZE, M, Q_SIZE, BN_O, BM,
                           BK_O, FMA, UPCAST, DOT_PRECISION)
            _add_to_residual(acc, residual_ptr, stride_residual, o_row0, o_end, M, BN_O, BM,
                             DTYPE)
        w_gate = _load_rows(gate_up_w, gu_row0, gu_end, 0, HIDDEN, BN_GATE_UP, BK_GATE_UP)
        w_up = _load_rows(gate_up_w, INTER + gu_row0, INTER + gu_end, 0, HIDDEN, BN_GATE_UP,
                          BK_GATE_UP)
        epoch += 1
        _grid_sync(flags_ptr, pid, epoch, P, P_PAD, USE_ASM)

        # 4. act = silu(gate) * up of (residual W_gate_up^T) / rms(residual), each rounded.
        _prefetch_rows(_layer_ptr(table_ptr, next_layer, 1, DTYPE), o_row0,
                       tl.where(has_next, o_end, o_row0), Q_SIZE, R_O, ELEM_BYTES,
                       PREFETCH)
        if PHASES & 8:
            inv_rms = 1.0 / tl.sqrt(_mean_square(residual_ptr, stride_residual, M, HIDDEN,
                                                 HIDDEN_PAD, BM, norm_eps))
            gate = _project(w_gate, gate_up_w, gu_row0, gu_end, residual_ptr, stride_residual,
                            M, HIDDEN, BN_GATE_UP, BM, BK_GATE_UP, FMA, UPCAST, DOT_PRECISION)
            up = _project(w_up, gate_up_w, INTER + gu_row0, INTER + gu_end, residual_ptr,
                          stride_residual, M, HIDDEN, BN_GATE_UP, BM, BK_GATE_UP, FMA, UPCAST,
                          DOT_PRECISION)
            gate = (gate * inv_rms[None, :]).to(DTYPE).to(tl.float32)
            up = (up * inv_rms[None, :]).to(DTYPE).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
            cols = gu_row0 + tl.arange(0, BN_GATE_UP)
            tl.store(act_ptr + ms[None, :] * INTER + cols[:, None], (silu * up).to(DTYPE),
                     mask=(cols < gu_end)[:, None] & m_mask[None, :])
        w_down = _load_rows(down_w, down_row0, down_end, 0, INTER, BN_DOWN, BK_DOWN)
        epoch += 1
        _grid_sync(flags_ptr, pid, epoch, P, P_PAD, USE_ASM)

        # 5. residual += act W_down^T.
        if PHASES & 16:
            acc = _project(w_down, down_w, down_row0, down_end, act_ptr, INTER, M, INTER,
                           BN_DOWN, BM, BK_DOWN, FMA, UPCAST, DOT_PRECISION)
            _add_to_residual(acc, residual_ptr, stride_residual, down_row0, down_end, M,
                             BN_DOWN, BM, DTYPE)
        w_qkv = _load_rows(_layer_ptr(table_ptr, next_layer, 0, DTYPE), qkv_row0,
                           tl.where(has_next, qkv_end, qkv_row0), 0, HIDDEN, BN_QKV, BK_QKV)
        epoch += 1
        _grid_sync(flags_ptr, pid, epoch, P, P_PAD, USE_ASM)

    # Every program is past the last barrier once it counts itself out: the last one zeroes
    # the flags for the next launch on the stream.
    done = tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu")
    if done == P - 1:
        offs = tl.arange(0, P_PAD)
        tl.store(flags_ptr + offs, tl.zeros([P_PAD], tl.int32), mask=offs < P)
        tl.atomic_xchg(sync_ptr, 0, sem="release", scope="gpu")


@dataclass(frozen=True, slots=True)
class Tiles:
    """Launch choices of the kernel (the defaults: Qwen3-0.6B on an H200, `benchmarks/`)."""

    # Rows of x at most this many: multiply-adds on the CUDA cores; more: tensor-core dots
    # (x padded to 16 rows, weight tiles of 16 rows or more).
    fma_max_rows: int = 2
    num_warps: int = 8
    # A weight tile in registers holds at most this many elements (longer rows: K in chunks).
    max_tile_elems: int = MAX_TILE_ELEMS
    # Each phase's weights asked into L2 two phases ahead (cp.async.bulk.prefetch.L2); CUDA only.
    prefetch: bool = True
    # The phases that run, bit i for phase i + 1 (see the module docstring): all of them,
    # but to time a phase by leaving it out (the output is then wrong).
    phases: int = 0b11111


DEFAULT_TILES = Tiles()


@dataclass(frozen=True, slots=True)
class _Projection:
    """A program's share of a projection of `rows` weight rows of `k` elements: `per_program`
    rows, in a tile of `block_rows` rows (a power of two), `block_k` elements of K a load."""

    per_program: int
    block_rows: int
    block_k: int

    @staticmethod
    def of(rows: int, k: int, programs: int, min_rows: int, max_elems: int) -> _Projection:
        per_program = -(-rows // programs)
        block_rows = max(min_rows, triton.next_power_of_2(per_program))
        fits = max(16, 1 << ((max_elems // block_rows).bit_length() - 1))
        block_k = min(triton.next_power_of_2(k), fits)
        return _Projection(per_program, block_rows, block_k)


def choose_num_splits(num_rows: int, num_kv_heads: int, num_programs: int) -> int:
    """Splits of each (row, KV head)'s cached keys: at most one attention item a program."""
    return max(1, min(MAX_SPLITS, num_programs // (num_rows * num_kv_heads)))


_SYNC: dict[torch.device, torch.Tensor] = {}


def _sync_buffer(device: torch.device) -> torch.Tensor:
    """The barrier flags and counters of a device, zero between launches (the last program
    out, and each merge, reset theirs); allocated by the first call, an eager one before any
    graph is captured."""
    sync = _SYNC.get(device)
    if sync is None:
        sync = torch.zeros(_SYNC_SIZE, dtype=torch.int32, device=device)
        _SYNC[device] = sync
    return sync


def _num_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another: a barrier needs one
    return torch.cuda.get_device_properties(device).multi_processor_count


class PersistentDecode:
    """The decode layers' op of a LlamaModel whose norms are folded (LlamaModel.fold_norms):
    `run(residual, positions, metadata)` runs every layer on the residual rows in place and
    returns True, or returns False where this kernel does not serve the step (the caller then
    runs the layers one by one)."""

    def __init__(self, model: torch.nn.Module, tiles: Tiles = DEFAULT_TILES) -> None:
        from sluice.model.models.llama import LlamaAttention, LlamaDecoderLayer

        layers = list(model.layers)
        attn = layers[0].self_attn
        mlp = layers[0].mlp
        for layer in layers:
            if type(layer) is not LlamaDecoderLayer or not isinstance(layer.self_attn,
                                                                      LlamaAttention):
                raise ValueError(f"persistent decode needs Llama decoder layers, got {layer}")
            linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if any(linear.bias is not None for linear in linears):
                raise ValueError("persistent decode does not run projections with a bias")
            if any(linear.tp.size != 1 for linear in linears):
                raise ValueError("persistent decode runs at tensor-parallel size 1 only")
            for linear, ref in zip(linears, (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                             mlp.down_proj)):
                if linear.weight.shape != ref.weight.shape or not linear.weight.is_contiguous():
                    raise ValueError("persistent decode needs contiguous weights of one shape "
                                     "in every layer")
        self.layers = layers
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim = attn.attn.head_dim
        if self.head_dim % 2:
            raise ValueError(f"persistent decode needs an even head_dim, got {self.head_dim}")
        self.scale = attn.attn.scale
        self.hidden = attn.qkv_proj.input_size
        self.inter = mlp.down_proj.input_size
        self.dtype = attn.qkv_proj.weight.dtype
        self.norm_eps = layers[0].input_layernorm.eps
        q_norm, _, head_eps = attn.qk_norms()
        self.has_norm = q_norm is not None
        self.head_eps = head_eps
        self.cos_sin_cache = attn.rotary_emb.cos_sin_cache
        self.tiles = tiles
        self._table: torch.Tensor | None = None
        self._table_key: tuple[int, ...] = ()

    def _pointer_table(self) -> torch.Tensor | None:
        """[L, 8] int64: each layer's addresses (_TABLE_ENTRIES), or None while no cache is
        bound or the caches are not the model dtype's; made again when another is bound."""
        caches = [layer.self_attn.attn.kv_cache for layer in self.layers]
        if any(cache.numel() == 0 for cache in caches):
            return None
        key = tuple(cache.data_ptr() for cache in caches)
        if self._table is not None and key == self._table_key:
            return self._table
        first = caches[0]
        for cache in caches:
            if (cache.dtype != self.dtype or cache.shape != first.shape
                    or cache.stride() != first.stride() or cache.stride(-1) != 1):
                return None  # an 8-bit cache, or caches of several shapes: not here
        rows = []
        for layer, cache in zip(self.layers, caches):
            attn, mlp = layer.self_attn, layer.mlp
            q_norm, k_norm, _ = attn.qk_norms()
            norm_ptr = lambda w: 0 if w is None else w.data_ptr()  # noqa: E731
            rows.append([attn.qkv_proj.weight.data_ptr(), attn.o_proj.weight.data_ptr(),
                         mlp.gate_up_proj.weight.data_ptr(), mlp.down_proj.weight.data_ptr(),
                         norm_ptr(q_norm), norm_ptr(k_norm), cache[0].data_ptr(),
                         cache[1].data_ptr()])
        self._table = torch.tensor(rows, dtype=torch.int64, device=first.device)
        self._table_key = key
        return self._table

    def run(self, residual: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata) -> bool:
        """residual: [T, hidden], the embedding output; every layer applied in place."""
        num_tokens = residual.shape[0]
        if (num_tokens > MAX_ROWS or num_tokens == 0 or metadata.max_query_len != 1
                or metadata.num_reqs != num_tokens or metadata.kv_hooks is not None
                or metadata.dense_prefill or metadata.split_queries
                or residual.dtype != self.dtype or residual.stride(1) != 1):
            return False
        table = self._pointer_table()
        if table is None:
            return False
        kv_cache = self.layers[0].self_attn.attn.kv_cache
        device = residual.device
        tiles = self.tiles
        fma = num_tokens <= tiles.fma_max_rows
        block_m = triton.next_power_of_2(num_tokens) if fma else 16
        min_rows = 1 if fma else 16
        programs = _num_programs(device)
        num_splits = choose_num_splits(num_tokens, self.num_kv_heads, programs)
        nh, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        d_pad = triton.next_power_of_2(d)
        qkv_n = (nh + 2 * kvh) * d

        def share(rows: int, k: int) -> _Projection:
            return _Projection.of(rows, k, programs, min_rows, tiles.max_tile_elems)

        qkv_p, o_p = share(qkv_n, self.hidden), share(self.hidden, nh * d)
        gate_up_p, down_p = share(self.inter, self.hidden), share(self.hidden, self.inter)
        qkv = torch.empty((block_m, qkv_n), dtype=self.dtype, device=device)
        attn = torch.empty((block_m, nh * d), dtype=self.dtype, device=device)
        act = torch.empty((block_m, self.inter), dtype=self.dtype, device=device)
        part_acc = torch.empty((block_m, nh, num_splits, d_pad), dtype=torch.float32,
                               device=device)
        part_max = torch.empty((block_m, nh, num_splits), dtype=torch.float32, device=device)
        part_sum = torch.empty_like(part_max)
        key_cache = kv_cache[0]
        block_tables = metadata.block_tables
        on_gpu = device.type == "cuda"
        _decode_layers_kernel[(programs,)](
            residual, positions, metadata.seq_lens, metadata.slot_mapping, block_tables,
            self.cos_sin_cache, table, qkv, attn, act, part_acc, part_max, part_sum,
            _sync_buffer(device), num_tokens, len(self.layers), residual.stride(0),
            block_tables.stride(0), self.cos_sin_cache.stride(0), key_cache.stride(0),
            key_cache.stride(1), key_cache.stride(2), self.norm_eps, self.head_eps,
            self.scale * LOG2_E,
            HIDDEN=self.hidden, HIDDEN_PAD=triton.next_power_of_2(self.hidden),
            INTER=self.inter, NUM_HEADS=nh, NUM_KV_HEADS=kvh, HEAD_DIM=d, HEAD_DIM_PAD=d_pad,
            NUM_SPLITS=num_splits, NUM_SPLITS_PAD=triton.next_power_of_2(num_splits),
            PAGE_SIZE=key_cache.shape[1], P=programs, P_PAD=triton.next_power_of_2(programs),
            BM=block_m,
            R_QKV=qkv_p.per_program, BN_QKV=qkv_p.block_rows, BK_QKV=qkv_p.block_k,
            R_O=o_p.per_program, BN_O=o_p.block_rows, BK_O=o_p.block_k,
            R_GATE_UP=gate_up_p.per_program, BN_GATE_UP=gate_up_p.block_rows,
            BK_GATE_UP=gate_up_p.block_k,
            R_DOWN=down_p.per_program, BN_DOWN=down_p.block_rows, BK_DOWN=down_p.block_k,
            BLOCK_N=ATTN_BLOCK_N, HAS_NORM=self.has_norm, FMA=fma, UPCAST=_INTERPRET,
            DOT_PRECISION="ieee" if self.dtype == torch.float32 else "tf32",
            PREFETCH=tiles.prefetch and on_gpu, USE_ASM=on_gpu, PHASES=tiles.phases,
            num_warps=tiles.num_warps, num_stages=1,
        )
        return True
