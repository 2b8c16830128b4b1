"""The Triton paged-attention backend equals the torch reference: same outputs and same cache
after the step, for decodes, prefills with and without a cached prefix, chunked prefills, mixed
batches, GQA, several block sizes, ragged lengths, padding rows and the split-KV decode path.

On a CPU the kernels run in Triton's interpreter (see conftest.py), so shapes stay tiny; with a
GPU the same tests run on CUDA, plus checks at Qwen3-0.6B's shapes and of CUDA graph replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from sluice.attention.backend import get_attention_backend
from sluice.attention.metadata import AttentionMetadata
from sluice.attention.torch_ref import TorchRefBackend
from sluice.attention.triton import split_kv_attention, store_kv
from sluice.attention.triton_backend import (
    SPLIT_TILES,
    TritonBackend,
    TritonBackendConfig,
    choose_num_splits,
)

# Triton runs CPU tensors only in its interpreter, which conftest.py turns on without a GPU.
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
TOLERANCE = {torch.float32: dict(atol=3e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=0)}


@dataclass
class Step:
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, KVH, D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, KVH, D], random where not written
    metadata: AttentionMetadata


def make_step(
    requests: list[tuple[int, int]],  # (seq_len, query_len); seq_len 0 = a padding request
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    num_padding_tokens: int = 0,
    seed: int = 0,
) -> Step:
    """Random q/k/v for this step's tokens, a cache of random values (the cached prefixes) in
    shuffled blocks, and the metadata the model runner would build."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-seq_len // block_size) for seq_len, _ in requests]
    num_blocks = sum(blocks_per_req) + 2
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_req) + 1  # a spare column, as padded tables have
    block_tables = torch.zeros(len(requests), width, dtype=torch.int32)
    slots: list[int] = []
    query_start_loc = [0]
    for i, (seq_len, query_len) in enumerate(requests):
        table = [free_blocks.pop() for _ in range(blocks_per_req[i])]
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        if seq_len == 0:  # a CUDA graph's padding request: its token stores nothing
            slots += [-1] * query_len
        else:
            slots += [
                table[p // block_size] * block_size + p % block_size
                for p in range(seq_len - query_len, seq_len)
            ]
        query_start_loc.append(query_start_loc[-1] + query_len)
    slots += [-1] * num_padding_tokens
    num_tokens = len(slots)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    seq_lens = torch.tensor([s for s, _ in requests], dtype=torch.int32)
    qsl = torch.tensor(query_start_loc, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=query_start_loc[-1],
        max_query_len=max(q for _, q in requests),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=qsl.to(device),
        seq_lens=seq_lens.to(device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    return Step(
        query=randn(num_tokens, num_heads, head_dim),
        key=randn(num_tokens, num_kv_heads, head_dim),
        value=randn(num_tokens, num_kv_heads, head_dim),
        kv_cache=randn(2, num_blocks, block_size, num_kv_heads, head_dim),
        metadata=metadata,
    )


def assert_matches_reference(step: Step, backend: TritonBackend, scale: float = 0.25) -> None:
    ref_cache = step.kv_cache.clone()
    expected = TorchRefBackend().forward(
        step.query, step.key, step.value, ref_cache, step.metadata, scale
    )
    out = backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata, scale)
    assert out.shape == step.query.shape and out.dtype == step.query.dtype
    torch.testing.assert_close(step.kv_cache, ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(out, expected, **TOLERANCE[step.query.dtype])


DECODE = [(9, 1), (40, 1), (16, 1), (77, 1), (1, 1)]  # ragged; one fills its block exactly
FRESH_PREFILL = [(21, 21), (5, 5), (1, 1)]
CACHED_PREFIX = [(50, 14), (23, 7), (33, 1)]  # prefix hits ending mid-block and on a boundary
CHUNKED = [(64, 24), (90, 30)]  # a middle chunk of a long prompt: context before and none after
MIXED = [(9, 1), (45, 13), (5, 5), (32, 1), (70, 2), (1, 1)]
SCENARIOS = {
    "decode": DECODE,
    "fresh_prefill": FRESH_PREFILL,
    "cached_prefix": CACHED_PREFIX,
    "chunked": CHUNKED,
    "mixed": MIXED,
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2)])
def test_unified_kernel_matches_reference(device, scenario, num_heads, num_kv_heads):
    step = make_step(SCENARIOS[scenario], num_heads, num_kv_heads, 16, device=device)
    assert_matches_reference(step, TritonBackend(TritonBackendConfig(split_kv="never")))


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_in_one_launch_matches_reference(device):
    # Decode rows inside prefill-sized tiles (the single-launch path for mixed batches).
    config = TritonBackendConfig(split_kv="never", split_mixed_batches=False)
    for seed, scenario in enumerate((MIXED, CACHED_PREFIX)):
        step = make_step(scenario, 4, 2, 16, device=device, seed=seed)
        assert_matches_reference(step, TritonBackend(config))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [4, 32, 64])
