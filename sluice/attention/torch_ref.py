"""Paged attention in plain torch: the CPU reference every other backend is tested against.

Clarity over speed: one loop over requests, vectorised gathers within each. Steps of `forward`:
1. store the key/value of every query token at its slot (slot -1 = padding, skipped), so a request
   can read a prefix another request of the same batch has just written (unless the caller has
   stored them: `kv_stored`);
2. per request, gather its `seq_len` context tokens through its block table row and attend its
   `query_len` queries (the last `query_len` positions) causally over them, in float32. With a
   sliding window, only the blocks from the first query's window on are gathered: blocks before
   it may have been freed (sluice.core.kv_cache_manager), their table entries stale.
"""

from __future__ import annotations

import torch

from sluice.attention.causal import causal_attention
from sluice.attention.dense import dense_prefill_attention
from sluice.attention.kv_layout import select_rows, write_rows
from sluice.attention.metadata import AttentionMetadata


class TorchRefBackend:
    name = "torch_ref"
    # Steps marked dense_prefill keep the paged path here unless this is set (tests of the
    # runner's dense-prefill steps on a CPU: sluice.attention.dense).
    dense_prefill = False

    def supports_dense_prefill(self, device: torch.device, dtype: torch.dtype,
                               num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return self.dense_prefill

    supports_dense_prefix = supports_dense_prefill

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, KVH, D]
        value: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
        metadata: AttentionMetadata,
        scale: float,
        kv_stored: bool = False,  # key/value already at their slots: no store
        sliding_window: int | None = None,  # a query at position p sees keys at > p - window
    ) -> torch.Tensor:  # [T, H, D]
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        output = torch.zeros_like(query)  # padding tokens past the requests stay zero
        # No cache bound (a profiling run): every request must be a fresh prefill.
        has_cache = kv_cache.numel() > 0
        if has_cache:
            block_size = kv_cache.shape[2]
            key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [num_slots, KVH, D]
            value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
        if has_cache and not kv_stored:
            slots = metadata.slot_mapping[: key.shape[0]]
            stored = slots >= 0
            write_rows(key_cache, slots[stored], key[stored])
            write_rows(value_cache, slots[stored], value[stored])

        if metadata.dense_prefill and self.dense_prefill and sliding_window is None:
            return dense_prefill_attention(query, key, value, kv_cache[0], kv_cache[1], metadata,
                                           scale, kv_as_cached=kv_stored)
        query_start_loc = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        for i, seq_len in enumerate(seq_lens):
            start, end = query_start_loc[i], query_start_loc[i + 1]
            if end == start:
                continue
            if not has_cache:
                if seq_len != end - start:
                    raise ValueError(
                        f"request {i} has context {seq_len} > its {end - start} query tokens, "
                        "but no KV cache is bound"
                    )
                keys, values = key[start:end], value[start:end]
                first_key_pos = 0
            else:
                first_query_pos = seq_len - (end - start)
                first_block = 0
                if sliding_window is not None:
                    first_block = max(first_query_pos - sliding_window + 1, 0) // block_size
                first_key_pos = first_block * block_size
                num_blocks = -(-seq_len // block_size)
                block_ids = metadata.block_tables[i, first_block:num_blocks].long()
                offsets = torch.arange(block_size, device=block_ids.device)
                context_slots = (block_ids[:, None] * block_size + offsets).flatten()[
                    : seq_len - first_key_pos]
                keys = select_rows(key_cache, context_slots)
                values = select_rows(value_cache, context_slots)
            output[start:end] = causal_attention(query[start:end], keys, values, scale,
                                                 sliding_window, first_key_pos)
        return output

