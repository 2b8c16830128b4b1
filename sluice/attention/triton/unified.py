"""Paged causal attention for any mix of decodes, chunked prefills and fresh prefills, one launch.

Grid: (query tiles, KV heads). A program owns one KV head and a tile of `BLOCK_Q` consecutive
query tokens of one request times the `GROUP` query heads that share that KV head (GQA packing:
`BLOCK_M = BLOCK_Q * GROUP_PAD` rows, row r = (token r // GROUP_PAD, head r % GROUP_PAD)), so each
K/V tile is loaded once for the whole group. The grid depends only on python ints; each program
finds its request by a binary search over `query_start_loc` on the device, so the launch needs no
host sync and can be captured in a CUDA graph.

A request's queries are the last `query_len` positions of its `seq_len` context. A query tile
reads KV tiles up to its last query's position only (causal tile skipping); tiles wholly at or
before its first query's position need no mask, the rest are masked. With a sliding window
(SLIDING) it also starts at the tile of its first query's first visible key, and masks the
tiles that reach before its last query's window. Requests with seq_len 0 and padding tokens
past the last request get zeros.

A launch may be restricted to requests whose query length lies in a range, so a mixed batch can
run its decodes with small tiles and its prefills with large ones in two launches.

Without a bound cache (a profiling run) every request is a fresh prefill and keys/values are read
straight from `key` / `value` (PAGED=False).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.attention.metadata import AttentionMetadata
from sluice.attention.triton.common import (
    LOG2_E,
    KernelDtypes,
    TileConfig,
    attend_tile,
    find_tile_owner,
    fit_tiles,
    group_padded,
)
from sluice.model.pdl import pdl_wait, use_pdl

MAX_INT32 = 2**31 - 1


# Integers that change from step to step are not specialised on (Triton would otherwise compile
# a variant per divisibility class of each, mid-run, on a fresh machine).
@triton.jit(do_not_specialize=["num_reqs", "num_tokens", "num_q_tiles", "min_query_len",
                               "max_query_len", "window", "stride_block_table"])
def _unified_attention_kernel(
    out_ptr,  # [T, H, D]
    query_ptr,  # [T, H, D]
    key_ptr,  # paged: key cache [num_blocks, block_size, KVH, D]; else keys [T, KVH, D]
    value_ptr,
    block_tables_ptr,  # [num_reqs, max_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    order_ptr,  # [num_reqs] int32 (ORDERED only): the request of each program
    num_reqs,
    num_tokens,
    num_q_tiles,
    min_query_len,  # requests with other query lengths are left to another launch
    max_query_len,
    window,  # SLIDING: each query sees the keys at positions > its own - window
    qk_scale,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_kv_block,
    stride_kv_slot,  # paged: between slots of a block; not paged: between tokens
    stride_kv_head,
    stride_block_table,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
    SLIDING: tl.constexpr,  # a sliding window (`window`) bounds the keys from below
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,  # KernelDtypes.fp16_dots
    ONE_QUERY: tl.constexpr,  # every request in this launch has one query token
    ORDERED: tl.constexpr,  # ONE_QUERY, no padding tokens, programs follow order_ptr
    USE_PDL: tl.constexpr,  # programmatic dependent launch (sluice.model.pdl)
):
    pdl_wait(USE_PDL)  # first: before any read of an activation and any write
    kv_head = tl.program_id(1)
    if ORDERED:
        # A decode batch with an order: program i serves request order[i] (longest first), whose
        # one query is token req (no padding tokens after the requests).
        req = tl.load(order_ptr + tl.program_id(0))
        q_start = req
        seq_len = tl.load(seq_lens_ptr + req)
        query_len = 1
        q_tile_start = 0
    else:
        # Late tiles of a request see the most keys: start them first for a better tail.
        tile = num_q_tiles - 1 - tl.program_id(0)
        req = find_tile_owner(query_start_loc_ptr, num_reqs, tile, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + req)
        q_end = num_tokens
        seq_len = 0
        if req < num_reqs:
            q_end = tl.load(query_start_loc_ptr + req + 1)
            seq_len = tl.load(seq_lens_ptr + req)
        query_len = q_end - q_start
        q_tile_start = (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q  # first query, local
    if (q_tile_start >= query_len) | (query_len < min_query_len) | (query_len > max_query_len):
        return
    context_len = seq_len - query_len  # keys before this step's queries

    rows = tl.arange(0, BLOCK_M)
    q_local = q_tile_start + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_valid = (q_local < query_len) & (head_in_group < GROUP)
    token = (q_start + q_local).to(tl.int64)
    head = kv_head * GROUP + head_in_group
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        query_ptr
        + token[:, None] * stride_query_token
        + head[:, None] * stride_query_head
        + dims[None, :],
        mask=row_valid[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(query_ptr.dtype.element_ty).to(tl.float32)
    else:
        q = q.to(query_ptr.dtype.element_ty)
    query_pos = context_len + q_local  # [BLOCK_M]

    k_base = key_ptr + kv_head * stride_kv_head
    v_base = value_ptr + kv_head * stride_kv_head
    block_table_row = block_tables_ptr + req.to(tl.int64) * stride_block_table
    # Keys [0, num_full * BLOCK_N) lie at or before the tile's first query: no mask. Keys up to
    # the tile's last query are masked; later ones are never loaded.
    first_query_pos = context_len + q_tile_start
    num_full = tl.maximum(first_query_pos + 1, 0) // BLOCK_N
    key_end = tl.minimum(seq_len, first_query_pos + BLOCK_Q)
    num_tiles = tl.cdiv(tl.maximum(key_end, 0), BLOCK_N)
    # A sliding window: keys before the first query's window are never loaded (the loops start
    # at its tile); tiles that reach before the last query's window are masked too, so the
    # unmasked middle is [first_full, num_full).
    key_start = 0
    first_tile = 0
    first_full = 0
    if SLIDING:
        key_start = tl.maximum(first_query_pos - window + 1, 0)
        first_tile = key_start // BLOCK_N
        first_full = tl.minimum(tl.cdiv(tl.maximum(key_end - window, 0), BLOCK_N), num_tiles)
        num_full = tl.maximum(num_full, first_full)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    if ONE_QUERY:
        # Decode: one pipelined loop, every tile masked at seq_len (the query is the last
        # position, so nothing else to mask), rather than an unpipelined pass over the last,
        # partial tile: a dependent round trip to memory per program. On the ragged decode
        # batches of the nano-vllm workload (H200) this took the kernel from 64-84% to 64-85%
        # of the copy bandwidth, +2.5 points on average over six batch sizes.
        num_full = 0
        for t in range(first_tile, num_tiles):
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, k_base, v_base, block_table_row, q_start, t * BLOCK_N,
                seq_len, query_pos, key_start, window, stride_kv_block, stride_kv_slot, dims,
                dim_mask, qk_scale, BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, PAGED=PAGED,
                MASK=True, CAUSAL=False, SLIDING=SLIDING,
                MASK_DIMS=HEAD_DIM != HEAD_DIM_PAD, UPCAST_DOT=UPCAST_DOT,
                DOT_PRECISION=DOT_PRECISION,
                COMPUTE_DTYPE=query_ptr.dtype.element_ty, FP16_DOTS=FP16_DOTS,
            )
        num_tiles = 0
        first_full = 0
    if SLIDING:
        for t in tl.range(first_tile, first_full, num_stages=1):  # the window's lower edge
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, k_base, v_base, block_table_row, q_start, t * BLOCK_N,
                seq_len, query_pos, key_start, window, stride_kv_block, stride_kv_slot, dims,
                dim_mask, qk_scale, BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, PAGED=PAGED,
                MASK=True, CAUSAL=True, SLIDING=True,
                MASK_DIMS=HEAD_DIM != HEAD_DIM_PAD, UPCAST_DOT=UPCAST_DOT,
                DOT_PRECISION=DOT_PRECISION,
                COMPUTE_DTYPE=query_ptr.dtype.element_ty, FP16_DOTS=FP16_DOTS,
            )
    for t in range(first_full, num_full):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, k_base, v_base, block_table_row, q_start, t * BLOCK_N, seq_len,
            query_pos, key_start, window, stride_kv_block, stride_kv_slot, dims, dim_mask,
            qk_scale, BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, PAGED=PAGED, MASK=False,
            CAUSAL=True, SLIDING=False,
            MASK_DIMS=HEAD_DIM != HEAD_DIM_PAD, UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION,
            COMPUTE_DTYPE=query_ptr.dtype.element_ty, FP16_DOTS=FP16_DOTS,
        )
    for t in tl.range(num_full, num_tiles, num_stages=1):  # few tiles: no smem to pipeline
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, k_base, v_base, block_table_row, q_start, t * BLOCK_N, seq_len,
            query_pos, key_start, window, stride_kv_block, stride_kv_slot, dims, dim_mask,
            qk_scale, BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, PAGED=PAGED, MASK=True,
            CAUSAL=True, SLIDING=SLIDING,
            MASK_DIMS=HEAD_DIM != HEAD_DIM_PAD, UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION,
            COMPUTE_DTYPE=query_ptr.dtype.element_ty, FP16_DOTS=FP16_DOTS,
        )
    # Rows that saw no key (seq_len 0) have l = 0 and acc = 0: write zeros.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_rows = token * stride_out_token + head * stride_out_head  # [BLOCK_M]
    tl.store(
        out_ptr + out_rows[:, None] + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_mask[None, :],
    )


def unified_attention(
    out: torch.Tensor,  # [T, H, D], written
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # paged: key cache [num_blocks, block_size, KVH, D]; else [T, KVH, D]
    value: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    tiles: TileConfig,
    paged: bool = True,
    query_lens: tuple[int, int] = (0, MAX_INT32),  # only requests with query_len in this range
    sliding_window: int | None = None,  # each query sees keys at positions > its own - window
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[-2]
    group, group_pad = group_padded(num_heads, num_kv_heads)
    block_m = max(tiles.block_m, group_pad)
    tiles, block_m = fit_tiles(tiles, block_m, triton.next_power_of_2(head_dim),
                               max(key.element_size(), query.element_size()),
                               min_block_m=max(16, group_pad))
    block_q = block_m // group_pad
    num_reqs = metadata.num_reqs
    # Request i's tiles start at query_start_loc[i] // BLOCK_Q + i (< num_tokens // BLOCK_Q +
    # num_reqs + 1 with the padding "request" num_reqs); an ordered decode batch needs a
    # program per request.
    one_query = metadata.max_query_len == 1 or query_lens[1] <= 1
    ordered = (metadata.decode_order is not None and metadata.max_query_len == 1
               and num_tokens == num_reqs and query_lens[0] <= 1 <= query_lens[1])
    num_q_tiles = num_reqs if ordered else num_tokens // block_q + num_reqs + 1
    dtypes = KernelDtypes.of(query.dtype, key.dtype, query.device)
    if paged:
        page_size = key.shape[1]
        stride_kv = (key.stride(0), key.stride(1), key.stride(2))
    else:
        page_size = 1
        stride_kv = (0, key.stride(0), key.stride(1))
    assert query.stride(2) == 1 and key.stride(-1) == 1 and out.stride(2) == 1
    pdl = use_pdl(query, "attention")
    _unified_attention_kernel[(num_q_tiles, num_kv_heads)](
        out,
        query,
        key,
        value,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        metadata.decode_order if ordered else metadata.seq_lens,
        num_reqs,
        num_tokens,
        num_q_tiles,
        *query_lens,
        sliding_window or 0,
        scale * LOG2_E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *stride_kv,
        metadata.block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=tiles.block_n,
        PAGE_SIZE=page_size,
        PAGED=paged,
        SLIDING=sliding_window is not None,
        UPCAST_DOT=dtypes.upcast_dot,
        DOT_PRECISION=dtypes.dot_precision,
        FP16_DOTS=dtypes.fp16_dots,
        ONE_QUERY=one_query,
        ORDERED=ordered,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        USE_PDL=pdl,
        launch_pdl=pdl,
    )
    return out
