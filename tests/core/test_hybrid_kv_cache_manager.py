"""The hybrid KV cache manager (Gemma 3): KV cache groups of one kind and equal size, one block
table each over one pool; a windowed group gives back its blocks behind the window, the global
group keeps them; allocation is for every group or none; a prefix hit is the longest every group can
serve (a windowed group only its window's blocks, null before them) and a group's hit is one
of its own blocks; every block comes back."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from sluice.core.hybrid_kv_cache_manager import HybridKVCacheManager
from sluice.core.kv_cache_groups import (
    KVCacheGroups,
    group_size_for,
    kv_cache_groups,
    split_layers,
)
from sluice.model.hf_config import parse_hf_config
from tests.core.test_kv_cache_manager import make_request

BLOCK_SIZE = 4
WINDOW = 6  # a token at p sees positions > p - 6: two blocks of 4 at most


def gemma_270m_layers() -> tuple[bool, ...]:
    return tuple((i + 1) % 6 != 0 for i in range(18))


def test_gemma_3_270m_splits_into_a_global_group_and_five_windowed_groups_of_three() -> None:
    groups = split_layers(gemma_270m_layers(), 512)
    assert groups.windows == (None, 512, 512, 512, 512, 512)
    assert groups.layers[0] == (5, 11, 17)
    assert groups.layers[1:] == ((0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16))
    assert groups.group_size == 3
    slots = groups.layer_slots()
    assert sorted(slots) == list(range(18))
    assert slots[11] == (0, 1) and slots[4] == (2, 1)  # layer 11 shares tensor 1 with layer 4
    # Gemma 3 1B: 26 layers, 22 windowed and 4 global: groups of 2.
    one_b = split_layers(tuple((i + 1) % 6 != 0 for i in range(26)), 512)
    assert one_b.group_size == 2 and one_b.num_groups == 13
    assert one_b.windows.count(None) == 2
    # (4 a group would pad 2 slots of 28, more than 1/16.)


def test_counts_without_a_large_divisor_make_fewer_groups_padded() -> None:
    """Gemma 3 4B (29 windowed, 5 global: coprime) makes 7 groups of 5, the last windowed
    one of 4 layers, where the divisor would make 34 groups of 1; 27B (52, 10) 13 groups of 5,
    3 slots padded, where vLLM's rule (the smaller count) would waste 8 of 70."""
    four_b = split_layers(tuple((i + 1) % 6 != 0 for i in range(34)), 1024)
    assert four_b.group_size == 5 and four_b.num_groups == 7
    assert four_b.layers[0] == (5, 11, 17, 23, 29)
    assert [len(members) for members in four_b.layers] == [5] * 6 + [4]
    assert four_b.layers[-1] == (30, 31, 32, 33)
    slots = four_b.layer_slots()
    assert sorted(slots) == list(range(34))
    assert slots[33] == (6, 3)  # the last group has no layer on tensor 4
    big = split_layers(tuple((i + 1) % 6 != 0 for i in range(62)), 1024)
    assert big.group_size == 5 and big.num_groups == 13
    assert big.num_groups * big.group_size - 62 == 3
    assert group_size_for(10, 52) == 5 and group_size_for(3, 15) == 3
    assert group_size_for(4, 22) == 2 and group_size_for(3, 14) == 3  # 1 slot of 17 padded


def test_groups_are_split_only_where_nothing_else_reads_the_blocks() -> None:
    base = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
            "num_attention_heads": 4, "sliding_window": 20,
            "layer_types": ["sliding_attention"] * 2 + ["full_attention"]
            + ["sliding_attention"] * 2 + ["full_attention"]}
    mixed = parse_hf_config(base)

    def groups(hf_config, spec=None, kv_transfer_config=None) -> KVCacheGroups:  # noqa: ANN001
        return kv_cache_groups(SimpleNamespace(
            hf_config=hf_config, kv_transfer_config=kv_transfer_config,
            scheduler_config=SimpleNamespace(speculative_config=spec,
                                            max_model_len=256)))

    split = groups(mixed)
    assert split.windows == (None, 20, 20) and split.layers == ((2, 5), (0, 1), (3, 4))
    # a connector or any proposer: one group, every block kept
    assert groups(mixed, kv_transfer_config=object()).windows == (None,)
    assert groups(mixed, SimpleNamespace(method="ngram", num_speculative_tokens=3)).windows == (
        None,)
    all_local = parse_hf_config({**base, "layer_types": ["sliding_attention"] * 6})
    assert groups(all_local).windows == (20,)
    all_global = parse_hf_config({**base, "layer_types": ["full_attention"] * 6})
    assert groups(all_global).windows == (None,)
    assert groups(all_global).layers == (tuple(range(6)),)


