"""Attention metadata: one shape for prefill, decode and mixed batches.

The query tokens of all scheduled requests are flattened into one sequence; request i owns
query tokens `query_start_loc[i]:query_start_loc[i+1]`, which are the last `query_len` tokens of
its `seq_lens[i]` tokens of context. K/V of every query token is written to `slot_mapping`
(`slot = block_id * block_size + offset`), then attention reads the whole context through
`block_tables`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch


class LayerKVHooks(Protocol):
    """Per-layer work of a KV connector (sluice/worker/kv_connector.py), run by each attention
    layer around its attention: wait for the layer's loads, then hand on its stored KV."""

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata | None) -> None: ...


@dataclass(slots=True)
class AttentionMetadata:
    num_actual_tokens: int  # query tokens that are real (the rest is padding)
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the model's device
    seq_lens: torch.Tensor  # [num_reqs] int32: context length incl. this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 means "do not store"
    # Host copies, so the reference backend never syncs with the device.
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    # Optional, for decode batches (one query per request, no padding tokens): [num_reqs] int32,
    # the requests longest context first. A kernel that runs one program per request may start
    # them in this order, so the longest ones do not make the tail of the launch.
    decode_order: torch.Tensor | None = None
    # The step is one prompt (chunk), its queries rows [0, query_start_loc[1]): over no cached
    # context they attend causally among themselves and any rows after them are padding; over a
    # cached prefix (eager, no padding) they also attend to it. A backend may then run dense
    # attention (sluice.attention.dense).
    dense_prefill: bool = False
    # A verification graph's step (a few query tokens per request): a backend may split each
    # token's context over programs as for a decode. Set only where the shapes are compiled
    # before the first request (a graph's warm-up), never for an eager step of a few tokens,
    # which would compile new kernel variants mid-run.
    split_queries: bool = False
    # Set only for eager steps with connector work (never inside a CUDA graph).
    kv_hooks: LayerKVHooks | None = None
    # A hybrid model's KV cache groups 1.. (sluice/core/kv_cache_groups.py): each group's
    # (block_tables, slot_mapping), shaped as the fields above (group 0's); () for one group.
    group_tables: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    _group_views: list[AttentionMetadata] | None = None

    def for_group(self, group: int) -> AttentionMetadata:
        """This metadata as the layers of KV cache group `group` read it: the same step over
        that group's block tables and slots. Made once per step for all groups, when a layer
        first asks (after the step's flags are set)."""
        if group == 0:
            return self
        if self._group_views is None:
            self._group_views = [
                replace(self, block_tables=tables, slot_mapping=slots, group_tables=())
                for tables, slots in self.group_tables]
        return self._group_views[group - 1]

    @property
    def num_reqs(self) -> int:
        return self.seq_lens_cpu.shape[0]
