"""Decode attention straight from the q/k/v projection: one launch that does what
`qk_norm_rope_store_kv` (sluice.model.triton_ops) and the unified kernel's decode path do in two.

For a small decode batch on a GPU each layer is a chain of short launches, and every launch
boundary costs about as much as a small kernel's work: the time is the boundaries, not the bytes
(benchmarks/journal/2026-11-27-fused-decode-attention.md). Folding the q/k norm, RoPE and the KV
store into the attention kernel removes one boundary per layer.

Grid: (requests, KV heads), one query token per request (token i is request i's, as in every
decode batch). A program:
1. completes the layer's input norm (folded into the projection, LlamaModel.fold_norms) with its
   token's 1 / rms of the residual row, when given;
2. norms (Qwen3) and rotates its KV head's k and its GROUP query heads, scales v, and stores k
   and v at the token's slot of the paged cache (none for a padding token, slot < 0);
3. attends to the new key from registers first (its score and value start the online
   softmax), then to the request's cached keys as the unified kernel does; so nothing it reads
   waits for its own stores.

Every value is rounded where `qk_norm_rope` rounds it, so k, v and q are what the two launches
compute but for float32 summation order; the new key's softmax weight stays in float32 where the
tiles' weights are rounded to the cache dtype before their product with v.

Each program repeats its token's 1 / rms (a 2 KiB row, from L2 after the first), so the backend
uses this only while the programs fit about one wave (`sluice.attention.triton_backend`); the
prologue would be paid wave after wave beyond that.

Neox RoPE in one pass over whole heads: element d pairs with element (d + D / 2) % D, so each
head is loaded twice (the second load, permuted, comes from L1) rather than split in halves.
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
    to_cache_dtype,
)
from sluice.model.pdl import pdl_wait, use_pdl


@triton.jit
def _norm_rope(
    ptrs,  # [R, HEAD_DIM] addresses of each row's head in qkv
    rot_ptrs,  # the same rows, element d at (d + HEAD_DIM / 2) % HEAD_DIM
    mask,  # [R, HEAD_DIM]
    sign,  # [HEAD_DIM]: -1 in the first half, +1 in the second
    cos,  # [HEAD_DIM] float32: cos of each element's pair's frequency
    sin,
    row_scale,  # 1 / rms of the residual row (1.0 without ROW_RMS)
    weight_ptr,  # [HEAD_DIM] the head norm's weight (HAS_NORM)
    dims,
    rot_dims,
    eps,
    HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
    ROW_RMS: tl.constexpr,
):
    """qk_norm_rope's rounding steps for whole heads: [R, HEAD_DIM] in qkv's dtype."""
    dtype = ptrs.dtype.element_ty
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x_rot = tl.load(rot_ptrs, mask=mask, other=0.0).to(tl.float32)
    if ROW_RMS:
        x = (x * row_scale).to(dtype).to(tl.float32)
        x_rot = (x_rot * row_scale).to(dtype).to(tl.float32)
    if HAS_NORM:
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        w = tl.load(weight_ptr + dims).to(tl.float32)[None, :]
        w_rot = tl.load(weight_ptr + rot_dims).to(tl.float32)[None, :]
        x = (w * (x * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x_rot = (w_rot * (x_rot * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return (x * cos[None, :] + sign[None, :] * x_rot * sin[None, :]).to(dtype)


@triton.jit(do_not_specialize=["window", "stride_block_table"])
def _decode_from_qkv_kernel(
    out_ptr,  # [T, H, D]
    qkv_ptr,  # [T, (H + 2 * KVH) * D]: the projection, read only
    positions_ptr,  # [T]
    cos_sin_ptr,  # [max_pos, D] float32: cos in the first half, sin in the second
    q_weight_ptr,  # [D] (HAS_NORM)
    k_weight_ptr,  # [D]
    residual_ptr,  # [T, hidden] (ROW_RMS)
    slot_mapping_ptr,  # [>= T] int64; < 0: padding, not stored
    key_cache_ptr,  # [num_blocks, block_size, KVH, D]
    value_cache_ptr,
    block_tables_ptr,  # [num_reqs, max_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    order_ptr,  # [num_reqs] int32 (ORDERED): the request of each program
    window,  # SLIDING: the token at position p sees keys at positions > p - window
    qk_scale,
    eps,
    residual_eps,
    hidden_size,
    stride_qkv_token,
    stride_position,
    stride_residual,
    stride_out_token,
    stride_out_head,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_head,
    stride_block_table,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows: the group's heads, padded to a tensor-core tile
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,  # a power of two
    PAGE_SIZE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    ROW_RMS: tl.constexpr,
    HIDDEN_PAD: tl.constexpr,
    ORDERED: tl.constexpr,
    SLIDING: tl.constexpr,  # a sliding window (`window`) bounds the keys from below
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,  # KernelDtypes.fp16_dots
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)  # first: before any read of an activation and any write
    kv_head = tl.program_id(1)
    req = tl.program_id(0)
    if ORDERED:
        req = tl.load(order_ptr + req)
    token = req.to(tl.int64)  # one query a request: token i is request i's
    seq_len = tl.load(seq_lens_ptr + req)
    HALF: tl.constexpr = HEAD_DIM // 2
    dims = tl.arange(0, HEAD_DIM)
    rot_dims = (dims + HALF) % HEAD_DIM
    sign = tl.where(dims < HALF, -1.0, 1.0)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + position * stride_position + dims % HALF)
    sin = tl.load(cos_sin_ptr + position * stride_position + HALF + dims % HALF)
    row_scale = 1.0
    if ROW_RMS:
        cols = tl.arange(0, HIDDEN_PAD)
        row = tl.load(residual_ptr + token * stride_residual + cols, mask=cols < hidden_size,
                      other=0.0).to(tl.float32)
        row_scale = tl.rsqrt(tl.sum(row * row, axis=0) / hidden_size + residual_eps)
    qkv_row = qkv_ptr + token * stride_qkv_token
    dtype = qkv_ptr.dtype.element_ty

    # This KV head's k and v of the new token ([1, HEAD_DIM]), to the cache at its slot.
    k_head = qkv_row + (NUM_HEADS + kv_head) * HEAD_DIM
    all_dims = (dims < HEAD_DIM)[None, :]
    k = _norm_rope(k_head + dims[None, :], k_head + rot_dims[None, :], all_dims, sign, cos, sin,
                   row_scale, k_weight_ptr, dims, rot_dims, eps, HEAD_DIM=HEAD_DIM,
                   HAS_NORM=HAS_NORM, ROW_RMS=ROW_RMS)
    v = tl.load(k_head + (NUM_HEADS // GROUP) * HEAD_DIM + dims[None, :])  # v follows k
    if ROW_RMS:
        v = (v.to(tl.float32) * row_scale).to(dtype)
    slot = tl.load(slot_mapping_ptr + token)
    cache_offsets = ((slot // PAGE_SIZE) * stride_kv_block + (slot % PAGE_SIZE) * stride_kv_slot
                     + kv_head * stride_kv_head + dims[None, :])
    store_mask = all_dims & (slot >= 0)
    k_cached = to_cache_dtype(k, key_cache_ptr.dtype.element_ty)
    v_cached = to_cache_dtype(v, value_cache_ptr.dtype.element_ty)
    tl.store(key_cache_ptr + cache_offsets, k_cached, mask=store_mask)
    tl.store(value_cache_ptr + cache_offsets, v_cached, mask=store_mask)

    # The group's query heads.
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < GROUP
    head = kv_head * GROUP + rows
    q_mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
    q_heads = qkv_row + head[:, None] * HEAD_DIM
    q = _norm_rope(q_heads + dims[None, :], q_heads + rot_dims[None, :], q_mask, sign, cos,
                   sin, row_scale, q_weight_ptr, dims, rot_dims, eps, HEAD_DIM=HEAD_DIM,
                   HAS_NORM=HAS_NORM, ROW_RMS=ROW_RMS)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # The new key is attended to from registers, first; the loop reads the cached keys before
    # it. Nothing here reads the slots stored above (no barrier, and the loop's loads need not
    # wait for the stores).
    k_new = k_cached.to(dtype).to(tl.float32)  # as the cache holds it
    v_new = v_cached.to(dtype).to(tl.float32)
    s_new = tl.sum(q.to(tl.float32) * k_new, axis=1) * qk_scale  # [BLOCK_M]
    has_key = seq_len > 0
    m_i = tl.where(has_key, s_new, float("-inf"))
    l_i = tl.where(has_key, 1.0, 0.0) + tl.zeros([BLOCK_M], tl.float32)
    acc = tl.where(has_key, 1.0, 0.0) * v_new + tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    block_table_row = block_tables_ptr + req.to(tl.int64) * stride_block_table
    k_base = key_cache_ptr + kv_head * stride_kv_head
    v_base = value_cache_ptr + kv_head * stride_kv_head
    num_cached = tl.maximum(seq_len - 1, 0)
    query_pos = tl.zeros([BLOCK_M], tl.int32) + num_cached
    # With a window the new key is always in it (window >= 1); the cached keys start at
    # seq_len - window, and the loop at that key's tile.
    key_start = 0
    if SLIDING:
        key_start = tl.maximum(seq_len - window, 0)
    for t in range(key_start // BLOCK_N, tl.cdiv(num_cached, BLOCK_N)):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, k_base, v_base, block_table_row, 0, t * BLOCK_N, num_cached,
            query_pos, key_start, window, stride_kv_block, stride_kv_slot, dims,
            dims < HEAD_DIM, qk_scale, BLOCK_N=BLOCK_N, PAGE_SIZE=PAGE_SIZE, PAGED=True,
            MASK=True, CAUSAL=False, SLIDING=SLIDING, MASK_DIMS=False, UPCAST_DOT=UPCAST_DOT,
            DOT_PRECISION=DOT_PRECISION,
            COMPUTE_DTYPE=dtype, FP16_DOTS=FP16_DOTS,
        )
    # A padding request (seq_len 0) saw no key: l = 0, acc = 0, zeros written.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_rows = token * stride_out_token + head.to(tl.int64) * stride_out_head
    tl.store(out_ptr + out_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=q_mask)


def decode_from_qkv(
    qkv: torch.Tensor,  # [T, (H + 2 * KVH) * D], T = num_reqs (one query a request)
    positions: torch.Tensor,  # [>= T]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] float32
    q_norm_weight: torch.Tensor | None,  # [D]; None: no q/k norm (Llama)
    k_norm_weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None,  # [>= T, hidden]: the input norm folded; None: not
    residual_eps: float,
    num_heads: int,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
    metadata: AttentionMetadata,
    scale: float,
    tiles: TileConfig,
    sliding_window: int | None = None,  # the token sees keys at positions > its own - window
) -> torch.Tensor:  # [T, H * D]
    """Attention output of a decode batch from its raw q/k/v projection: `qk_norm_rope` with
    its KV store, then the unified kernel's decode path, in one launch (see the module)."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    if num_tokens != metadata.num_reqs or metadata.max_query_len != 1:
        raise ValueError(f"decode_from_qkv takes one query per request, got {num_tokens} "
                         f"tokens for {metadata.num_reqs} requests")
    if head_dim & (head_dim - 1) or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv of shape {tuple(qkv.shape)} does not hold {num_heads} + 2 x "
                         f"{num_kv_heads} heads of a power-of-two head_dim {head_dim}")
    assert qkv.stride(1) == 1 and cos_sin_cache.stride(1) == 1 and kv_cache.stride(4) == 1
    group = num_heads // num_kv_heads
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return out.view(num_tokens, num_heads * head_dim)
    has_norm = q_norm_weight is not None
    row_rms = residual is not None
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    ordered = metadata.decode_order is not None
    dtypes = KernelDtypes.of(qkv.dtype, kv_cache.dtype, qkv.device)
    pdl = use_pdl(qkv, "attention")
    _decode_from_qkv_kernel[(num_tokens, num_kv_heads)](
        out,
        qkv,
        positions,
        cos_sin_cache,
        q_norm_weight if has_norm else qkv,
        k_norm_weight if has_norm else qkv,
        residual if row_rms else qkv,
        metadata.slot_mapping,
        key_cache,
        value_cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.decode_order if ordered else metadata.seq_lens,
        sliding_window or 0,
        scale * LOG2_E,
        eps,
        residual_eps,
        residual.shape[1] if row_rms else 1,
        qkv.stride(0),
        cos_sin_cache.stride(0),
        residual.stride(0) if row_rms else 0,
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        metadata.block_tables.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=tiles.block_n,
        HEAD_DIM=head_dim,
        PAGE_SIZE=key_cache.shape[1],
        HAS_NORM=has_norm,
        ROW_RMS=row_rms,
        HIDDEN_PAD=triton.next_power_of_2(residual.shape[1]) if row_rms else 1,
        ORDERED=ordered,
        SLIDING=sliding_window is not None,
        UPCAST_DOT=dtypes.upcast_dot,
        DOT_PRECISION=dtypes.dot_precision,
        FP16_DOTS=dtypes.fp16_dots,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        USE_PDL=pdl,
        launch_pdl=pdl,
    )
    return out.view(num_tokens, num_heads * head_dim)