def manager(num_blocks: int, num_windowed: int = 2, enable_caching: bool = True
            ) -> HybridKVCacheManager:
    groups = KVCacheGroups(windows=(None,) + (WINDOW,) * num_windowed,
                           layers=tuple((i,) for i in range(1 + num_windowed)))
    return HybridKVCacheManager(groups, num_blocks, BLOCK_SIZE, enable_caching)


def run_prompt(m: HybridKVCacheManager, request, chunk: int) -> None:  # noqa: ANN001
    """Compute the request's prompt in chunks, as the scheduler would."""
    hits, num_hit = m.get_computed_blocks(request)
    request.num_computed_tokens = 0
    first = True
    while request.num_computed_tokens + num_hit * first < request.num_tokens:
        start = request.num_computed_tokens + (num_hit if first else 0)
        num_new = min(chunk, request.num_tokens - start)
        assert m.allocate_slots(request, num_new, hits if first else None) is not None
        request.num_computed_tokens = start + num_new
        first = False
        m.check_integrity()


def test_windowed_groups_give_back_blocks_behind_the_window_the_global_group_keeps_them() -> None:
    m = manager(num_blocks=64)
    request = make_request("a", list(range(40)))  # 10 blocks a group
    run_prompt(m, request, chunk=4)
    # The next token (position 40) sees positions > 34: blocks 8 on of each windowed group;
    # blocks 0..7 go back (the global group keeps all 11).
    assert m.allocate_slots(request, 1) is not None
    global_ids = m.get_block_ids("a")
    assert 0 not in global_ids and len(global_ids) == 11
    for ids in m.get_group_block_ids("a"):
        assert len(ids) == 11
        assert ids[:8] == [0] * 8 and 0 not in ids[8:]
    assert m.num_blocks_held("a") == 11 + 2 * 3
    assert m.num_window_freed_blocks_total == 16
    assert m.get_num_blocks_in_use() == 11 + 2 * 3
    m.free(request)
    m.check_integrity()
    assert m.get_num_free_blocks() == 63


def test_allocation_is_for_every_group_or_none() -> None:
    m = manager(num_blocks=1 + 3 * 2 + 2)  # 8 usable: a 2-block step of 3 groups needs 6
    a = make_request("a", list(range(8)))
    assert m.allocate_slots(a, 8) is not None
    assert m.get_num_free_blocks() == 2
    b = make_request("b", list(range(100, 108)))
    assert m.allocate_slots(b, 8) is None  # 6 needed, 2 free: nothing taken
    assert m.get_num_free_blocks() == 2 and "b" not in m.req_to_blocks
    assert all("b" not in g.req_to_blocks for g in m.managers)
    m.check_integrity()
    m.free(a)
    assert m.get_num_free_blocks() == 8


def test_a_prefix_hit_is_each_group_s_own_blocks() -> None:
    m = manager(num_blocks=64)
    prompt = list(range(24))
    first = make_request("a", prompt)
    run_prompt(m, first, chunk=24)
    first_ids = [m.get_block_ids("a"), *m.get_group_block_ids("a")]
    m.free(first)
    again = make_request("b", prompt + [99])
    hits, num_tokens = m.get_computed_blocks(again)
    assert num_tokens == 24  # every full block, in every group
    # The token at 24 sees 19 .. 24: a windowed group's hit is its blocks 2 and 3, null before.
    assert [[b.block_id for b in group_hits] for group_hits in hits] == [
        first_ids[0], *([0] * 4 + ids[4:] for ids in first_ids[1:])]
    assert len({b.block_id for group_hits in hits for b in group_hits} - {0}) == 6 + 2 * 2
    run_prompt(m, again, chunk=8)  # looks up again: a second hit of 24 tokens
    assert m.prefix_cache_hits == 48
    m.free(again)
    m.check_integrity()
    assert m.get_num_free_blocks() == 63


