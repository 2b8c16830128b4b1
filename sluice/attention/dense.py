"""Dense causal attention for a step that is one fresh prompt (no cached context).

Such a step's queries, keys and values are all this step's rows, so attention needs no paged
cache: `torch.nn.functional.scaled_dot_product_attention` over the rows, causal, with the K/V
heads shared by their query groups. On CUDA it runs cuDNN's fused attention, which on an H200
took 23.6 us for a 1,024-token Qwen3-0.6B layer against 34.9 for sluice's paged Triton kernel,
and 484 us against 724 at 8,192 tokens (`benchmarks/`, issue 20); PyTorch's FlashAttention-2
was slower than the Triton kernel (38.5 / 963 us), so it is never picked. Elsewhere (the CPU
tests) PyTorch picks its kernel.

Rows past the prompt (a CUDA graph's padding) attend causally to the prompt and to each other:
their outputs are finite and unused, and no prompt row sees them.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention


def dense_causal_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    # [1, heads, T, D] views: the rows' strides stay as they are (q/k/v are views of one qkv).
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    if query.is_cuda:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
    else:
        out = scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                           enable_gqa=key.shape[1] != query.shape[1])
    return out[0].transpose(0, 1)  # cuDNN writes it token-major: a view, no copy


@functools.cache
def cudnn_attention_works(device: torch.device, dtype: torch.dtype, num_heads: int,
                          num_kv_heads: int, head_dim: int) -> bool:
    """Whether this PyTorch build runs cuDNN attention for these shapes on `device` (cuDNN 9
    attention needs sm80+, a 16-bit dtype and supported head sizes): tried once on 64 rows,
    outside any CUDA graph capture, against a float32 reference."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(64, heads, head_dim, device=device, dtype=dtype, generator=gen)
               for heads in (num_heads, num_kv_heads, num_kv_heads))
    try:
        out = dense_causal_attention(q, k, v, head_dim**-0.5)
    except (RuntimeError, TypeError):  # no cuDNN kernel for these shapes; TypeError: torch < 2.5
        return False
    group = num_heads // num_kv_heads
    ref = scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().repeat_interleave(group, 1).transpose(0, 1),
        v.float().repeat_interleave(group, 1).transpose(0, 1), is_causal=True,
        scale=head_dim**-0.5).transpose(0, 1)
    return bool((out.float() - ref).abs().max() < 0.05)
