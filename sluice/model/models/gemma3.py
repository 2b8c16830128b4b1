"""Gemma 3's text decoder: `Gemma3ForCausalLM` (Gemma 3 270M and 1B) and the text model of
`Gemma3ForConditionalGeneration` checkpoints (4B, 12B, 27B; their vision tower is not read, so
prompts are text only).

What it adds to the Llama decoder:
- RMSNorms scaling by (1 + weight), computed in float32 then cast (`GemmaRMSNorm`);
- four norms a layer: input and post-attention around attention, pre- and post-feedforward
  around the MLP, each added to the residual after its post-norm;
- RMSNorms on each query and key head;
- GeGLU with the tanh GELU;
- embeddings scaled by sqrt(hidden_size), in the model's dtype;
- attention scaled by query_pre_attn_scalar ** -0.5;
- sliding-window layers with their own RoPE base (10,000) beside the global layers' (1e6,
  linearly scaled by 8 in the 4B-27B models);
- the final logits soft-capped where the config sets it.

A sliding layer's attention is bounded by the config's window (Attention.sliding_window: a
query at position p sees keys at positions > p - window, transformers' rule); a global layer's
is not. The windowed and global layers are KV cache groups of their own (each layer's
`Attention.kv_group`, sluice/core/kv_cache_groups.py): the global layers' blocks are all kept,
the windowed layers' freed behind the window (docs/architecture.md, "The hybrid KV cache").
The layers are plain torch ops around the attention backend. None of the fused CUDA kernels
(sluice.worker.compile) applies, and the projections take the small-batch GEMM like any
Linear.

Not read: the vision tower and multimodal projector of Gemma3ForConditionalGeneration (image
inputs are not supported).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from sluice.attention.backend import AttentionBackend
from sluice.attention.metadata import AttentionMetadata
from sluice.distributed.tp import SINGLE_RANK, TPGroup
from sluice.model.attention import Attention
from sluice.model.embed_head import ParallelLMHead, VocabParallelEmbedding
from sluice.model.hf_config import HFModelConfig
from sluice.model.layers import RotaryEmbedding, apply_rotary
from sluice.model.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sluice.model.loader import load_packed_weights
from sluice.model.models.llama import PACKED_MODULES
from sluice.model.weights import LoadedWeight, new_param


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, cast back to x's dtype (transformers'
    Gemma3RMSNorm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = new_param(size)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(nn.Module):
    def __init__(self, config: HFModelConfig, rotary_emb: RotaryEmbedding,
                 attn_backend: AttentionBackend, tp: TPGroup, sliding: bool) -> None:
        super().__init__()
        head_dim = config.head_dim
        bias = config.attention_bias
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.num_attention_heads,
                                          config.num_key_value_heads, head_dim, bias, tp)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim,
                                        config.hidden_size, bias=bias, tp=tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.head_dim = head_dim
        self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        scale = config.gemma.query_pre_attn_scalar ** -0.5
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, scale, attn_backend,
                              sliding_window=config.sliding_window if sliding else None)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        t, d = qkv.shape[0], self.head_dim
        q = self.q_norm(qkv[:, : self.q_size].reshape(t, self.num_heads, d))
        k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size]
                        .reshape(t, self.num_kv_heads, d))
        q, k = apply_rotary(positions, q, k, self.rotary_emb.cos_sin_cache, d)
        v = qkv[:, self.q_size + self.kv_size :]
        out = self.attn(q.reshape(t, self.q_size), k.reshape(t, self.kv_size).contiguous(),
                        v, attn_metadata)
        return self.o_proj(out)


class Gemma3MLP(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: HFModelConfig, rotary_emb: RotaryEmbedding,
                 attn_backend: AttentionBackend, tp: TPGroup, sliding: bool) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, rotary_emb, attn_backend, tp, sliding)
        self.mlp = Gemma3MLP(config.hidden_size, config.intermediate_size, tp)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), attn_metadata)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    def __init__(self, config: HFModelConfig, attn_backend: AttentionBackend,
                 tp: TPGroup) -> None:
        super().__init__()
        gemma = config.gemma
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.embed_scale = config.hidden_size ** 0.5
        max_pos = config.max_position_embeddings
        scaling = (None if gemma.global_rope_factor is None
                   else {"rope_type": "linear", "factor": gemma.global_rope_factor})
        global_rope = RotaryEmbedding(config.head_dim, max_pos, config.rope_theta, scaling)
        local_rope = RotaryEmbedding(config.head_dim, max_pos, gemma.local_rope_theta)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, local_rope if sliding else global_rope, attn_backend, tp,
                               sliding)
            for sliding in gemma.sliding_layers)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # transformers scales by sqrt(hidden) rounded to the embedding's dtype
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        for layer in self.layers:
            hidden = layer(positions, hidden, attn_metadata)
        return self.norm(hidden)


class Gemma3ForCausalLM(nn.Module):
    packed_modules = PACKED_MODULES

    def __init__(self, config: HFModelConfig, attn_backend: AttentionBackend,
                 tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        if config.gemma is None:
            raise ValueError("a Gemma3ForCausalLM config must say model_type 'gemma3_text'")
        self.config = config
        self.model = Gemma3Model(config, attn_backend, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.softcap = config.gemma.final_logit_softcapping

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        if self.softcap is None:
            return self.lm_head(hidden, upcast)
        logits = self.lm_head(hidden, True)
        logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits if upcast else logits.to(hidden.dtype)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> None:
        skip = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)
        load_packed_weights(self, weights, self.packed_modules, skip)


# Where a Gemma3ForConditionalGeneration checkpoint keeps its text model (the Hub's layout and
# transformers 5's), and what of it is not the text model.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text model of a Gemma 3 4B-27B checkpoint: Gemma3ForCausalLM over its
    `language_model` weights; the vision weights are skipped unread."""

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> None:
        def text_weights() -> Iterable[tuple[str, LoadedWeight]]:
            for name, weight in weights:
                if name.startswith(_VISION_PREFIXES):
                    continue
                for prefix, replacement in _TEXT_PREFIXES:
                    if name.startswith(prefix):
                        name = replacement + name[len(prefix):]
                        break
                yield name, weight

        super().load_weights(text_weights())
