"""KV cache manager: prefix hits, sharing, caching in decode, tail-first freeing, all-or-nothing
allocation, and a randomized workload that must leave every block free and the pool intact."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.kv_cache_utils import KVCacheBlock
from sluice.core.request import Request
from sluice.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, token_ids: list[int], prompt_logprobs: int | None = None
                 ) -> Request:
    params = SamplingParams(temperature=0.0, prompt_logprobs=prompt_logprobs)
    return Request(request_id, token_ids, params)


def prefill(manager: KVCacheManager, request: Request) -> list[KVCacheBlock]:
    """Look up the prefix cache and allocate the whole rest of the prompt, as one step would."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    manager.check_integrity()
    return new_blocks


def num_hit_tokens(manager: KVCacheManager, token_ids: list[int]) -> int:
    return manager.get_computed_blocks(make_request("probe", token_ids))[1]


def ref_cnts(manager: KVCacheManager) -> list[int]:
    return [block.ref_cnt for block in manager.block_pool.blocks]


def test_tail_first_free_evicts_the_leaf_and_keeps_the_prefix() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    prompt = list(range(12))
    first = make_request("a", prompt)
    prefill(manager, first)
    assert manager.get_block_ids("a") == [1, 2, 3]
    manager.free(first)
    assert manager.get_num_free_blocks() == 3

    # One block for an unrelated request evicts the chain's leaf (block 3), not its root.
    other = make_request("b", [100, 101, 102])
    assert [b.block_id for b in prefill(manager, other)] == [3]
    manager.free(other)

    again = make_request("c", prompt + [12])
    hits, num_tokens = manager.get_computed_blocks(again)
    assert [b.block_id for b in hits] == [1, 2]
    assert num_tokens == 8
    manager.check_integrity()


def test_shared_prefix_blocks_are_shared_by_ref_count() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    first, second = make_request("a", prompt), make_request("b", prompt)
    prefill(manager, first)
    hits, num_tokens = manager.get_computed_blocks(second)
    assert num_tokens == 8
    new_blocks = manager.allocate_slots(second, 1, hits)
    assert new_blocks is not None and len(new_blocks) == 1
    first_blocks, second_blocks = manager.req_to_blocks["a"], manager.req_to_blocks["b"]
    assert second_blocks[:2] == first_blocks[:2]
    assert all(a is b for a, b in zip(second_blocks[:2], first_blocks[:2]))
    assert second_blocks[2] is not first_blocks[2]
    assert [b.ref_cnt for b in second_blocks] == [2, 2, 1]
    assert manager.get_num_free_blocks() == 7 - 4
    manager.check_integrity()

    manager.free(first)
    assert [b.ref_cnt for b in second_blocks] == [1, 1, 1]
    assert manager.get_num_free_blocks() == 7 - 3
    manager.check_integrity()
    manager.free(second)
    assert manager.get_num_free_blocks() == 7
    assert manager.usage == 0.0
    manager.check_integrity()


