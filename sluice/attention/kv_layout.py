"""The paged KV cache's layout: what the attention backends read and write, and its size.

One tensor per attention layer, `[2, num_blocks, block_size, num_kv_heads, head_dim]`: index 0 of
the first dimension holds keys, 1 values. A model's caches are a dict `{layer_name: tensor}` in
layer order, keyed by the layers' qualified module names (Attention.layer_name). Token slot `s`
(AttentionMetadata.slot_mapping) is block `s // block_size`, offset `s % block_size`; slot -1
stores nothing. Block 0 is the null block: the block pool never hands it out, so padding (CUDA
graphs' padding rows) may read it.

The model runner sizes the cache (sluice.worker.kv_cache.determine_num_blocks), allocates it here
once the model is loaded and binds each tensor to its layer (sluice.model.attention); a draft
model's or EAGLE head's cache is allocated the same way, addressed by the same block ids.

The cache holds K/V in the model's dtype, or with `kv_cache_dtype="fp8"` in float8_e4m3fn (one
byte an element, no scale: what vLLM does for a checkpoint without KV scales), which halves a 16-bit
model's KV bytes, so a decode step reads half as much and twice the tokens fit;
`kv_cache_dtype="fp8_e5m2"` stores float8_e5m2 instead (2 mantissa bits rather than 3, range
+-57344 rather than +-448). Every write saturates at the format's largest finite value
(`to_cache_dtype`) and rounds to nearest even, and every attention reads K/V as the cache
holds them, the current step's too (the dense attention of a prompt included), so each path
attends to the same values and chunked prefill, prefix hits and CUDA graphs leave greedy output
as it is with the same cache dtype. The output differs from a 16-bit cache's: this is
quantization, chosen by the user. KV connectors (the CPU tier, the pool, prefill/decode
transfers) see an 8-bit cache as bytes (`kv_bytes`) and name its dtype in their keys and
handshakes, so instances of different cache dtypes never exchange blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sluice.config import KV_CACHE_DTYPES

FP8_E4M3_MAX = 448.0
FP8_E5M2_MAX = 57344.0
_FP8_MAX = {torch.float8_e4m3fn: FP8_E4M3_MAX, torch.float8_e5m2: FP8_E5M2_MAX}


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for a `kv_cache_dtype` setting and the model's dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    if kv_cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, "
                     f"got {kv_cache_dtype!r}")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in _FP8_MAX


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`x` as a cache of `cache_dtype` stores it: for an 8-bit cache saturated at the format's
    largest finite value (+-448, e5m2 +-57344; torch would make e5m2 infinite) and rounded to
    nearest even (the Triton kernels' `to_cache_dtype` does the same), else a plain
    conversion."""
    if is_fp8(cache_dtype):
        limit = _FP8_MAX[cache_dtype]
        x = x.float().clamp(-limit, limit)
    return x.to(cache_dtype)


def select_rows(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache[index] along dim 0; an 8-bit cache is indexed through its bytes (indexing ops
    need not support float8 on every device)."""
    if is_fp8(cache.dtype):
        return cache.view(torch.uint8).index_select(0, index).view(cache.dtype)
    return cache.index_select(0, index)


def write_rows(cache: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """cache[index] = rows as the cache stores them (to_cache_dtype)."""
    rows = to_cache_dtype(rows, cache.dtype)
    if is_fp8(cache.dtype):
        cache.view(torch.uint8)[index] = rows.view(torch.uint8)
    else:
        cache[index] = rows


def kv_bytes(kv: torch.Tensor) -> torch.Tensor:
    """What a KV connector is given of a cache: an 8-bit cache as its bytes (uint8, the same
    shape), which every copy and index op takes on every device; any other cache as it is.
    Connectors move blocks without reading their values."""
    return kv.view(torch.uint8) if is_fp8(kv.dtype) else kv


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`x` (fresh K or V) rounded to what a cache of `cache_dtype` would hold, in x's dtype:
    attention over fresh K/V (dense prefill) sees what attention over the cache sees."""
    if not is_fp8(cache_dtype):
        return x
    return to_cache_dtype(x, cache_dtype).to(x.dtype)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[int, int, int, int, int]:
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """Bytes one block id costs across all `num_layers` layers' caches."""
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * elem


# (layer names, shape of each layer's cache, dtype, device) -> zeroed caches by layer name, in
# that order: where a KV connector places the cache (KVConnectorWorker.kv_cache_allocator).
KVCacheAllocator = Callable[[Sequence[str], tuple[int, ...], torch.dtype, torch.device],
                            dict[str, torch.Tensor]]


def allocate_kv_caches(layer_names: Sequence[str], num_blocks: int, block_size: int,
                       num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       device: torch.device, allocator: KVCacheAllocator | None = None
                       ) -> dict[str, torch.Tensor]:
    """Zeroed caches, one per layer name, in the order given (layer order); from `allocator`
    where one is given."""
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    if allocator is not None:
        return allocator(layer_names, shape, dtype, device)
    return {name: torch.zeros(shape, dtype=dtype, device=device) for name in layer_names}
