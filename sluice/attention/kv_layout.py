"""The paged KV cache's layout: what the attention backends read and write, and its size.

One tensor per attention layer, `[2, num_blocks, block_size, num_kv_heads, head_dim]`: index 0 of
the first dimension holds keys, 1 values. A model's caches are a dict `{layer_name: tensor}` in
layer order, keyed by the layers' qualified module names (Attention.layer_name). Token slot `s`
(AttentionMetadata.slot_mapping) is block `s // block_size`, offset `s % block_size`; slot -1
stores nothing. Block 0 is the null block: the block pool never hands it out, so padding (CUDA
graphs' padding rows) may read it.

The model runner sizes the cache (sluice.worker.kv_cache.determine_num_blocks), allocates it here
once the model is loaded and binds each tensor to its layer (sluice.model.attention); a draft
model's or EAGLE head's cache is allocated the same way, addressed by the same block ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, int, int, int, int]:
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """Bytes one block id costs across all `num_layers` layers' caches."""
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * elem


def allocate_kv_caches(layer_names: Sequence[str], num_blocks: int, block_size: int,
                       num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       device: torch.device) -> dict[str, torch.Tensor]:
    """Zeroed caches, one per layer name, in the order given (layer order)."""
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    return {name: torch.zeros(shape, dtype=dtype, device=device) for name in layer_names}
