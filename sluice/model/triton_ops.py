"""Triton kernels for the small per-layer ops of the decoder, each one launch per call:

- `qk_norm_rope`: per-head RMSNorm of q and k (Qwen3; skipped without weights, as in Llama) and
  neox RoPE, rewriting the q and k columns of the fused qkv projection output in place, and
  given a paged KV cache, storing the final k and the v heads there (`qk_norm_rope_store_kv`);
- `silu_and_mul`: SwiGLU's `silu(gate) * up`;
- `rms_norm` and `add_rms_norm`: the decoder's norms, the latter with the residual sum.

The first two optionally read the residual stream too, to complete an RMSNorm whose weight was
folded into the projection before them (LlamaModel.fold_norms): each row is first scaled by its
1 / rms(residual row), as `sluice.model.layers.scale_by_inv_rms` does.

Each computes exactly what its torch namesake in `sluice.model.layers` computes, in the same order
and the same dtypes: statistics and transcendental math in float32, every rounding to the input
dtype where torch rounds (after the norm scaling, after the weight product, after the rotation,
after the SiLU, after the product and the residual sum). A 16-bit product or sum is computed in
float32 and rounded once, which is what a 16-bit torch op does. Results match bit for bit but
where a float32 difference (approximate rsqrt / exp on the GPU, fused multiply-adds, another
summation order) lands across a rounding boundary: a few values in a thousand or fewer, off by
about one unit in the last place. (Arithmetic is never done on 16-bit values directly: Triton's
CPU interpreter computes bfloat16 products wrongly.)

The functions take CUDA tensors, or CPU tensors under `TRITON_INTERPRET=1` (the tests). The
grids depend only on python ints, so the launches can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.attention.kv_layout import is_fp8
from sluice.attention.triton.common import to_cache_dtype
from sluice.model.pdl import pdl_wait, use_pdl

# qk_norm_rope: with fewer (token, head) pairs than this, one head per program (a small decode
# batch: every head its own program gives the most parallelism for a latency-bound launch);
# below TWO_HEADS_PER_PROGRAM_BELOW two; past it up to PREFILL_HEADS_PER_PROGRAM heads (more
# bytes per program). Measured on an H200 with Qwen3-0.6B's 16 + 8 heads (the fused store on):
# 32 tokens 5.8 us with one head per program (6.9 with 8); 128 tokens 6.4 us with two (7.6
# with one); 256 tokens 7.6 us with 8 (10.5 with one); 512 tokens 8.7 us with 8 (15.5).
ONE_HEAD_PER_PROGRAM_BELOW = 2048
TWO_HEADS_PER_PROGRAM_BELOW = 4096
PREFILL_HEADS_PER_PROGRAM = 8
# The norms keep a whole row in registers: up to this many elements.
MAX_NORM_SIZE = 32768
SILU_BLOCK = 1024
# From this many tokens each program of silu_and_mul loops over a whole row.
SILU_ROW_PROGRAM_TOKENS = 1024


@triton.jit
def _row_inv_rms(residual_ptr, token, stride_residual, hidden_size, eps,
                 HIDDEN_PAD: tl.constexpr):
    """1 / rms of residual row `token` (float32 statistics, as rms_norm)."""
    cols = tl.arange(0, HIDDEN_PAD)
    row = tl.load(residual_ptr + token * stride_residual + cols, mask=cols < hidden_size,
                  other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(row * row, axis=0) / hidden_size + eps)


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,  # [T, (H + 2 * KVH) * D]: q and k heads rewritten in place, v untouched
    positions_ptr,  # [T]
    cos_sin_ptr,  # [max_pos, D] float32: cos in the first half, sin in the second
    q_weight_ptr,  # [D] (read only with HAS_NORM)
    k_weight_ptr,  # [D]
    key_cache_ptr,  # [num_blocks, block_size, KVH, D] (written only with STORE_KV)
    value_cache_ptr,  # [num_blocks, block_size, KVH, D]
    slot_mapping_ptr,  # [>= T] int64; < 0: a padding token, not stored
    residual_ptr,  # [T, hidden] (read only with ROW_RMS)
    stride_token,
    stride_position,
    stride_residual,
    hidden_size,
    residual_eps,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # D / 2
    HALF_PAD: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STORE_KV: tl.constexpr,
    # An 8-bit cache: k and v also rewritten in qkv as the cache holds them, so attention that
    # reads this step's K/V from qkv (dense prefill) sees what attention over the cache sees.
    ROUND_KV: tl.constexpr,
    CACHE_BLOCK_SIZE: tl.constexpr,
    ROW_RMS: tl.constexpr,  # scale q, k and v by the residual row's 1 / rms first
    HIDDEN_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (sluice.model.pdl)
):
    pdl_wait(USE_PDL)  # first: before any read of an activation and any write
    # Head blocks [0, num_q_blocks) cover q heads, then num_kv_blocks of k heads, then (with
    # STORE_KV) num_kv_blocks of v heads: a block never mixes two, so it has one norm weight.
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    num_q_blocks: tl.constexpr = (NUM_HEADS + HEADS_PER_PROGRAM - 1) // HEADS_PER_PROGRAM
    num_kv_blocks: tl.constexpr = (NUM_KV_HEADS + HEADS_PER_PROGRAM - 1) // HEADS_PER_PROGRAM
    dims = tl.arange(0, HALF_PAD)
    dim_mask = dims < HALF
    dtype = qkv_ptr.dtype.element_ty
    if ROW_RMS:
        # The input norm folded into the projection (see qk_norm_rope): this token's 1 / rms.
        row_scale = _row_inv_rms(residual_ptr, token, stride_residual, hidden_size,
                                 residual_eps, HIDDEN_PAD)
    else:
        row_scale = 1.0
    if STORE_KV:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        # [1, HALF_PAD]: the first half of head 0 at this token's slot in either cache
        cache_row = ((slot // CACHE_BLOCK_SIZE) * stride_cache_block
                     + (slot % CACHE_BLOCK_SIZE) * stride_cache_slot + dims[None, :])
    if block >= num_q_blocks + num_kv_blocks:
        # A v block: copies its heads to the cache (none for padding), and with ROW_RMS first
        # scales them, also in qkv, where attention without a cache reads them.
        kv_heads = (block - num_q_blocks - num_kv_blocks) * HEADS_PER_PROGRAM + tl.arange(
            0, HEADS_PER_PROGRAM)
        mask = (kv_heads < NUM_KV_HEADS)[:, None] & dim_mask[None, :]
        if STORE_KV and not ROW_RMS:
            mask = mask & (slot >= 0)
        heads = NUM_HEADS + NUM_KV_HEADS + kv_heads
        offsets = token * stride_token + heads[:, None] * (2 * HALF) + dims[None, :]
        v1 = tl.load(qkv_ptr + offsets, mask=mask)
        v2 = tl.load(qkv_ptr + offsets + HALF, mask=mask)
        if ROW_RMS:
            v1 = (v1.to(tl.float32) * row_scale).to(dtype)
            v2 = (v2.to(tl.float32) * row_scale).to(dtype)
        if STORE_KV:
            cache_offsets = cache_row + kv_heads[:, None] * stride_cache_head
            cache_dtype = value_cache_ptr.dtype.element_ty
            cache_mask = mask & (slot >= 0)
            v1_cached = to_cache_dtype(v1, cache_dtype)
            v2_cached = to_cache_dtype(v2, cache_dtype)
            tl.store(value_cache_ptr + cache_offsets, v1_cached, mask=cache_mask)
            tl.store(value_cache_ptr + cache_offsets + HALF, v2_cached, mask=cache_mask)
            if ROUND_KV:
                v1 = v1_cached.to(dtype)
                v2 = v2_cached.to(dtype)
        if ROW_RMS or ROUND_KV:
            tl.store(qkv_ptr + offsets, v1, mask=mask)
            tl.store(qkv_ptr + offsets + HALF, v2, mask=mask)
        return
    is_q = block < num_q_blocks
    first_head = tl.where(is_q, block * HEADS_PER_PROGRAM,
                          NUM_HEADS + (block - num_q_blocks) * HEADS_PER_PROGRAM)
    end_head = tl.where(is_q, NUM_HEADS, NUM_HEADS + NUM_KV_HEADS)
    heads = first_head + tl.arange(0, HEADS_PER_PROGRAM)
    mask = (heads < end_head)[:, None] & dim_mask[None, :]
    # x1: the first half of each head, x2 the second; [HEADS_PER_PROGRAM, HALF_PAD]
    offsets = token * stride_token + heads[:, None] * (2 * HALF) + dims[None, :]
    x1 = tl.load(qkv_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(qkv_ptr + offsets + HALF, mask=mask, other=0.0).to(tl.float32)
    if ROW_RMS:
        x1 = (x1 * row_scale).to(dtype).to(tl.float32)
        x2 = (x2 * row_scale).to(dtype).to(tl.float32)
    if HAS_NORM:
        mean_square = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
        inv_rms = tl.rsqrt(mean_square + eps)[:, None]
        weight_ptr = tl.where(is_q, q_weight_ptr, k_weight_ptr)
        w1 = tl.load(weight_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + HALF + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
        # rms_norm: scale in float32, round, multiply by the weight in the input dtype.
        x1 = (w1 * (x1 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos_sin_row = cos_sin_ptr + position * stride_position
    cos = tl.load(cos_sin_row + dims, mask=dim_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_row + HALF + dims, mask=dim_mask, other=0.0)[None, :]
    out1 = (x1 * cos - x2 * sin).to(dtype)
    out2 = (x2 * cos + x1 * sin).to(dtype)
    if STORE_KV:
        # The same k values, in the cache dtype: what store_kv would write from qkv's k.
        key_mask = mask & (block >= num_q_blocks) & (slot >= 0)
        cache_offsets = cache_row + (heads - NUM_HEADS)[:, None] * stride_cache_head
        cache_dtype = key_cache_ptr.dtype.element_ty
        out1_cached = to_cache_dtype(out1, cache_dtype)
        out2_cached = to_cache_dtype(out2, cache_dtype)
        tl.store(key_cache_ptr + cache_offsets, out1_cached, mask=key_mask)
        tl.store(key_cache_ptr + cache_offsets + HALF, out2_cached, mask=key_mask)
        if ROUND_KV:  # a k block leaves k in qkv as the cache holds it
            out1 = tl.where(is_q, out1, out1_cached.to(dtype))
            out2 = tl.where(is_q, out2, out2_cached.to(dtype))
    tl.store(qkv_ptr + offsets, out1, mask=mask)
    tl.store(qkv_ptr + offsets + HALF, out2, mask=mask)


def heads_per_program(num_tokens: int, num_heads: int, num_kv_heads: int) -> int:
    """Heads one qk_norm_rope program handles (see ONE_HEAD_PER_PROGRAM_BELOW): 1 or 2 for
    small token counts, else PREFILL_HEADS_PER_PROGRAM or fewer when no part has that many
    heads. Three values, so three compiled variants per model (all met by the warm-up and the
    CUDA graph captures)."""
    pairs = num_tokens * (num_heads + num_kv_heads)
    if pairs < ONE_HEAD_PER_PROGRAM_BELOW:
        return 1
    if pairs < TWO_HEADS_PER_PROGRAM_BELOW:
        return 2
    return min(PREFILL_HEADS_PER_PROGRAM, triton.next_power_of_2(max(num_heads, num_kv_heads)))


def qk_norm_rope(
    qkv: torch.Tensor,  # [T, (H + 2 * KVH) * D], last dim contiguous
    positions: torch.Tensor,  # [T] int
    cos_sin_cache: torch.Tensor,  # [max_pos, D] float32
    q_norm_weight: torch.Tensor | None,  # [D], or None for no q/k norm
    k_norm_weight: torch.Tensor | None,  # [D]
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    kv_cache: torch.Tensor | None = None,  # [2, num_blocks, block_size, KVH, D]
    slot_mapping: torch.Tensor | None = None,  # [>= T] int64; < 0: not stored
    residual: torch.Tensor | None = None,  # [T, hidden]: the input norm folded (see below)
    residual_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # q [T, H * D], k [T, KVH * D]: views of qkv
    """sluice.model.layers.qk_norm_rope, rewriting qkv's q and k columns in place. Given a
    kv_cache, also what store_kv would do next (sluice.attention.triton.store_kv): each token's
    final k heads and its v heads go to the cache at its slot, cast to the cache dtype, unless
    the slot is negative (padding). k is still rewritten in qkv too: attention without a cache
    (a profiling run) and dense prefill read it there. With an 8-bit cache k and v are
    rewritten in qkv as the cache holds them (sluice.attention.kv_layout).

    Given `residual`, qkv is the projection of the raw residual rows by a weight with the
    layer's input-norm weight folded in (LlamaModel.fold_norms): every q, k and v head is first
    multiplied in float32 by its token's 1 / rms(residual row) (eps `residual_eps`) and rounded
    to qkv's dtype, which completes the norm; v is rewritten so in qkv as well as stored. That
    1 / rms costs each program a read of the row (2 KiB for Qwen3-0.6B, from L2 after the
    first), in place of a norm launch per layer.

    Grid (T, head blocks): a program handles 1 or a few heads of one token (see
    `heads_per_program`) and reads that token's cos/sin row once for all of them. Tokens alone
    would give 1 to 256 programs at decode, too few to hide memory latency; (token, head) gives
    T * (H + KVH) (24 at batch 1 and 6,144 at batch 256 for Qwen3-0.6B's 16 + 8 heads). At
    prefill 8,192 tokens, 8 heads per program still gives 24,576 programs of 2 KiB read and
    written each, enough to keep the memory system busy with fewer per-program overheads and
    cos/sin reads (these hit L2: a token's programs read the same row).

    With a cache, k blocks also write their heads to the cache from registers (store_kv's read
    of k is saved), and each token gets as many v blocks as k blocks, which copy its v heads and
    read nothing else. v has programs of its own rather than riding along in the k programs so
    that no program moves more than about three heads' bytes (a k program reads one and writes
    two) and decode keeps the most programs in flight: T * (H + 2 * KVH), 32 per token for
    Qwen3-0.6B, 32,768 programs at an 8,192-token prefill.
    """
    num_tokens, width = qkv.shape
    head_dim = cos_sin_cache.shape[1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    assert width == q_size + 2 * kv_size and qkv.stride(1) == 1 and head_dim % 2 == 0
    assert cos_sin_cache.stride(1) == 1 and positions.shape[0] >= num_tokens
    has_norm = q_norm_weight is not None
    if has_norm:
        assert k_norm_weight is not None and q_norm_weight.dtype == qkv.dtype
        assert q_norm_weight.is_contiguous() and k_norm_weight.is_contiguous()
    stores_kv = kv_cache is not None
    if stores_kv:
        assert slot_mapping is not None and slot_mapping.shape[0] >= num_tokens
        assert kv_cache.shape[3:] == (num_kv_heads, head_dim) and kv_cache.stride(4) == 1
    row_rms = residual is not None
    if row_rms:
        assert residual.shape[0] >= num_tokens and residual.stride(1) == 1
        if residual.shape[1] > MAX_NORM_SIZE:
            raise ValueError(
                f"hidden size must be at most {MAX_NORM_SIZE}, got {residual.shape[1]}")
    q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
    if num_tokens == 0:
        return q, k
    block_heads = heads_per_program(num_tokens, num_heads, num_kv_heads)
    num_kv_blocks = triton.cdiv(num_kv_heads, block_heads)
    num_blocks = (triton.cdiv(num_heads, block_heads)
                  + num_kv_blocks * (2 if stores_kv or row_rms else 1))
    key_cache, value_cache = (kv_cache[0], kv_cache[1]) if stores_kv else (qkv, qkv)
    half_pad = triton.next_power_of_2(head_dim // 2)
    pdl = use_pdl(qkv, "ops")
    _qk_norm_rope_kernel[(num_tokens, num_blocks)](
        qkv,
        positions,
        cos_sin_cache,
        q_norm_weight if has_norm else qkv,
        k_norm_weight if has_norm else qkv,
        key_cache,
        value_cache,
        slot_mapping if stores_kv else positions,
        residual if row_rms else qkv,
        qkv.stride(0),
        cos_sin_cache.stride(0),
        residual.stride(0) if row_rms else 0,
        residual.shape[1] if row_rms else 1,
        residual_eps,
        key_cache.stride(0) if stores_kv else 0,
        key_cache.stride(1) if stores_kv else 0,
        key_cache.stride(2) if stores_kv else 0,
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=head_dim // 2,
        HALF_PAD=half_pad,
        HEADS_PER_PROGRAM=block_heads,
        HAS_NORM=has_norm,
        STORE_KV=stores_kv,
        ROUND_KV=stores_kv and is_fp8(kv_cache.dtype),
        CACHE_BLOCK_SIZE=kv_cache.shape[2] if stores_kv else 1,
        ROW_RMS=row_rms,
        HIDDEN_PAD=triton.next_power_of_2(residual.shape[1]) if row_rms else 1,
        # 16 bytes per thread and load: 2 warps for 8 bfloat16 heads of 128, 1 for one head.
        num_warps=max(1, min(4, block_heads * half_pad * qkv.element_size() // 512)),
        USE_PDL=pdl,
        launch_pdl=pdl,
    )
    return q, k


def qk_norm_rope_store_kv(
    qkv: torch.Tensor,  # [T, (H + 2 * KVH) * D], last dim contiguous
    positions: torch.Tensor,  # [T] int
    cos_sin_cache: torch.Tensor,  # [max_pos, D] float32
    q_norm_weight: torch.Tensor | None,  # [D], or None for no q/k norm
    k_norm_weight: torch.Tensor | None,  # [D]
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D], or empty: none bound yet
    slot_mapping: torch.Tensor,  # [>= T] int64; < 0: not stored
    residual: torch.Tensor | None = None,  # [T, hidden]: the input norm folded
    residual_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, bool]:  # q, k (views of qkv), whether k/v are stored
    """The attention layers' qk_norm_rope_op on CUDA (sluice.worker.compile): qk_norm_rope
    storing k and v into the layer's cache, which spares the attention backend its store_kv
    launch; nothing is stored while no cache is bound (a profiling run)."""
    stored = kv_cache.numel() > 0
    q, k = qk_norm_rope(
        qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, num_heads,
        num_kv_heads, kv_cache if stored else None, slot_mapping, residual, residual_eps,
    )
    return q, k, stored


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2 * I]: gate, up
    out_ptr,  # [T, I]
    residual_ptr,  # [T, hidden] (read only with ROW_RMS)
    stride_x,
    stride_out,
    stride_residual,
    intermediate_size,
    hidden_size,
    residual_eps,
    BLOCK: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,  # column blocks one program loops over
    ROW_RMS: tl.constexpr,  # scale gate and up by the residual row's 1 / rms first
    HIDDEN_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (sluice.model.pdl)
):
    pdl_wait(USE_PDL)  # first: before any read of an activation and any write
    token = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    if ROW_RMS:  # once per program, however many blocks it loops over
        row_scale = _row_inv_rms(residual_ptr, token, stride_residual, hidden_size,
                                 residual_eps, HIDDEN_PAD)
    first = tl.program_id(1) * BLOCKS_PER_PROGRAM * BLOCK
    for b in range(BLOCKS_PER_PROGRAM):
        cols = first + b * BLOCK + tl.arange(0, BLOCK)
        mask = cols < intermediate_size
        gate_ptr = x_ptr + token * stride_x + cols
        gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_ptr + intermediate_size, mask=mask, other=0.0).to(tl.float32)
        if ROW_RMS:
            gate = (gate * row_scale).to(dtype).to(tl.float32)
            up = (up * row_scale).to(dtype).to(tl.float32)
        # F.silu computes in float32 and rounds; the product is then a rounded 16-bit product.
        activation = tl.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
        tl.store(out_ptr + token * stride_out + cols, (activation * up).to(dtype), mask=mask)


def silu_blocks_per_program(num_tokens: int, col_blocks: int) -> int:
    """Column blocks of SILU_BLOCK a program of silu_and_mul loops over: a whole row from
    SILU_ROW_PROGRAM_TOKENS tokens, else one. With the residual's 1 / rms each program reads
    the whole residual row: at Qwen3-8B's 12 blocks a row a program per block read 8 KB of
    residual per 6 KB of gate, up and output. Measured on an H200 (8B's shapes, us; blocks a
    program 1 / 8 / 12): 1,024 tokens 50.0 / 46.2 / 35.2, 3,072 110.2 / 95.3 / 72.4, 8,192
    337.3 / 230.5 / 167.7; 256 tokens 13.4 with one, 42.9 with 12
    (benchmarks/journal/2026-12-02-8b-prefill-and-decode.md)."""
    return col_blocks if num_tokens >= SILU_ROW_PROGRAM_TOKENS else 1


def silu_and_mul(x: torch.Tensor, residual: torch.Tensor | None = None,
                 residual_eps: float = 0.0) -> torch.Tensor:
    """x: [T, 2 * I] (gate, up) -> [T, I]; sluice.model.layers.silu_and_mul. Given `residual`
    (the input norm folded into the gate/up weight, LlamaModel.fold_norms), gate and up are
    first multiplied in float32 by the token's 1 / rms(residual row) and rounded to x's dtype.

    Grid (T, I / SILU_BLOCK): 3 programs per token at I = 3,072 (768 at a decode batch of
    256); from SILU_ROW_PROGRAM_TOKENS tokens (T, 1), each program looping over its row
    (silu_blocks_per_program)."""
    num_tokens, width = x.shape
    intermediate_size = width // 2
    assert x.stride(1) == 1 and width % 2 == 0
    row_rms = residual is not None
    if row_rms:
        assert residual.shape[0] >= num_tokens and residual.stride(1) == 1
        if residual.shape[1] > MAX_NORM_SIZE:
            raise ValueError(
                f"hidden size must be at most {MAX_NORM_SIZE}, got {residual.shape[1]}")
    out = torch.empty(num_tokens, intermediate_size, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(intermediate_size))
    col_blocks = triton.cdiv(intermediate_size, block)
    per_program = silu_blocks_per_program(num_tokens, col_blocks)
    grid = (num_tokens, triton.cdiv(col_blocks, per_program))
    pdl = use_pdl(x, "ops")
    _silu_and_mul_kernel[grid](
        x, out, residual if row_rms else x, x.stride(0), out.stride(0),
        residual.stride(0) if row_rms else 0, intermediate_size,
        residual.shape[1] if row_rms else 1, residual_eps, BLOCK=block,
        BLOCKS_PER_PROGRAM=per_program, ROW_RMS=row_rms,
        HIDDEN_PAD=triton.next_power_of_2(residual.shape[1]) if row_rms else 1, num_warps=4,
        USE_PDL=pdl,
        launch_pdl=pdl,
    )
    return out


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, N]
    residual_ptr,  # [T, N] (read only with HAS_RESIDUAL)
    weight_ptr,  # [N]
    out_ptr,  # [T, N]
    sum_ptr,  # [T, N]: x + residual (written only with HAS_RESIDUAL)
    stride_x,
    stride_residual,
    hidden_size,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (sluice.model.pdl)
):
    pdl_wait(USE_PDL)  # first: before any read of an activation and any write
    # One program per row; out and sum are fresh contiguous [T, N] tensors.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    normed = norm_row(x_ptr, residual_ptr, weight_ptr, sum_ptr, row, stride_x, stride_residual,
                      hidden_size, eps, BLOCK, HAS_RESIDUAL)
    tl.store(out_ptr + row * hidden_size + cols, normed.to(sum_ptr.dtype.element_ty),
             mask=cols < hidden_size)


@triton.jit
def norm_row(x_ptr, residual_ptr, weight_ptr, sum_ptr, row, stride_x, stride_residual,
             hidden_size, eps, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Row `row` of rms_norm(x) or rms_norm(x + residual) in float32 (its values before the
    last rounding to sum_ptr's dtype), writing the sum's row with HAS_RESIDUAL: [BLOCK]."""
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    dtype = sum_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x + residual.to(tl.float32)).to(dtype).to(tl.float32)
        tl.store(sum_ptr + row * hidden_size + cols, x.to(dtype), mask=mask)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden_size + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return weight * (x * inv_rms).to(dtype).to(tl.float32)


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden_size = x.shape[-1]
    if hidden_size > MAX_NORM_SIZE:
        raise ValueError(f"hidden size must be at most {MAX_NORM_SIZE}, got {hidden_size}")
    assert weight.dtype == x.dtype and weight.is_contiguous()
    rows = x.reshape(-1, hidden_size)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else None
    residual_rows = residual.reshape(-1, hidden_size) if residual is not None else rows
    if residual_rows.stride(1) != 1:
        residual_rows = residual_rows.contiguous()
    if rows.shape[0] == 0:
        return out, summed
    block = triton.next_power_of_2(hidden_size)
    pdl = use_pdl(rows, "ops")
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        residual_rows,
        weight,
        out,
        summed if summed is not None else out,
        rows.stride(0),
        residual_rows.stride(0),
        hidden_size,
        eps,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=max(1, min(16, block // 256)),
        USE_PDL=pdl,
        launch_pdl=pdl,
    )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., N] -> [..., N]; sluice.model.layers.rms_norm. One program per row."""
    out, _ = _launch_rms_norm(x, None, weight, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """sluice.model.layers.add_rms_norm: (rms_norm(x + residual), x + residual), both fresh
    tensors. Writing the sum over `residual` would save an allocation but not a byte of traffic,
    and under CUDA graphs allocations are free; fresh outputs keep the torch version's contract
    (inputs untouched)."""
    out, summed = _launch_rms_norm(x, residual, weight, eps)
    assert summed is not None
    return out, summed
