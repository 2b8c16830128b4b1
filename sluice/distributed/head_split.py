"""How a model's heads and MLP split over tensor-parallel ranks, in integers only (no PyTorch),
so the API server checks a tensor_parallel_size without importing it.

Query heads are split evenly (tensor_parallel_size N must divide them); key/value heads are
split evenly when there are at least N of them (N must divide them), else each is replicated
on N / KVH ranks (KVH must divide N), rank r holding the one its query heads read. The MLP's
intermediate size is split evenly too.
"""

from __future__ import annotations


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """Key/value heads each rank holds: an even share, or one (replicated) when there are
    fewer heads than ranks."""
    return max(1, num_kv_heads // tp_size)


def first_kv_head(num_kv_heads: int, tp_size: int, rank: int) -> int:
    """The first of rank `rank`'s key/value heads, among the model's (see the module
    docstring): its heads are [first, first + kv_heads_per_rank)."""
    return rank * num_kv_heads // tp_size


def check_tp_size(tp_size: int, num_attention_heads: int, num_kv_heads: int,
                  intermediate_size: int) -> None:
    """ValueError, naming both numbers, unless the model's heads and MLP split over tp_size
    ranks as the layers shard them (see the module docstring)."""
    check_head_split(tp_size, num_attention_heads, num_kv_heads)
    if intermediate_size % tp_size:
        raise ValueError(f"tensor_parallel_size ({tp_size}) must divide the model's "
                         f"intermediate_size ({intermediate_size})")


def check_head_split(tp_size: int, num_attention_heads: int, num_kv_heads: int) -> None:
    if num_attention_heads % tp_size:
        raise ValueError(f"tensor_parallel_size ({tp_size}) must divide the model's "
                         f"num_attention_heads ({num_attention_heads})")
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        raise ValueError(f"tensor_parallel_size ({tp_size}) must divide the model's "
                         f"num_key_value_heads ({num_kv_heads})")
    if num_kv_heads < tp_size and tp_size % num_kv_heads:
        raise ValueError(f"with fewer key/value heads ({num_kv_heads}) than "
                         f"tensor_parallel_size ({tp_size}), the heads must divide it (each is "
                         f"replicated on tensor_parallel_size / num_key_value_heads ranks)")