def test_other_block_sizes_match_reference(device, block_size):
    step = make_step(MIXED, 4, 2, block_size, device=device, seed=1)
    assert_matches_reference(step, TritonBackend(TritonBackendConfig(split_kv="never")))


@pytest.mark.parametrize("device", DEVICES)
def test_query_tiles_smaller_than_a_prompt_skip_future_keys(device):
    # Prefill tiles of 16 rows (8 tokens x 2 heads) over 16-key tiles: a 45-token prompt spans
    # several query tiles, each with unmasked, masked and skipped key tiles.
    from sluice.attention.triton import TileConfig

    tiles = TileConfig(block_m=16, block_n=16)
    config = TritonBackendConfig(split_kv="never", prefill_tiles=tiles)
    step = make_step([(45, 45), (60, 33)], 4, 2, 16, device=device, seed=2)
    assert_matches_reference(step, TritonBackend(config))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(4, 2, 16), (8, 2, 32), (2, 2, 16)])
def test_split_kv_decode_matches_reference(device, num_splits, num_heads, num_kv_heads, block_size):
    # 8 splits of a 9-token context: most splits are empty and merge as nothing.
    config = TritonBackendConfig(split_kv="always", num_splits=num_splits)
    step = make_step(DECODE, num_heads, num_kv_heads, block_size, device=device, seed=3)
    assert_matches_reference(step, TritonBackend(config))


# Verifications of speculative drafts (1 + k tokens a request, the last positions of its
# context), one request decoding, a fresh 5-token prompt: at most MAX_QUERY_LEN tokens each.
VERIFY = [(9, 3), (40, 5), (16, 1), (77, 5), (5, 5), (33, 8)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size,num_splits,padded",
                         [(4, 2, 16, 1, False), (4, 2, 16, 2, True), (8, 2, 32, 8, True)])
def test_split_kv_verification_matches_reference(device, num_heads, num_kv_heads, block_size,
                                                 num_splits, padded):
    """Each token attends up to its own position (its context: seq_len less the request's
    tokens after it), split like a decode. (Three cases of the six a full grid would give: under
    the CPU interpreter each takes 8-30 s on 2 cores.)"""
    config = TritonBackendConfig(split_kv="always", num_splits=num_splits)
    step = make_step(VERIFY, num_heads, num_kv_heads, block_size, device=device, seed=4)
    assert_matches_reference(step, TritonBackend(config))
    if padded:
        # With padding tokens after the requests (a verification graph's): they output zeros.
        padded_step = make_step(VERIFY, num_heads, num_kv_heads, block_size, device=device,
                                seed=4, num_padding_tokens=3)
        assert_matches_reference(padded_step, TritonBackend(config))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2)])
def test_decode_batch_in_a_given_order_matches_reference(device, num_heads, num_kv_heads):
    # The runner's longest-first order of a decode batch, padding requests (seq_len 0) last:
    # the programs follow it, every request still gets its own output row.
    requests = [(9, 1), (0, 1), (40, 1), (77, 1), (16, 1), (0, 1), (1, 1)]
    step = make_step(requests, num_heads, num_kv_heads, 16, device=device, seed=5)
    seq_lens = torch.tensor([s for s, _ in requests])
    order = torch.argsort(-seq_lens, stable=True).to(torch.int32)
    assert order.tolist() == [3, 2, 4, 0, 6, 1, 5]
    step.metadata.decode_order = order.to(device)
    backend = TritonBackend(TritonBackendConfig(split_kv="never"))
    assert_matches_reference(step, backend)
    # With padding tokens after the requests the order is not used (and not needed).
    padded = make_step(requests, num_heads, num_kv_heads, 16, device=device, seed=5,
                       num_padding_tokens=2)
    padded.metadata.decode_order = order.to(device)
    assert_matches_reference(padded, backend)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split_kv", ["never", "always"])
