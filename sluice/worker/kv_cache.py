"""Sizing the paged KV cache: how many blocks this engine's memory budget holds.

The layout and its allocation are the attention side's (sluice.attention.kv_layout); this is the
policy: a GPU's share left after the weights less a reserve for activations, or the CPU budget,
capped at what every sequence at full length could use.
"""

from __future__ import annotations

import torch

from sluice.attention.kv_layout import bytes_per_block
from sluice.config import CacheConfig, SchedulerConfig
from sluice.core.kv_cache_groups import KVCacheGroups
from sluice.distributed.head_split import kv_heads_per_rank
from sluice.model.hf_config import HFModelConfig

# Kept free on a GPU for activations, logits and the allocator's fragmentation.
_GPU_ACTIVATION_RESERVE_BYTES = 2 << 30


def determine_num_blocks(
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    hf_config: HFModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    gpu_bytes_available: int = 0,
    extra_bytes_per_block: int = 0,
    tp_size: int = 1,
    kv_groups: KVCacheGroups | None = None,
) -> int:
    """Blocks that fit the memory budget (or the override) of one rank, whose cache holds its
    share of the KV heads (tp_size ranks). On a GPU, `gpu_bytes_available` is this engine's
    share left after its weights (see ModelRunner). `extra_bytes_per_block`: the same block in
    other caches addressed by the same block ids (a draft model's). `kv_groups`: the model's
    KV cache groups (None: one of every layer); a block is a page of one group's layers."""
    if cache_config.num_gpu_blocks_override is not None:
        return cache_config.num_gpu_blocks_override
    num_groups = 1 if kv_groups is None else kv_groups.num_groups
    num_kv_layers = hf_config.num_hidden_layers if kv_groups is None else kv_groups.group_size
    block_bytes = extra_bytes_per_block + bytes_per_block(
        num_kv_layers, cache_config.block_size,
        kv_heads_per_rank(hf_config.num_key_value_heads, tp_size), hf_config.head_dim, dtype)
    if device.type == "cuda":
        budget = gpu_bytes_available - _GPU_ACTIVATION_RESERVE_BYTES
    else:
        budget = cache_config.cpu_kv_cache_bytes
    # Never more than every sequence at full length could use, plus the null block: beyond that
    # blocks only hold evicted prefixes, and each costs host memory for its bookkeeping (a small
    # model on a big GPU would otherwise get millions). Every group holds a sequence's blocks.
    blocks_per_seq = -(-scheduler_config.max_model_len // cache_config.block_size) * num_groups
    needed = scheduler_config.max_num_seqs * blocks_per_seq + 1
    num_blocks = min(budget // block_bytes, needed)
    if num_blocks < 2:
        raise ValueError(
            f"the KV cache budget fits {num_blocks} blocks of {block_bytes} bytes; at least 2 are "
            "needed: raise gpu_memory_utilization / the CPU KV budget, or lower block_size")
    return int(num_blocks)

