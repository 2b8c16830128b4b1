"""The KV cache manager of a hybrid model (Gemma 3): one KVCacheManager per KV cache group over
one shared block pool (the groups: sluice/core/kv_cache_groups.py).

It answers the scheduler as a KVCacheManager does, per group where blocks are concerned:
- `get_computed_blocks`: the longest prefix of L tokens that every group can serve, a global
  group its cached chain from block 0 to L, a windowed group only the window of the token at L
  (null blocks before it): the global groups bound L, the windowed groups shrink it in turn
  until none does (vLLM's hybrid coordinator), so the global groups' hit survives a windowed
  group's evicted first blocks;
- `allocate_slots`: each windowed group first gives back the blocks behind its window, then
  every group's blocks for the step are taken at once, or none (None: too few free);
- `block_ids_of` / `get_block_ids` + `get_group_block_ids`: group 0's ids where a step message
  has always carried them, the other groups' beside them;
- `free`, `cache_blocks`, `flush_pending_cache`: every group.
Each group keys its prefix cache by (group, hash) (BlockPool), so a hit is always one of the
group's own blocks. The counters (`num_blocks_held`, peaks, blocks freed behind windows) count
every group's blocks: they are what the pool holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from sluice.core.block_pool import BlockPool
from sluice.core.kv_cache_groups import KVCacheGroups
from sluice.core.kv_cache_manager import KVCacheManager, check_allocation_args, num_null_blocks
from sluice.core.kv_cache_utils import KVCacheBlock, sha256_hash

if TYPE_CHECKING:
    from sluice.core.request import Request


class HybridKVCacheManager:
    # One group's window: none (the per-group windows are in `groups`).
    sliding_window = None

    def __init__(
        self,
        groups: KVCacheGroups,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_fn: Callable[[bytes], bytes] = sha256_hash,
        defer_caching: bool = False,
    ) -> None:
        if groups.num_groups < 2:
            raise ValueError(f"a hybrid KV cache needs 2 groups or more, got {groups.num_groups}")
        self.groups = groups
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, hash_fn)
        self.managers = [
            KVCacheManager(num_blocks, block_size, enable_caching, hash_fn, defer_caching,
                           sliding_window=window, block_pool=self.block_pool, group=group)
            for group, window in enumerate(groups.windows)]
        self._windowed = [m for m in self.managers if m.sliding_window is not None]
        self._global = [m for m in self.managers if m.sliding_window is None]
        self._first = self.managers[0]
        # Group 0's, which every group's mirrors (the same requests, as many blocks each).
        self.req_to_blocks = self._first.req_to_blocks
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.peak_blocks_in_use = 0
        self.peak_blocks_per_request = 0

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_window_freed_blocks_total(self) -> int:
        return sum(m.num_window_freed_blocks_total for m in self._windowed)

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_num_blocks_in_use(self) -> int:
        return self.block_pool.num_blocks - 1 - self.block_pool.get_num_free_blocks()

    def num_blocks_held(self, request_id: str) -> int:
        return sum(m.num_blocks_held(request_id) for m in self.managers)

    def update_block_hashes(self, request: Request, max_blocks: int | None = None) -> None:
        self._first.update_block_hashes(request, max_blocks)

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """Per group, the blocks of the longest prefix every group can serve (a windowed
        group's first ones null); its tokens."""
        self.flush_pending_cache()
        if not self.enable_caching or request.skip_prefix_cache:
            return [[] for _ in self.managers], 0
        num_hits = (request.num_tokens - 1) // self.block_size
        hits: dict[int, list[KVCacheBlock]] = {}
        # A global group's hit holds at every shorter length: one walk each bounds the hit.
        for manager in self._global:
            hits[manager.group] = manager.find_cached_prefix(request, num_hits)
            num_hits = len(hits[manager.group])
        # A windowed group's longest hit up to a bound may be shorter, and a shorter bound
        # may undo another windowed group's hit: shrink until a pass leaves it unchanged.
        bound = None
        while bound != num_hits:
            bound = num_hits
            for manager in self._windowed:
                hits[manager.group] = manager.find_cached_prefix(request, num_hits)
                num_hits = len(hits[manager.group])
        hits = [hits[manager.group][:num_hits] for manager in self.managers]
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hits * self.block_size
        return hits, num_hits * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[list[KVCacheBlock]] | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[list[KVCacheBlock]] | None:
        """KVCacheManager.allocate_slots for every group at once: per group its new blocks, or
        None (nothing taken, but blocks behind the windows given back) if too few are free."""
        check_allocation_args(num_new_tokens, num_lookahead_tokens, num_external_computed_tokens)
        for manager in self._windowed:
            manager.free_behind_window(request)
        hits = new_computed_blocks or [[] for _ in self.managers]
        if (not hits[0] and not num_lookahead_tokens and not num_external_computed_tokens
                and not delay_cache_blocks and self._first.fits_last_block(request,
                                                                           num_new_tokens)):
            # Every group holds as many blocks, as many cached: one group answers for all.
            return [[] for _ in self.managers]
        needed = sum(manager.num_blocks_needed(request, num_new_tokens, group_hits,
                                               num_lookahead_tokens,
                                               num_external_computed_tokens)
                     for manager, group_hits in zip(self.managers, hits))
        if needed > self.block_pool.get_num_free_blocks():
            return None
        # Every group's hits out of the free queue before any group takes new blocks, which
        # would otherwise evict another group's hits.
        for group_hits in hits:
            self.block_pool.touch(group_hits[num_null_blocks(group_hits):])
        new_blocks = [manager.take_blocks(request, num_new_tokens, group_hits,
                                          num_lookahead_tokens, num_external_computed_tokens,
                                          delay_cache_blocks, hits_touched=True)
                      for manager, group_hits in zip(self.managers, hits)]
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.get_num_blocks_in_use())
        self.peak_blocks_per_request = max(self.peak_blocks_per_request,
                                           self.num_blocks_held(request.request_id))
        return new_blocks

    def block_ids_of(self, new_blocks: list[list[KVCacheBlock]]
                     ) -> tuple[list[int], list[list[int]]]:
        """allocate_slots' blocks as the step message carries them: group 0's ids, the other
        groups' ids."""
        ids = [[block.block_id for block in blocks] for blocks in new_blocks]
        return ids[0], ids[1:]

    def get_block_ids(self, request_id: str) -> list[int]:
        return self._first.get_block_ids(request_id)

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """Block ids of the request's groups 1.. (0 for blocks freed behind a window)."""
        return [manager.get_block_ids(request_id) for manager in self.managers[1:]]

    def flush_pending_cache(self) -> None:
        for manager in self.managers:
            manager.flush_pending_cache()

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        for manager in self.managers:
            manager.cache_blocks(request, num_tokens)

    def free(self, request: Request) -> None:
        for manager in self.managers:
            manager.free(request)

    def reset_prefix_cache(self) -> bool:
        self.flush_pending_cache()
        return self.block_pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Pool invariants, every group's, and: the groups' blocks account for every
        reference."""
        self.block_pool.check_integrity()
        num_pairs = sum(manager.check_requests() for manager in self.managers)
        num_refs = sum(block.ref_cnt for block in self.block_pool.blocks)
        assert num_refs == num_pairs, (
            f"ref counts sum to {num_refs} but the groups' requests hold {num_pairs} "
            f"(request, block) pairs")
        owner: dict[int, int] = {}
        for manager in self.managers:
            assert manager.req_to_blocks.keys() == self.req_to_blocks.keys(), (
                f"group {manager.group} holds blocks of other requests than group 0")
            for blocks in manager.req_to_blocks.values():
                for block in blocks:
                    if block.is_null:
                        continue
                    group = owner.setdefault(block.block_id, manager.group)
                    assert group == manager.group, (
                        f"block {block.block_id} is held by groups {group} and {manager.group}")
