"""Sliding-window attention in every attention path equals a brute-force reference written
from transformers' rule (`sliding_window_overlay`: a query at position p sees the keys at
positions k with p - window < k <= p), and no path reads a block wholly before a query's
window: those table entries point at a block of NaNs here, as a freed block's entry may point
at another request's data (sluice.core.kv_cache_manager frees them).

Windows smaller than, equal to and larger than the context, not multiples of the block size,
one key (window 1); decodes, fresh prefills, chunks over a cached prefix, mixed batches; the
torch reference, the unified kernel (decode and prefill tiles, small tiles that make its three
loops), split-KV decode and verification, and the fused decode_from_qkv. On a CPU the kernels
run in Triton's interpreter (conftest.py), so the shapes stay tiny.
"""

from __future__ import annotations

import pytest
import torch

from sluice.attention.torch_ref import TorchRefBackend
from sluice.attention.triton import TileConfig
from sluice.attention.triton_backend import DECODE_TILES, TritonBackend, TritonBackendConfig
from sluice.model import layers
from tests.kernels.test_fused_ops import EPS, cos_sin_cache, decode_step, random
from tests.kernels.test_triton_attention import DEVICES, Step, make_step

SCALE = 0.25


def brute_force(step: Step, kv_cache: torch.Tensor, window: int | None) -> torch.Tensor:
    """Attention of every query over its request's context, position by position, in float64,
    from an unpoisoned cache that holds this step's K/V."""
    md = step.metadata
    block_size = kv_cache.shape[2]
    num_heads, num_kv_heads = step.query.shape[1], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros(step.query.shape, dtype=torch.float64)
    qsl, seq_lens = md.query_start_loc_cpu.tolist(), md.seq_lens_cpu.tolist()
    for i, seq_len in enumerate(seq_lens):
        start, end = qsl[i], qsl[i + 1]
        if seq_len == 0 or end == start:
            continue
        table = md.block_tables[i].cpu().long()
        slots = [int(table[k // block_size]) * block_size + k % block_size
                 for k in range(seq_len)]
        keys = kv_cache[0].reshape(-1, num_kv_heads, kv_cache.shape[-1])[slots].double().cpu()
        values = kv_cache[1].reshape(-1, num_kv_heads, kv_cache.shape[-1])[slots].double().cpu()
        for row in range(start, end):
            p = seq_len - (end - row)
            visible = [k for k in range(seq_len) if k <= p and (window is None or k > p - window)]
            for h in range(num_heads):
                q = step.query[row, h].double().cpu()
                kv_h = h // group
                scores = torch.stack([q @ keys[k, kv_h] for k in visible]) * SCALE
                probs = scores.softmax(0)
                out[row, h] = (probs[:, None] * values[visible, kv_h]).sum(0)
    return out


def poison_blocks_before_windows(step: Step, window: int) -> int:
    """Point every table entry wholly before its request's first query's window at a new
    block of NaNs; returns how many entries were poisoned."""
    md = step.metadata
    block_size = step.kv_cache.shape[2]
    nan_block = torch.full_like(step.kv_cache[:, :1], float("nan"))
    step.kv_cache = torch.cat([step.kv_cache, nan_block], dim=1)
    poison = step.kv_cache.shape[1] - 1
    qsl, seq_lens = md.query_start_loc_cpu.tolist(), md.seq_lens_cpu.tolist()
    num_poisoned = 0
    for i, seq_len in enumerate(seq_lens):
        first_query_pos = seq_len - (qsl[i + 1] - qsl[i])
        num_dead = max(first_query_pos - window + 1, 0) // block_size
        md.block_tables[i, :num_dead] = poison
        num_poisoned += num_dead
    return num_poisoned


def run_windowed(requests: list[tuple[int, int]], window: int, backend, block_size: int = 16,
                 num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0,
                 expect_poisoned: bool | None = None) -> None:
    step = make_step(requests, num_heads, num_kv_heads, block_size, device=DEVICES[0],
                     seed=seed)
    # The cache as it is after this step's stores, for the brute force.
    full_cache = step.kv_cache.clone()
    TorchRefBackend().forward(step.query, step.key, step.value, full_cache, step.metadata,
                              SCALE)
    expected = brute_force(step, full_cache, window)
    num_poisoned = poison_blocks_before_windows(step, window)
    if expect_poisoned is not None:  # the case does have blocks wholly before a window
        assert (num_poisoned > 0) == expect_poisoned
    out = backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata,
                          SCALE, sliding_window=window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double().cpu(), expected, atol=3e-5, rtol=1e-5)
    torch.testing.assert_close(step.kv_cache[:, :-1], full_cache, atol=0, rtol=0)


DECODE = [(9, 1), (40, 1), (16, 1), (77, 1), (1, 1)]
PREFILL = [(45, 45), (21, 21), (5, 5)]
CACHED_PREFIX = [(50, 14), (70, 7), (33, 1)]  # a chunk of a long prompt over its cached part
MIXED = [(9, 1), (45, 13), (5, 5), (64, 1), (70, 2), (1, 1)]


@pytest.mark.parametrize("window", [1, 7, 16, 24, 200])
@pytest.mark.parametrize("requests", [DECODE, PREFILL, CACHED_PREFIX, MIXED],
                         ids=["decode", "prefill", "cached_prefix", "mixed"])
def test_reference_backend_bounds_each_query_by_its_window(requests, window):
    run_windowed(requests, window, TorchRefBackend(),
                 expect_poisoned=None if requests is PREFILL else window < 60)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("requests,window,block_size", [
    (DECODE, 24, 16), (DECODE, 16, 4), (PREFILL, 7, 16), (CACHED_PREFIX, 24, 16),
    (MIXED, 19, 4), (MIXED, 200, 16)],
    ids=["decode-24", "decode-16-bs4", "prefill-7", "cached_prefix-24", "mixed-19-bs4",
         "mixed-wider-than-context"])
def test_unified_kernel_bounds_each_query_by_its_window(device, requests, window, block_size):
    backend = TritonBackend(TritonBackendConfig(split_kv="never"))
    run_windowed(requests, window, backend, block_size, seed=1,
                 expect_poisoned=None if requests is PREFILL else window < 60)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [5, 40])