def test_block_filled_in_decode_becomes_a_prefix_hit() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", [1, 2, 3, 4, 5, 6])
    prefill(manager, request)
    for token in (7, 8):
        # A decode step: the sampled token is appended, then its KV is scheduled.
        request.append_output_token_ids([token])
        assert num_hit_tokens(manager, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4
        assert manager.allocate_slots(request, 1) == []
        request.num_computed_tokens += 1
        manager.check_integrity()
    assert num_hit_tokens(manager, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8
    assert len(request.block_hashes) == 2


def test_blocks_computed_after_a_prefix_hit_are_cached() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE)
    prefill(manager, make_request("a", list(range(9))))
    extended = list(range(8)) + [100, 101, 102, 103, 104]
    second = make_request("b", extended)
    hits, num_tokens = manager.get_computed_blocks(second)
    assert num_tokens == 8
    new_blocks = manager.allocate_slots(second, 5, hits)
    assert new_blocks is not None and len(new_blocks) == 2
    assert num_hit_tokens(manager, extended + [7]) == 12
    manager.check_integrity()


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = list(range(8))
    prefill(manager, make_request("a", prompt))
    second = make_request("b", prompt)
    hits, num_tokens = manager.get_computed_blocks(second)
    assert (len(hits), num_tokens) == (1, 4)
    assert manager.prefix_cache_queries == 16
    assert manager.prefix_cache_hits == 4
    new_blocks = manager.allocate_slots(second, 4, hits)
    assert new_blocks is not None and len(new_blocks) == 1
    # The recomputed last block duplicates a cached one: it stays uncached, the map is unchanged.
    assert new_blocks[0].block_hash is None
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    manager.check_integrity()


def test_forced_hash_collision_never_returns_other_tokens() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, hash_fn=lambda b: b"\0" * 32)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    prefill(manager, make_request("a", prompt))
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    assert num_hit_tokens(manager, [11, 12, 13, 14, 15, 16, 17, 18, 19]) == 0
    assert num_hit_tokens(manager, [1, 2, 3, 4, 50, 60, 70, 80, 9]) == 4
    same = make_request("b", prompt)
    hits, num_tokens = manager.get_computed_blocks(same)
    assert num_tokens == 8
    assert hits == manager.req_to_blocks["a"][:2]


def test_forced_collision_never_puts_one_block_at_two_positions() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=2, hash_fn=lambda b: b"\0" * 32)
    prompt = [3, 3, 3, 3, 3, 3, 3]
    prefill(manager, make_request("a", prompt))
    hits, num_tokens = manager.get_computed_blocks(make_request("b", prompt))
    assert (len(hits), num_tokens) == (1, 2)


def test_forced_collision_never_splices_a_block_after_another_parent() -> None:
    # Every hash collides, so keys differ only by tokens: chain "a" is [X, Y], chain "r" is
    # [Z, W]. A prompt [X, W] must not get r's W block: its KV was computed after Z, not X.
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, hash_fn=lambda b: b"\0" * 32)
    x, y, z, w = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]
    prefill(manager, make_request("a", x + y + [0]))
    prefill(manager, make_request("r", z + w + [0]))
    hits, num_tokens = manager.get_computed_blocks(make_request("b", x + w + [0]))
    assert num_tokens == 4
    assert hits == manager.req_to_blocks["a"][:1]
    # A block handed out again is a new generation: an old child no longer follows it.
    assert num_hit_tokens(manager, z + w + [0]) == 8


def test_allocate_slots_changes_nothing_when_out_of_blocks() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    first = make_request("a", list(range(8)))
    prefill(manager, first)
    before = ref_cnts(manager)
    second = make_request("b", list(range(100, 109)))
    assert manager.allocate_slots(second, 9) is None
    assert ref_cnts(manager) == before
    assert manager.get_num_free_blocks() == 1
    assert "b" not in manager.req_to_blocks
    manager.check_integrity()


def test_free_prefix_hits_count_against_the_free_pool() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    prompt = list(range(8))
    first = make_request("a", prompt)
    prefill(manager, first)
    manager.free(first)
    assert manager.get_num_free_blocks() == 3

    # 2 free hits + 2 new blocks > 3 free: refused, and the hits stay free and cached.
    longer = make_request("b", prompt + list(range(100, 109)))
    hits, num_tokens = manager.get_computed_blocks(longer)
    assert num_tokens == 8
    assert manager.allocate_slots(longer, 9, hits) is None
    assert [b.ref_cnt for b in hits] == [0, 0]
    assert manager.get_num_free_blocks() == 3
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    manager.check_integrity()

    # 2 free hits + 1 new block fit exactly.
    fits = make_request("c", prompt + [100, 101])
    hits, num_tokens = manager.get_computed_blocks(fits)
    new_blocks = manager.allocate_slots(fits, 2, hits)
    assert new_blocks is not None and len(new_blocks) == 1
    assert manager.get_block_ids("c") == [1, 2, 3]
    assert manager.get_num_free_blocks() == 0
    manager.check_integrity()


