"""Llama (2, 3, 3.1 with llama3 RoPE scaling) and Qwen2, which is Llama with a q/k/v bias.

Pre-norm decoder: x -> RMSNorm -> attention -> + x -> RMSNorm -> SwiGLU MLP -> + x. The residual
sum is carried between layers and fused into the next RMSNorm.

Tensor parallelism (`tp`, sluice.model.linear): each rank holds its query / key-value heads and
its slice of the MLP's intermediate features; o_proj and down_proj all-reduce their partial sums,
so the residual stream ([T, hidden]) is whole and the same on every rank between them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from sluice.attention.backend import AttentionBackend
from sluice.attention.metadata import AttentionMetadata
from sluice.distributed.tp import SINGLE_RANK, TPGroup
from sluice.model.attention import Attention
from sluice.model.embed_head import ParallelLMHead, VocabParallelEmbedding
from sluice.model.hf_config import HFModelConfig
from sluice.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul, qk_norm_rope
from sluice.model.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from sluice.model.loader import load_packed_weights
from sluice.model.weights import LoadedWeight

# HF module name -> (sluice merged module, shard id)
PACKED_MODULES: dict[str, tuple[str, str | int]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int,
                 tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], tp=tp)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp=tp)
        # (gate_up, down weight) -> down(silu_and_mul(gate_up)) in one op; install_fused_ops
        self.act_down_op = None
        # FP8 down_proj: (gate_up, down_proj) -> this rank's down(silu_and_mul(gate_up)) in one
        # op, or None at sizes it does not run (fp8_gemm.fp8_silu_mul_linear: one row);
        # install_fp8_ops
        self.fp8_act_down_op = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        gate_up = self.gate_up_proj(x)
        if self.fp8_act_down_op is not None:
            partial = self.fp8_act_down_op(gate_up, self.down_proj)
            if partial is not None:
                return self.down_proj.all_reduce(partial)
        if self.act_down_op is not None:
            return self.down_proj.all_reduce(self.act_down_op(gate_up, self.down_proj.weight))
        return self.down_proj(self.act_fn(gate_up))

    def add_to_residual(self, residual: torch.Tensor, norm_eps: float) -> None:
        """residual += forward(rms_norm(residual)), in place, with the norm's weight folded into
        gate_up_proj (LlamaModel.fold_norms): its 1 / rms scales gate and up inside the
        activation, and the down projection accumulates into residual (one GEMM, no add).
        Small batches on CUDA: gate_up_proj's GEMM applies the 1 / rms itself and the down
        GEMM the SiLU-and-mul, so no activation launch either."""
        gate_up = self.gate_up_proj.inv_rms_forward(residual, norm_eps)
        if gate_up is not None:
            self.down_proj.add_to(residual, gate_up, silu_mul=True)
            return
        activation = self.act_fn(self.gate_up_proj(residual), residual, norm_eps)
        self.down_proj.add_to(residual, activation)


def qk_norm_rope_leaving_kv_store(
    qkv: torch.Tensor,  # [T, (H + 2 * KVH) * D]
    positions: torch.Tensor,  # [T]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] float32
    q_norm_weight: torch.Tensor | None,  # [D]; None: no q/k norm
    k_norm_weight: torch.Tensor | None,  # [D]
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D], or empty
    slot_mapping: torch.Tensor,  # [>= T] int64
    residual: torch.Tensor | None = None,  # [T, hidden]: the input norm folded
    residual_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, bool]:  # q [T, H * D], k [T, KVH * D], k/v stored
    """The attention layer's qk_norm_rope_op: (q, k, whether k and v are already in kv_cache at
    slot_mapping). This one is the torch op and stores nothing, leaving the store to the
    attention backend; the fused kernel on CUDA stores them itself
    (sluice.model.triton_ops.qk_norm_rope_store_kv). `residual`: see qk_norm_rope."""
    q, k = qk_norm_rope(
        qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, num_heads,
        num_kv_heads, residual, residual_eps,
    )
    return q, k, False


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: HFModelConfig,
        rotary_emb: RotaryEmbedding,
        attn_backend: AttentionBackend,
        qkv_bias: bool,
        o_bias: bool,
        tp: TPGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.num_attention_heads,
                                          config.num_key_value_heads, head_dim, qkv_bias, tp)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim,
                                        config.hidden_size, bias=o_bias, tp=tp)
        self.rotary_emb = rotary_emb  # shared by all layers: one cos/sin table
        # This rank's heads (all of them at TP = 1).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        # Mistral and Phi-3 window every layer (None for the other Llama-family models).
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5,
                              attn_backend, sliding_window=config.sliding_window)
        # A plain function, so a runner may swap in one fused kernel for all layers, which may
        # also store k and v into the paged KV cache (see qk_norm_rope_leaving_kv_store).
        self.qk_norm_rope_op = qk_norm_rope_leaving_kv_store
        # Whether a decode step may ask the attention backend for its output straight from the
        # projection (Attention.decode_from_qkv: one launch for what qk_norm_rope_op and the
        # attention do), on the folded path; set with the fused ops (sluice.worker.compile).
        self.fused_decode = False

    def qk_norms(self) -> tuple[torch.Tensor | None, torch.Tensor | None, float]:
        """(q weight, k weight, eps) of the per-head RMSNorm before RoPE: none in Llama."""
        return None, None, 0.0

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """positions: [T]; hidden: [T, hidden] -> [T, hidden]."""
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 * KVH) * D]
        q_norm_weight, k_norm_weight, eps = self.qk_norms()
        q, k, kv_stored = self.qk_norm_rope_op(  # [T, H * D], [T, KVH * D]; may be views of qkv
            qkv, positions, self.rotary_emb.cos_sin_cache, q_norm_weight, k_norm_weight, eps,
            self.num_heads, self.num_kv_heads, self.attn.kv_cache, attn_metadata.slot_mapping,
        )
        v = qkv[:, self.q_size + self.kv_size :]  # [T, KVH * D]
        return self.o_proj(self.attn(q, k, v, attn_metadata, kv_stored=kv_stored))

    def add_to_residual(
        self, positions: torch.Tensor, residual: torch.Tensor, norm_eps: float,
        attn_metadata: AttentionMetadata,
    ) -> None:
        """residual += forward(positions, rms_norm(residual)), in place, with the norm's weight
        folded into qkv_proj (LlamaModel.fold_norms): qk_norm_rope_op scales q, k and v by
        1 / rms (or, with `fused_decode`, the attention backend does for a small decode batch),
        and o_proj accumulates into residual (one GEMM, no add)."""
        qkv = self.qkv_proj(residual)
        q_norm_weight, k_norm_weight, eps = self.qk_norms()
        cos_sin_cache = self.rotary_emb.cos_sin_cache
        out = None
        if self.fused_decode:
            out = self.attn.decode_from_qkv(qkv, positions, cos_sin_cache, q_norm_weight,
                                            k_norm_weight, eps, residual, norm_eps,
                                            attn_metadata)
        if out is None:
            q, k, kv_stored = self.qk_norm_rope_op(
                qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps,
                self.num_heads, self.num_kv_heads, self.attn.kv_cache,
                attn_metadata.slot_mapping, residual, norm_eps,
            )
            v = qkv[:, self.q_size + self.kv_size :]
            out = self.attn(q, k, v, attn_metadata, kv_stored=kv_stored)
        self.o_proj.add_to(residual, out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, config: HFModelConfig,
                 tp: TPGroup = SINGLE_RANK, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = self_attn
        # the dense SwiGLU MLP, or another block of the same interface (sluice.model.moe)
        self.mlp = mlp if mlp is not None else LlamaMLP(config.hidden_size,
                                                        config.intermediate_size, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def add_to_residual(
        self, positions: torch.Tensor, residual: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> None:
        """The layer on the residual stream in place, its norms folded (LlamaModel.fold_norms):
        no norm launch, no add."""
        self.self_attn.add_to_residual(positions, residual, self.input_layernorm.eps,
                                       attn_metadata)
        self.mlp.add_to_residual(residual, self.post_attention_layernorm.eps)


def _fold_norm_weight(norm: RMSNorm, linear: MergedColumnParallelLinear) -> None:
    """linear.weight[:, j] *= norm.weight[j] (in float32, rounded once), norm.weight = 1; in
    slices of rows, so a large weight needs no float32 copy of itself."""
    gain = norm.weight.float()
    weight = linear.weight.data
    for start in range(0, weight.shape[0], 4096):
        rows = weight[start : start + 4096]
        rows.copy_((rows.float() * gain).to(rows.dtype))
    norm.weight.data.fill_(1.0)


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: HFModelConfig,
        build_attention: Callable[[RotaryEmbedding], nn.Module],
        tp: TPGroup = SINGLE_RANK,
        build_mlp: Callable[[int], nn.Module | None] | None = None,
    ) -> None:
        """build_mlp(layer index): that layer's MLP block, None for the dense one."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(build_attention(rotary_emb), config, tp,
                              build_mlp(i) if build_mlp is not None else None)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Steps of more tokens than this run the layers' folded forms (fold_norms); None: never.
        self.folded_above_tokens: int | None = None

    def fold_norms(self, above_tokens: int) -> bool:
        """Fold each layer's two RMSNorm weights g into the projections they feed (W[:, j] *=
        g[j] for qkv_proj and gate_up_proj, g then all ones), so that steps of more than
        `above_tokens` tokens can run `LlamaDecoderLayer.add_to_residual`: the projections read
        the raw residual stream, the q/k/v and SiLU kernels apply each row's 1 / rms, and
        o_proj and down_proj accumulate into the residual in their GEMM. That drops a layer's
        two norm launches (both adds go into the GEMMs); smaller steps keep the norms, which
        with g = 1 compute the same function. Only where the folded path computes the same
        thing: no bias on the projections (the bias would be scaled too) and not float16 (the
        raw residual's products could overflow it), and not FP8 weights (g would need quantizing
        into them). Returns whether it folded.

        rms_norm(x) W^T = (1 / rms(x)) (x (W diag g)^T): equal in exact arithmetic; in 16 bits
        the roundings move (W diag g is rounded once, the normed activations are not), which is
        why this is a fused-ops (CUDA) transform, never applied to the CPU reference path."""
        if self.folded_above_tokens is not None:
            return True
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if (type(layer) is not LlamaDecoderLayer or not isinstance(attn, LlamaAttention)
                    or type(mlp) is not LlamaMLP):  # not a mixture of experts either
                return False
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if (any(linear.bias is not None or linear.is_fp8 for linear in linears)
                    or attn.qkv_proj.weight.dtype not in (torch.bfloat16, torch.float32)):
                return False
        with torch.no_grad():
            for layer in self.layers:
                _fold_norm_weight(layer.input_layernorm, layer.self_attn.qkv_proj)
                _fold_norm_weight(layer.post_attention_layernorm, layer.mlp.gate_up_proj)
        self.folded_above_tokens = above_tokens
        return True

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden [T, hidden]."""
        hidden = self.embed_tokens(input_ids)
        if self.folded_above_tokens is not None and hidden.shape[0] > self.folded_above_tokens:
            for layer in self.layers:  # the embedding output is the residual stream
                layer.add_to_residual(positions, hidden, attn_metadata)
            return self.norm(hidden)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, attn_metadata)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    packed_modules = PACKED_MODULES

    def __init__(self, config: HFModelConfig, attn_backend: AttentionBackend,
                 tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.attention_builder(config, attn_backend, tp), tp,
                                self.mlp_builder(config, tp))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def mlp_builder(config: HFModelConfig, tp: TPGroup = SINGLE_RANK
                    ) -> Callable[[int], nn.Module | None] | None:
        """The MLP block of layer i (None: every layer's is dense; sluice.model.moe)."""
        return None

    @staticmethod
    def attention_builder(
        config: HFModelConfig, attn_backend: AttentionBackend, tp: TPGroup = SINGLE_RANK
    ) -> Callable[[RotaryEmbedding], nn.Module]:
        bias = config.attention_bias
        return lambda rotary_emb: LlamaAttention(config, rotary_emb, attn_backend, bias, bias, tp)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden [T, hidden]."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab]: float32, or the model dtype with
        upcast=False."""
        return self.lm_head(hidden, upcast)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> None:
        skip = ("rotary_emb.inv_freq",)
        if self.config.tie_word_embeddings:
            skip += ("lm_head.weight",)  # some tied checkpoints still carry a copy
        load_packed_weights(self, weights, self.packed_modules, skip)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with a bias on q, k and v (not on o)."""

    @staticmethod
    def attention_builder(
        config: HFModelConfig, attn_backend: AttentionBackend, tp: TPGroup = SINGLE_RANK
    ) -> Callable[[RotaryEmbedding], nn.Module]:
        return lambda rotary_emb: LlamaAttention(
            config, rotary_emb, attn_backend, qkv_bias=True, o_bias=False, tp=tp
        )