def test_small_tiles_mask_the_window_edge_and_skip_what_lies_before(device, window):
    # 8 query tokens x 2 heads over 16-key tiles: a long prompt's query tiles each have tiles
    # wholly before their window (skipped), at its lower edge (masked), inside it (unmasked)
    # and at the causal edge (masked); one request of each tile size's alignment.
    tiles = TileConfig(block_m=16, block_n=16)
    backend = TritonBackend(TritonBackendConfig(split_kv="never", prefill_tiles=tiles,
                                                decode_tiles=tiles))
    run_windowed([(90, 30), (45, 45), (57, 1)], window, backend, block_size=4, seed=2,
                 expect_poisoned=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits,window,requests", [
    (1, 24, DECODE), (3, 20, DECODE), (8, 33, DECODE), (2, 10, [(9, 3), (40, 5), (77, 8)])],
    ids=["1-split", "3-splits", "8-splits", "verification"])
def test_split_kv_bounds_each_token_by_its_window(device, num_splits, window, requests):
    backend = TritonBackend(TritonBackendConfig(split_kv="always", num_splits=num_splits))
    run_windowed(requests, window, backend, seed=3, expect_poisoned=True)


@pytest.mark.parametrize("device", DEVICES)
def test_without_a_cache_a_prompt_attends_within_its_window(device):
    # The profiling run's path: keys straight from the step's rows.
    step = make_step(PREFILL, 4, 2, 16, device=device, seed=4)
    full_cache = step.kv_cache.clone()
    TorchRefBackend().forward(step.query, step.key, step.value, full_cache, step.metadata,
                              SCALE)
    expected = brute_force(step, full_cache, 9)
    for backend in (TorchRefBackend(), TritonBackend()):
        out = backend.forward(step.query, step.key, step.value, torch.empty(0), step.metadata,
                              SCALE, sliding_window=9)
        torch.testing.assert_close(out.double().cpu(), expected, atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 6, 13, 100])