@pytest.mark.parametrize("num_padding_tokens", [0, 1])
def test_cuda_graph_padding_rows_store_nothing_and_read_as_zeros(device, split_kv,
                                                                  num_padding_tokens):
    # A decode bucket: 3 real requests, 2 padding requests (seq_len 0, slot -1), and maybe a
    # padding token past the last request.
    requests = [(20, 1), (0, 1), (37, 1), (0, 1), (5, 1)]
    step = make_step(requests, 4, 2, 16, device=device, num_padding_tokens=num_padding_tokens,
                     seed=4)
    cache_before = step.kv_cache.clone()
    backend = TritonBackend(TritonBackendConfig(split_kv=split_kv, num_splits=2))
    out = backend.forward(step.query, step.key, step.value, step.kv_cache, step.metadata, 0.25)
    assert torch.all(out[[1, 3, *range(5, 5 + num_padding_tokens)]] == 0)
    real = step.metadata.slot_mapping >= 0
    changed = (step.kv_cache != cache_before).flatten(3).any(-1)  # [2, num_blocks, block_size]
    assert changed.sum() == 2 * int(real.sum())
    step.kv_cache.copy_(cache_before)
    assert_matches_reference(step, backend)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split_kv", ["never", "always"])
def test_bfloat16_matches_reference(device, split_kv):
    requests = DECODE if split_kv == "always" else MIXED
    step = make_step(requests, 8, 2, 16, dtype=torch.bfloat16, device=device, seed=5)
    assert_matches_reference(step, TritonBackend(TritonBackendConfig(split_kv=split_kv)))


@pytest.mark.parametrize("device", DEVICES)
def test_non_power_of_two_head_dim_and_group(device):
    # 6 query heads over 2 KV heads (group 3) and head_dim 24: both padded to powers of two.
    for split_kv in ("never", "always"):
        requests = DECODE if split_kv == "always" else MIXED
        step = make_step(requests, 6, 2, 16, head_dim=24, device=device, seed=6)
        assert_matches_reference(step, TritonBackend(TritonBackendConfig(split_kv=split_kv)))


@pytest.mark.parametrize("device", DEVICES)
def test_store_kv_writes_each_slot_and_skips_negative_ones(device):
    step = make_step([(10, 4), (3, 3)], 2, 2, 4, device=device, num_padding_tokens=2)
    expected = step.kv_cache.clone()
    flat = expected.view(2, -1, 2, 16)
    real = step.metadata.slot_mapping >= 0
    flat[0, step.metadata.slot_mapping[real]] = step.key[real]
    flat[1, step.metadata.slot_mapping[real]] = step.value[real]
    store_kv(step.key, step.value, step.kv_cache, step.metadata.slot_mapping)
    torch.testing.assert_close(step.kv_cache, expected, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_without_a_bound_cache_fresh_prefills_attend_within_themselves(device):
    step = make_step([(12, 12), (5, 5)], 4, 2, 16, device=device, seed=7)
    qkv = (step.query, step.key, step.value)
    empty = torch.empty(0, device=device)
    expected = TorchRefBackend().forward(*qkv, empty, step.metadata, 0.3)
    out = TritonBackend().forward(*qkv, empty, step.metadata, 0.3)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])

    step = make_step([(6, 2)], 4, 2, 16, device=device)
    with pytest.raises(ValueError, match="no KV cache is bound"):
        TritonBackend().forward(step.query, step.key, step.value, empty, step.metadata, 0.3)


def test_split_kv_refuses_batches_with_prefills():
    step = make_step(MIXED, 4, 2, 16)
    with pytest.raises(ValueError, match="max_query_len at most 8"):
        split_kv_attention(
            torch.empty_like(step.query), step.query, step.kv_cache[0], step.kv_cache[1],
            step.metadata, 0.25, num_splits=2, tiles=SPLIT_TILES,
        )


