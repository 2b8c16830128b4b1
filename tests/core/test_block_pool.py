"""Block pool: LRU eviction, hash eviction, ref counts, the null block, integrity checks."""

from __future__ import annotations

import hashlib
import struct

import pytest

from sluice.core.block_pool import BlockPool
from sluice.core.kv_cache_utils import (
    NONE_HASH,
    BlockHash,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    hash_block_tokens,
    hash_blocks,
    sha256_hash,
)
from sluice.core.request import Request
from sluice.sampling_params import SamplingParams

BLOCK_SIZE = 2


def make_request(request_id: str, token_ids: list[int]) -> Request:
    """A request whose block_hashes cover its full blocks of BLOCK_SIZE tokens."""
    request = Request(request_id, token_ids, SamplingParams(temperature=0.0))
    parent = None
    for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        block_hash = hash_block_tokens(sha256_hash, parent, token_ids[start:start + BLOCK_SIZE])
        request.block_hashes.append(block_hash)
        parent = block_hash.hash_value
    return request


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


# ----------------------------------------------------------------------------- hashing


def test_block_hash_is_sha256_of_parent_and_int64_le_tokens() -> None:
    block_hash = hash_block_tokens(sha256_hash, None, [1, 2, 300])
    expected = hashlib.sha256(NONE_HASH + struct.pack("<3q", 1, 2, 300)).digest()
    assert block_hash == BlockHash(expected, (1, 2, 300), None)
    child = hash_block_tokens(sha256_hash, block_hash.hash_value, [7])
    assert child.hash_value == hashlib.sha256(expected + struct.pack("<q", 7)).digest()


def test_block_hash_depends_on_parent_tokens_and_extra_keys() -> None:
    base = hash_block_tokens(sha256_hash, None, [1, 2])
    assert hash_block_tokens(sha256_hash, None, [1, 2]) == base
    assert hash_block_tokens(sha256_hash, b"p" * 32, [1, 2]).hash_value != base.hash_value
    assert hash_block_tokens(sha256_hash, None, [2, 1]).hash_value != base.hash_value
    with_extra = hash_block_tokens(sha256_hash, None, [1, 2], ("lora-a", 3))
    assert with_extra.hash_value != base.hash_value
    assert with_extra.extra_keys == ("lora-a", 3)
    assert hash_block_tokens(sha256_hash, None, [1, 2], ("lora-b", 3)) != with_extra
    assert hash_block_tokens(sha256_hash, None, [1, 2], ("lora-a", 3)) == with_extra
    # "3" (a string) and 3 (an int) are distinct keys.
    assert hash_block_tokens(sha256_hash, None, [1, 2], ("lora-a", "3")) != with_extra


def test_block_hash_equality_compares_tokens_not_only_the_digest() -> None:
    a = BlockHash(b"\0" * 32, (1, 2), None)
    b = BlockHash(b"\0" * 32, (1, 3), None)
    assert hash(a) == hash(b)
    assert a != b
    assert {a: "a"}.get(b) is None


@pytest.mark.parametrize("extra_keys", [None, ("lora-a", 3)])
@pytest.mark.parametrize("parent", [None, b"p" * 32])
def test_hash_blocks_chains_hash_block_tokens(parent, extra_keys) -> None:
    """The batched form gives each full block's hash_block_tokens, chained from `parent`;
    a partial last block gets none."""
    token_ids = [(i * 7919) % 151_936 for i in range(37)]
    expected, previous = [], parent
    for start in range(0, 36, 4):
        block_hash = hash_block_tokens(sha256_hash, previous, token_ids[start:start + 4],
                                       extra_keys)
        expected.append(block_hash)
        previous = block_hash.hash_value
    assert hash_blocks(sha256_hash, parent, token_ids, 4, extra_keys) == expected
    assert hash_blocks(sha256_hash, parent, token_ids[:3], 4, extra_keys) == []


def test_unsupported_extra_key_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="extra_keys items must be .* got object"):
        hash_block_tokens(sha256_hash, None, [1], (object(),))


# ----------------------------------------------------------------------------- free queue


def test_free_queue_order_remove_and_append() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 5
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue.get_all_free_blocks()) == [1, 3]
    queue.append(blocks[4])
    queue.append_n([blocks[0], blocks[2]])
    assert ids(queue.get_all_free_blocks()) == [1, 3, 4, 0, 2]
    assert queue.popleft().block_id == 1
    assert ids(queue.popleft_n(2)) == [3, 4]
    assert queue.num_free_blocks == 2
    assert ids(queue.check_links(max_len=5)) == [0, 2]
    assert ids(queue.popleft_n(2)) == [0, 2]
    assert queue.get_all_free_blocks() == []
    assert blocks[1].prev_free_block is None and blocks[1].next_free_block is None


def test_free_queue_errors() -> None:
    block = KVCacheBlock(7)
    queue = FreeKVCacheBlockQueue([])
    with pytest.raises(ValueError, match="free block queue is empty"):
        queue.popleft()
    with pytest.raises(ValueError, match=r"cannot pop 1 blocks: must be in \[0, 0\]"):
        queue.popleft_n(1)
    with pytest.raises(ValueError, match="block 7 is not in the free block queue"):
        queue.remove(block)
    queue.append(block)
    with pytest.raises(ValueError, match="block 7 is already in the free block queue"):
        queue.append(block)


# ----------------------------------------------------------------------------- pool


def test_null_block_is_reserved_and_never_allocated() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 3
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError, match=r"cannot allocate 1 blocks: must be in \[0, 0\]"):
        pool.get_new_blocks(1)
    # Freeing the null block (e.g. padding in a block table) is a no-op.
    pool.free_blocks([pool.null_block])
    assert pool.get_num_free_blocks() == 0
    pool.check_integrity()


