"""The torch reference paged attention equals naive dense causal attention, for mixed batches of
decodes, prefills over a cached prefix and fresh prefills, with GQA and shuffled blocks."""

from __future__ import annotations

import pytest
import torch

from sluice.attention.metadata import AttentionMetadata
from sluice.attention.torch_ref import TorchRefBackend

HEAD_DIM = 8
SCALE = HEAD_DIM**-0.5


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [S, H, D] for every position; k, v: [S, KVH, D]. Plain masked softmax, heads repeated
    to H (query head h reads KV head h // (H / KVH), as HF's repeat_kv)."""
    seq_len, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1).double()
    v = v.repeat_interleave(group, dim=1).double()
    out = torch.empty(q.shape, dtype=torch.float64)
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    for h in range(num_heads):
        scores = (q[:, h].double() @ k[:, h].T) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        out[:, h] = scores.softmax(dim=-1) @ v[:, h]
    return out


def build_batch(
    requests: list[tuple[int, int]],  # (seq_len, query_len): context incl. this step's tokens
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    num_blocks: int = 40,
    num_padding: int = 0,
    seed: int = 0,
):
    """Random q/k/v for every position of every request, a cache holding each request's cached
    prefix (and garbage everywhere else), and metadata for this step's tokens."""
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, HEAD_DIM, generator=gen)
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    full_qkv, step_q, step_k, step_v, slots, tables = [], [], [], [], [], []
    query_start_loc = [0]
    for seq_len, query_len in requests:
        q = torch.randn(seq_len, num_heads, HEAD_DIM, generator=gen)
        k = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, HEAD_DIM, generator=gen)
        full_qkv.append((q, k, v))
        table = [free_blocks.pop() for _ in range(-(-seq_len // block_size))]
        tables.append(table)
        req_slots = [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        cached = seq_len - query_len
        for pos in range(cached):  # written by earlier steps
            block, offset = divmod(req_slots[pos], block_size)
            kv_cache[0, block, offset] = k[pos]
            kv_cache[1, block, offset] = v[pos]
        step_q.append(q[cached:])
        step_k.append(k[cached:])
        step_v.append(v[cached:])
        slots += req_slots[cached:]
        query_start_loc.append(query_start_loc[-1] + query_len)
    # Padding tokens (e.g. a CUDA graph's fixed batch size): random values, slot -1.
    step_q.append(torch.randn(num_padding, num_heads, HEAD_DIM, generator=gen))
    step_k.append(torch.randn(num_padding, num_kv_heads, HEAD_DIM, generator=gen))
    step_v.append(torch.randn(num_padding, num_kv_heads, HEAD_DIM, generator=gen))
    slots += [-1] * num_padding

    width = max(len(t) for t in tables) + 1  # a spare column: tables are padded in practice
    block_tables = torch.zeros(len(requests), width, dtype=torch.int32)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table)
    seq_lens = torch.tensor([s for s, _ in requests], dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=query_start_loc[-1],
        max_query_len=max(q for _, q in requests),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens_cpu=seq_lens.clone(),
    )
    step = (torch.cat(step_q), torch.cat(step_k), torch.cat(step_v))
    return full_qkv, step, kv_cache, metadata


def expected_output(full_qkv, requests) -> torch.Tensor:
    rows = [
        dense_causal_attention(q, k, v, SCALE)[seq_len - query_len :]
        for (q, k, v), (seq_len, query_len) in zip(full_qkv, requests)
    ]
    return torch.cat(rows)


# A decode, a prefill over a cached prefix ending mid-block, a fresh prefill, a decode whose
# context fills its last block exactly, a one-token prompt.
MIXED = [(9, 1), (23, 7), (5, 5), (16, 1), (1, 1)]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2)])
def test_mixed_batch_matches_dense_causal_attention(num_heads, num_kv_heads, block_size):
    full_qkv, (q, k, v), kv_cache, metadata = build_batch(
        MIXED, num_heads, num_kv_heads, block_size
    )
    out = TorchRefBackend().forward(q, k, v, kv_cache, metadata, SCALE)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), expected_output(full_qkv, MIXED), atol=1e-5, rtol=0)
    # This step's K/V now sit in the cache at their slots.
    key_cache = kv_cache[0].view(-1, num_kv_heads, HEAD_DIM)
    value_cache = kv_cache[1].view(-1, num_kv_heads, HEAD_DIM)
    torch.testing.assert_close(key_cache[metadata.slot_mapping], k, atol=0, rtol=0)
    torch.testing.assert_close(value_cache[metadata.slot_mapping], v, atol=0, rtol=0)