def test_a_windowed_group_s_reused_first_blocks_keep_the_global_group_s_hit() -> None:
    """A long request's windowed groups give back their first blocks, which the pool then
    reuses first: the same prefix still hits its whole length, the global group's blocks from
    block 0 and each windowed group's window (its blocks 8 and 9, which the request holds)."""
    m = manager(num_blocks=31)  # 30 usable: a 40-token prompt takes 10 in each of 3 groups
    prompt = list(range(40))
    a = make_request("a", prompt)
    run_prompt(m, a, chunk=4)
    assert m.num_blocks_held("a") == 10 + 2 * 3 and m.get_num_free_blocks() == 14
    probe = make_request("probe", prompt + [99])
    assert m.get_computed_blocks(probe)[1] == 40  # freed blocks stay cached until reused
    assert len(m.managers[0].find_cached_prefix(probe, 10)) == 10
    b = make_request("b", [500, 501, 502])
    assert m.allocate_slots(b, 3) is not None  # 3 blocks: the first freed, the groups' roots
    assert len(m.managers[0].find_cached_prefix(probe, 10)) == 10
    assert m.managers[1].block_pool.get_cached_block(probe.block_hashes[0], 1) is None
    c = make_request("c", prompt + [98])
    hits, num_tokens = m.get_computed_blocks(c)
    assert num_tokens == 40
    assert [b.block_id for b in hits[0]] == m.get_block_ids("a")
    for group_hits, ids in zip(hits[1:], m.get_group_block_ids("a")):
        assert [b.block_id for b in group_hits] == [0] * 8 + ids[8:10]
    # c shares the hit blocks with a and takes one new block a group for its last token.
    assert m.allocate_slots(c, 1, hits) is not None
    assert m.num_blocks_held("c") == 11 + 2 * 3  # a windowed group: blocks 8, 9 and 10
    m.check_integrity()
    for request in (a, b, c):
        m.free(request)
    m.check_integrity()
    assert m.get_num_free_blocks() == 30


def forget(m: HybridKVCacheManager, group: int, request, index: int) -> None:  # noqa: ANN001
    """Evict the cached block `index` of the request's prompt in `group` (free, uncached)."""
    key = m.block_pool.get_cached_block(request.block_hashes[index], group).block_hash
    m.block_pool.cached_block_hash_to_block.pop(key).reset_hash()


def test_the_hit_shrinks_until_every_windowed_group_has_its_window() -> None:
    """Windowed groups with different blocks evicted: group 1 lacks its blocks 0, 9 and 5,
    group 2 its blocks 0 and 7 (a window is two blocks). Bounded by 10, group 1 could serve 9
    blocks, group 2 then 7, group 1 at 7 only 5, which group 2 serves: 5 blocks, where one
    pass over the groups would say 7 and the walk from block 0 none."""
    m = manager(num_blocks=64)
    prompt = list(range(41))
    first = make_request("a", prompt)
    run_prompt(m, first, chunk=41)  # one step: every block held, then every block cached
    m.free(first)
    m.check_integrity()
    probe = make_request("probe", prompt)
    assert m.get_computed_blocks(probe)[1] == 40
    for group, index in ((1, 0), (1, 9), (1, 5), (2, 0), (2, 7)):
        forget(m, group, probe, index)
    m.check_integrity()
    b = make_request("b", prompt)
    hits, num_tokens = m.get_computed_blocks(b)
    assert num_tokens == 20
    assert [len(group_hits) for group_hits in hits] == [5, 5, 5]
    for group_hits in hits[1:]:
        assert [b.is_null for b in group_hits] == [True] * 3 + [False] * 2
    run_prompt(m, b, chunk=8)
    m.free(b)
    m.check_integrity()
    assert m.get_num_free_blocks() == 63