def test_split_rule_splits_decode_batches_that_leave_the_gpu_underfilled():
    # 132 SMs, 8 KV heads (an H200 serving Qwen3-0.6B).
    assert choose_num_splits(256, 8, 1024, 132) == 1  # 2048 programs already fill the GPU
    assert choose_num_splits(37, 8, 40960, 132) == 1  # 296 programs: over 2 per SM
    assert choose_num_splits(1, 8, 8192, 132) == 32  # 4 x 132 / 8 = 66 -> 32 (power of two)
    assert choose_num_splits(8, 8, 8192, 132) == 8
    assert choose_num_splits(8, 8, 300, 132) == 1  # too short to split
    assert choose_num_splits(0, 8, 0, 132) == 1
    # At most a sixteenth of the SMs in programs, a context under 512 keys: 64-key tiles, and
    # always 8 splits (the short-context graphs' plan: no other variant to compile mid-run).
    for context in (511, 300, 192, 64, 1):
        assert choose_num_splits(1, 8, context, 132) == 8
    assert choose_num_splits(2, 8, 511, 132) == 1  # 16 programs: the rule above
    assert choose_num_splits(1, 8, 512, 132) == 2  # longer: 256 keys a split at least


def test_decode_plan_gives_short_contexts_their_own_tiles():
    """Decode batches of SHORT_DECODE_MIN_REQS requests or more whose longest context is under
    SHORT_DECODE_CONTEXT get the short-context tiles (so the graph runner captures their sizes
    again for short contexts), others the decode tiles; a split batch says its split count."""
    from sluice.attention.triton_backend import (
        DECODE_TILES,
        SHORT_DECODE_CONTEXT,
        SHORT_DECODE_MIN_REQS,
        SHORT_DECODE_TILES,
    )

    backend, cpu = TritonBackend(), torch.device("cpu")  # 4 "SMs" off a GPU
    short, many = SHORT_DECODE_CONTEXT - 1, SHORT_DECODE_MIN_REQS
    bf16 = torch.bfloat16
    assert SHORT_DECODE_TILES != DECODE_TILES
    assert backend.decode_plan(many, 8, short, cpu, bf16) == (0, SHORT_DECODE_TILES)
    assert backend.decode_plan(many, 8, SHORT_DECODE_CONTEXT, cpu, bf16) == (0, DECODE_TILES)
    assert backend.decode_plan(many - 1, 8, short, cpu, bf16) == (0, DECODE_TILES)
    assert backend.decode_plan(1, 2, 4096, cpu, bf16)[0] > 1


def test_decode_plan_gives_wide_fp8_batches_their_own_tiles():
    """Over an 8-bit cache, decode batches of FP8_DECODE_MIN_PROGRAMS_PER_SM programs per SM or
    more take FP8_DECODE_TILES whatever their contexts; smaller ones the 16-bit rule."""
    from sluice.attention.triton_backend import (
        DECODE_TILES,
        FP8_DECODE_MIN_PROGRAMS_PER_SM,
        FP8_DECODE_TILES,
        SHORT_DECODE_CONTEXT,
    )

    backend, cpu, fp8 = TritonBackend(), torch.device("cpu"), torch.float8_e4m3fn
    wide = FP8_DECODE_MIN_PROGRAMS_PER_SM * 4 // 2  # requests of 2 KV heads on 4 "SMs"
    assert FP8_DECODE_TILES not in (DECODE_TILES, TritonBackendConfig().short_decode_tiles)
    for context in (SHORT_DECODE_CONTEXT - 1, 1000):
        assert backend.decode_plan(wide, 2, context, cpu, fp8) == (0, FP8_DECODE_TILES)
        assert backend.decode_plan(wide, 2, context, cpu, torch.bfloat16)[1] != FP8_DECODE_TILES
    assert backend.decode_plan(wide - 1, 2, SHORT_DECODE_CONTEXT - 1, cpu, fp8) == (0, DECODE_TILES)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_query_len", [1, 3, 40])
def test_short_context_decode_tiles_match_reference(device, max_query_len, monkeypatch):
    # 16 requests of short contexts: a decode batch (reading 1 to 2 tiles each) takes the
    # short-context tiles (64 keys); a verification-like step of 1 to 3 queries, and a mixed
    # step with prompt chunks of up to 40, keep DECODE_TILES for their decode rows (the
    # variants the warm-up compiles).
    from sluice.attention import triton_backend
    from sluice.attention.triton_backend import (
        DECODE_TILES,
        PREFILL_TILES,
        SHORT_DECODE_MIN_REQS,
        SHORT_DECODE_TILES,
    )

    launched = []

    def recording(*args, **kwargs):
        launched.append(args[6])  # the tiles
        return unified(*args, **kwargs)

    unified = triton_backend.unified_attention
    monkeypatch.setattr(triton_backend, "unified_attention", recording)
    requests = [(3 + 9 * i, 1 + i % max_query_len) for i in range(SHORT_DECODE_MIN_REQS)]
    step = make_step(requests, 4, 2, 16, device=device)
    assert_matches_reference(step, TritonBackend(TritonBackendConfig(split_kv="never")))
    expected = {1: [SHORT_DECODE_TILES], 3: [DECODE_TILES], 40: [DECODE_TILES, PREFILL_TILES]}
    assert launched == expected[max_query_len]