def test_padding_slots_are_not_stored():
    requests = [(6, 2), (3, 3)]
    full_qkv, (q, k, v), kv_cache, metadata = build_batch(requests, 4, 2, 4, num_padding=3)
    real = metadata.num_actual_tokens
    expected_cache = kv_cache.clone()
    flat = expected_cache.view(2, -1, 2, HEAD_DIM)
    flat[0, metadata.slot_mapping[:real]] = k[:real]
    flat[1, metadata.slot_mapping[:real]] = v[:real]

    out = TorchRefBackend().forward(q, k, v, kv_cache, metadata, SCALE)
    # Exactly the real tokens' slots changed: slot -1 did not write the last slot.
    torch.testing.assert_close(kv_cache, expected_cache, atol=0, rtol=0)
    torch.testing.assert_close(
        out[:real].double(), expected_output(full_qkv, requests), atol=1e-5, rtol=0
    )
    assert out.shape[0] == real + 3


def test_request_reads_prefix_written_earlier_in_same_batch():
    # Request 1 shares request 0's first two blocks (a prefix hit on blocks still being filled
    # in this very step) and adds 3 tokens of its own in a third block.
    block_size, num_heads, num_kv_heads = 4, 4, 2
    gen = torch.Generator().manual_seed(3)
    shared_k = torch.randn(8, num_kv_heads, HEAD_DIM, generator=gen)
    shared_v = torch.randn(8, num_kv_heads, HEAD_DIM, generator=gen)
    own_k = torch.randn(3, num_kv_heads, HEAD_DIM, generator=gen)
    own_v = torch.randn(3, num_kv_heads, HEAD_DIM, generator=gen)
    q = torch.randn(11, num_heads, HEAD_DIM, generator=gen)
    kv_cache = torch.randn(2, 8, block_size, num_kv_heads, HEAD_DIM, generator=gen)
    shared_blocks, own_block = [5, 2], 6
    slots = [b * block_size + o for b in shared_blocks for o in range(4)]
    slots += [own_block * block_size + o for o in range(3)]
    metadata = AttentionMetadata(
        num_actual_tokens=11,
        max_query_len=8,
        max_seq_len=11,
        query_start_loc=torch.tensor([0, 8, 11], dtype=torch.int32),
        seq_lens=torch.tensor([8, 11], dtype=torch.int32),
        block_tables=torch.tensor([[5, 2, 0], [5, 2, 6]], dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
        query_start_loc_cpu=torch.tensor([0, 8, 11], dtype=torch.int32),
        seq_lens_cpu=torch.tensor([8, 11], dtype=torch.int32),
    )
    k = torch.cat([shared_k, own_k])
    v = torch.cat([shared_v, own_v])
    out = TorchRefBackend().forward(q, k, v, kv_cache, metadata, SCALE)
    # Request 1's queries are positions 8..10 of the context shared_k + own_k.
    q_full = torch.cat([torch.zeros(8, num_heads, HEAD_DIM), q[8:]])
    expected = dense_causal_attention(q_full, k, v, SCALE)[8:]
    torch.testing.assert_close(out[8:].double(), expected, atol=1e-5, rtol=0)


def test_bfloat16_inputs_are_computed_in_float32_and_cast_back():
    full_qkv, (q, k, v), kv_cache, metadata = build_batch(MIXED, 4, 2, 4)
    out = TorchRefBackend().forward(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), kv_cache.bfloat16(), metadata, SCALE
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected_output(full_qkv, MIXED), atol=3e-2, rtol=0)


def test_without_a_bound_cache_fresh_prefills_attend_within_themselves():
    requests = [(5, 5), (3, 3)]
    full_qkv, (q, k, v), _, metadata = build_batch(requests, 4, 2, 4)
    out = TorchRefBackend().forward(q, k, v, torch.empty(0), metadata, SCALE)
    torch.testing.assert_close(out.double(), expected_output(full_qkv, requests), atol=1e-5, rtol=0)

    _, (q, k, v), _, metadata = build_batch([(6, 2)], 4, 2, 4)
    with pytest.raises(ValueError, match="no KV cache is bound"):
        TorchRefBackend().forward(q, k, v, torch.empty(0), metadata, SCALE)