def test_decode_from_qkv_bounds_the_token_by_its_window(window):
    """The fused decode (q/k norm, RoPE, the store, attention in one launch) against the torch
    ops and the reference backend with the same window."""
    from sluice.attention.triton.decode_qkv import decode_from_qkv

    device = DEVICES[0]
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    seq_lens = [9, 0, 40, 16, 1, 23]
    metadata, cache = decode_step(seq_lens, num_kv_heads, head_dim, block_size, torch.float32,
                                  seed=20)
    num_tokens = len(seq_lens)
    qkv = random(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=torch.float32,
                 seed=21, scale=2.0)
    positions = torch.tensor([max(s - 1, 0) for s in seq_lens], device=device)
    table = cos_sin_cache(head_dim)
    expected_cache = cache.clone()
    q, k = layers.qk_norm_rope(qkv.clone(), positions, table, None, None, EPS, num_heads,
                               num_kv_heads)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:]
    expected = TorchRefBackend().forward(
        q.reshape(num_tokens, num_heads, head_dim), k.reshape(num_tokens, num_kv_heads, head_dim),
        v.reshape(num_tokens, num_kv_heads, head_dim), expected_cache, metadata, SCALE,
        sliding_window=window)
    # Blocks wholly before each window: a block of NaNs, never read.
    cache = torch.cat([cache, torch.full_like(cache[:, :1], float("nan"))], dim=1)
    for i, seq_len in enumerate(seq_lens):
        num_dead = max(seq_len - window, 0) // block_size
        metadata.block_tables[i, :num_dead] = cache.shape[1] - 1
    out = decode_from_qkv(qkv, positions, table, None, None, EPS, None, EPS, num_heads, cache,
                          metadata, SCALE, DECODE_TILES, sliding_window=window)
    torch.testing.assert_close(out.view(num_tokens, num_heads, head_dim), expected,
                               atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_the_split_rule_counts_only_a_windowed_layer_s_keys(device):
    """One request decoding at 2,000 keys splits (few programs, a long context); over a 300-key
    window the rule sees 300 keys: under the interpreter (4 SMs) one split's worth, the
    unified kernel; on an H200 the short-context rule's 8 splits (the variant its graphs
    compile), against 4 for 2,000 keys. Either way the output is the reference's."""
    backend = TritonBackend()  # "auto": the rule decides
    step = make_step([(2000, 1)], 4, 2, 16, device=device, seed=5)
    dev = step.query.device
    full = backend._num_splits(step.metadata, 2, dev)
    windowed = backend._num_splits(step.metadata, 2, dev, sliding_window=300)
    assert full > 1 and full == backend._split_count(1, 2, 2000, dev)
    assert windowed == backend._split_count(1, 2, 300, dev) != full
    if dev.type == "cpu":
        assert windowed == 0
    run_windowed([(2000, 1)], 300, backend, seed=5, expect_poisoned=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [24, 40, 48])
def test_a_windowed_layer_runs_dense_prefill_only_where_the_window_holds_every_key(
        device, window, monkeypatch):
    """A fresh prompt of 37 rows and 11 padding rows (a dense-prefill graph of 48) marked
    dense: a window of 48 (the step's size: every key of every replay in each query's window)
    runs dense attention; 24 and 40 take the paged kernel. Both equal the windowed reference."""
    from sluice.attention import triton_backend
    from tests.kernels.test_triton_attention import dense_step

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    step = dense_step(37, 11, 4, 2, dtype, device)
    # as a graph of 48 is captured: its host-side lengths are its size
    step.metadata.seq_lens_cpu[0] = step.metadata.query_start_loc_cpu[1] = 48
    calls = []
    real = triton_backend.dense_prefill_attention
    monkeypatch.setattr(triton_backend, "dense_prefill_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = step.kv_cache.clone()
    out = TritonBackend().forward(step.query, step.key, step.value, step.kv_cache,
                                  step.metadata, 0.25, sliding_window=window)
    assert calls == ([1] if window >= 48 else [])
    step.metadata.seq_lens_cpu[0] = step.metadata.query_start_loc_cpu[1] = 37
    expected = TorchRefBackend().forward(step.query, step.key, step.value, cache, step.metadata,
                                         0.25, sliding_window=window)
    tolerance = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5,
                                                                                rtol=1e-5)
    torch.testing.assert_close(out[:37], expected[:37], **tolerance)
