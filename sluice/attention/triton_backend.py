"""The Triton attention backend: the same metadata and KV layout as the torch reference, on GPU
kernels (`sluice.attention.triton`).

`forward` = store this step's K/V at their slots, then attention:
- split-KV (flash-decoding) when every request has one query token and there are too few
  (request, KV head) pairs to fill the GPU, with contexts long enough to split;
- otherwise the unified kernel: small query tiles for decode batches, large ones for prefills,
  and for a mix of both two launches (each skips the other's requests), so decode rows never
  ride in a prefill-sized tile.

Every choice is made from python ints (token count, `num_reqs`, `max_query_len`,
`max_seq_len`), never from device data, so a decode step can be captured in a CUDA graph: the
runner fixes those ints per batch-size bucket (padding requests: slot -1, seq_len 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import triton

from sluice.attention.dense import (
    cudnn_attention_works,
    cudnn_prefix_attention_works,
    dense_prefill_attention,
)
from sluice.attention.kv_layout import is_fp8
from sluice.attention.metadata import AttentionMetadata
from sluice.attention.triton import TileConfig, split_kv_attention, store_kv, unified_attention
from sluice.attention.triton.decode_qkv import decode_from_qkv
from sluice.attention.triton.split_kv import MAX_QUERY_LEN as MAX_SPLIT_QUERY_LEN
from sluice.attention.triton.unified import MAX_INT32

SplitKVMode = Literal["auto", "always", "never"]
DensePrefillMode = Literal["auto", "never"]

# Tile shapes and split rules, chosen by `python -m sluice.bench.kernels [--sweep]` and checked in
# the model on an H200 with Qwen3-0.6B's attention (16 / 8 heads, head_dim 128, block size 16).
# The measurements behind each are in the journal note named beside it.
#
# Decode: 128-key tiles, because the workload's decode batches are ragged and shrink (64-key tiles
# win only on a uniform batch); more than 3 stages gain nothing, as the block-table load ahead of
# each K/V tile takes a stage of its own
# (benchmarks/journal/2026-11-22-fused-kernels-and-decode-tiles.md).
DECODE_TILES = TileConfig(block_m=16, block_n=128, num_warps=4, num_stages=3)
PREFILL_TILES = TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
SPLIT_TILES = TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)
# Decode batches of at least SHORT_DECODE_MIN_REQS requests, every context under
# SHORT_DECODE_CONTEXT keys (their own CUDA graphs: sluice.worker.graph_runner): 64-key tiles let
# more programs share an SM; one request and longer contexts are faster with 128-key tiles. Only
# decode batches take them: a mixed or verification step's decode rows keep DECODE_TILES, whose
# variants the warm-up compiles (else a compile mid-run:
# benchmarks/journal/2026-11-27-no-midrun-planning.md; the tiles:
# benchmarks/journal/2026-11-27-dense-prefill.md).
SHORT_DECODE_TILES = TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)
SHORT_DECODE_MIN_REQS = 16
# An 8-bit cache: from FP8_DECODE_MIN_PROGRAMS_PER_SM (request, KV head) programs per SM, 64-key
# tiles in 5 stages, which Triton's pipeliner makes two K/V buffers a program (3 stages give one):
# half the bytes a key needs more bytes in flight. Below the threshold they were slower, so those
# batches keep the 16-bit rule (benchmarks/journal/2026-11-28-fp8-attention-ptx-v.md).
FP8_DECODE_TILES = TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=5)
FP8_DECODE_MIN_PROGRAMS_PER_SM = 2
# Split-KV over an 8-bit cache, for the same reason: 5 stages, never slower than SPLIT_TILES' 3
# with L2 flushed (benchmarks/journal/2026-11-28-fp8-vs-vllm-e5m2-fp16-dots.md).
FP8_SPLIT_TILES = TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=5)
# Few programs: split so the GPU fills (about 4 programs per SM), keeping at least
# MIN_KEYS_PER_SPLIT keys per split so the merge stays cheap next to the reads. With more
# programs, splits measured slower or within noise on the workload's ragged decode batches.
SPLIT_BELOW_PROGRAMS_PER_SM = 2
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64
# Very few programs over a short context (at most a sixteenth of the SMs: one request of
# Qwen3-0.6B's 8 KV heads on an H200): one program walking a KV head's tiles is the step's
# latency, so contexts under SHORT_DECODE_CONTEXT split into 8 splits of 64-key tiles (-1.4% ITL
# at batch 1); at 4 requests and at longer contexts splitting was slower
# (benchmarks/journal/2026-11-28-short-context-split.md).
FEW_PROGRAMS_SM_FRACTION = 16
FEW_PROGRAMS_KEYS_PER_SPLIT = 64
# Decode batches of FUSED_DECODE_MIN_REQS requests or more, with at most
# FUSED_DECODE_MAX_PROGRAMS_PER_SM (request, KV head) programs per SM, take q/k norm, RoPE and
# the KV store inside the attention kernel (decode_from_qkv): one launch a layer fewer, for a
# prologue each program repeats, which costs once while the programs fit about one wave. Under
# 16 requests the separate q/k kernel is short and overlaps the attention's launch (PDL), so the
# two launches stay (benchmarks/journal/2026-11-27-fused-decode-attention.md).
FUSED_DECODE_MIN_REQS = 16
FUSED_DECODE_MAX_PROGRAMS_PER_SM = 4
# The fused kernel's own tiles, at any context, from FUSED_TILES_MIN_PROGRAMS_PER_SM programs per
# SM: its prologue holds registers the unified kernel's does not, so with the unified kernel's
# tiles only 3 programs fit an SM and a batch ran in two waves; these keep 4 resident
# (tests/kernels/test_fp8_ptx.py checks it). Fewer programs keep the unified kernel's tiles, where
# deeper pipelines pay (benchmarks/journal/2026-11-28-fused-decode-tiles.md).
FUSED_DECODE_TILES = TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)
FP8_FUSED_DECODE_TILES = TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=2)
FUSED_TILES_MIN_PROGRAMS_PER_SM = 2
# No context under this is split but by very few programs (see choose_num_splits): from
# SHORT_DECODE_MIN_REQS requests short_decode_tiles take such batches.
SHORT_DECODE_CONTEXT = 2 * MIN_KEYS_PER_SPLIT


@dataclass(frozen=True, slots=True)
class TritonBackendConfig:
    split_kv: SplitKVMode = "auto"  # "always": every decode batch (tests); "never": unified only
    decode_tiles: TileConfig = DECODE_TILES
    # Decode tiles of a decode batch (one query a request) whose longest context is under
    # SHORT_DECODE_CONTEXT and which has at least SHORT_DECODE_MIN_REQS requests.
    short_decode_tiles: TileConfig = SHORT_DECODE_TILES
    # Decode tiles of a decode batch over an 8-bit cache with at least
    # FP8_DECODE_MIN_PROGRAMS_PER_SM programs per SM.
    fp8_decode_tiles: TileConfig = FP8_DECODE_TILES
    prefill_tiles: TileConfig = PREFILL_TILES
    split_tiles: TileConfig = SPLIT_TILES
    fp8_split_tiles: TileConfig = FP8_SPLIT_TILES  # split-KV over an 8-bit cache
    fused_decode_tiles: TileConfig = FUSED_DECODE_TILES  # decode_from_qkv
    fp8_fused_decode_tiles: TileConfig = FP8_FUSED_DECODE_TILES  # ... over an 8-bit cache
    num_splits: int | None = None  # fixed split count (tests, benchmarks); None = by the rule
    # Mixed batches: decodes and prefills in separate launches with their own tiles.
    split_mixed_batches: bool = True
    # A step that is one prompt (chunk) (AttentionMetadata.dense_prefill): "auto" runs it as
    # dense attention (cuDNN) where that works for the model's dtype and shapes. The engine's
    # switch is `--no-dense-prefill` (ModelConfig.dense_prefill).
    dense_prefill: DensePrefillMode = "auto"

    def __post_init__(self) -> None:
        if self.split_kv not in ("auto", "always", "never"):
            raise ValueError(
                f"split_kv must be one of ['auto', 'always', 'never'], got {self.split_kv!r}"
            )
        if self.dense_prefill not in ("auto", "never"):
            raise ValueError(
                f"dense_prefill must be one of ['auto', 'never'], got {self.dense_prefill!r}")
        if self.num_splits is not None and not 1 <= self.num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {self.num_splits}")


def choose_num_splits(
    num_reqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int
) -> int:
    """Splits per request for a decode batch: 1 (no split) when the batch already fills the
    GPU or contexts are short for its programs; else a power of two (few distinct values: few
    compiled variants)."""
    programs = num_reqs * num_kv_heads
    if programs == 0 or programs >= SPLIT_BELOW_PROGRAMS_PER_SM * num_sms:
        return 1
    want = -(-4 * num_sms // programs)
    if max_seq_len < SHORT_DECODE_CONTEXT and programs * FEW_PROGRAMS_SM_FRACTION <= num_sms:
        # As many splits as the longest short context has tiles, whatever this one's length:
        # the variant the short-context graphs compile, so an eager step compiles none mid-run
        # (splits past a context's end return at once).
        num_splits = min(want, SHORT_DECODE_CONTEXT // FEW_PROGRAMS_KEYS_PER_SPLIT)
    else:
        fits = max(1, max_seq_len // MIN_KEYS_PER_SPLIT)
        num_splits = min(want, fits, MAX_SPLITS)
    return 1 << (num_splits.bit_length() - 1)


class TritonBackend:
    name = "triton"
    # Launches depend only on python ints and fixed-shape buffers: decode steps may be captured.
    supports_cuda_graphs = True

    def __init__(self, config: TritonBackendConfig | None = None) -> None:
        self.config = config or TritonBackendConfig()
        self._num_sms: dict[torch.device, int] = {}

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, KVH, D]
        value: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
        metadata: AttentionMetadata,
        scale: float,
        kv_stored: bool = False,  # key/value already at their slots: no store_kv launch
        sliding_window: int | None = None,  # the layer's: keys at positions > p - window
    ) -> torch.Tensor:  # [T, H, D]
        output = torch.empty_like(query)
        if query.shape[0] == 0:
            return output
        if kv_cache.numel() == 0:
            return self._forward_without_cache(output, query, key, value, metadata, scale,
                                               sliding_window)
        if not kv_stored:
            store_kv(key, value, kv_cache, metadata.slot_mapping)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        # A windowed layer takes dense attention (no window mask there) only where every key
        # of the step lies in each query's window: a context of at most `sliding_window`
        # tokens. A dense-prefill graph is captured with seq_lens[0] its size, which bounds
        # every prompt that replays it, so the choice holds for each replay; an eager step
        # reads its own. Longer contexts take the paged kernels.
        if metadata.dense_prefill and (sliding_window is None
                                       or int(metadata.seq_lens_cpu[0]) <= sliding_window):
            return dense_prefill_attention(query, key, value, key_cache, value_cache, metadata,
                                           scale, kv_as_cached=kv_stored)
        num_splits = self._num_splits(metadata, key.shape[1], query.device, sliding_window)
        if num_splits > 0:
            tiles = (self.config.fp8_split_tiles if is_fp8(key_cache.dtype)
                     else self.config.split_tiles)
            return split_kv_attention(
                output, query, key_cache, value_cache, metadata, scale, num_splits, tiles,
                sliding_window=sliding_window)
        return self._unified(output, query, key_cache, value_cache, metadata, scale, paged=True,
                             sliding_window=sliding_window)

    def decode_from_qkv(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 * KVH) * D]: the raw q/k/v projection
        positions: torch.Tensor,  # [>= T]
        cos_sin_cache: torch.Tensor,  # [max_pos, D] float32
        q_norm_weight: torch.Tensor | None,  # [D]; None: no q/k norm
        k_norm_weight: torch.Tensor | None,
        eps: float,
        residual: torch.Tensor | None,  # [>= T, hidden]: the input norm folded
        residual_eps: float,
        num_heads: int,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # the layer's: keys at positions > p - window
    ) -> torch.Tensor | None:  # [T, H * D]
        """The attention output of a small decode batch straight from its q/k/v projection
        (q/k norm, RoPE, the KV store and attention in one launch:
        sluice.attention.triton.decode_qkv), or None where this step takes qk_norm_rope and
        `forward`: prefills, verification steps, split-KV batches, fewer requests than
        FUSED_DECODE_MIN_REQS or more programs than FUSED_DECODE_MAX_PROGRAMS_PER_SM per SM, no
        bound cache. Decided from python ints, so a
        CUDA graph keeps the choice it was captured with."""
        num_kv_heads, head_dim = kv_cache.shape[-2:] if kv_cache.dim() == 5 else (0, 0)
        if (kv_cache.numel() == 0 or metadata.dense_prefill or metadata.max_query_len != 1
                or qkv.shape[0] != metadata.num_reqs or head_dim & (head_dim - 1)
                or metadata.num_reqs < FUSED_DECODE_MIN_REQS
                or metadata.num_reqs * num_kv_heads
                > FUSED_DECODE_MAX_PROGRAMS_PER_SM * self._sm_count(qkv.device)
                or self._num_splits(metadata, num_kv_heads, qkv.device, sliding_window) > 0):
            return None
        return decode_from_qkv(qkv, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps,
                               residual, residual_eps, num_heads, kv_cache, metadata, scale,
                               self.fused_decode_tiles(metadata.num_reqs, metadata.max_seq_len,
                                                       num_kv_heads, kv_cache.dtype,
                                                       qkv.device),
                               sliding_window=sliding_window)

    def fused_decode_tiles(self, num_reqs: int, max_seq_len: int, num_kv_heads: int,
                           cache_dtype: torch.dtype, device: torch.device) -> TileConfig:
        """The tiles of decode_from_qkv for a decode batch (see FUSED_DECODE_TILES)."""
        if num_reqs * num_kv_heads < FUSED_TILES_MIN_PROGRAMS_PER_SM * self._sm_count(device):
            return self._decode_tiles(num_reqs, max_seq_len, 1, num_kv_heads, cache_dtype,
                                      device)
        return (self.config.fp8_fused_decode_tiles if is_fp8(cache_dtype)
                else self.config.fused_decode_tiles)

    def supports_dense_prefill(self, device: torch.device, dtype: torch.dtype,
                               num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether `forward` should be given steps marked `dense_prefill` (the runner marks
        them only then): on CUDA where cuDNN attention runs for the model's dtype and shapes."""
        return self.config.dense_prefill == "auto" and cudnn_attention_works(
            device, dtype, num_heads, num_kv_heads, head_dim)

    def supports_dense_prefix(self, device: torch.device, dtype: torch.dtype,
                              num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether steps of one prompt chunk over a cached prefix may be marked
        `dense_prefill` too (eager steps: sluice.attention.dense.dense_attention_over_prefix)."""
        return self.config.dense_prefill == "auto" and cudnn_prefix_attention_works(
            device, dtype, num_heads, num_kv_heads, head_dim)

    def _unified(
        self,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        paged: bool,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Decode tiles while every request's queries fit one decode tile (decodes, short
        speculative runs); else prefill tiles, and with several requests two launches: requests
        that fit a decode tile in decode tiles, the others in prefill tiles."""
        decode_tiles = self._decode_tiles(metadata.num_reqs, metadata.max_seq_len,
                                          metadata.max_query_len, key.shape[-2], key.dtype,
                                          key.device)
        group_pad = triton.next_power_of_2(query.shape[1] // key.shape[-2])
        decode_query_len = max(decode_tiles.block_m, group_pad) // group_pad
        args = (output, query, key, value, metadata, scale)
        window = sliding_window
        if metadata.max_query_len <= decode_query_len:
            return unified_attention(*args, decode_tiles, paged=paged, sliding_window=window)
        if metadata.num_reqs == 1 or not self.config.split_mixed_batches:
            return unified_attention(*args, self.config.prefill_tiles, paged=paged,
                                     sliding_window=window)
        unified_attention(*args, decode_tiles, paged=paged, query_lens=(0, decode_query_len),
                          sliding_window=window)
        prefill_lens = (decode_query_len + 1, MAX_INT32)
        return unified_attention(
            *args, self.config.prefill_tiles, paged=paged, query_lens=prefill_lens,
            sliding_window=window)

    def _decode_tiles(self, num_reqs: int, max_seq_len: int, max_query_len: int,
                      num_kv_heads: int, cache_dtype: torch.dtype,
                      device: torch.device) -> TileConfig:
        if (max_query_len == 1 and is_fp8(cache_dtype) and num_reqs * num_kv_heads
                >= FP8_DECODE_MIN_PROGRAMS_PER_SM * self._sm_count(device)):
            return self.config.fp8_decode_tiles
        if (max_query_len == 1 and max_seq_len < SHORT_DECODE_CONTEXT
                and num_reqs >= SHORT_DECODE_MIN_REQS):
            return self.config.short_decode_tiles
        return self.config.decode_tiles

    def _num_splits(
        self, metadata: AttentionMetadata, num_kv_heads: int, device: torch.device,
        sliding_window: int | None = None,
    ) -> int:
        """0 for the unified kernel, else the split count of the split-KV path: decodes, and
        verifications of speculative drafts (a few query tokens a request, each token its own
        programs there, where the unified kernel runs one program per request and KV head:
        8 for a batch-1 verification of Qwen3-0.6B). A windowed layer's tokens read at most
        `sliding_window` keys each: the rule counts those."""
        if metadata.max_query_len > 1 and (
                metadata.max_query_len > MAX_SPLIT_QUERY_LEN
                or not (metadata.split_queries or self.config.split_kv == "always")):
            return 0
        programs_per_head = (metadata.num_reqs if metadata.max_query_len == 1
                             else metadata.num_actual_tokens)
        max_keys = metadata.max_seq_len
        if sliding_window is not None:
            max_keys = min(max_keys, sliding_window)
        return self._split_count(programs_per_head, num_kv_heads, max_keys, device)

    def decode_plan(self, num_reqs: int, num_kv_heads: int, max_seq_len: int,
                    device: torch.device, cache_dtype: torch.dtype) -> tuple[int, TileConfig]:
        """The kernels a decode batch (one query token per request) of `num_reqs` requests
        whose longest context is `max_seq_len` gets: (0 for the unified kernel, else the split
        count of the split-KV path; the unified kernel's tiles). A CUDA graph captured with a
        `max_seq_len` keeps its plan for every batch it replays (sluice.worker.graph_runner
        captures a second decode set for short contexts where the plans differ)."""
        num_splits = self._split_count(num_reqs, num_kv_heads, max_seq_len, device)
        return num_splits, self._decode_tiles(num_reqs, max_seq_len, 1, num_kv_heads,
                                              cache_dtype, device)

    def _split_count(self, num_reqs: int, num_kv_heads: int, max_seq_len: int,
                     device: torch.device) -> int:
        """0 for the unified kernel, else the split count (see choose_num_splits)."""
        mode = self.config.split_kv
        if mode == "never":
            return 0
        if self.config.num_splits is not None:
            num_splits = self.config.num_splits
        else:
            num_splits = choose_num_splits(
                num_reqs, num_kv_heads, max_seq_len, self._sm_count(device)
            )
        if mode == "always":
            return num_splits
        return num_splits if num_splits > 1 else 0

    def _sm_count(self, device: torch.device) -> int:
        if device not in self._num_sms:
            self._num_sms[device] = (
                torch.cuda.get_device_properties(device).multi_processor_count
                if device.type == "cuda"
                else 4  # the interpreter: any count exercises the rule
            )
        return self._num_sms[device]

    def _forward_without_cache(
        self,
        output: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """A profiling run before the cache exists: fresh prefills attend within themselves."""
        query_lens = metadata.query_start_loc_cpu.diff()
        if not torch.equal(query_lens, metadata.seq_lens_cpu):
            bad = int((query_lens != metadata.seq_lens_cpu).nonzero()[0, 0])
            raise ValueError(
                f"request {bad} has context {int(metadata.seq_lens_cpu[bad])} > its "
                f"{int(query_lens[bad])} query tokens, but no KV cache is bound"
            )
        assert key.stride() == value.stride()
        return self._unified(output, query, key, value, metadata, scale, paged=False,
                             sliding_window=sliding_window)
