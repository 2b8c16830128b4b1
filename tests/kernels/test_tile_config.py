"""Tile shapes that fit the GPU's shared memory."""

from __future__ import annotations

from sluice.attention.triton.common import SHARED_MEMORY_BUDGET, TileConfig, fit_tiles


def test_float32_prefill_tiles_of_large_heads_shrink_to_fit_shared_memory() -> None:
    # 128 x 128 tiles at 3 stages of a float32 head_dim-128 cache asked 256 KiB on an H200.
    tiles, block_m = fit_tiles(TileConfig(128, 128, 8, 3), 128, 128, 4, min_block_m=16)
    assert (tiles.block_m, tiles.block_n, tiles.num_stages, block_m) == (128, 64, 2, 128)
    assert (block_m + 2 * 64) * 128 * 4 <= SHARED_MEMORY_BUDGET


def test_16_bit_and_small_float32_tiles_are_left_as_tuned() -> None:
    prefill = TileConfig(128, 128, 8, 3)
    assert fit_tiles(prefill, 128, 128, 2, min_block_m=16) == (prefill, 128)
    decode = TileConfig(16, 64, 4, 3)
    assert fit_tiles(decode, 16, 128, 4, min_block_m=16) == (decode, 16)
    assert fit_tiles(prefill, 128, 16, 4, min_block_m=16) == (prefill, 128)  # tiny heads
