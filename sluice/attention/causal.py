"""Causal attention of a request's queries over its gathered context, in float32: the math of the
CPU reference backend (torch_ref.py), and the yardstick dense.py holds cuDNN's kernels to."""

from __future__ import annotations

import torch


def causal_attention(
    query: torch.Tensor,  # [Q, H, D]: the last Q positions of the context
    keys: torch.Tensor,  # [S, KVH, D]
    values: torch.Tensor,  # [S, KVH, D]
    scale: float,
) -> torch.Tensor:  # [Q, H, D], dtype of query
    num_queries, num_heads, head_dim = query.shape
    seq_len, num_kv_heads = keys.shape[0], keys.shape[1]
    group = num_heads // num_kv_heads  # query heads served by one KV head
    q = query.float().view(num_queries, num_kv_heads, group, head_dim)
    scores = torch.einsum("qhgd,shd->hgqs", q, keys.float()) * scale  # [KVH, G, Q, S]
    query_pos = torch.arange(seq_len - num_queries, seq_len, device=query.device)
    key_pos = torch.arange(seq_len, device=query.device)
    future = key_pos[None, :] > query_pos[:, None]  # [Q, S]
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    out = torch.einsum("hgqs,shd->qhgd", probs, values.float())
    return out.reshape(num_queries, num_heads, head_dim).to(query.dtype)
