"""Write this step's keys and values into the paged KV cache.

Token t goes to `slot_mapping[t]` (`slot = block_id * block_size + offset`); a negative slot is a
padding token (a CUDA graph's fixed batch) and is skipped. One program per token moves all of its
KV heads, so the write is a few contiguous rows per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.attention.triton.common import to_cache_dtype
from sluice.model.pdl import pdl_wait, use_pdl


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [T, KVH, D]
    value_ptr,
    key_cache_ptr,  # [num_blocks, block_size, KVH, D]
    value_cache_ptr,
    slot_mapping_ptr,  # [>= T] int64
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    NUM_KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (sluice.model.pdl)
):
    pdl_wait(USE_PDL)  # first: before any read of an activation and any write
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, NUM_KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    cache_offsets = (
        (slot // PAGE_SIZE) * stride_cache_block
        + (slot % PAGE_SIZE) * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    key = tl.load(
        key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :],
        mask=mask,
    )
    tl.store(key_cache_ptr + cache_offsets, to_cache_dtype(key, key_cache_ptr.dtype.element_ty),
             mask=mask)
    tl.store(value_cache_ptr + cache_offsets,
             to_cache_dtype(value, value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
    slot_mapping: torch.Tensor,  # [>= T] int64; < 0 = skip
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.stride(4) == 1
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    pdl = use_pdl(key, "attention")
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        NUM_KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        PAGE_SIZE=kv_cache.shape[2],
        USE_PDL=pdl,
        launch_pdl=pdl,
    )
