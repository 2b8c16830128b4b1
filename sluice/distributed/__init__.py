"""Tensor parallelism's process group: which rank this process is, and the collectives the
parallel layers (sluice.model.linear, sluice.model.embed_head) call."""

from sluice.distributed.tp import SINGLE_RANK, TPGroup, kv_heads_per_rank

__all__ = ["SINGLE_RANK", "TPGroup", "kv_heads_per_rank"]
