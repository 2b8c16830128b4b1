"""Causal attention of a request's queries over its gathered context, in float32: the math of the
CPU reference backend (torch_ref.py), and the yardstick dense.py holds cuDNN's kernels to."""

from __future__ import annotations

import torch


def causal_attention(
    query: torch.Tensor,  # [Q, H, D]: the last Q positions of the context
    keys: torch.Tensor,  # [S, KVH, D]: context positions first_key_pos .. first_key_pos + S - 1
    values: torch.Tensor,  # [S, KVH, D]
    scale: float,
    sliding_window: int | None = None,  # a query at position p sees keys at > p - window
    first_key_pos: int = 0,  # keys before it are left out (outside every query's window)
) -> torch.Tensor:  # [Q, H, D], dtype of query
    num_queries, num_heads, head_dim = query.shape
    seq_len, num_kv_heads = keys.shape[0], keys.shape[1]
    group = num_heads // num_kv_heads  # query heads served by one KV head
    q = query.float().view(num_queries, num_kv_heads, group, head_dim)
    scores = torch.einsum("qhgd,shd->hgqs", q, keys.float()) * scale  # [KVH, G, Q, S]
    context_len = first_key_pos + seq_len
    query_pos = torch.arange(context_len - num_queries, context_len, device=query.device)
    key_pos = torch.arange(first_key_pos, context_len, device=query.device)
    hidden = key_pos[None, :] > query_pos[:, None]  # [Q, S]: the future
    if sliding_window is not None:  # transformers' sliding_window_overlay: kv > q - window
        hidden |= key_pos[None, :] <= query_pos[:, None] - sliding_window
    probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
    out = torch.einsum("hgqs,shd->qhgd", probs, values.float())
    return out.reshape(num_queries, num_heads, head_dim).to(query.dtype)