def test_lookahead_slots_are_allocated_but_not_cached() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(8)))
    new_blocks = manager.allocate_slots(request, 4)
    assert new_blocks is not None and len(new_blocks) == 1
    # Only the scheduled tokens are cached, though the request already has 2 full blocks.
    assert len(manager.block_pool.cached_block_hash_to_block) == 1
    request.num_computed_tokens = 4
    new_blocks = manager.allocate_slots(request, 4, num_lookahead_tokens=3)
    assert new_blocks is not None and len(new_blocks) == 2
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    assert [b.block_hash is None for b in manager.req_to_blocks["a"]] == [False, False, True]
    # Nothing new is needed for zero tokens.
    request.num_computed_tokens = 8
    assert manager.allocate_slots(request, 0) == []
    manager.check_integrity()


def test_skip_prefix_cache_gets_no_hits_but_its_blocks_are_cached() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prompt = list(range(9))
    prefill(manager, make_request("a", prompt))
    wants_logprobs = make_request("b", prompt, prompt_logprobs=1)
    assert wants_logprobs.skip_prefix_cache
    assert manager.get_computed_blocks(wants_logprobs) == ([], 0)
    # Only the first prefill's lookup is counted.
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (9, 0)

    other = list(range(50, 59))
    prefill(manager, make_request("c", other, prompt_logprobs=1))
    assert num_hit_tokens(manager, other) == 8


def test_caching_disabled_never_hits() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False)
    prompt = list(range(9))
    prefill(manager, make_request("a", prompt))
    second = make_request("b", prompt)
    assert manager.get_computed_blocks(second) == ([], 0)
    assert second.block_hashes == []
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (0, 0)


def test_free_is_idempotent_and_forgets_the_request() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(5)))
    prefill(manager, request)
    assert manager.get_block_ids("a") == [1, 2]
    manager.free(request)
    manager.free(request)
    manager.free(make_request("unknown", [1]))
    assert manager.get_block_ids("a") == []
    assert manager.get_num_free_blocks() == 7
    manager.check_integrity()


def test_reset_prefix_cache_needs_every_block_free() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", list(range(9)))
    prefill(manager, request)
    assert manager.reset_prefix_cache() is False
    manager.free(request)
    assert manager.reset_prefix_cache() is True
    assert num_hit_tokens(manager, list(range(9))) == 0


def test_invalid_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        KVCacheManager(num_blocks=8, block_size=0)
    with pytest.raises(ValueError, match="num_blocks must be >= 2 .* got 1"):
        KVCacheManager(num_blocks=1, block_size=4)
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0, got -1"):
        manager.allocate_slots(request, -1)
    with pytest.raises(ValueError, match="num_lookahead_tokens must be >= 0, got -2"):
        manager.allocate_slots(request, 1, num_lookahead_tokens=-2)


def test_check_integrity_catches_a_leaked_reference() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefill(manager, make_request("a", list(range(5))))
    manager.block_pool.blocks[1].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref counts sum to 3 but requests hold 2"):
        manager.check_integrity()


# ----------------------------------------------------------------------------- random workload

# Weighted so that requests live long enough to share, fill and evict blocks.
OPERATION_NAMES = ["add"] * 2 + ["schedule"] * 3 + ["step"] * 4 + ["abort", "preempt"]
OPERATION = st.tuples(
    st.sampled_from(OPERATION_NAMES),
    st.integers(0, 1000),  # which request
    st.integers(1, 8),  # chunk size, in tokens
    st.lists(st.integers(0, 2), max_size=10),  # new tokens, from a tiny alphabet
)
MAX_OUTPUT_TOKENS = 3


