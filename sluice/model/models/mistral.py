"""Mistral (`MistralForCausalLM`): the Llama decoder (GQA, SwiGLU, RMSNorm, no biases), its head
size possibly set apart from hidden / heads (Mistral Nemo's 128 with a hidden size of 5,120),
with an optional sliding window (Mistral 7B v0.1's 4,096; null from v0.2 on) on every layer
(LlamaAttention passes it to its Attention; the KV cache manager frees the blocks behind it:
docs/architecture.md, "Sliding-window attention")."""

from __future__ import annotations

from sluice.model.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
