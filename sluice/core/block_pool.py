"""The pool of KV blocks: ref counts, the prefix-cache map, and the LRU queue of free blocks.

Lifecycle of a block: free and uncached -> allocated (`get_new_blocks`, ref 1) -> cached once
full (`cache_full_blocks`) -> shared by prefix hits (`touch`, ref + 1) -> freed (`free_blocks`,
ref 0: back in the free queue, still cached) -> either hit again (`touch` takes it out of the
queue) or evicted when it reaches the front of the queue and is reallocated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from sluice.core.kv_cache_utils import (
    BlockHash,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    sha256_hash,
)

if TYPE_CHECKING:
    from sluice.core.request import Request

# A prefix-cache key: a block's hash in group 0, (group, hash) in another group.
CacheKey = BlockHash | tuple[int, BlockHash]


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool,
        hash_fn: Callable[[bytes], bytes] = sha256_hash,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the reserved null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # Keyed by the hash (group 0) or (group, hash); a cached block's block_hash is its key.
        self.cached_block_hash_to_block: dict[CacheKey, KVCacheBlock] = {}

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(
            block_hash if group == 0 else (group, block_hash))

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        group: int = 0,
    ) -> None:
        """Enter blocks[num_cached_blocks:num_full_blocks] of `request` (its blocks of KV cache
        group `group`) into the prefix cache."""
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        assert len(request.block_hashes) >= num_full_blocks, (
            f"request {request.request_id} has {len(request.block_hashes)} block hashes, "
            f"needs {num_full_blocks}")
        assert len(blocks) >= num_full_blocks
        cache = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], request.block_hashes[i]
            if group:
                block_hash = (group, block_hash)
            if block.block_hash is not None:
                # A prefix-cache hit: already cached under this very hash.
                assert block.block_hash == block_hash, (
                    f"block {block.block_id} is cached under another hash")
                continue
            # Another block already holds this content: keep that one, this one stays uncached.
            if block_hash not in cache:
                block.block_hash = block_hash
                if i > 0:
                    block.parent = (blocks[i - 1].block_id, blocks[i - 1].generation)
                cache[block_hash] = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take the `num_blocks` least recently freed blocks, evicting their cached content."""
        num_free = self.free_block_queue.num_free_blocks
        if not 0 <= num_blocks <= num_free:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: must be in [0, {num_free}] "
                f"(the number of free blocks)")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            if block.block_hash is not None:
                evicted = self.cached_block_hash_to_block.pop(block.block_hash)
                assert evicted is block, f"map entry of block {block.block_id} names another block"
                block.reset_hash()
            block.parent = None
            block.generation += 1
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free hit leaves the free queue."""
        for block in blocks:
            assert not block.is_null, "the null block cannot be touched"
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; blocks left unreferenced join the free queue in the
        order given (front = evicted first), keeping their cached content until evicted."""
        for block in ordered_blocks:
            if block.is_null:
                continue
            assert block.ref_cnt > 0, f"block {block.block_id} freed with ref_cnt {block.ref_cnt}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) in use."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Only possible when no block is in use."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.reset_hash()
        self.cached_block_hash_to_block.clear()
        return True

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant of ref counts, queue or map."""
        null = self.null_block
        assert null.is_null and null.ref_cnt == 0 and null.block_hash is None, (
            f"null block changed: {null}")
        assert null.prev_free_block is None and null.next_free_block is None, (
            "null block is in the free queue")
        in_queue = self.free_block_queue.check_links(max_len=self.num_blocks - 1)
        queued_ids = {id(block) for block in in_queue}
        assert len(queued_ids) == len(in_queue), "a block is in the free queue more than once"
        for block in self.blocks[1:]:
            assert not block.is_null, f"block {block.block_id} is marked null"
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            queued = id(block) in queued_ids
            if block.ref_cnt == 0:
                assert queued, f"block {block.block_id} has ref_cnt 0 but is not in the free queue"
            else:
                assert not queued, (
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but is in the free queue")
                assert block.prev_free_block is None and block.next_free_block is None, (
                    f"used block {block.block_id} still has free-queue links")
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, (
                    f"block {block.block_id} has a hash but the map does not point to it")
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, (
                f"map entry for block {block.block_id} does not match the block's hash")
            assert not block.is_null, "the null block is in the prefix-cache map"
            assert self.blocks[block.block_id] is block, (
                f"map entry names block {block.block_id}, which is not this pool's")
        if not self.enable_caching:
            assert not self.cached_block_hash_to_block, "caching is off but the map is not empty"