def test_backend_is_registered_and_validates_its_config():
    assert get_attention_backend("triton").name == "triton"
    with pytest.raises(ValueError, match="split_kv must be one of"):
        TritonBackendConfig(split_kv="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_splits must be in"):
        TritonBackendConfig(num_splits=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("split_kv", ["never", "auto"])
def test_qwen3_shapes_on_cuda(split_kv):
    # Qwen3-0.6B attention: 16 query heads, 8 KV heads, head_dim 128, bf16, block size 16.
    if split_kv == "auto":
        requests = [(4000, 1), (1500, 1), (0, 1), (8191, 1)]
    else:
        requests = [(700, 1), (2048, 300), (513, 513), (1200, 1), (3000, 129), (0, 1)]
    step = make_step(requests, 16, 8, 16, head_dim=128, dtype=torch.bfloat16, device="cuda")
    backend = TritonBackend(TritonBackendConfig(split_kv=split_kv))
    assert_matches_reference(step, backend, scale=128**-0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("split_kv", ["never", "always"])
def test_decode_step_replays_from_a_cuda_graph(split_kv):
    # A bucket of 8 decode rows captured once (max_seq_len 512, block tables 33 wide), replayed
    # with other requests' data copied into the same buffers: 5 real rows, 3 padding rows.
    backend = TritonBackend(TritonBackendConfig(split_kv=split_kv, num_splits=4))
    shapes = dict(num_heads=16, num_kv_heads=8, block_size=16, head_dim=128, device="cuda")
    first = make_step([(512, 1)] * 8, dtype=torch.bfloat16, seed=8, **shapes)
    qkv = (first.query, first.key, first.value)
    for _ in range(2):  # compile outside the capture
        backend.forward(*qkv, first.kv_cache, first.metadata, 0.088)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(*qkv, first.kv_cache, first.metadata, 0.088)

    requests = [(500, 1), (0, 1), (17, 1), (256, 1), (0, 1), (1, 1), (0, 1), (99, 1)]
    second = make_step(requests, dtype=torch.bfloat16, seed=9, **shapes)
    assert second.kv_cache.shape[1] <= first.kv_cache.shape[1]
    first.kv_cache[:, : second.kv_cache.shape[1]].copy_(second.kv_cache)
    second.kv_cache = first.kv_cache.clone()
    for name in ("query_start_loc", "seq_lens", "slot_mapping"):
        getattr(first.metadata, name).copy_(getattr(second.metadata, name))
    first.metadata.block_tables.zero_()
    width = second.metadata.block_tables.shape[1]
    first.metadata.block_tables[:, :width].copy_(second.metadata.block_tables)
    for static, new in zip(qkv, (second.query, second.key, second.value)):
        static.copy_(new)
    graph.replay()
    expected = TorchRefBackend().forward(
        second.query, second.key, second.value, second.kv_cache, second.metadata, 0.088
    )
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.bfloat16])
    torch.testing.assert_close(first.kv_cache, second.kv_cache, atol=0, rtol=0)


