"""The attention layer the models hold: shapes heads and hands off to an attention backend.

The layer owns no policy: its KV cache is a tensor the model runner allocates and binds with
`bind_kv_caches`, and which tokens go where comes in the `AttentionMetadata` of each forward.
"""

from __future__ import annotations

import torch
from torch import nn

from sluice.attention.backend import AttentionBackend
from sluice.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        # [2, num_blocks, block_size, num_kv_heads, head_dim] once bound; a plain attribute, not a
        # buffer, so it stays out of state_dict and `model.to()`.
        self.kv_cache: torch.Tensor = torch.empty(0)

    def forward(
        self,
        q: torch.Tensor,  # [T, H * D]
        k: torch.Tensor,  # [T, KVH * D]
        v: torch.Tensor,  # [T, KVH * D]
        attn_metadata: AttentionMetadata,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [T, H * D]
        """kv_stored: k and v are already in `kv_cache` at `attn_metadata.slot_mapping` (a fused
        kernel wrote them with the rotary embedding), so the backend skips its store."""
        num_tokens = q.shape[0]
        out = self.backend.forward(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            attn_metadata,
            self.scale,
            kv_stored,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_dim)


def bind_kv_caches(model: nn.Module, kv_caches: list[torch.Tensor]) -> None:
    """Give the i-th Attention layer of `model` (in layer order) the i-th cache tensor."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != len(kv_caches):
        raise ValueError(
            f"got {len(kv_caches)} KV cache tensors for a model with {len(layers)} attention layers"
        )
    for layer, kv_cache in zip(layers, kv_caches):
        layer.kv_cache = kv_cache
