"""Qwen3 (dense): the Llama decoder with an RMSNorm on each query and key head before RoPE."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sluice.attention.backend import AttentionBackend
from sluice.distributed.tp import SINGLE_RANK, TPGroup
from sluice.model.hf_config import HFModelConfig
from sluice.model.layers import RMSNorm, RotaryEmbedding
from sluice.model.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(
        self, config: HFModelConfig, rotary_emb: RotaryEmbedding, attn_backend: AttentionBackend,
        tp: TPGroup = SINGLE_RANK,
    ) -> None:
        bias = config.attention_bias
        super().__init__(config, rotary_emb, attn_backend, qkv_bias=bias, o_bias=bias, tp=tp)
        # Over head_dim, per head; applied by qk_norm_rope_op, which reads their weights. One
        # weight for every head, so each rank holds all of it and norms its own heads.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def qk_norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_builder(
        config: HFModelConfig, attn_backend: AttentionBackend, tp: TPGroup = SINGLE_RANK
    ) -> Callable[[RotaryEmbedding], nn.Module]:
        return lambda rotary_emb: Qwen3Attention(config, rotary_emb, attn_backend, tp)