def dense_step(prompt_len: int, num_padding_tokens: int, num_heads: int, num_kv_heads: int,
               dtype: torch.dtype, device: str, head_dim: int = 16) -> Step:
    """One fresh prompt (no cached context) and a CUDA graph's padding rows after it, marked
    for dense attention as the runner marks such a step."""
    step = make_step([(prompt_len, prompt_len)], num_heads, num_kv_heads, 16, head_dim=head_dim,
                     dtype=dtype, device=device, num_padding_tokens=num_padding_tokens)
    step.metadata.dense_prefill = True
    return step


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2)])
def test_dense_prefill_over_a_prefix_equals_paged_attention(device, num_heads, num_kv_heads):
    """A prompt chunk over a cached prefix (ending mid-block) marked dense_prefill: the prefix
    gathered from the cache and the chunk's own keys, merged by log-sum-exp, equal the
    reference's paged attention."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    step = make_step([(77, 30)], num_heads, num_kv_heads, 16, dtype=dtype, device=device)
    step.metadata.dense_prefill = True
    if device == "cuda":
        from sluice.attention.dense import cudnn_prefix_attention_works

        assert cudnn_prefix_attention_works(torch.device("cuda"), dtype, num_heads,
                                            num_kv_heads, 16)
    assert_matches_reference(step, TritonBackend())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2)])
def test_dense_prefill_equals_paged_attention_on_the_prompt_rows(device, num_heads,
                                                                 num_kv_heads):
    """A step marked dense_prefill: the prompt's rows equal the reference's paged attention,
    its K/V are stored as by the paged path, the padding rows after it are finite."""
    # cuDNN attention (a GPU's dense path) takes 16-bit dtypes only; the CPU's takes float32.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    step = dense_step(37, 11, num_heads, num_kv_heads, dtype, device)
    ref_cache = step.kv_cache.clone()
    expected = TorchRefBackend().forward(step.query, step.key, step.value, ref_cache,
                                         step.metadata, 0.25)
    out = TritonBackend().forward(step.query, step.key, step.value, step.kv_cache,
                                  step.metadata, 0.25)
    assert out.shape == step.query.shape and out.dtype == step.query.dtype
    torch.testing.assert_close(step.kv_cache, ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(out[:37], expected[:37], **TOLERANCE[dtype])
    assert torch.isfinite(out[37:]).all()


def test_dense_prefill_is_offered_only_where_cudnn_attention_runs():
    """On a CPU (and for float32 anywhere) the runner is never told to mark dense steps; the
    reference backend offers them only when a test turns them on; a bad mode is refused."""
    cpu = torch.device("cpu")
    assert not TritonBackend().supports_dense_prefill(cpu, torch.bfloat16, 16, 8, 128)
    assert not TritonBackend().supports_dense_prefix(cpu, torch.bfloat16, 16, 8, 128)
    assert not TorchRefBackend().supports_dense_prefill(cpu, torch.float32, 16, 8, 128)
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert not TritonBackend().supports_dense_prefill(cuda, torch.float32, 16, 8, 128)
        never = TritonBackend(TritonBackendConfig(dense_prefill="never"))
        assert not never.supports_dense_prefill(cuda, torch.bfloat16, 16, 8, 128)
    with pytest.raises(ValueError, match="dense_prefill must be one of"):
        TritonBackendConfig(dense_prefill="always")  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("prompt_len,num_padding_tokens", [(1024, 0), (700, 324), (64, 0)])
def test_dense_prefill_runs_cudnn_at_qwen3_shapes_within_bf16_tolerance(prompt_len,
                                                                         num_padding_tokens):
    """Qwen3-0.6B's attention (16 / 8 heads, head_dim 128, bf16): cuDNN's dense attention is
    offered, and the prompt's rows equal the reference's paged attention as closely as the
    Triton kernel's do, eagerly and replayed from a CUDA graph."""
    cuda = torch.device("cuda")
    backend = TritonBackend()
    assert backend.supports_dense_prefill(cuda, torch.bfloat16, 16, 8, 128)
    assert backend.supports_dense_prefix(cuda, torch.bfloat16, 16, 8, 128)
    step = dense_step(prompt_len, num_padding_tokens, 16, 8, torch.bfloat16, "cuda",
                      head_dim=128)
    scale = 128**-0.5
    expected = TorchRefBackend().forward(step.query, step.key, step.value,
                                         step.kv_cache.clone(), step.metadata, scale)
    qkv = (step.query, step.key, step.value)
    eager = backend.forward(*qkv, step.kv_cache, step.metadata, scale)
    torch.testing.assert_close(eager[:prompt_len], expected[:prompt_len],
                               **TOLERANCE[torch.bfloat16])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(*qkv, step.kv_cache, step.metadata, scale)
    out.zero_()
    graph.replay()
    torch.testing.assert_close(out, eager, atol=0, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("seq_len,query_len", [(3000, 2048), (9000, 4000)])
def test_dense_prefill_over_a_prefix_at_qwen3_shapes_within_bf16_tolerance(seq_len, query_len):
    """A long prompt's later chunk at Qwen3-0.6B's attention shapes, bf16: cuDNN over the
    gathered prefix and over the chunk, merged, equals the reference's paged attention as
    closely as the Triton kernel does."""
    step = make_step([(seq_len, query_len)], 16, 8, 16, head_dim=128, dtype=torch.bfloat16,
                     device="cuda")
    step.metadata.dense_prefill = True
    assert_matches_reference(step, TritonBackend(), scale=128**-0.5)

