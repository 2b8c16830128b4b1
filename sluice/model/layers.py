"""Building blocks of the decoder models: norm, rotary embedding, activation (the linear layers
are in sluice.model.linear, the embedding and LM head in sluice.model.embed_head).

The small ops (`rms_norm`, `add_rms_norm`, `qk_norm_rope`, `silu_and_mul`) are plain torch
functions held in module attributes, so a runner can swap in fused kernels with the same
semantics for all layers (sluice.worker.compile).

Parameters are created with `torch.empty` (the loader fills them) on the current default device and
dtype, each with its `weight_loader` (sluice.model.weights): these are replicated on every
tensor-parallel rank (the per-head q/k norms too: every head's weight is the same [head_dim]).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sluice.model.weights import new_param


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden]. Statistics in float32, weight applied in the input dtype, as HF does."""
    x_f32 = x.float()
    x_f32 = x_f32 * torch.rsqrt(x_f32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x_f32.to(x.dtype)


def scale_by_inv_rms(x: torch.Tensor, residual: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, N] times each row's 1 / rms(residual row) ([T, hidden]), computed in float32
    and rounded to x's dtype: what completes an RMSNorm whose weight was folded into the
    projection that made x from the raw residual (LlamaModel.fold_norms)."""
    residual_f32 = residual[: x.shape[0]].float()
    inv_rms = torch.rsqrt(residual_f32.pow(2).mean(-1, keepdim=True) + eps)
    return (x.float() * inv_rms).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise `x + residual`; also return that sum (the next residual)."""
    x = x + residual
    return rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_param(hidden_size)
        # Plain functions, so a runner may swap in one compiled (fused) version for all layers.
        self.norm_op = rms_norm
        self.add_norm_op = add_rms_norm
        # (x, residual or None, weight, eps) -> what forward returns, the output maybe
        # quantized for the FP8 projection it feeds (sluice.worker.compile); None: not fused.
        self.quant_norm_op = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [..., hidden]. With `residual`, normalises `x + residual` and also returns that
        sum as the next residual (the pre-norm decoder's skip connection)."""
        if self.quant_norm_op is not None:
            return self.quant_norm_op(x, residual, self.weight, self.eps)
        if residual is None:
            return self.norm_op(x, self.weight, self.eps)
        return self.add_norm_op(x, residual, self.weight, self.eps)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept,
    a smooth blend in between."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(head_dim: int, base: float,
                  rope_scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """RoPE's inverse frequencies, [head_dim / 2] float32 whatever the default dtype (positions
    up to 1e5+ need the precision)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_scaling is None:
        return inv_freq
    if rope_scaling.get("rope_type") == "linear":  # positions divided by the factor
        return inv_freq / float(rope_scaling["factor"])
    if rope_scaling.get("rope_type") != "llama3":
        raise ValueError(f"rope_type must be one of ['llama3', 'linear'] when scaling, got "
                         f"{rope_scaling!r}")
    return _llama3_inv_freq(inv_freq, rope_scaling)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate the two halves of each head) over a precomputed cos/sin table."""

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, base, rope_scaling)
        positions = torch.arange(max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_pos, head_dim / 2]
        # cos_sin_cache: [max_pos, head_dim], cos in the first half, sin in the second.
        cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; query: [T, H * D] or [T, H, D]; key likewise. Same shapes back."""
        return apply_rotary(positions, query, key, self.cos_sin_cache, self.head_dim)


def apply_rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                 cos_sin_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotation of query and key heads at `positions` (see RotaryEmbedding)."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # each [T, D / 2]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D / 2]
    return _rotate(query, cos, sin, head_dim), _rotate(key, cos, sin, head_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            head_dim: int) -> torch.Tensor:
    heads = x.view(x.shape[0], -1, head_dim).float()  # [T, H, D]
    x1, x2 = heads.chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotated.to(x.dtype).view(x.shape)


def qk_norm_rope(
    qkv: torch.Tensor,  # [T, (H + 2 * KVH) * D]: the fused q/k/v projection
    positions: torch.Tensor,  # [T]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] float32 (see RotaryEmbedding)
    q_norm_weight: torch.Tensor | None,  # [D]; None: no q/k norm (Llama)
    k_norm_weight: torch.Tensor | None,  # [D]
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    residual: torch.Tensor | None = None,  # [T, hidden]: the input norm folded
    residual_eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # q [T, H * D], k [T, KVH * D]
    """Attention's q and k from qkv: each head RMS-normalised over head_dim when weights are
    given (Qwen3), then rotated. This version returns new tensors; the fused kernel
    (sluice.model.triton_ops) rewrites qkv's q and k columns and returns views of them, so
    callers must not read those columns afterwards.

    Given `residual`, qkv first becomes scale_by_inv_rms(qkv, residual, residual_eps), in
    place (its v columns are read afterwards): the layer's input norm was folded into the
    projection (LlamaModel.fold_norms)."""
    if residual is not None:
        qkv.copy_(scale_by_inv_rms(qkv, residual, residual_eps))
    num_tokens, head_dim = qkv.shape[0], cos_sin_cache.shape[1]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        assert k_norm_weight is not None
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    q, k = apply_rotary(positions, q, k, cos_sin_cache, head_dim)
    return q.reshape(num_tokens, q_size), k.reshape(num_tokens, kv_size)


def silu_and_mul(x: torch.Tensor, residual: torch.Tensor | None = None,
                 residual_eps: float = 0.0) -> torch.Tensor:
    """x: [T, 2 * I] (gate, up) -> [T, I]. Given `residual`, x is first
    scale_by_inv_rms(x, residual, residual_eps): the input norm folded into gate_up_proj."""
    if residual is not None:
        x = scale_by_inv_rms(x, residual, residual_eps)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.op = silu_and_mul
        # x -> silu_and_mul(x), maybe quantized for the FP8 projection it feeds
        # (sluice.worker.compile); None: not fused.
        self.quant_op = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                residual_eps: float = 0.0) -> torch.Tensor:
        """x: [T, 2 * I] (gate, up) -> [T, I]; `residual`: see silu_and_mul."""
        if residual is None and self.quant_op is not None:
            return self.quant_op(x)
        if residual is None:
            return self.op(x)
        return self.op(x, residual, residual_eps)
