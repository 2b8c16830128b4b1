"""The attention layer the models hold: shapes heads and hands off to an attention backend.

The layer owns no policy: its KV cache is a tensor the model runner allocates and binds with
`bind_kv_caches`, and which tokens go where comes in the `AttentionMetadata` of each forward.

Each layer is known by its `layer_name`, its qualified module name in the model
(`model.layers.0.self_attn.attn`): the loader names the layers once the model is built
(`name_attention_layers`), and KV caches travel as `{layer_name: tensor}` in layer order, so
whatever reads or moves them per layer (a KV connector) needs no positional convention.
"""

from __future__ import annotations

import torch
from torch import nn

from sluice.attention.backend import AttentionBackend
from sluice.attention.kv_layout import kv_bytes
from sluice.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        backend: AttentionBackend,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        # This layer's window: a query at position p sees the keys at positions > p - window
        # (None: every earlier key). Every backend path takes it from here.
        self.sliding_window = sliding_window
        # The qualified module name in its model, set by name_attention_layers.
        self.layer_name = ""
        # The KV cache group whose block tables and slots this layer reads (a hybrid model's,
        # sluice/core/kv_cache_groups.py; set with the cache), its metadata `for_group`.
        self.kv_group = 0
        # [2, num_blocks, block_size, num_kv_heads, head_dim] once bound; a plain attribute, not a
        # buffer, so it stays out of state_dict and `model.to()`.
        self.kv_cache: torch.Tensor = torch.empty(0)
        self.kv_cache_bytes = self.kv_cache  # what KV connectors are given of it (kv_bytes)

    def forward(
        self,
        q: torch.Tensor,  # [T, H * D]
        k: torch.Tensor,  # [T, KVH * D]
        v: torch.Tensor,  # [T, KVH * D]
        attn_metadata: AttentionMetadata,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [T, H * D]
        """kv_stored: k and v are already in `kv_cache` at `attn_metadata.slot_mapping` (a fused
        kernel wrote them with the rotary embedding), so the backend skips its store.

        A KV connector's per-layer hooks (eager steps only) run around the attention: this
        layer's loads are waited for before it reads the cache, and its KV of this step is
        handed on once stored (the blocks they touch are not this step's new tokens' slots)."""
        num_tokens = q.shape[0]
        if self.kv_group:
            attn_metadata = attn_metadata.for_group(self.kv_group)
        hooks = attn_metadata.kv_hooks
        if hooks is not None:
            hooks.wait_for_layer_load(self.layer_name)
        out = self.backend.forward(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            attn_metadata,
            self.scale,
            kv_stored,
            sliding_window=self.sliding_window,
        )
        if hooks is not None:
            hooks.save_kv_layer(self.layer_name, self.kv_cache_bytes, attn_metadata)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def decode_from_qkv(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 * KVH) * D]: the raw q/k/v projection
        positions: torch.Tensor,  # [T]
        cos_sin_cache: torch.Tensor,  # [max_pos, D] float32
        q_norm_weight: torch.Tensor | None,  # [D]; None: no q/k norm
        k_norm_weight: torch.Tensor | None,
        eps: float,
        residual: torch.Tensor | None,  # [T, hidden]: the input norm folded
        residual_eps: float,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor | None:  # [T, H * D]
        """This step's attention output from the projection where the backend fuses q/k norm,
        RoPE and the KV store into its decode attention (a small decode batch), else None: the
        caller runs its qk_norm_rope op and `forward`. Never with a KV connector's per-layer
        hooks (they wrap `forward`)."""
        fused = getattr(self.backend, "decode_from_qkv", None)
        if fused is None or attn_metadata.kv_hooks is not None or self.kv_cache.numel() == 0:
            return None
        if self.kv_group:
            attn_metadata = attn_metadata.for_group(self.kv_group)
        return fused(qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, residual,
                     residual_eps, self.num_heads, self.kv_cache, attn_metadata, self.scale,
                     sliding_window=self.sliding_window)


def attention_layers(model: nn.Module) -> dict[str, Attention]:
    """The Attention layers of `model` by qualified module name, in layer order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Attention)}


def name_attention_layers(model: nn.Module) -> list[str]:
    """Set every Attention layer's `layer_name` to its qualified name in `model`; the names, in
    layer order. Called once, when the model is built."""
    layers = attention_layers(model)
    for name, layer in layers.items():
        layer.layer_name = name
    return list(layers)


def bind_kv_caches(model: nn.Module, kv_caches: dict[str, torch.Tensor]) -> None:
    """Give each Attention layer of `model` the cache keyed by its qualified name (its
    `layer_name` once named)."""
    layers = attention_layers(model)
    missing = [name for name in layers if name not in kv_caches]
    extra = [name for name in kv_caches if name not in layers]
    if missing or extra:
        raise ValueError(
            f"KV caches do not match the model's attention layers: missing {missing}, "
            f"extra {extra}")
    for name, layer in layers.items():
        assert layer.layer_name in ("", name), f"{layer.layer_name} was named in another model"
        layer.kv_cache = kv_caches[name]
        layer.kv_cache_bytes = kv_bytes(layer.kv_cache)  # made once, not in every forward
