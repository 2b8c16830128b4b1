"""The descriptors of a KV transfer: (source address, destination address, length) triples
that copy a room's blocks from a prefill rank's paged cache into a decode rank's.

A layer's cache is one tensor [2, num_blocks, block_size, heads, dim], so block b's
K is at base + b * B and its V at base + (num_blocks + b) * B (B: bytes of one block's K).
Block pairs that are consecutive on both sides are coalesced into one descriptor per layer and
half ([5,6,7,12,13] -> [9,10,11,2,3] is runs (5->9, 3) and (12->2, 2)).

When the prefill and decode TP sizes differ (heads.py), a prefill rank sends a slice of the
heads of each token, or a decode rank receives one, and in this layout (heads inside a token's
row) a head slice of a block is strided: one piece of `num_heads * head_dim` elements per token.
Such a write is one descriptor per token, layer and K / V, straight from cache to cache. The
other designs were a staging buffer (gather the slice into contiguous memory on the side whose
slice is strided, scatter it on the other) or a head-major cache layout ([.., heads, block_size,
dim], where a slice is contiguous per block: what vLLM's NIXL connector asks for). Staging needs
a second registered region sized for the rooms in flight, a copy on each side, and, when the
strided side is the receiver (prefill TP > decode TP, the common case), a scatter that decode
must run and order against its own steps before the room may succeed; a head-major layout
touches every attention kernel. Per-token descriptors need none of that and stay correct for any
TP pair; their cost is the descriptor count, block_size times that of a whole-row transfer
(batched, `max_batch` a batch), with pieces of heads * head_dim * dtype bytes (1 KiB for 4 heads
of 128 in bfloat16). Over RDMA such small writes are bound by the NIC's message rate, not its
bandwidth (not measured here: no RDMA on these machines); over Mooncake's TCP transport, which
is for tests and loopback, each costs a request. If that shows, a staging gather on the prefill
side suits decode TP > prefill TP, where the destination slice is whole blocks. Where the slice
is the whole row on both sides (equal TP sizes), writes stay coalesced.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.kv_transfer.disagg.heads import HeadSlice


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """Where one rank's paged KV cache lives: one tensor per layer,
    [2, num_blocks, block_size, num_kv_heads, head_dim]."""

    layer_addresses: tuple[int, ...]
    num_blocks: int
    block_size: int
    num_kv_heads: int  # on this rank
    head_bytes: int  # one head of one token, K or V

    @property
    def token_bytes(self) -> int:
        return self.num_kv_heads * self.head_bytes

    @property
    def half_block_bytes(self) -> int:
        """One block's K (or V)."""
        return self.block_size * self.token_bytes

    @property
    def bytes_per_block_layer(self) -> int:
        """K and V of one block of one layer."""
        return 2 * self.half_block_bytes


def block_runs(src_blocks: list[int], dst_blocks: list[int]) -> list[tuple[int, int, int]]:
    """(first source block, first destination block, length) of each run of pairs that are
    consecutive on both sides."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destinations")
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_blocks, dst_blocks):
        if runs:
            s, d, n = runs[-1]
            if src == s + n and dst == d + n:
                runs[-1] = (s, d, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


def build_descriptors(src: CacheLayout, dst: CacheLayout, runs: list[tuple[int, int, int]],
                      heads: HeadSlice | None = None) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, destination addresses, lengths) that copy the blocks of `runs`, for
    every layer and K / V: whole blocks, one descriptor per run (`heads` None, or a slice that
    is every head on both sides), else `heads.num_heads` heads of each token, one descriptor
    per token (see the module docstring)."""
    if len(src.layer_addresses) != len(dst.layer_addresses):
        raise ValueError(f"{len(src.layer_addresses)} layers here, "
                         f"{len(dst.layer_addresses)} at the peer")
    if src.block_size != dst.block_size or src.head_bytes != dst.head_bytes:
        raise ValueError(f"blocks of {src.block_size} tokens and heads of {src.head_bytes} "
                         f"bytes here, {dst.block_size} and {dst.head_bytes} at the peer")
    if heads is None:
        if src.num_kv_heads != dst.num_kv_heads:
            raise ValueError(f"{src.num_kv_heads} KV heads here, {dst.num_kv_heads} at the "
                             "peer: a head slice is needed")
        heads = HeadSlice(0, 0, 0, 0, src.num_kv_heads)
    if (heads.src_head + heads.num_heads > src.num_kv_heads
            or heads.dst_head + heads.num_heads > dst.num_kv_heads):
        raise ValueError(f"{heads} does not fit {src.num_kv_heads} heads here and "
                         f"{dst.num_kv_heads} at the peer")
    whole = heads.num_heads == src.num_kv_heads == dst.num_kv_heads
    src_half, dst_half = src.half_block_bytes, dst.half_block_bytes
    piece = heads.num_heads * src.head_bytes
    src_addrs: list[int] = []
    dst_addrs: list[int] = []
    lengths: list[int] = []
    if piece == 0:
        return src_addrs, dst_addrs, lengths
    for src_base, dst_base in zip(src.layer_addresses, dst.layer_addresses):
        for kv in (0, 1):
            src_kv = src_base + kv * src.num_blocks * src_half
            dst_kv = dst_base + kv * dst.num_blocks * dst_half
            for s, d, n in runs:
                if whole:
                    src_addrs.append(src_kv + s * src_half)
                    dst_addrs.append(dst_kv + d * dst_half)
                    lengths.append(n * src_half)
                    continue
                # [n * block_size tokens] of the run, each its own piece of the row.
                first_src = src_kv + s * src_half + heads.src_head * src.head_bytes
                first_dst = dst_kv + d * dst_half + heads.dst_head * dst.head_bytes
                for token in range(n * src.block_size):
                    src_addrs.append(first_src + token * src.token_bytes)
                    dst_addrs.append(first_dst + token * dst.token_bytes)
                    lengths.append(piece)
    return src_addrs, dst_addrs, lengths


def batches(count: int, max_batch: int) -> list[tuple[int, int]]:
    """[start, end) index ranges of at most `max_batch` each."""
    return [(start, min(start + max_batch, count)) for start in range(0, count, max_batch)]