class Workload:
    """Drives a KVCacheManager like a scheduler would, tracking what each KV slot holds.

    A slot's KV is a function of the token prefix up to and including its position, so a slot
    is recorded as that prefix: a prefix hit is correct only if every hit slot holds exactly the
    requesting sequence's prefix.
    """

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.block_size = manager.block_size
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Token sequences of every request so far: new prompts extend their prefixes.
        self.history: list[list[int]] = []
        # Prefix-cache lookups, in tokens, to check the manager's counters.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    def apply(self, name: str, pick: int, chunk: int, tokens: list[int]) -> None:
        if name == "add":
            self.add(pick, tokens)
        elif name == "schedule":
            self.schedule(pick, chunk)
        elif name == "step":
            self.step(pick, chunk)
        elif name == "abort":
            self.abort(pick)
        else:
            self.preempt(pick)

    def add(self, pick: int, suffix: list[int]) -> None:
        prompt = list(suffix)
        if self.history and pick % 3:
            source = self.history[pick % len(self.history)]
            prompt = source[:pick % (len(source) + 1)] + prompt
        # An empty suffix repeats a known prefix: whole prompts then hit, but for the last token.
        request = make_request(f"r{len(self.history)}", prompt or [0])
        self.history.append(request.all_token_ids)
        self.waiting.append(request)

    def schedule(self, pick: int, chunk: int) -> None:
        if not self.waiting:
            return
        request = self.waiting[pick % len(self.waiting)]
        hits, num_hit_tokens = self.manager.get_computed_blocks(request)
        self.check_hits(request, hits, num_hit_tokens)
        if self.manager.enable_caching:
            self.num_queried_tokens += request.num_tokens
            self.num_hit_tokens += num_hit_tokens
        num_new_tokens = min(chunk, request.num_tokens - num_hit_tokens)
        assert num_new_tokens >= 1
        if self.allocate(request, num_new_tokens, hits, num_hit_tokens):
            self.waiting.remove(request)
            if not self.sample_and_maybe_finish(request):
                self.running.append(request)

    def step(self, pick: int, chunk: int) -> None:
        """One engine step: every running request gets up to `chunk` tokens (a prefill chunk or
        a decode token), starting from the `pick`-th."""
        order = [self.running[(pick + i) % len(self.running)] for i in range(len(self.running))]
        for request in order:
            num_new_tokens = min(chunk, request.num_tokens - request.num_computed_tokens)
            if (self.allocate(request, num_new_tokens, [], request.num_computed_tokens)
                    and self.sample_and_maybe_finish(request)):
                self.running.remove(request)

    def allocate(self, request: Request, num_new_tokens: int, hits: list[KVCacheBlock],
                 num_computed_tokens: int) -> bool:
        before = self.snapshot(request)
        if self.manager.allocate_slots(request, num_new_tokens, hits) is None:
            if self.manager.sliding_window is None:  # else blocks behind it may have gone back
                assert self.snapshot(request) == before
            return False
        blocks = self.manager.req_to_blocks[request.request_id]
        window = self.manager.sliding_window
        if window is not None and num_new_tokens:
            # The first new token's window is held and holds its tokens' KV, a hit's too.
            for position in range(max(num_computed_tokens - window + 1, 0), num_computed_tokens):
                block = blocks[position // self.block_size]
                assert not block.is_null, f"position {position} is in the window but null"
                assert self.slots[block.block_id, position % self.block_size] == tuple(
                    request.all_token_ids[:position + 1])
        for position in range(num_computed_tokens, num_computed_tokens + num_new_tokens):
            block = blocks[position // self.block_size]
            self.slots[block.block_id, position % self.block_size] = tuple(
                request.all_token_ids[:position + 1])
        request.num_computed_tokens = num_computed_tokens + num_new_tokens
        return True

    def sample_and_maybe_finish(self, request: Request) -> bool:
        """After a step that computed every token, append the sampled token (from the same tiny
        alphabet); free the request once it has its output. Returns whether it finished."""
        if request.num_computed_tokens < request.num_tokens:
            return False
        request.append_output_token_ids([sum(request.all_token_ids) % 3])
        if request.num_output_tokens < MAX_OUTPUT_TOKENS:
            return False
        self.manager.free(request)
        return True

    def snapshot(self, request: Request) -> tuple:
        return (ref_cnts(self.manager), self.manager.get_num_free_blocks(),
                dict(self.manager.block_pool.cached_block_hash_to_block),
                self.manager.get_block_ids(request.request_id),
                len(self.manager.block_pool.free_block_queue.get_all_free_blocks()))

    def check_hits(self, request: Request, hits: list[KVCacheBlock], num_hit_tokens: int) -> None:
        assert num_hit_tokens == len(hits) * self.block_size < request.num_tokens
        window = self.manager.sliding_window
        # A windowed hit's null blocks lie wholly before the window of the token at the hit's
        # end (the first it computes); every other block holds the tokens it claims.
        first_seen = 0 if window is None else max(num_hit_tokens - window + 1, 0)
        for position in range(num_hit_tokens):
            block = hits[position // self.block_size]
            if block.is_null:
                assert (position // self.block_size + 1) * self.block_size <= first_seen
                continue
            assert self.slots[block.block_id, position % self.block_size] == tuple(
                request.all_token_ids[:position + 1])

    def abort(self, pick: int) -> None:
        known = self.waiting + self.running
        if not known:
            return
        request = known[pick % len(known)]
        self.manager.free(request)
        (self.waiting if request in self.waiting else self.running).remove(request)

    def preempt(self, pick: int) -> None:
        if not self.running:
            return
        request = self.running.pop(pick % len(self.running))
        self.manager.free(request)
        request.num_computed_tokens = 0
        self.waiting.append(request)

    def finish_all(self) -> None:
        for request in self.waiting + self.running:
            self.manager.free(request)
        self.waiting.clear()
        self.running.clear()


@settings(max_examples=100, deadline=None)
@given(
    num_blocks=st.integers(2, 16),
    block_size=st.sampled_from([1, 2, 4]),
    enable_caching=st.booleans(),
    defer_caching=st.booleans(),
    sliding_window=st.sampled_from([None, 1, 3, 6]),
    operations=st.lists(OPERATION, min_size=30, max_size=80),
)
def test_random_workload_keeps_the_pool_consistent_and_returns_every_block(
    num_blocks: int, block_size: int, enable_caching: bool, defer_caching: bool,
    sliding_window: int | None, operations: list[tuple[str, int, int, list[int]]],
) -> None:
    """Also with deferred caching, and with blocks freed behind a sliding window: every hit
    still holds the tokens it claims (check_hits), a freed block's included."""
    manager = KVCacheManager(num_blocks, block_size, enable_caching,
                             defer_caching=defer_caching, sliding_window=sliding_window)
    workload = Workload(manager)
    for operation in operations:
        workload.apply(*operation)
        manager.check_integrity()
    workload.finish_all()
    manager.check_integrity()
    assert manager.req_to_blocks == {}
    assert manager.get_num_free_blocks() == num_blocks - 1
    assert manager.usage == 0.0
    assert manager.prefix_cache_queries == workload.num_queried_tokens
    assert manager.prefix_cache_hits == workload.num_hit_tokens
    assert manager.reset_prefix_cache() is True


def test_deferred_caching_caches_before_any_lookup_free_or_flush() -> None:
    """defer_caching: allocate_slots only notes the blocks; a later request's lookup (in the
    same step), a free, or flush_pending_cache enters them, as if cached when allocated."""
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, defer_caching=True)
    prompt = list(range(13))  # three full blocks and one token
    first = make_request("a", prompt)
    hits, _ = manager.get_computed_blocks(first)
    assert manager.allocate_slots(first, first.num_tokens, hits) is not None
    assert manager.block_pool.get_cached_block(first.block_hashes[0]) is None
    assert len(first.block_hashes) == 1  # the lookup hashed only as far as it went
    manager.check_integrity()
    # A request admitted after it in the same step finds its blocks.
    second = make_request("b", prompt[:12] + [99])
    hits, num_tokens = manager.get_computed_blocks(second)
    assert num_tokens == 12 and [b.block_id for b in hits] == manager.get_block_ids("a")[:3]
    assert manager.allocate_slots(second, 1, hits) is not None

    third = make_request("c", [50 + i for i in range(9)])
    hits, _ = manager.get_computed_blocks(third)
    assert manager.allocate_slots(third, third.num_tokens, hits) is not None
    manager.flush_pending_cache()
    assert num_hit_tokens(manager, third.all_token_ids + [7]) == 8
    fourth = make_request("d", [80 + i for i in range(5)])
    hits, _ = manager.get_computed_blocks(fourth)
    assert manager.allocate_slots(fourth, fourth.num_tokens, hits) is not None
    manager.free(fourth)  # freed before a flush: its full block was still cached
    assert num_hit_tokens(manager, fourth.all_token_ids) == 4
    for request in (first, second, third):
        manager.free(request)
    manager.check_integrity()
    assert manager.get_num_free_blocks() == 15


def test_lookup_hashes_as_far_as_it_hits() -> None:
    """The lookup computes block hashes in doubling runs while it hits, so a miss at block 0
    hashes one block, and a full hit hashes every block it can use."""
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK_SIZE)
    prompt = list(range(41))  # ten full blocks
    prefill(manager, make_request("a", prompt))
    fresh = make_request("b", [500 + i for i in range(41)])
    assert manager.get_computed_blocks(fresh)[1] == 0
    assert len(fresh.block_hashes) == 1
    again = make_request("c", prompt)
    assert manager.get_computed_blocks(again)[1] == 40
    assert len(again.block_hashes) == 10
    diverging = make_request("d", prompt[:20] + [999] * 21)
    assert manager.get_computed_blocks(diverging)[1] == 20
    assert len(diverging.block_hashes) == 8  # 1, 2, 4, then 8 blocks hashed


# ---- a sliding window (every layer windowed: Mistral, Phi-3) ---------------------------------


def decode(manager: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Append and compute `num_tokens` output tokens one step at a time."""
    for _ in range(num_tokens):
        request.append_output_token_ids([7])
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        manager.check_integrity()


@pytest.mark.parametrize("enable_caching", [True, False])
def test_blocks_behind_the_window_go_back_as_the_request_advances(enable_caching: bool) -> None:
    """Window 6 over blocks of 4: the token at position p needs keys p - 5 .. p, so block i
    (tokens 4i .. 4i + 3) is freed once the next token's position passes 4i + 8; the null
    block (id 0) takes its place in the request's block ids."""
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE,
                             enable_caching=enable_caching, sliding_window=6)
    request = make_request("a", list(range(10)))
    prefill(manager, request)  # 10 tokens in one step: all 3 blocks held for it
    assert manager.num_blocks_held("a") == 3 and manager.peak_blocks_per_request == 3
    decode(manager, request, 1)  # computing position 10: sees 5 .. 10, block 0 is dead
    assert manager.get_block_ids("a")[0] == 0
    assert manager.num_blocks_held("a") == 2
    decode(manager, request, 20)  # to 31 tokens: position 30 sees 25 .. 30 (blocks 6, 7)
    ids = manager.get_block_ids("a")
    assert len(ids) == 8 and ids[:6] == [0] * 6 and 0 not in ids[6:]
    assert manager.num_blocks_held("a") == 2
    assert manager.num_window_freed_blocks_total == 6
    assert manager.peak_blocks_per_request == 3
    manager.free(request)
    manager.check_integrity()
    assert manager.get_num_free_blocks() == 15


def test_a_windowed_hit_needs_only_the_blocks_its_window_sees() -> None:
    """Blocks freed behind the window keep their hashes in the free queue; a hit of L tokens
    needs only the blocks the token at L sees (window 4 over blocks of 4: the one before L),
    null before them, so it survives the pool reusing the chain's first blocks; once the
    window's block goes too, the hit falls to the longest L whose window is still cached."""
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, sliding_window=4)
    prompt = list(range(12))
    first = make_request("a", prompt)
    prefill(manager, first)
    decode(manager, first, 5)  # computing position 16 (sees 13 .. 16): blocks 0 .. 2 freed
    assert manager.get_block_ids("a") == [0, 0, 0, 4, 5]
    probe = make_request("probe", prompt + [7, 7])
    assert [b.block_id for b in manager.get_computed_blocks(probe)[0]] == [0, 0, 3]
    # An unrelated request takes 4 of the 5 free blocks: the 2 never used, then the freed ones
    # in the order freed (tail first among each step's: block 1's, then block 0's).
    other = make_request("b", list(range(100, 116)))
    prefill(manager, other)
    assert [b.block_id for b in manager.get_computed_blocks(probe)[0]] == [0, 0, 3]
    # Past the reused blocks: 16 tokens need block 3 only, which "a" still holds.
    longer = make_request("c", first.all_token_ids + [9])
    hits, num_tokens = manager.get_computed_blocks(longer)
    assert ([b.block_id for b in hits], num_tokens) == ([0, 0, 0, 4], 16)
    # Its new block is the last free one, the prompt's block 2: no L <= 12 has its window.
    assert [b.block_id for b in manager.allocate_slots(longer, 2, hits)] == [3]
    assert manager.get_block_ids("c") == [0, 0, 0, 4, 3] and manager.num_blocks_held("c") == 2
    manager.check_integrity()
    assert manager.get_computed_blocks(probe) == ([], 0)
    for request in (first, other, longer):
        manager.free(request)
        manager.check_integrity()
    assert manager.get_num_free_blocks() == 7


def test_prefix_hits_behind_the_window_are_given_back_at_once() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, sliding_window=5)
    prompt = list(range(17))
    prefill(manager, make_request("a", prompt))
    second = make_request("b", prompt)
    hits, num_tokens = manager.get_computed_blocks(second)
    assert num_tokens == 16  # 4 blocks; the last token is computed
    assert manager.allocate_slots(second, 1, hits) is not None
    # Computing position 16 sees 12 .. 16: blocks 0 .. 2 are dead (3 is the last cached: held).
    assert manager.get_block_ids("b")[:3] == [0, 0, 0]
    assert manager.num_blocks_held("b") == 2
    manager.check_integrity()


