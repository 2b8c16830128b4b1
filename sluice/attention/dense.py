"""Dense causal attention for a step that is one fresh prompt (no cached context).

Such a step's queries, keys and values are all this step's rows, so attention needs no paged
cache: `torch.nn.functional.scaled_dot_product_attention` over the rows, causal, with the K/V
heads shared by their query groups. On CUDA it runs cuDNN's fused attention, about 1.5x faster
than sluice's paged Triton kernel for a Qwen3-0.6B layer at 1k-8k tokens on an H200; PyTorch's
FlashAttention-2 was slower than the Triton kernel, so it is never picked
(benchmarks/journal/2026-11-27-dense-prefill.md). Elsewhere (the CPU tests) PyTorch picks its
kernel.

Rows past the prompt (a CUDA graph's padding) attend causally to the prompt and to each other:
their outputs are finite and unused, and no prompt row sees them.

A long prompt's middle chunks (one request's queries over a cached prefix, eager steps) run it
in two parts merged by their log-sum-exps: the queries over the prefix, gathered from the paged
cache, with no mask, and over themselves, causally (`dense_attention_over_prefix`). cuDNN gives
the log-sum-exp only through its private ATen op, so that path is offered where a start-up trial
of it equals the paged reference (`cudnn_prefix_attention_works`).

cuDNN builds an execution plan for every new shape, as long as a step
(benchmarks/journal/2026-11-27-no-midrun-planning.md), so the runner marks only steps of shapes
planned before the first request (sluice.worker.graph_runner, DENSE_PREFIX_MAX_BYTES).
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from sluice.attention.causal import causal_attention
from sluice.attention.kv_layout import as_cached, select_rows
from sluice.attention.metadata import AttentionMetadata


def dense_prefill_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], this step's K/V stored
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,  # dense_prefill: one request, its queries rows [0, Q)
    scale: float,
    kv_as_cached: bool = False,  # key/value already hold what the cache holds (the fused op's)
) -> torch.Tensor:  # [T, H, D]
    """A step marked dense_prefill: over no cached context (a CUDA graph's padding rows may
    follow), or over a cached prefix (eager: no padding)."""
    num_queries = int(metadata.query_start_loc_cpu[1])
    context_len = int(metadata.seq_lens_cpu[0]) - num_queries
    if not kv_as_cached:
        # An 8-bit cache: this step's K/V as the cache holds them, as paged attention reads
        # them (a no-op for any other cache dtype).
        key, value = as_cached(key, key_cache.dtype), as_cached(value, value_cache.dtype)
    if context_len == 0:
        return dense_causal_attention(query, key, value, scale)
    assert num_queries == query.shape[0], "a step over a prefix runs eagerly, unpadded"
    return dense_attention_over_prefix(query, key, value, key_cache, value_cache,
                                       metadata.block_tables[0], context_len, scale)


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
    return _close_to_reference(out, q, k, v, head_dim**-0.5)


def _close_to_reference(out: torch.Tensor, query: torch.Tensor, keys: torch.Tensor,
                        values: torch.Tensor, scale: float) -> bool:
    """out [Q, H, D] against the reference backend's float32 attention of the queries as the
    last Q positions of keys / values [S, KVH, D], within bfloat16's reach."""
    ref = causal_attention(query.float(), keys, values, scale)
    return bool((out.float() - ref).abs().max() < 0.05)


def dense_attention_over_prefix(
    query: torch.Tensor,  # [Q, H, D]: the last Q positions of the context
    key: torch.Tensor,  # [Q, KVH, D]: this step's keys
    value: torch.Tensor,  # [Q, KVH, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor,
    block_table_row: torch.Tensor,  # [>= ceil(context_len / block_size)] int32
    context_len: int,  # cached positions before the queries
    scale: float,
) -> torch.Tensor:  # [Q, H, D]
    block_size = key_cache.shape[1]
    blocks = block_table_row[:-(-context_len // block_size)].long()
    prefix_key, prefix_value = (
        select_rows(cache, blocks).flatten(0, 1)[:context_len].to(query.dtype)
        for cache in (key_cache, value_cache))  # [C, KVH, D]
    out_prefix, lse_prefix = _attention_with_lse(query, prefix_key, prefix_value, scale, False)
    out_self, lse_self = _attention_with_lse(query, key, value, scale, True)
    # softmax over both key sets = the two partial softmaxes weighted by their mass
    lse = torch.logaddexp(lse_prefix, lse_self)  # [Q, H]
    out = (out_prefix.float() * (lse_prefix - lse).exp()[..., None]
           + out_self.float() * (lse_self - lse).exp()[..., None])
    return out.to(query.dtype)


def _attention_with_lse(
    query: torch.Tensor,  # [Q, H, D]
    key: torch.Tensor,  # [S, KVH, D]
    value: torch.Tensor,  # [S, KVH, D]
    scale: float,
    causal: bool,  # square: query i sees keys 0..i
) -> tuple[torch.Tensor, torch.Tensor]:  # out [Q, H, D], natural-log log-sum-exp [Q, H] float32
    group = query.shape[1] // key.shape[1]
    q = query.transpose(0, 1).unsqueeze(0)
    k, v = (t.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0) for t in (key, value))
    if query.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
        return out[0].transpose(0, 1), lse.reshape(query.shape[1], -1).transpose(0, 1)
    # The CPU (tests): the same in float32 math.
    scores = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) * scale
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = scores.logsumexp(-1)  # [1, H, Q]
    out = torch.einsum("bhqk,bhkd->bhqd", (scores - lse[..., None]).exp(), v.float())
    return out[0].transpose(0, 1).to(query.dtype), lse[0].transpose(0, 1)


@functools.cache
def cudnn_prefix_attention_works(device: torch.device, dtype: torch.dtype, num_heads: int,
                                 num_kv_heads: int, head_dim: int) -> bool:
    """Whether dense_attention_over_prefix runs here and equals a float32 reference: 48 queries
    over 80 cached positions in 16-slot blocks, tried once outside any CUDA graph capture."""
    if not cudnn_attention_works(device, dtype, num_heads, num_kv_heads, head_dim):
        return False
    gen = torch.Generator(device=device).manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    context_len, num_queries = 80, 48
    key_cache, value_cache = randn(9, 16, num_kv_heads, head_dim), randn(9, 16, num_kv_heads,
                                                                          head_dim)
    table = torch.tensor([7, 2, 5, 0, 8], dtype=torch.int32, device=device)
    query, key, value = (randn(num_queries, heads, head_dim)
                         for heads in (num_heads, num_kv_heads, num_kv_heads))
    try:
        out = dense_attention_over_prefix(query, key, value, key_cache, value_cache, table,
                                          context_len, head_dim**-0.5)
    except (RuntimeError, AttributeError, TypeError):  # the private op missing or refusing
        return False
    prefix_k, prefix_v = (c[table.long()].flatten(0, 1)[:context_len] for c in (key_cache,
                                                                                value_cache))
    return _close_to_reference(out, query, torch.cat([prefix_k, key]),
                               torch.cat([prefix_v, value]), head_dim**-0.5)

