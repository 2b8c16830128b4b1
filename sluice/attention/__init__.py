"""Attention metadata and backends (torch reference on CPU; Triton kernels on GPU later)."""

from sluice.attention.backend import AttentionBackend, get_attention_backend
from sluice.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
