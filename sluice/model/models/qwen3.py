"""Qwen3 (dense): the Llama decoder with an RMSNorm on each query and key head before RoPE."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sluice.attention.backend import AttentionBackend
from sluice.attention.metadata import AttentionMetadata
from sluice.model.hf_config import HFModelConfig
from sluice.model.layers import RMSNorm, RotaryEmbedding
from sluice.model.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(
        self, config: HFModelConfig, rotary_emb: RotaryEmbedding, attn_backend: AttentionBackend
    ) -> None:
        bias = config.attention_bias
        super().__init__(config, rotary_emb, attn_backend, qkv_bias=bias, o_bias=bias)
        self.head_dim = config.head_dim
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)  # over head_dim, per head
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """positions: [T]; hidden: [T, hidden] -> [T, hidden]."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.qkv_sizes, dim=-1)  # [T, (KV)H * D] each
        q = self.q_norm(q.reshape(num_tokens, -1, self.head_dim))  # [T, H, D]
        k = self.k_norm(k.reshape(num_tokens, -1, self.head_dim))  # [T, KVH, D]
        q, k = self.rotary_emb(positions, q, k)
        q, k = q.reshape(num_tokens, -1), k.reshape(num_tokens, -1)
        return self.o_proj(self.attn(q, k, v, attn_metadata))


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_builder(
        config: HFModelConfig, attn_backend: AttentionBackend
    ) -> Callable[[RotaryEmbedding], nn.Module]:
        return lambda rotary_emb: Qwen3Attention(config, rotary_emb, attn_backend)
