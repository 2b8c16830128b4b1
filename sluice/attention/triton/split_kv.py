"""Split-KV decode attention (flash-decoding): for a few long sequences, one program per
(token, KV head) would leave most SMs idle, so each request's context is cut into `num_splits`
slices that run in parallel, and a second kernel merges their partial softmaxes.

For batches where every request has at most MAX_QUERY_LEN query tokens, the last positions of
its context: decodes, and the verification of speculative drafts (1 + k tokens a request). Each
token attends to the keys up to its own position, so its context is seq_len less the request's
tokens after it, and no other causal mask is needed; with a sliding window only its last
`window` keys, whose tiles are the ones split. `num_splits` is a python int and every
buffer's shape follows from python ints, so both launches can be captured in a CUDA graph. Each
token's own tiles are spread evenly over the splits; splits past its end return at once, and the
merge reads only the splits that hold keys.
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
    find_token_owner,
    fit_tiles,
    group_padded,
)
from sluice.model.pdl import pdl_wait, use_pdl

# Query tokens per request the split path serves (a verification's 1 + k for k up to 7).
MAX_QUERY_LEN = 8


@triton.jit
def _token_context(seq_lens_ptr, query_start_loc_ptr, num_reqs, req, token):
    """Keys `token` attends to: its request's seq_len less the request's tokens after it (0
    for a padding token after the last request)."""
    context = token * 0
    if req < num_reqs:
        next_start = tl.load(query_start_loc_ptr + req + 1)
        context = tl.load(seq_lens_ptr + req) - (next_start - 1 - token)
    return context


@triton.jit
def _token_tiles(seq_len, window, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr):
    """(first key, first tile, number of tiles) a token with `seq_len` keys of context reads:
    all of them, or with a sliding window only the tiles holding its last `window` keys."""
    key_start = seq_len * 0
    if SLIDING:
        key_start = tl.maximum(seq_len - window, 0)
    first_tile = key_start // BLOCK_N
    return key_start, first_tile, tl.cdiv(seq_len, BLOCK_N) - first_tile


@triton.jit(do_not_specialize=["num_reqs", "window", "stride_block_table"])  # vary by step
def _split_kv_partial_kernel(
    partial_acc_ptr,  # [T, H, NUM_SPLITS, HEAD_DIM_PAD] float32, unnormalised
    partial_max_ptr,  # [T, H, NUM_SPLITS] float32, log2 domain
    partial_sum_ptr,  # [T, H, NUM_SPLITS] float32
    query_ptr,  # [T, H, D]
    key_cache_ptr,  # [num_blocks, block_size, KVH, D]
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_reqs,
    window,  # SLIDING: a token at position p sees keys at positions > p - window
    qk_scale,
    stride_query_token,
    stride_query_head,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_head,
    stride_block_table,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= GROUP: row r is query head kv_head * GROUP + r
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SLIDING: tl.constexpr,  # a sliding window (`window`) bounds the keys from below
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,  # KernelDtypes.fp16_dots
    USE_PDL: tl.constexpr,  # programmatic dependent launch (sluice.model.pdl)
):
    pdl_wait(USE_PDL)  # first: before any read of an activation and any write
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = find_token_owner(query_start_loc_ptr, num_reqs, token)
    seq_len = _token_context(seq_lens_ptr, query_start_loc_ptr, num_reqs, req, token)
    # The splits share the tiles the token reads (with a window, only the window's).
    key_start, first_tile, num_seq_tiles = _token_tiles(seq_len, window, BLOCK_N, SLIDING)
    tiles_per_split = tl.cdiv(num_seq_tiles, NUM_SPLITS)
    tile_begin = split * tiles_per_split
    if tile_begin >= num_seq_tiles:
        return  # a split past the context's end: the merge reads none of it (_used_splits)
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_seq_tiles)
    tile_begin += first_tile
    tile_end += first_tile

    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < GROUP
    head = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        query_ptr
        + token.to(tl.int64) * stride_query_token
        + head[:, None] * stride_query_head
        + dims[None, :],
        mask=row_valid[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if UPCAST_DOT:
        q = q.to(query_ptr.dtype.element_ty).to(tl.float32)
    else:
        q = q.to(query_ptr.dtype.element_ty)

    k_base = key_cache_ptr + kv_head * stride_kv_head
    v_base = value_cache_ptr + kv_head * stride_kv_head
    block_table_row = block_tables_ptr + req.to(tl.int64) * stride_block_table
    query_pos = tl.zeros([BLOCK_M], tl.int32) + seq_len - 1
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # One pipelined loop, every tile masked at seq_len: an unpipelined pass over the partial
    # last tile would add a dependent round trip to memory to the split that holds it.
    for t in range(tile_begin, tile_end):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, k_base, v_base, block_table_row, 0, t * BLOCK_N, seq_len,
            query_pos, key_start, window, stride_kv_block, stride_kv_slot, dims, dim_mask,
            qk_scale, BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, PAGED=True, MASK=True,
            CAUSAL=False, SLIDING=SLIDING, MASK_DIMS=HEAD_DIM != HEAD_DIM_PAD,
            UPCAST_DOT=UPCAST_DOT, DOT_PRECISION=DOT_PRECISION,
            COMPUTE_DTYPE=query_ptr.dtype.element_ty, FP16_DOTS=FP16_DOTS,
        )
    stat = (token.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + split  # [BLOCK_M]
    tl.store(partial_max_ptr + stat, m_i, mask=row_valid)
    tl.store(partial_sum_ptr + stat, l_i, mask=row_valid)
    tl.store(
        partial_acc_ptr + stat[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_valid[:, None]
    )


@triton.jit
def _used_splits(seq_len, window, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 SLIDING: tl.constexpr):
    """Splits that hold a tile of a context of seq_len keys (its window's, SLIDING): each takes
    cdiv(tiles, NUM_SPLITS) tiles in turn, so a short context fills the first few and the
    partial kernel's programs of the others return at once (decode graphs are captured with
    splits for max_model_len)."""
    _, _, num_seq_tiles = _token_tiles(seq_len, window, BLOCK_N, SLIDING)
    return tl.cdiv(num_seq_tiles, tl.maximum(tl.cdiv(num_seq_tiles, NUM_SPLITS), 1))


@triton.jit(do_not_specialize=["num_reqs", "window"])  # vary by step
def _split_kv_reduce_kernel(
    out_ptr,  # [T, H, D]
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    num_reqs,
    window,
    stride_out_token,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # the partial kernel's keys per tile
    SLIDING: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    NUM_SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (sluice.model.pdl)
):
    pdl_wait(USE_PDL)  # first: before any read of an activation and any write
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    req = find_token_owner(query_start_loc_ptr, num_reqs, token)
    seq_len = _token_context(seq_lens_ptr, query_start_loc_ptr, num_reqs, req, token)
    splits = tl.arange(0, NUM_SPLITS_PAD)
    split_mask = splits < _used_splits(seq_len, window, BLOCK_N, NUM_SPLITS, SLIDING)
    dims = tl.arange(0, HEAD_DIM_PAD)
    stat = (token * NUM_HEADS + head) * NUM_SPLITS + splits  # [NUM_SPLITS_PAD]
    m = tl.load(partial_max_ptr + stat, mask=split_mask, other=float("-inf"))
    l_split = tl.load(partial_sum_ptr + stat, mask=split_mask, other=0.0)
    acc = tl.load(
        partial_acc_ptr + stat[:, None] * HEAD_DIM_PAD + dims[None, :],
        mask=split_mask[:, None],
        other=0.0,
    )
    m_all = tl.max(m, 0)
    # Splits with no key (and whole padding rows) have m = -inf: weight 0, and zeros out.
    weight = tl.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))  # [NUM_SPLITS_PAD]
    total = tl.sum(l_split * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def split_kv_attention(
    out: torch.Tensor,  # [T, H, D], written
    query: torch.Tensor,  # [T, H, D], at most MAX_QUERY_LEN tokens per request
    key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    num_splits: int,
    tiles: TileConfig,
    sliding_window: int | None = None,  # each token sees keys at positions > its own - window
) -> torch.Tensor:
    if metadata.max_query_len > MAX_QUERY_LEN:
        raise ValueError(
            f"split-KV attention serves decodes and verifications (max_query_len at most "
            f"{MAX_QUERY_LEN}), got max_query_len {metadata.max_query_len}"
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group, group_pad = group_padded(num_heads, num_kv_heads)
    head_dim_pad = triton.next_power_of_2(head_dim)
    tiles, block_m = fit_tiles(tiles, max(tiles.block_m, group_pad), head_dim_pad,
                               max(key_cache.element_size(), query.element_size()),
                               min_block_m=max(16, group_pad))
    dtypes = KernelDtypes.of(query.dtype, key_cache.dtype, query.device)
    partial_acc = torch.empty(
        num_tokens, num_heads, num_splits, head_dim_pad, dtype=torch.float32, device=query.device
    )
    partial_max = torch.empty(
        num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device
    )
    partial_sum = torch.empty_like(partial_max)
    assert query.stride(2) == 1 and key_cache.stride(3) == 1 and out.stride(2) == 1
    pdl = use_pdl(query, "attention")
    _split_kv_partial_kernel[(num_tokens, num_kv_heads, num_splits)](
        partial_acc,
        partial_max,
        partial_sum,
        query,
        key_cache,
        value_cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        metadata.num_reqs,
        sliding_window or 0,
        scale * LOG2_E,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        metadata.block_tables.stride(0),
        NUM_HEADS=num_heads,
        NUM_SPLITS=num_splits,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=block_m,
        BLOCK_N=tiles.block_n,
        PAGE_SIZE=key_cache.shape[1],
        SLIDING=sliding_window is not None,
        UPCAST_DOT=dtypes.upcast_dot,
        DOT_PRECISION=dtypes.dot_precision,
        FP16_DOTS=dtypes.fp16_dots,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        USE_PDL=pdl,
        launch_pdl=pdl,
    )
    _split_kv_reduce_kernel[(num_tokens, num_heads)](
        out,
        partial_acc,
        partial_max,
        partial_sum,
        metadata.seq_lens,
        metadata.query_start_loc,
        metadata.num_reqs,
        sliding_window or 0,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        BLOCK_N=tiles.block_n,
        SLIDING=sliding_window is not None,
        NUM_SPLITS=num_splits,
        NUM_SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        USE_PDL=pdl,
        launch_pdl=pdl,
    )
    return out
