"""Triton kernels for the paged KV cache: store, unified (mixed-batch) attention, split-KV decode.

Kernels run on CUDA tensors, and on CPU tensors under `TRITON_INTERPRET=1` (the tests).
"""

from sluice.attention.triton.common import TileConfig
from sluice.attention.triton.split_kv import split_kv_attention
from sluice.attention.triton.store_kv import store_kv
from sluice.attention.triton.unified import unified_attention

__all__ = ["TileConfig", "split_kv_attention", "store_kv", "unified_attention"]
