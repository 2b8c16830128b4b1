"""Which KV blocks each request owns: prefix-cache lookup, slot allocation, freeing.

Per request: `get_computed_blocks` (once, before first scheduling or after preemption) finds the
cached prefix; `allocate_slots` (every step it is scheduled) takes those hits and enough new blocks
for the step's tokens, or returns None without changing anything; `free` returns every block,
tail first. Full blocks enter the prefix cache as soon as their tokens are scheduled, in prefill
and in decode alike, except blocks a KV connector loads into: those are allocated with
`delay_cache_blocks` and cached by `cache_blocks` once the load is known to be good (a failed
load must never be served to another request as a prefix hit).

With `defer_caching` (the engine's, without a KV connector), `allocate_slots` only notes the
blocks to cache; they enter the prefix cache at the next `flush_pending_cache`, which the engine
calls right after it hands the step to the device, and which every lookup (`get_computed_blocks`)
and every `free` and `schedule` does first. So the chained hashes of a new prompt's blocks (64
sha256 calls for 1,024 tokens, 0.25 ms on an H100 host) are computed while the device runs the
step rather than before it starts, and a request admitted later in the same step still finds the
blocks of one admitted before it. The lookup hashes only as far as it hits.

With `sliding_window` (a model whose every layer attends in a window of that many positions,
given by the engine only where nothing else reads a request's older blocks), a block wholly
before the window of the request's next token is of no use to it: each `allocate_slots` returns
those blocks to the pool and leaves the null block in their place, so `get_block_ids` keeps its
positions and the attention kernels, which start at the window, never read the entry. A freed
block keeps its hash in the free queue (evictable, a prefix hit for another request until
evicted), and only blocks already cached, not the last of them, are freed, so the next block
cached finds its parent held. A prefix hit of L tokens needs only the blocks the token at L
sees (`find_window_hit`): the last ceil((window - 1) / block_size) before L, at least one,
all of them when L is shorter; the blocks before them are the null block in the hit, as if
freed behind the window. Without a window the lookup walks from block 0 to the first miss.

A hybrid model (Gemma 3) runs one manager per KV cache group over a shared pool
(`block_pool`, `group`): sluice/core/hybrid_kv_cache_manager.py, which calls the steps of
`allocate_slots` (`free_behind_window`, `fits_last_block`, `num_blocks_needed`,
`take_blocks`) for every group at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from sluice.core.block_pool import BlockPool
from sluice.core.kv_cache_utils import KVCacheBlock, hash_blocks, sha256_hash

if TYPE_CHECKING:
    from sluice.core.request import Request


def num_null_blocks(hits: list[KVCacheBlock]) -> int:
    """How many of a prefix hit's first blocks are the null block (a windowed group's hit:
    the blocks before its window)."""
    num_null = 0
    while num_null < len(hits) and hits[num_null].is_null:
        num_null += 1
    return num_null


def check_allocation_args(num_new_tokens: int, num_lookahead_tokens: int,
                          num_external_computed_tokens: int) -> None:
    if num_new_tokens < 0:
        raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
    if num_lookahead_tokens < 0:
        raise ValueError(f"num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}")
    if num_external_computed_tokens < 0:
        raise ValueError(f"num_external_computed_tokens must be >= 0, "
                         f"got {num_external_computed_tokens}")


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_fn: Callable[[bytes], bytes] = sha256_hash,
        defer_caching: bool = False,
        sliding_window: int | None = None,
        block_pool: BlockPool | None = None,
        group: int = 0,
    ) -> None:
        """block_pool, group: a pool shared with the other KV cache groups of a hybrid model
        and this manager's group in it (HybridKVCacheManager); by default a pool of its own."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        # A token at position p needs the keys at positions > p - sliding_window only.
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        self.block_pool = (block_pool if block_pool is not None
                           else BlockPool(num_blocks, enable_caching, hash_fn))
        self.group = group
        # Blocks of each request, in token order: block i holds tokens [i*bs, (i+1)*bs).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the prefix cache (or skipped).
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache hit rate, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.defer_caching = defer_caching
        # defer_caching: request id -> (request, its tokens whose full blocks to cache).
        self._pending_cache: dict[str, tuple[Request, int]] = {}
        # sliding_window: how many leading blocks of each request were freed (null in
        # req_to_blocks), and the count freed so far over all requests.
        self.num_freed_blocks: dict[str, int] = {}
        self.num_window_freed_blocks_total = 0
        # The most blocks in use at once and held by one request, since the start.
        self.peak_blocks_in_use = 0
        self.peak_blocks_per_request = 0

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_num_blocks_in_use(self) -> int:
        """Blocks some request holds (the null block left out)."""
        return self.block_pool.num_blocks - 1 - self.block_pool.get_num_free_blocks()

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks `request_id` holds now (its freed ones, behind a window, not counted)."""
        blocks = self.req_to_blocks.get(request_id, ())
        return len(blocks) - self.num_freed_blocks.get(request_id, 0)

    def update_block_hashes(self, request: Request, max_blocks: int | None = None) -> None:
        """Extend request.block_hashes to cover every full block of its tokens (the first
        `max_blocks` at most)."""
        block_hashes = request.block_hashes
        num_full_blocks = request.num_tokens // self.block_size
        if max_blocks is not None:
            num_full_blocks = min(num_full_blocks, max_blocks)
        if len(block_hashes) >= num_full_blocks:
            return
        start = len(block_hashes) * self.block_size
        parent = block_hashes[-1].hash_value if block_hashes else None
        block_hashes += hash_blocks(
            self.hash_fn, parent,
            request.all_token_ids[start:num_full_blocks * self.block_size], self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of `request` (hit blocks, hit tokens); does not take refs.

        The last token is never a hit: its logits are needed, so it is always computed.
        """
        self.flush_pending_cache()  # blocks of requests scheduled before this one
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        hits = self.find_cached_prefix(request, (request.num_tokens - 1) // self.block_size)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hits, num_hit_tokens

    def find_cached_prefix(self, request: Request, max_hit_blocks: int) -> list[KVCacheBlock]:
        """The longest prefix hit of this manager's group, `max_hit_blocks` at most: without a
        window the cached blocks matching the request's first blocks (a walk from block 0 to
        the first miss); with one, find_window_hit's."""
        if self.sliding_window is not None:
            return self.find_window_hit(request, max_hit_blocks)
        hits: list[KVCacheBlock] = []
        for i in range(max(0, max_hit_blocks)):
            if i == len(request.block_hashes):
                # Hashed as far as the lookup goes, twice as far each time it runs out.
                self.update_block_hashes(request, max(2 * i, 1))
            block = self.block_pool.get_cached_block(request.block_hashes[i], self.group)
            if block is None:
                break
            # The key compares tokens, not what came before them: check the block was cached
            # right after the block matched before it (what a hash collision could fake).
            expected_parent = (hits[-1].block_id, hits[-1].generation) if hits else None
            if block.parent != expected_parent:
                break
            hits.append(block)
        return hits

    def find_window_hit(self, request: Request, max_hit_blocks: int) -> list[KVCacheBlock]:
        """The longest hit of n <= max_hit_blocks blocks whose window is cached: the token at
        position L = n * block_size sees keys > L - window, in blocks
        (L - window + 1) // block_size .. n - 1, the last ceil((window - 1) / block_size) (at
        least one: the next block cached names it as parent; all n when fewer). Those must be
        this group's cached blocks, each cached right after the one before it; the blocks
        before them are the null block in the hit (no kernel reads them), as if freed behind
        the window. The run's first block is trusted on its chained hash (sha256 over every
        token before it); at block 0 it must have been cached as a root.

        Searched from the top down (vLLM's SlidingWindowManager), so the prompt's full blocks
        up to max_hit_blocks are hashed at once (caching them would hash them anyway)."""
        if max_hit_blocks <= 0:
            return []
        self.update_block_hashes(request, max_hit_blocks)
        num_window_blocks = max(1, -(-(self.sliding_window - 1) // self.block_size))
        run: list[KVCacheBlock] = []  # cached blocks from position i up, the highest first
        for i in range(max_hit_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(request.block_hashes[i], self.group)
            if block is None or (i == 0 and block.parent is not None):
                run.clear()
                continue
            if run and run[-1].parent != (block.block_id, block.generation):
                run.clear()  # the block above was cached after another block: a new run
            run.append(block)
            if len(run) == num_window_blocks or i == 0:
                return [self.block_pool.null_block] * i + run[::-1]
        return []

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` (+ lookahead) after the computed and hit tokens, and
        the `num_external_computed_tokens` a KV connector loads between the two.

        Returns the newly allocated blocks, or None (and changes nothing, but for giving back
        blocks behind a sliding window, which the request can never read again) if too few
        are free. `delay_cache_blocks`: enter none of the new blocks into the prefix cache now.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0 or num_external_computed_tokens < 0:
            check_allocation_args(num_new_tokens, num_lookahead_tokens,
                                  num_external_computed_tokens)
        request_id = request.request_id
        if self.sliding_window is not None:
            self._free_blocks_behind_window(request_id, request.num_computed_tokens)
        if (not new_computed_blocks and not num_lookahead_tokens
                and not num_external_computed_tokens and not delay_cache_blocks):
            # The common decode step (fits_last_block, inline: it runs for every request of
            # every step).
            end = request.num_computed_tokens + num_new_tokens
            if (end <= len(self.req_to_blocks.get(request_id, ())) * self.block_size
                    and (not self.enable_caching or min(end, request.num_tokens)
                         // self.block_size <= self.num_cached_blocks.get(request_id, 0))):
                return []
        new_computed_blocks = new_computed_blocks or []
        num_needed = self.num_blocks_needed(request, num_new_tokens, new_computed_blocks,
                                            num_lookahead_tokens, num_external_computed_tokens)
        if num_needed > self.block_pool.get_num_free_blocks():
            return None
        return self.take_blocks(request, num_new_tokens, new_computed_blocks,
                                num_lookahead_tokens, num_external_computed_tokens,
                                delay_cache_blocks)

    # The steps of allocate_slots, which a HybridKVCacheManager runs for every group.

    def free_behind_window(self, request: Request) -> None:
        """Give back the request's blocks the window of its next token no longer sees."""
        self._free_blocks_behind_window(request.request_id, request.num_computed_tokens)

    def fits_last_block(self, request: Request, num_new_tokens: int) -> bool:
        """The common decode step: the tokens fit the blocks held and complete none to cache."""
        request_id = request.request_id
        end = request.num_computed_tokens + num_new_tokens
        return (end <= len(self.req_to_blocks.get(request_id, ())) * self.block_size
                and (not self.enable_caching or min(end, request.num_tokens)
                     // self.block_size <= self.num_cached_blocks.get(request_id, 0)))

    def num_blocks_needed(self, request: Request, num_new_tokens: int,
                          new_computed_blocks: list[KVCacheBlock], num_lookahead_tokens: int,
                          num_external_computed_tokens: int) -> int:
        """Free blocks `take_blocks` would take out of the pool: new ones, and hits with ref 0
        (they sit in the free queue)."""
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id, [])
        assert not (blocks and new_computed_blocks), (
            f"request {request_id} already owns blocks; prefix hits come only before them")
        assert len(blocks) * self.block_size >= request.num_computed_tokens, (
            f"request {request_id} has {request.num_computed_tokens} computed tokens but "
            f"{len(blocks)} blocks (num_computed_tokens not reset after free?)")
        _, num_new_blocks = self._extent(request, num_new_tokens, new_computed_blocks,
                                         num_lookahead_tokens, num_external_computed_tokens)
        return num_new_blocks + sum(1 for block in new_computed_blocks
                                    if block.ref_cnt == 0 and not block.is_null)

    def _extent(self, request: Request, num_new_tokens: int,
                new_computed_blocks: list[KVCacheBlock], num_lookahead_tokens: int,
                num_external_computed_tokens: int) -> tuple[int, int]:
        """(tokens computed once the hits and the loaded tokens count, new blocks the step
        needs)."""
        num_computed_tokens = (request.num_computed_tokens
                               + len(new_computed_blocks) * self.block_size
                               + num_external_computed_tokens)
        num_required_blocks = -(-(num_computed_tokens + num_new_tokens + num_lookahead_tokens)
                                // self.block_size)
        num_held = len(self.req_to_blocks.get(request.request_id, ()))
        return (num_computed_tokens,
                max(0, num_required_blocks - num_held - len(new_computed_blocks)))

    def take_blocks(self, request: Request, num_new_tokens: int,
                    new_computed_blocks: list[KVCacheBlock], num_lookahead_tokens: int,
                    num_external_computed_tokens: int, delay_cache_blocks: bool,
                    hits_touched: bool = False) -> list[KVCacheBlock]:
        """allocate_slots once the pool is known to have the blocks: the new blocks.
        hits_touched: the caller took the hits' references already (every group's hits before
        any group allocates, so that no group's new blocks evict another group's hits)."""
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id, [])
        num_computed_tokens, num_new_blocks = self._extent(
            request, num_new_tokens, new_computed_blocks, num_lookahead_tokens,
            num_external_computed_tokens)
        # A windowed hit's first blocks are the null block (behind its window): none held.
        num_null_hits = num_null_blocks(new_computed_blocks)
        # Touch before allocating, so that get_new_blocks cannot evict the hits.
        if not hits_touched:
            self.block_pool.touch(new_computed_blocks[num_null_hits:])
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks = self.req_to_blocks.setdefault(request_id, blocks)
        if num_null_hits:
            self.num_freed_blocks[request_id] = num_null_hits
        blocks.extend(new_computed_blocks)
        blocks.extend(new_blocks)
        if not self.enable_caching:
            if self.sliding_window is not None:
                self._free_blocks_behind_window(request_id, num_computed_tokens)
            self._note_peaks(request_id)
            return new_blocks

        # Hits are cached already; lookahead (speculative) slots hold no known tokens yet.
        self.num_cached_blocks[request_id] = max(self.num_cached_blocks.get(request_id, 0),
                                                 len(new_computed_blocks))
        if self.sliding_window is not None and new_computed_blocks:
            # Hits behind the window of the first token computed: back at once.
            self._free_blocks_behind_window(request_id, num_computed_tokens)
        self._note_peaks(request_id)
        if delay_cache_blocks:
            return new_blocks
        if self.defer_caching:
            _, pending = self._pending_cache.get(request_id, (request, 0))
            self._pending_cache[request_id] = (
                request, max(pending, num_computed_tokens + num_new_tokens))
        else:
            self.cache_blocks(request, num_computed_tokens + num_new_tokens)
        return new_blocks

    def _free_blocks_behind_window(self, request_id: str, num_computed_tokens: int) -> None:
        """Return the request's blocks wholly before the window of its token at position
        `num_computed_tokens` (the next computed), tail first among them; the null block
        stands in their place. With caching, only cached blocks but the last are freed: a
        block is never freed before its tokens' KV is cached, and the next block cached names
        a parent still held."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        num_dead = max(num_computed_tokens - self.sliding_window + 1, 0) // self.block_size
        if self.enable_caching:
            num_dead = min(num_dead, self.num_cached_blocks.get(request_id, 0) - 1)
        num_freed = self.num_freed_blocks.get(request_id, 0)
        if num_dead <= num_freed:
            return
        dead = blocks[num_freed:num_dead]
        blocks[num_freed:num_dead] = [self.block_pool.null_block] * len(dead)
        self.num_freed_blocks[request_id] = num_dead
        self.num_window_freed_blocks_total += len(dead)
        self.block_pool.free_blocks(reversed(dead))

    def _note_peaks(self, request_id: str) -> None:
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.get_num_blocks_in_use())
        self.peak_blocks_per_request = max(self.peak_blocks_per_request,
                                           self.num_blocks_held(request_id))

    def flush_pending_cache(self) -> None:
        """Cache the blocks `allocate_slots` left for later (defer_caching)."""
        if not self._pending_cache:
            return
        pending, self._pending_cache = self._pending_cache, {}
        for request, num_tokens in pending.values():
            self.cache_blocks(request, num_tokens)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Enter the full blocks among the request's first `num_tokens` tokens into the prefix
        cache (their KV is computed or scheduled). Only known tokens count: drafts of
        speculative decoding enter once verified (the scheduler calls this after verification)."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        num_cached_blocks = self.num_cached_blocks.get(request_id, 0)
        num_full_blocks = min(num_tokens, request.num_tokens) // self.block_size
        if num_full_blocks > num_cached_blocks:
            self.update_block_hashes(request)
            self.block_pool.cache_full_blocks(request, self.req_to_blocks[request_id],
                                              num_cached_blocks, num_full_blocks, self.group)
            self.num_cached_blocks[request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Return every block of `request`, tail first so its chain is evicted leaf first."""
        pending = self._pending_cache.pop(request.request_id, None)
        if pending is not None:
            self.cache_blocks(request, pending[1])  # as if cached when allocated
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.num_freed_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def block_ids_of(self, new_blocks: list[KVCacheBlock]) -> tuple[list[int], list[list[int]]]:
        """allocate_slots' blocks as the step message carries them: (ids, the other groups'
        ids: none here)."""
        return [block.block_id for block in new_blocks], []

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """Block ids of the request's other KV cache groups (none: one group)."""
        return []

    def get_block_ids(self, request_id: str) -> list[int]:
        """Block ids of the request in token order ([] for a request without blocks); 0 (the
        null block) for blocks freed behind a sliding window."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        self.flush_pending_cache()
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants, plus: the requests' blocks account for every reference."""
        self.block_pool.check_integrity()
        num_pairs = self.check_requests()
        num_refs = sum(block.ref_cnt for block in self.block_pool.blocks)
        assert num_refs == num_pairs, (
            f"ref counts sum to {num_refs} but requests hold {num_pairs} (request, block) pairs")

    def check_requests(self) -> int:
        """This manager's per-request invariants; returns the (request, block) pairs held."""
        assert self._pending_cache.keys() <= self.req_to_blocks.keys(), (
            f"blocks to cache for requests without blocks: "
            f"{sorted(self._pending_cache.keys() - self.req_to_blocks.keys())}")
        assert self.num_freed_blocks.keys() <= self.req_to_blocks.keys(), (
            f"freed blocks noted for requests without blocks: "
            f"{sorted(self.num_freed_blocks.keys() - self.req_to_blocks.keys())}")
        num_pairs = 0
        for request_id, all_blocks in self.req_to_blocks.items():
            num_freed = self.num_freed_blocks.get(request_id, 0)
            assert all(block.is_null for block in all_blocks[:num_freed]), (
                f"request {request_id}'s first {num_freed} blocks were freed but one is held")
            blocks = all_blocks[num_freed:]
            assert len({id(block) for block in blocks}) == len(blocks), (
                f"request {request_id} holds a block twice")
            for block in blocks:
                assert not block.is_null, f"request {request_id} holds the null block"
                assert block.ref_cnt >= 1, (
                    f"request {request_id} holds block {block.block_id} with ref_cnt "
                    f"{block.ref_cnt}")
            num_cached = self.num_cached_blocks.get(request_id, 0)
            assert num_cached <= len(all_blocks), (
                f"request {request_id} has more cached blocks than blocks")
            assert num_freed == 0 or self.sliding_window is not None, (
                f"request {request_id} has null blocks but group {self.group} has no window")
            # The last cached block is held: the next block cached names it as its parent.
            assert not self.enable_caching or num_freed == 0 or num_freed < num_cached, (
                f"request {request_id}'s first {num_freed} blocks are null but only "
                f"{num_cached} are cached")
            num_pairs += len(blocks)
        return num_pairs
