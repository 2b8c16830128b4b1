"""Qwen2-MoE (`Qwen2MoeForCausalLM`: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): the Qwen2 decoder (a
bias on q, k and v; `qkv_bias`) whose sparse layers route each token to `top_k` experts
(sluice.model.moe, as Qwen3-MoE) and also through one shared SwiGLU expert, whose output is
scaled by sigmoid(shared_expert_gate(x)), a per-token scalar, and added:

    y = sum_k w_k expert_k(x) + sigmoid(x . g) * shared_expert(x)

(transformers' Qwen2MoeSparseMoeBlock). Under tensor parallelism the shared expert is split like
a dense MLP (its own all-reduce) and its gate, one row, is replicated; so it stays under expert
parallelism, which partitions only the routed experts."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sluice.attention.backend import AttentionBackend
from sluice.distributed.tp import SINGLE_RANK, TPGroup
from sluice.model.hf_config import HFModelConfig, MoeConfig
from sluice.model.layers import RotaryEmbedding
from sluice.model.linear import Linear
from sluice.model.models.llama import LlamaAttention, LlamaMLP
from sluice.model.models.qwen3_moe import Qwen3MoeForCausalLM
from sluice.model.moe import FusedMoE


class SharedExpertMoE(FusedMoE):
    """FusedMoE plus Qwen2-MoE's gated shared expert (`shared_expert`, `shared_expert_gate`)."""

    def __init__(self, hidden_size: int, moe: MoeConfig, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__(hidden_size, moe, tp)
        assert moe.shared_intermediate_size is not None
        self.shared_expert = LlamaMLP(hidden_size, moe.shared_intermediate_size, tp)
        self.shared_expert_gate = Linear(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    @staticmethod
    def attention_builder(
        config: HFModelConfig, attn_backend: AttentionBackend, tp: TPGroup = SINGLE_RANK
    ) -> Callable[[RotaryEmbedding], nn.Module]:
        return lambda rotary_emb: LlamaAttention(
            config, rotary_emb, attn_backend, qkv_bias=config.attention_bias, o_bias=False,
            tp=tp)

    @staticmethod
    def mlp_builder(config: HFModelConfig, tp: TPGroup = SINGLE_RANK
                    ) -> Callable[[int], nn.Module | None] | None:
        moe = config.moe
        if moe is None or moe.shared_intermediate_size is None:
            raise ValueError("a Qwen2MoeForCausalLM config must say model_type 'qwen2_moe'")
        return lambda i: (None if i in moe.dense_layers
                          else SharedExpertMoE(config.hidden_size, moe, tp))
