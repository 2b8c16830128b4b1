"""Every decoder layer of a small decode batch in one persistent kernel (Llama, Qwen3: the folded
path of LlamaModel, its norms folded into the projections).

Why: at one to a few rows a decode step is a chain of ~200 short launches (28 layers x 7 for
Qwen3-0.6B), and each projection there costs 4-5 us on an H200 where streaming its weight takes
1-3: the cost is the kernel boundaries (a launch, the first loads' round trips, the tail), not
the bytes (`benchmarks/README.md`, "launch boundaries, not the bytes"). Here one program per SM
runs every layer's work, a layer as six phases separated by grid-wide barriers:

1. q/k/v projection of the residual rows, each output scaled by its row's 1 / rms (the input
   norm folded into the weight), into `qkv` [M, (H + 2 KVH) D];
2. attention, split-KV: a work item is (row, KV head, split of its context); it norms and rotates
   its query heads (and, holding the context's last key, the new k, storing k and v into the
   layer's paged cache at the row's slot), then writes its partial softmax;
3. the merge of each (row, head)'s splits into `attn` [M, H D];
4. o_proj, accumulated into the residual;
5. gate/up of the residual rows (scaled by 1 / rms: the post-attention norm folded), SiLU and
   the product, into `act` [M, I];
6. down_proj, accumulated into the residual.

A barrier is an arrival counter in global memory: each program adds one (release) and spins until
every program has arrived (acquire); data written within the launch is read back with `.cg` loads
(L2, never a stale L1 line). The weights no phase writes are asked into L2 two phases ahead of
their use (`prefetch_l2`), so their bytes stream from HBM while barriers and attention run. The
grid is one program per SM, all resident at once (a barrier waits for every program); the last
program out resets the counters for the next launch.

Each value is rounded where the layer-by-layer kernels round it (sluice.model.triton_gemm,
sluice.model.triton_ops, sluice.attention.triton): the projections' float32 sums to the model
dtype, then the 1 / rms scaling, the q/k norm, the rotation, the residual sums, SiLU and its
product, each rounded as there; only the summation order differs.

On the CPU (Triton's interpreter, the tests) the grid is one program: its barriers pass at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from sluice.attention.metadata import AttentionMetadata
from sluice.attention.triton.common import LOG2_E, attend_tile
from sluice.model.pdl import line_elems, lines_pad, prefetch_l2

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Decode batches of at most this many rows run here (the decode graphs of 1, 2, 4 and 8).
MAX_ROWS = 8
# Keys per attention tile, and the most splits of one (row, KV head)'s context.
ATTN_BLOCK_N = 64
MAX_SPLITS = 32
# A layer's row of the pointer table: its weights (q/k/v, o, gate/up, down), q/k norm weights,
# key and value caches, in this order (the kernel reads them by index).
_TABLE_ENTRIES = ("qkv", "o", "gate_up", "down", "q_norm", "k_norm", "key_cache", "value_cache")


@triton.jit
def _grid_sync(sync_ptr, target):
    """Wait until `target` arrivals (every program's, at this barrier and all before it)."""
    tl.debug_barrier()  # every thread's writes of the phase are issued before the release
    tl.atomic_add(sync_ptr, 1, sem="release", scope="gpu")
    while tl.atomic_add(sync_ptr, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton.jit
def _layer_ptr(table_ptr, layer, index: tl.constexpr, DTYPE: tl.constexpr):
    return tl.load(table_ptr + layer * 8 + index).to(tl.pointer_type(DTYPE))


@triton.jit
def _prefetch_rows(w_ptr, row0, K: tl.constexpr, BN: tl.constexpr, LINE_ELEMS: tl.constexpr,
                   LINES_PAD: tl.constexpr):
    """Ask the L2 lines of weight rows [row0, row0 + BN) x [0, K) from HBM."""
    rows = (row0 + tl.arange(0, BN)).to(tl.int64) * K
    line_k = tl.minimum(tl.arange(0, LINES_PAD) * LINE_ELEMS, K - 1)
    prefetch_l2(w_ptr + rows[:, None] + line_k[None, :])


@triton.jit
def _prefetch_phase(w_ptr, pid, P, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                    LINE_ELEMS: tl.constexpr, LINES_PAD: tl.constexpr, PREFETCH: tl.constexpr):
    """This program's weight rows of a projection phase (items pid, pid + P, ... of BN rows);
    LINES_PAD: a power of two >= the L2 lines of a row."""
    if PREFETCH:
        for j in range(0, tl.cdiv(N // BN - pid, P)):
            _prefetch_rows(w_ptr, (pid + j * P) * BN, K, BN, LINE_ELEMS, LINES_PAD)


@triton.jit
def _rows_dot(w_ptr, row0, x_ptr, stride_x, M, K: tl.constexpr, BN: tl.constexpr,
              BM: tl.constexpr, BK: tl.constexpr, FMA: tl.constexpr, UPCAST: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """[BN, BM] float32: weight rows [row0, row0 + BN) (each K long) times rows [0, M) of x."""
    rows = row0 + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    ms = tl.arange(0, BM)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
    acc = tl.zeros((BN, BM), tl.float32)
    for k0 in tl.static_range(0, K, BK):
        w = tl.load(w_ptrs + k0, eviction_policy="evict_first")
        if FMA:  # a few rows: multiply-adds on the CUDA cores, the weight tile read once
            w32 = w.to(tl.float32)
            for mi in tl.static_range(BM):
                x_row = tl.load(x_ptr + mi * stride_x + k0 + ks, mask=(ks < BK) & (mi < M),
                                other=0.0, cache_modifier=".cg").to(tl.float32)
                part = tl.sum(w32 * x_row[None, :], axis=1)  # [BN]
                acc += tl.where(ms[None, :] == mi, part[:, None], 0.0)
        else:
            x = tl.load(x_ptr + ms[:, None] * stride_x + k0 + ks[None, :],
                        mask=(ms < M)[:, None], other=0.0, cache_modifier=".cg")
            if UPCAST:
                w = w.to(tl.float32)
                x = x.to(tl.float32)
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _rows_mean_square(x_ptr, stride_x, M, HIDDEN: tl.constexpr, HIDDEN_PAD: tl.constexpr,
                      BM: tl.constexpr, eps):
    """[BM] mean(x^2) + eps of rows [0, M) of x, in float32: 1 / rms is its rsqrt."""
    ms = tl.arange(0, BM)
    cols = tl.arange(0, HIDDEN_PAD)
    x = tl.load(x_ptr + ms[:, None] * stride_x + cols[None, :],
                mask=(ms < M)[:, None] & (cols < HIDDEN)[None, :], other=0.0,
                cache_modifier=".cg").to(tl.float32)
    return tl.sum(x * x, axis=1) / HIDDEN + eps


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
def _attention_item(item, qkv_ptr, stride_qkv, positions_ptr, cos_sin_ptr, stride_cos_sin,
                    q_norm_ptr, k_norm_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                    block_tables_ptr, stride_block_table, seq_lens_ptr, part_acc_ptr,
                    part_max_ptr, part_sum_ptr, qk_scale, head_eps, stride_cache_block,
                    stride_cache_slot, stride_cache_head,
                    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    HAS_NORM: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    DTYPE: tl.constexpr):
    """Work item (row, KV head, split): its partial softmax over its share of the context."""
    split = item % NUM_SPLITS
    kv_head = (item // NUM_SPLITS) % NUM_KV_HEADS
    row = item // (NUM_SPLITS * NUM_KV_HEADS)
    seq_len = tl.load(seq_lens_ptr + row, cache_modifier=".cg")
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_begin = split * tiles_per_split
    if tile_begin < num_tiles:  # else a split past the context: the merge reads none of it
        tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
        HALF: tl.constexpr = HEAD_DIM // 2
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_mask = dims < HEAD_DIM
        partner = (dims + HALF) % HEAD_DIM
        sign = tl.where(dims < HALF, -1.0, 1.0)[None, :]
        position = tl.load(positions_ptr + row, cache_modifier=".cg").to(tl.int64)
        freq = dims % HALF
        cos = tl.load(cos_sin_ptr + position * stride_cos_sin + freq, mask=dim_mask,
                      other=0.0)[None, :]
        sin = tl.load(cos_sin_ptr + position * stride_cos_sin + HALF + freq, mask=dim_mask,
                      other=0.0)[None, :]
        qkv_row = qkv_ptr + row * stride_qkv
        # The query heads of this KV head: rows [0, GROUP) of a [BLOCK_Q, D] tile.
        q_rows = tl.arange(0, BLOCK_Q)
        q_valid = (q_rows < GROUP)[:, None] & dim_mask[None, :]
        q_cols = (kv_head * GROUP + q_rows)[:, None] * HEAD_DIM
        x = tl.load(qkv_row + q_cols + dims[None, :], mask=q_valid, other=0.0,
                    cache_modifier=".cg").to(tl.float32)
        x_partner = tl.load(qkv_row + q_cols + partner[None, :], mask=q_valid, other=0.0,
                            cache_modifier=".cg").to(tl.float32)
        q = _norm_rope(x, x_partner, head_eps, q_norm_ptr, dims, partner, dim_mask, cos, sin,
                       sign, HEAD_DIM, HAS_NORM, DTYPE)
        if UPCAST:
            q = q.to(tl.float32)
        cache_head = kv_head * stride_cache_head
        if tile_end == num_tiles:
            # This split holds the context's last key, the row's new token: its k normed and
            # rotated, and its v (already scaled), go to the cache first.
            k_cols = (NUM_HEADS + kv_head) * HEAD_DIM
            k = tl.load(qkv_row + k_cols + dims[None, :], mask=dim_mask[None, :], other=0.0,
                        cache_modifier=".cg").to(tl.float32)
            k_partner = tl.load(qkv_row + k_cols + partner[None, :], mask=dim_mask[None, :],
                                other=0.0, cache_modifier=".cg").to(tl.float32)
            k = _norm_rope(k, k_partner, head_eps, k_norm_ptr, dims, partner, dim_mask, cos,
                           sin, sign, HEAD_DIM, HAS_NORM, DTYPE)
            v_cols = (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
            v = tl.load(qkv_row + v_cols + dims[None, :], mask=dim_mask[None, :], other=0.0,
                        cache_modifier=".cg")
            slot = tl.load(slot_mapping_ptr + row, cache_modifier=".cg")
            cache_offsets = ((slot // PAGE_SIZE) * stride_cache_block
                             + (slot % PAGE_SIZE) * stride_cache_slot + cache_head + dims[None, :])
            store_mask = dim_mask[None, :] & (slot >= 0)
            tl.store(k_cache_ptr + cache_offsets, k, mask=store_mask)
            tl.store(v_cache_ptr + cache_offsets, v, mask=store_mask)
            tl.debug_barrier()  # the stores are visible to the block's loads of the tile below
        block_table_row = block_tables_ptr + row.to(tl.int64) * stride_block_table
        query_pos = tl.zeros([BLOCK_Q], tl.int32) + seq_len - 1
        m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, HEAD_DIM_PAD], tl.float32)
        for t in range(tile_begin, tile_end):
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, k_cache_ptr + cache_head, v_cache_ptr + cache_head,
                block_table_row, 0, t * BLOCK_N, seq_len, query_pos, stride_cache_block,
                stride_cache_slot, dims, dim_mask, qk_scale, BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE,
                PAGED=True, MASK=True, CAUSAL=False, MASK_DIMS=HEAD_DIM != HEAD_DIM_PAD,
                UPCAST_DOT=UPCAST, DOT_PRECISION=DOT_PRECISION, COMPUTE_DTYPE=DTYPE,
                FP16_DOTS=False,
            )
        head = kv_head * GROUP + q_rows
        stat = (row * NUM_HEADS + head) * NUM_SPLITS + split  # [BLOCK_Q]
        q_row_valid = q_rows < GROUP
        tl.store(part_max_ptr + stat, m_i, mask=q_row_valid)
        tl.store(part_sum_ptr + stat, l_i, mask=q_row_valid)
        tl.store(part_acc_ptr + stat[:, None] * HEAD_DIM_PAD + dims[None, :], acc,
                 mask=q_row_valid[:, None])


@triton.jit
def _merge_item(item, attn_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, seq_lens_ptr,
                NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                NUM_SPLITS: tl.constexpr, NUM_SPLITS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                DTYPE: tl.constexpr):
    """Work item (row, head): its splits' partial softmaxes merged into attn[row, head]."""
    row = item // NUM_HEADS
    head = item % NUM_HEADS
    seq_len = tl.load(seq_lens_ptr + row, cache_modifier=".cg")
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    used = tl.cdiv(num_tiles, tl.maximum(tl.cdiv(num_tiles, NUM_SPLITS), 1))
    splits = tl.arange(0, NUM_SPLITS_PAD)
    split_mask = splits < used
    dims = tl.arange(0, HEAD_DIM_PAD)
    stat = item * NUM_SPLITS + splits
    m = tl.load(part_max_ptr + stat, mask=split_mask, other=float("-inf"), cache_modifier=".cg")
    l_split = tl.load(part_sum_ptr + stat, mask=split_mask, other=0.0, cache_modifier=".cg")
    acc = tl.load(part_acc_ptr + stat[:, None] * HEAD_DIM_PAD + dims[None, :],
                  mask=split_mask[:, None], other=0.0, cache_modifier=".cg")
    m_all = tl.max(m, 0)
    # Splits with no key (and padding rows) have m = -inf: weight 0, and zeros out.
    weight = tl.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))
    total = tl.sum(l_split * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(attn_ptr + (row * NUM_HEADS + head) * HEAD_DIM + dims, out.to(DTYPE),
             mask=dims < HEAD_DIM)


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
    sync_ptr,  # [2] int32: barrier arrivals, exits; zero between launches
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
    PAGE_SIZE: tl.constexpr,
    BM: tl.constexpr,
    BN_QKV: tl.constexpr,
    BN_O: tl.constexpr,
    BN_GATE_UP: tl.constexpr,
    BN_DOWN: tl.constexpr,
    BK_HIDDEN: tl.constexpr,
    BK_ATTN: tl.constexpr,
    BK_INTER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FMA: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
    LINE_ELEMS: tl.constexpr,  # weight elements per L2 line
    LINES_HIDDEN: tl.constexpr,  # a power of two >= the L2 lines of a row of HIDDEN elements
    LINES_ATTN: tl.constexpr,  # ... of NUM_HEADS * HEAD_DIM
    LINES_INTER: tl.constexpr,  # ... of INTER
    NUM_SPLITS_PAD: tl.constexpr,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    DTYPE: tl.constexpr = residual_ptr.dtype.element_ty
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    BLOCK_Q: tl.constexpr = 16 if GROUP <= 16 else GROUP
    Q_SIZE: tl.constexpr = NUM_HEADS * HEAD_DIM
    QKV_N: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    ms = tl.arange(0, BM)
    m_mask = ms < M
    arrivals = 0
    _prefetch_phase(_layer_ptr(table_ptr, 0, 0, DTYPE), pid, P, QKV_N, HIDDEN, BN_QKV,
                    LINE_ELEMS, LINES_HIDDEN, PREFETCH)
    _prefetch_phase(_layer_ptr(table_ptr, 0, 1, DTYPE), pid, P, HIDDEN, Q_SIZE, BN_O,
                    LINE_ELEMS, LINES_ATTN, PREFETCH)
    for layer in range(num_layers):
        qkv_w = _layer_ptr(table_ptr, layer, 0, DTYPE)
        o_w = _layer_ptr(table_ptr, layer, 1, DTYPE)
        gate_up_w = _layer_ptr(table_ptr, layer, 2, DTYPE)
        down_w = _layer_ptr(table_ptr, layer, 3, DTYPE)

        # 1. qkv = (residual W_qkv^T rounded) / rms(residual), rounded.
        inv_rms = tl.rsqrt(_rows_mean_square(residual_ptr, stride_residual, M, HIDDEN, HIDDEN_PAD,
                                         BM, norm_eps))
        for j in range(0, tl.cdiv(QKV_N // BN_QKV - pid, P)):
            row0 = (pid + j * P) * BN_QKV
            acc = _rows_dot(qkv_w, row0, residual_ptr, stride_residual, M, HIDDEN, BN_QKV, BM,
                            BK_HIDDEN, FMA, UPCAST, DOT_PRECISION)
            out = (acc.to(DTYPE).to(tl.float32) * inv_rms[None, :]).to(DTYPE)
            cols = row0 + tl.arange(0, BN_QKV)
            tl.store(qkv_ptr + ms[None, :] * QKV_N + cols[:, None], out, mask=m_mask[None, :])
        arrivals += 1
        _grid_sync(sync_ptr, arrivals * P)

        # 2. attention partials; meanwhile gate/up's weights on their way to L2.
        _prefetch_phase(gate_up_w, pid, P, 2 * INTER, HIDDEN, BN_GATE_UP, LINE_ELEMS,
                        LINES_HIDDEN, PREFETCH)
        num_attn_items = M * NUM_KV_HEADS * NUM_SPLITS
        for j in range(0, tl.cdiv(num_attn_items - pid, P)):
            _attention_item(
                pid + j * P, qkv_ptr, QKV_N, positions_ptr, cos_sin_ptr, stride_cos_sin,
                _layer_ptr(table_ptr, layer, 4, DTYPE), _layer_ptr(table_ptr, layer, 5, DTYPE),
                _layer_ptr(table_ptr, layer, 6, DTYPE), _layer_ptr(table_ptr, layer, 7, DTYPE),
                slot_mapping_ptr, block_tables_ptr, stride_block_table, seq_lens_ptr,
                part_acc_ptr, part_max_ptr, part_sum_ptr, qk_scale, head_eps,
                stride_cache_block, stride_cache_slot, stride_cache_head,
                NUM_HEADS, NUM_KV_HEADS, GROUP, HEAD_DIM, HEAD_DIM_PAD, NUM_SPLITS, BLOCK_Q,
                BLOCK_N, PAGE_SIZE, HAS_NORM, UPCAST, DOT_PRECISION, DTYPE)
        arrivals += 1
        _grid_sync(sync_ptr, arrivals * P)

        # 3. merge the splits; down_proj's weights on their way.
        _prefetch_phase(down_w, pid, P, HIDDEN, INTER, BN_DOWN, LINE_ELEMS, LINES_INTER,
                        PREFETCH)
        for j in range(0, tl.cdiv(M * NUM_HEADS - pid, P)):
            _merge_item(pid + j * P, attn_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
                        seq_lens_ptr, NUM_HEADS, HEAD_DIM, HEAD_DIM_PAD, NUM_SPLITS,
                        NUM_SPLITS_PAD, BLOCK_N, DTYPE)
        arrivals += 1
        _grid_sync(sync_ptr, arrivals * P)

        # 4. residual += attn W_o^T; the next layer's q/k/v weights on their way.
        if layer + 1 < num_layers:
            _prefetch_phase(_layer_ptr(table_ptr, layer + 1, 0, DTYPE), pid, P, QKV_N, HIDDEN,
                            BN_QKV, LINE_ELEMS, LINES_HIDDEN, PREFETCH)
        for j in range(0, tl.cdiv(HIDDEN // BN_O - pid, P)):
            row0 = (pid + j * P) * BN_O
            acc = _rows_dot(o_w, row0, attn_ptr, Q_SIZE, M, Q_SIZE, BN_O, BM, BK_ATTN, FMA,
                            UPCAST, DOT_PRECISION)
            cols = row0 + tl.arange(0, BN_O)
            r_ptrs = residual_ptr + ms[None, :] * stride_residual + cols[:, None]
            acc += tl.load(r_ptrs, mask=m_mask[None, :], other=0.0,
                           cache_modifier=".cg").to(tl.float32)
            tl.store(r_ptrs, acc.to(DTYPE), mask=m_mask[None, :])
        arrivals += 1
        _grid_sync(sync_ptr, arrivals * P)

        # 5. act = silu(gate) * up of (residual W_gate_up^T) / rms(residual), each rounded.
        if layer + 1 < num_layers:
            _prefetch_phase(_layer_ptr(table_ptr, layer + 1, 1, DTYPE), pid, P, HIDDEN, Q_SIZE,
                            BN_O, LINE_ELEMS, LINES_ATTN, PREFETCH)
        inv_rms = 1.0 / tl.sqrt(_rows_mean_square(residual_ptr, stride_residual, M, HIDDEN,
                                              HIDDEN_PAD, BM, norm_eps))
        for j in range(0, tl.cdiv(INTER // BN_GATE_UP - pid, P)):
            row0 = (pid + j * P) * BN_GATE_UP
            gate = _rows_dot(gate_up_w, row0, residual_ptr, stride_residual, M, HIDDEN,
                             BN_GATE_UP, BM, BK_HIDDEN, FMA, UPCAST, DOT_PRECISION)
            up = _rows_dot(gate_up_w, INTER + row0, residual_ptr, stride_residual, M, HIDDEN,
                           BN_GATE_UP, BM, BK_HIDDEN, FMA, UPCAST, DOT_PRECISION)
            gate = (gate * inv_rms[None, :]).to(DTYPE).to(tl.float32)
            up = (up * inv_rms[None, :]).to(DTYPE).to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
            cols = row0 + tl.arange(0, BN_GATE_UP)
            tl.store(act_ptr + ms[None, :] * INTER + cols[:, None], (silu * up).to(DTYPE),
                     mask=m_mask[None, :])
        arrivals += 1
        _grid_sync(sync_ptr, arrivals * P)

        # 6. residual += act W_down^T.
        for j in range(0, tl.cdiv(HIDDEN // BN_DOWN - pid, P)):
            row0 = (pid + j * P) * BN_DOWN
            acc = _rows_dot(down_w, row0, act_ptr, INTER, M, INTER, BN_DOWN, BM, BK_INTER, FMA,
                            UPCAST, DOT_PRECISION)
            cols = row0 + tl.arange(0, BN_DOWN)
            r_ptrs = residual_ptr + ms[None, :] * stride_residual + cols[:, None]
            acc += tl.load(r_ptrs, mask=m_mask[None, :], other=0.0,
                           cache_modifier=".cg").to(tl.float32)
            tl.store(r_ptrs, acc.to(DTYPE), mask=m_mask[None, :])
        arrivals += 1
        _grid_sync(sync_ptr, arrivals * P)

    # Every program is past the last barrier once it counts itself out: the last one resets the
    # counters for the next launch on the stream.
    done = tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if done == P - 1:
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")


@dataclass(frozen=True, slots=True)
class Tiles:
    """Weight rows a work item of each projection phase takes, and keys of K a load takes.
    Defaults for Qwen3-0.6B on an H200's 132 SMs: about one item a program for q/k/v (4,096
    rows), o_proj and down_proj (1,024), two or three for gate/up (3,072 of each)."""

    qkv: int = 32
    o: int = 8
    gate_up: int = 8
    down: int = 8
    block_k: int = 512
    # Rows of x at most this many: multiply-adds on the CUDA cores; more: tensor-core dots
    # (x padded to 16 rows).
    fma_max_rows: int = 2
    num_warps: int = 8
    # Each phase's weights asked into L2 two phases ahead (prefetch_l2); CUDA only.
    prefetch: bool = True

    def for_dots(self) -> Tiles:
        """The tiles of the tensor-core dots: at least 16 weight rows an item."""
        return replace(self, qkv=max(16, self.qkv), o=max(16, self.o),
                       gate_up=max(16, self.gate_up), down=max(16, self.down))


DEFAULT_TILES = Tiles()


def _fit(rows: int, block: int) -> int:
    """The largest power of two <= block dividing rows (a work item never straddles the end)."""
    while block > 1 and rows % block:
        block //= 2
    return block


def _block_k(k: int, block: int) -> int:
    return _fit(k, block)


_SYNC: dict[torch.device, torch.Tensor] = {}


def _sync_counters(device: torch.device) -> torch.Tensor:
    """The barrier counters of a device, zero between launches (the last program out resets
    them); allocated by the first call, an eager one before any graph is captured."""
    sync = _SYNC.get(device)
    if sync is None:
        sync = torch.zeros(2, dtype=torch.int32, device=device)
        _SYNC[device] = sync
    return sync


def choose_num_splits(num_rows: int, num_kv_heads: int, num_programs: int) -> int:
    """Splits of each (row, KV head)'s context: about one attention item a program."""
    return max(1, min(MAX_SPLITS, num_programs // (num_rows * num_kv_heads)))


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
        self.scale = attn.attn.scale
        self.hidden = attn.qkv_proj.input_size
        self.inter = mlp.down_proj.input_size
        self.dtype = attn.qkv_proj.weight.dtype
        self.norm_eps = layers[0].input_layernorm.eps
        q_norm, _, head_eps = attn.qk_norms()
        self.has_norm = q_norm is not None
        self.head_eps = head_eps
        self.cos_sin_cache = attn.rotary_emb.cos_sin_cache
        qkv_n = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        sizes = (qkv_n, self.hidden, self.inter, self.hidden)

        def fitted(t: Tiles, min_rows: int) -> Tiles | None:
            blocks = [_fit(n, b) for n, b in zip(sizes, (t.qkv, t.o, t.gate_up, t.down))]
            if min(blocks) < min_rows:
                return None
            return replace(t, qkv=blocks[0], o=blocks[1], gate_up=blocks[2], down=blocks[3])

        # Multiply-add tiles (a few rows), and tensor-core ones, whose items are 16 weight rows
        # or more (None: sizes they cannot cut so).
        self.tiles = fitted(tiles, 2)
        self.dot_tiles = fitted(tiles.for_dots(), 16)
        if self.tiles is None:
            raise ValueError("persistent decode needs projection sizes with a power-of-two "
                             "factor of at least 2")
        self._table: torch.Tensor | None = None
        self._table_key: tuple[int, ...] = ()

    def _pointer_table(self) -> torch.Tensor | None:
        """[L, 8] int64: each layer's addresses (_TABLE_ENTRIES), or None while no cache is
        bound; made again when another cache is bound."""
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
        fma = num_tokens <= self.tiles.fma_max_rows
        tiles = self.tiles if fma else self.dot_tiles
        if tiles is None:
            return False
        block_m = triton.next_power_of_2(num_tokens) if fma else 16
        programs = _num_programs(device)
        num_splits = choose_num_splits(num_tokens, self.num_kv_heads, programs)
        nh, d = self.num_heads, self.head_dim
        d_pad = triton.next_power_of_2(d)
        qkv_n = (nh + 2 * self.num_kv_heads) * d
        qkv = torch.empty((block_m, qkv_n), dtype=self.dtype, device=device)
        attn = torch.empty((block_m, nh * d), dtype=self.dtype, device=device)
        act = torch.empty((block_m, self.inter), dtype=self.dtype, device=device)
        part_acc = torch.empty((block_m, nh, num_splits, d_pad), dtype=torch.float32,
                               device=device)
        part_max = torch.empty((block_m, nh, num_splits), dtype=torch.float32, device=device)
        part_sum = torch.empty_like(part_max)
        key_cache = kv_cache[0]
        block_tables = metadata.block_tables
        lines = lambda n: lines_pad(n, residual)  # noqa: E731
        _decode_layers_kernel[(programs,)](
            residual, positions, metadata.seq_lens, metadata.slot_mapping, block_tables,
            self.cos_sin_cache, table, qkv, attn, act, part_acc, part_max, part_sum,
            _sync_counters(device), num_tokens, len(self.layers), residual.stride(0),
            block_tables.stride(0), self.cos_sin_cache.stride(0), key_cache.stride(0),
            key_cache.stride(1), key_cache.stride(2), self.norm_eps, self.head_eps,
            self.scale * LOG2_E,
            HIDDEN=self.hidden, HIDDEN_PAD=triton.next_power_of_2(self.hidden),
            INTER=self.inter, NUM_HEADS=nh, NUM_KV_HEADS=self.num_kv_heads, HEAD_DIM=d,
            HEAD_DIM_PAD=d_pad, NUM_SPLITS=num_splits, PAGE_SIZE=key_cache.shape[1],
            BM=block_m, BN_QKV=tiles.qkv, BN_O=tiles.o, BN_GATE_UP=tiles.gate_up,
            BN_DOWN=tiles.down, BK_HIDDEN=_block_k(self.hidden, tiles.block_k),
            BK_ATTN=_block_k(nh * d, tiles.block_k), BK_INTER=_block_k(self.inter, tiles.block_k),
            BLOCK_N=ATTN_BLOCK_N, HAS_NORM=self.has_norm, FMA=fma, UPCAST=_INTERPRET,
            DOT_PRECISION="ieee" if self.dtype == torch.float32 else "tf32",
            PREFETCH=tiles.prefetch and device.type == "cuda", LINE_ELEMS=line_elems(residual),
            LINES_HIDDEN=lines(self.hidden), LINES_ATTN=lines(nh * d),
            LINES_INTER=lines(self.inter), NUM_SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=tiles.num_warps, num_stages=1,
        )
        return True
