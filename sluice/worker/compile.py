"""Fused Triton kernels for the small per-layer ops on CUDA (sluice.model.triton_ops): per-head
q/k RMSNorm with RoPE and the paged KV-cache store, SiLU-and-mul, RMSNorm with and without the
residual add. Each is one launch instead of several torch kernels, which matters most in decode,
where the model is a chain of small launches, and they run near memory bandwidth at prefill
sizes, where the torch.compile (inductor) versions they replace did not (rotary at 8,192 tokens:
10x the bytes' time). And the projections of small decode batches (sluice.model.triton_gemm,
the down projection with SiLU-and-mul folded in), which cuBLAS runs slowly at a few rows. And the
layers' RMSNorm weights folded into the projections they feed (LlamaModel.fold_norms): the
norms' 1 / rms rides in the q/k/v and SiLU kernels (or gate_up's Triton GEMM) and the residual
adds in the GEMMs, so a layer is 7 launches instead of 9 (6 instead of 8 at small batches). And
decode steps hand the raw q/k/v projection to the attention backend, which folds the q/k norm,
RoPE and KV store into its decode attention for batches of 16 requests to about one wave of
programs (TritonBackend.decode_from_qkv): one launch a layer fewer there. The layers of an FP8
checkpoint multiply in FP8 (sluice.model.fp8_gemm; with SLUICE_FP8_ROW_KERNEL=1, one row in
triton_gemm's one-row kernel, SiLU-and-mul folded into the down projection); their norms are
not folded (the weights would need quantizing again), but the norms and SiLU-and-mul before
them write FP8 activations and scales where the product takes them (fp8_gemm.norm_for_fp8,
silu_for_fp8).

Only the instance attributes of this model change; other engines in the process are untouched.
"""

from __future__ import annotations

import functools
import os

from torch import nn

from sluice.model.layers import RMSNorm, SiluAndMul
from sluice.model.linear import Linear, RowParallelLinear
from sluice.model.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel


def install_fp8_ops(model: nn.Module) -> None:
    """The FP8 kernels (sluice.model.fp8_gemm) for every layer of `model` that holds FP8
    weights (CUDA): also with enforce_eager, where the other fused ops stay off, since the
    layers' default op (the CPU reference) dequantizes the whole weight at every step. FP8
    experts take sluice.model.triton_moe's W8A16 kernels (any batch: static shapes). With
    SLUICE_FP8_ROW_KERNEL=1 a dense MLP's FP8 down projection at one row takes SiLU-and-mul in
    its GEMM's prologue (fp8_gemm.fp8_silu_mul_linear: no activation launch; off by default,
    slower on an H200)."""
    from sluice.model import fp8_gemm, triton_moe
    from sluice.model.moe import FusedMoE

    for module in model.modules():
        if (isinstance(module, LlamaMLP) and module.down_proj.is_fp8
                and module.down_proj.bias is None):
            module.fp8_act_down_op = fp8_gemm.fp8_silu_mul_linear
        if isinstance(module, FusedMoE) and module.is_fp8:
            module.fp8_experts_op = triton_moe.fused_experts
            if module.expert_map is not None:  # expert parallelism: ids -1 for other ranks'
                module.fp8_experts_op = functools.partial(triton_moe.fused_experts,
                                                          local_only=True)
        if isinstance(module, Linear) and module.is_fp8:
            module.fp8_op = fp8_gemm.fp8_linear
            if module.fp8_block == (128, 128):  # probed now, never inside a graph's capture
                fp8_gemm.block_scaled_mm_supported(module.weight.device)


def install_fused_ops(model: nn.Module) -> None:
    """Swap the torch ops of every layer of `model` (CUDA weights) for the Triton kernels."""
    from sluice.model import triton_gemm, triton_moe, triton_ops  # Triton only on a GPU
    from sluice.model.moe import FusedMoE

    for module in model.modules():
        if isinstance(module, FusedMoE):  # static shapes: capturable in the CUDA graphs
            module.experts_op = triton_moe.fused_experts
            if module.expert_map is not None:  # expert parallelism: ids -1 for other ranks'
                module.experts_op = functools.partial(triton_moe.fused_experts,
                                                      local_only=True)
            module.route_op = triton_moe.fused_route
        if isinstance(module, Linear):
            module.gemm_op = triton_gemm.linear  # FP8 layers: install_fp8_ops
        if isinstance(module, RowParallelLinear):
            module.add_gemm_op = triton_gemm.linear_add
        elif (isinstance(module, LlamaMLP) and module.down_proj.bias is None
              and not module.down_proj.is_fp8):
            module.act_down_op = triton_gemm.silu_mul_linear
            module.gate_up_proj.inv_rms_gemm_op = triton_gemm.inv_rms_linear
        if isinstance(module, RMSNorm):
            module.norm_op = triton_ops.rms_norm
            module.add_norm_op = triton_ops.add_rms_norm
        elif isinstance(module, SiluAndMul):
            module.op = triton_ops.silu_and_mul
        elif isinstance(module, LlamaAttention):
            module.qk_norm_rope_op = triton_ops.qk_norm_rope_store_kv
            module.fused_decode = True
    # FP8 layers (not folded): the norm before q/k/v and gate/up, and SiLU-and-mul before
    # down, write FP8 activations and their scales where the projection quantizes its input
    # through the Triton W8A8 kernel (fp8_gemm.fuses_quantization: up to 64 rows per
    # channel): one launch and two passes over memory fewer each (batch-64 ITL 1.3% lower on
    # an H200). SLUICE_FP8_FUSED_QUANT=0 leaves the quantization to the projections.
    from sluice.model import fp8_gemm

    for module in model.modules():
        if type(module) is not LlamaDecoderLayer or os.environ.get(
                "SLUICE_FP8_FUSED_QUANT", "1") == "0":
            continue
        qkv = getattr(module.self_attn, "qkv_proj", None)
        if isinstance(module.self_attn, LlamaAttention) and qkv is not None and qkv.is_fp8:
            module.input_layernorm.quant_norm_op = functools.partial(fp8_gemm.norm_for_fp8,
                                                                     target=qkv)
        mlp = module.mlp
        if type(mlp) is LlamaMLP and mlp.gate_up_proj.is_fp8:
            module.post_attention_layernorm.quant_norm_op = functools.partial(
                fp8_gemm.norm_for_fp8, target=mlp.gate_up_proj)
        if type(mlp) is LlamaMLP and mlp.down_proj.is_fp8 and mlp.act_down_op is None:
            mlp.act_fn.quant_op = functools.partial(fp8_gemm.silu_for_fp8, target=mlp.down_proj)
    # The layers' norms ride in the q/k/v and SiLU kernels (at the Triton GEMM's rows: in
    # gate_up's GEMM, and SiLU-and-mul in the down GEMM) and the residual adds in the GEMMs:
    # 7 launches a layer instead of 9 (6 instead of 8 at the Triton GEMM's rows).
    for module in model.modules():
        if isinstance(module, LlamaModel):
            module.fold_norms(above_tokens=0)