def test_a_non_positive_window_is_refused() -> None:
    with pytest.raises(ValueError, match="sliding_window must be >= 1 or None, got 0"):
        KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, sliding_window=0)


@pytest.mark.parametrize("window", [1, 2, 4, 5, 8, 9, 13])
def test_a_windowed_hit_is_the_longest_whose_window_the_rule_says_is_cached(window: int) -> None:
    """Against the window rule itself (a token at p sees keys > p - window): over random sets
    of evicted blocks, the hit is the longest n blocks such that every block holding a key
    the token at n * 4 sees is cached (block n - 1 at least), and exactly those are real."""
    rng = random.Random(window)
    prompt = list(range(6 * BLOCK_SIZE + 1))
    for _ in range(20):
        manager = KVCacheManager(num_blocks=16, block_size=BLOCK_SIZE, sliding_window=window)
        first = make_request("a", prompt)
        prefill(manager, first)
        manager.free(first)
        evicted = {i for i in range(6) if rng.random() < 0.3}
        for i in evicted:
            block = manager.block_pool.get_cached_block(first.block_hashes[i])
            manager.block_pool.cached_block_hash_to_block.pop(block.block_hash).reset_hash()

        def seen_blocks(n: int) -> set[int]:
            end = n * BLOCK_SIZE  # the first token computed
            return {k // BLOCK_SIZE for k in range(max(end - window + 1, 0), end)} | {n - 1}

        want = max((n for n in range(1, 7) if not seen_blocks(n) & evicted), default=0)
        hits, num_tokens = manager.get_computed_blocks(make_request("b", prompt))
        assert num_tokens == want * BLOCK_SIZE, (evicted, [b.block_id for b in hits])
        assert [not b.is_null for b in hits] == [i in seen_blocks(want) for i in range(want)]
        manager.check_integrity()
