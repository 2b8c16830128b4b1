"""The interface every attention backend implements."""

from __future__ import annotations

from typing import Protocol

import torch

from sluice.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        kv_stored: bool = False,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store key/value at `metadata.slot_mapping` (unless `kv_stored`: the caller has
        written them already), then attend causally over each request's paged context. Without
        a cache (`kv_cache.numel() == 0`, a profiling run) attend over `key`/`value` directly.

        `sliding_window` (the layer's, None: none): a query at position p attends only to keys
        at positions > p - window (transformers' convention), and the backend never reads the
        blocks before a query's window: the KV cache manager may have freed them, leaving
        stale ids in the block table."""
        ...

    # Optional: `decode_plan(num_reqs, num_kv_heads, max_seq_len, device, cache_dtype) ->
    # Hashable`, what `forward` runs for a decode batch of that size whose longest context is
    # max_seq_len (TritonBackend: its split count and tiles). Where the plan for short contexts
    # differs from the one for max_model_len, the graph runner captures a decode graph for each.
    #
    # Optional: `supports_dense_prefill(device, dtype, num_heads, num_kv_heads, head_dim) ->
    # bool`: whether the runner should mark steps that are one fresh prompt
    # (`AttentionMetadata.dense_prefill`), which `forward` then runs as dense causal attention;
    # and `supports_dense_prefix(...)`, the same for one prompt chunk over a cached prefix.
    #
    # Optional: `decode_from_qkv(qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight,
    # eps, residual, residual_eps, num_heads, kv_cache, metadata, scale, sliding_window) ->
    # Tensor | None`: a decode step's attention output from the raw q/k/v projection, doing what
    # the model's qk_norm_rope op and `forward` do (TritonBackend: in one launch), or None where
    # the backend leaves this step to them (Attention.decode_from_qkv).


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "torch_ref":
        from sluice.attention.torch_ref import TorchRefBackend

        return TorchRefBackend()
    if name == "triton":
        from sluice.attention.triton_backend import TritonBackend

        return TritonBackend()
    raise ValueError(f"attention backend must be one of ['torch_ref', 'triton'], got {name!r}")