def test_num_blocks_below_two_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 2 .* got 1"):
        BlockPool(num_blocks=1, enable_caching=True)


def test_negative_allocation_is_a_value_error() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    with pytest.raises(ValueError, match=r"cannot allocate -1 blocks: must be in \[0, 2\]"):
        pool.get_new_blocks(-1)


def test_blocks_freed_earlier_are_evicted_first() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    b1, b2, b3, b4 = pool.get_new_blocks(4)
    pool.free_blocks([b3])
    pool.free_blocks([b1, b4])
    pool.free_blocks([b2])
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 1, 4, 2]
    assert ids(pool.get_new_blocks(2)) == [3, 1]
    assert ids(pool.get_new_blocks(2)) == [4, 2]
    pool.check_integrity()


def test_touched_block_leaves_the_free_queue() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    request = make_request("a", [1, 2, 3, 4, 5, 6])
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, 0, 3)
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == 3

    # Freed tail first, so block 3 (the chain's leaf) is at the front of the queue.
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 2, 1]
    hit = pool.get_cached_block(request.block_hashes[2])
    assert hit is blocks[2]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.touch([hit])
    assert hit.ref_cnt == 2 and pool.get_num_free_blocks() == 2
    pool.check_integrity()
    assert ids(pool.get_new_blocks(2)) == [2, 1]
    assert pool.get_cached_block(request.block_hashes[2]) is hit
    pool.free_blocks([hit, hit])
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3]
    pool.check_integrity()


def test_reallocating_a_cached_block_evicts_its_hash() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    request = make_request("a", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2)
    pool.free_blocks(reversed(blocks))
    # Freed blocks keep their content until evicted.
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
    assert pool.get_cached_block(request.block_hashes[1]) is blocks[1]

    (reused,) = pool.get_new_blocks(1)
    assert reused is blocks[1]
    assert reused.block_hash is None and reused.ref_cnt == 1
    assert pool.get_cached_block(request.block_hashes[1]) is None
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
    assert len(pool.cached_block_hash_to_block) == 1
    pool.check_integrity()


def test_duplicate_content_leaves_the_second_block_uncached() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    first = make_request("a", [1, 2, 3, 4])
    second = make_request("b", [1, 2, 3, 4])
    first_blocks = pool.get_new_blocks(2)
    second_blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(first, first_blocks, 0, 2)
    pool.cache_full_blocks(second, second_blocks, 0, 2)
    assert [b.block_hash for b in second_blocks] == [None, None]
    assert pool.get_cached_block(second.block_hashes[1]) is first_blocks[1]
    pool.free_blocks(second_blocks)
    assert len(pool.cached_block_hash_to_block) == 2
    pool.check_integrity()


def test_cache_full_blocks_only_caches_the_given_range() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    request = make_request("a", [1, 2, 3, 4, 5, 6])
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(request, blocks, 1, 2)
    assert [b.block_hash for b in blocks] == [None, request.block_hashes[1], None, None]
    pool.cache_full_blocks(request, blocks, 1, 3)  # block 1 again is a no-op
    assert [b.block_hash for b in blocks[1:]] == [*request.block_hashes[1:3], None]
    pool.check_integrity()


def test_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=False)
    request = make_request("a", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2)
    assert pool.cached_block_hash_to_block == {}
    assert [b.block_hash for b in blocks] == [None, None]
    pool.check_integrity()


def test_reset_prefix_cache_only_when_every_block_is_free() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    request = make_request("a", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2)
    pool.free_blocks([blocks[1]])
    assert pool.reset_prefix_cache() is False
    assert len(pool.cached_block_hash_to_block) == 2
    pool.free_blocks([blocks[0]])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(block.block_hash is None for block in pool.blocks)
    assert pool.get_num_free_blocks() == 2
    pool.check_integrity()


def test_usage_counts_usable_blocks() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(1)
    assert pool.get_usage() == 0.25
    pool.touch(blocks)  # shared: still one block in use
    assert pool.get_usage() == 0.25


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda pool, blocks: setattr(blocks[0], "ref_cnt", 0),
         "block 1 has ref_cnt 0 but is not in the free queue"),
        (lambda pool, blocks: setattr(pool.blocks[3], "ref_cnt", 1),
         "block 3 has ref_cnt 1 but is in the free queue"),
        (lambda pool, blocks: setattr(blocks[1], "ref_cnt", -1),
         "block 2 has ref_cnt -1"),
        (lambda pool, blocks: setattr(pool.free_block_queue, "num_free_blocks", 3),
         "free queue holds 2 blocks but num_free_blocks=3"),
        (lambda pool, blocks: setattr(pool.blocks[4], "prev_free_block", blocks[0]),
         "block 4.prev is not block 3"),
        (lambda pool, blocks: setattr(blocks[1], "block_hash", blocks[0].block_hash),
         "block 2 has a hash but the map does not point to it"),
        (lambda pool, blocks: pool.cached_block_hash_to_block.update(
            {BlockHash(b"x", (9, 9), None): blocks[0]}),
         "map entry for block 1 does not match the block's hash"),
        (lambda pool, blocks: setattr(pool.null_block, "ref_cnt", 1), "null block changed"),
    ],
)
def test_check_integrity_names_the_broken_invariant(corrupt, message: str) -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    request = make_request("a", [1, 2, 3, 4])
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, 0, 2)
    pool.check_integrity()
    corrupt(pool, blocks)
    with pytest.raises(AssertionError, match=message.replace(".", r"\.")):
        pool.check_integrity()