def test_no_group_s_new_blocks_evict_another_group_s_hits() -> None:
    """The windowed groups' first blocks, freed behind the window, are the first the pool
    reuses; a prompt that hits them and needs a new block in the global group must not be
    given one of them (one block in two groups' tables: their layers share the tensors)."""
    m = manager(num_blocks=19)  # every usable block is taken once by the first request
    prompt = list(range(24))
    first = make_request("a", prompt)
    run_prompt(m, first, chunk=4)
    m.free(first)
    again = make_request("b", prompt[:8] + [99])
    hits, num_tokens = m.get_computed_blocks(again)
    assert num_tokens == 8
    hit_ids = [[b.block_id for b in group_hits] for group_hits in hits]
    front = m.block_pool.free_block_queue.check_links(max_len=18)[:2]  # reused first
    assert [b.block_id for b in front] == [hit_ids[1][0], hit_ids[2][0]]
    assert m.allocate_slots(again, 1, hits) is not None  # a new block in every group
    m.check_integrity()
    assert [m.get_block_ids("b")[:2], *(ids[:2] for ids in m.get_group_block_ids("b"))] == (
        hit_ids)
    m.free(again)
    m.check_integrity()
    assert m.get_num_free_blocks() == 18


def test_a_random_workload_returns_every_block() -> None:
    """Prompts of shared prefixes, chunks, decodes, frees and preemptions at random; the pool
    always balances, and at the end every block is free."""
    rng = random.Random(0)
    for enable_caching in (True, False):
        m = manager(num_blocks=40, enable_caching=enable_caching)
        base = [rng.randrange(50) for _ in range(32)]
        live = []
        for step in range(400):
            if live and rng.random() < 0.3:
                m.free(live.pop(rng.randrange(len(live))))
            elif rng.random() < 0.5 or not live:
                n = rng.randrange(1, 40)
                request = make_request(f"r{step}", base[:rng.randrange(33)] + [
                    rng.randrange(50) for _ in range(n)])
                hits, num_hit = m.get_computed_blocks(request)
                num_new = min(request.num_tokens - num_hit, rng.randrange(1, 17))
                if m.allocate_slots(request, num_new, hits) is not None:
                    request.num_computed_tokens = num_hit + num_new
                    live.append(request)
            else:
                request = rng.choice(live)
                if request.num_computed_tokens == request.num_tokens:  # decode a token
                    request.append_output_token_ids([rng.randrange(50)])
                num_new = min(rng.randrange(1, 9),
                              request.num_tokens - request.num_computed_tokens)
                if m.allocate_slots(request, num_new) is not None:
                    request.num_computed_tokens += num_new
            m.check_integrity()
        for request in live:
            m.free(request)
        m.check_integrity()
        assert m.get_num_free_blocks() == 39


def test_a_hybrid_manager_needs_two_groups() -> None:
    with pytest.raises(ValueError, match="2 groups or more, got 1"):
        HybridKVCacheManager(KVCacheGroups((None,), ((0,),)), 8, BLOCK_SIZE)


def test_a_request_s_most_blocks_count_a_window_and_a_step_per_windowed_group() -> None:
    """What the engine checks the cache against at start-up: a global group all of
    max_model_len's blocks, a windowed group its window and a step's tokens (never more than
    the whole context); one group, the whole context as before."""
    groups = KVCacheGroups(windows=(None, 20, 20), layers=((2, 5), (0, 1), (3, 4)))
    # 256 tokens of 8: 32 blocks; a window of 20 and 16 tokens a step: (19 + 16) // 8 + 3 = 7
    assert groups.max_blocks_per_request(256, 8, 16) == 32 + 2 * 7
    assert groups.max_blocks_per_request(40, 8, 16) == 3 * 5  # the context is shorter
    assert KVCacheGroups((20,), ((0, 1),)).max_blocks_per_request(256, 8, 16) == 32
