"""Block hashing and the LRU queue of free blocks: the data structures under the block pool.

A full block of tokens is identified by a chained hash, `h_i = H(h_{i-1} + tokens_i + extra_i)`,
so equal hashes mean equal prefixes. The prefix-cache key (`BlockHash`) also carries the block's
token ids: a collision of `hash_value` alone cannot hand out a block holding other tokens.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


def sha256_hash(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


# The parent hash of block 0 of every sequence.
NONE_HASH: bytes = sha256_hash(b"sluice")


class BlockHash(NamedTuple):
    """Prefix-cache key of one full block: its chained hash plus what was hashed."""

    hash_value: bytes
    token_ids: tuple[int, ...]
    extra_keys: tuple | None = None

    def __hash__(self) -> int:
        # Equality still compares every field; hashing only the digest keeps dict lookups O(1)
        # in the block size (bytes cache their hash, tuples do not).
        return hash(self.hash_value)


def _encode_extra_key(value: object, out: list[bytes]) -> None:
    # Tagged and length-prefixed, so distinct keys never encode alike; stable across processes
    # (unlike hash()), because the chain hash also names blocks in the global KV pool.
    if value is None:
        out.append(b"N")
    elif isinstance(value, bool):
        out.append(b"T" if value else b"F")
    elif isinstance(value, int):
        digits = str(value).encode()
        out.append(b"i" + struct.pack("<I", len(digits)) + digits)
    elif isinstance(value, float):
        out.append(b"f" + struct.pack("<d", value))
    elif isinstance(value, str):
        data = value.encode()
        out.append(b"s" + struct.pack("<I", len(data)) + data)
    elif isinstance(value, bytes):
        out.append(b"b" + struct.pack("<I", len(value)) + value)
    elif isinstance(value, tuple):
        out.append(b"t" + struct.pack("<I", len(value)))
        for item in value:
            _encode_extra_key(item, out)
    else:
        raise ValueError(
            f"extra_keys items must be None, bool, int, float, str, bytes or tuples of them, "
            f"got {type(value).__name__}: {value!r}")


def hash_block_tokens(
    hash_fn: Callable[[bytes], bytes],
    parent_hash_value: bytes | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    """The chained hash of one block: `hash_fn(parent + int64 LE tokens + extra_keys)`."""
    if not token_ids:
        raise ValueError("a block has at least one token")
    return hash_blocks(hash_fn, parent_hash_value, token_ids, len(token_ids), extra_keys)[0]


def hash_blocks(
    hash_fn: Callable[[bytes], bytes],
    parent_hash_value: bytes | None,
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple | None = None,
) -> list[BlockHash]:
    """The chained hash of each full block of `token_ids` in turn (see hash_block_tokens), from
    `parent_hash_value`, with the tokens converted to bytes once for all of them (a 1,024-token
    prompt has 64 blocks of 16)."""
    num_blocks = len(token_ids) // block_size
    tokens = array("q", token_ids[: num_blocks * block_size])
    if sys.byteorder == "big":
        tokens.byteswap()
    data = tokens.tobytes()
    extra_parts: list[bytes] = []
    if extra_keys is not None:
        _encode_extra_key(extra_keys, extra_parts)
    extra = b"".join(extra_parts)
    parent = NONE_HASH if parent_hash_value is None else parent_hash_value
    block_bytes = block_size * tokens.itemsize
    hashes = []
    for i in range(num_blocks):
        parent = hash_fn(parent + data[i * block_bytes:(i + 1) * block_bytes] + extra)
        hashes.append(BlockHash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]),
                                extra_keys))
    return hashes


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of KV slots. Compared by identity; the links belong to the free queue."""

    block_id: int
    ref_cnt: int = 0
    # Set while the block is in the prefix cache (full, hashed, and in the pool's map).
    block_hash: BlockHash | None = None
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)
    # Block 0: padding target, never allocated or freed.
    is_null: bool = False
    # Bumped each time the block is handed out anew, i.e. each time its content may change.
    generation: int = 0
    # (block_id, generation) of the block that preceded this one when it was cached: a hit
    # must follow exactly that block, so even colliding hashes never splice two chains.
    parent: tuple[int, int] | None = None

    def reset_hash(self) -> None:
        self.block_hash = None


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order (front = evicted first), as an intrusive doubly linked list.

    The links live in the blocks themselves so that taking a cached block out of the middle
    (a prefix-cache hit) is O(1). Sentinels at both ends remove the edge cases. A block outside
    the queue has both links None.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        assert block is not None
        if block is self._tail:
            raise ValueError("cannot pop a block: the free block queue is empty")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if not 0 <= n <= self.num_free_blocks:
            raise ValueError(
                f"cannot pop {n} blocks: must be in [0, {self.num_free_blocks}] (the free count)")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise ValueError(f"block {block.block_id} is not in the free block queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free block queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, front (next to evict) first."""
        blocks = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks

    def check_links(self, max_len: int) -> list[KVCacheBlock]:
        """Walk the queue checking links both ways; returns its blocks. Raises AssertionError."""
        blocks: list[KVCacheBlock] = []
        prev = self._head
        block = self._head.next_free_block
        while block is not self._tail:
            assert block is not None, f"free queue broken after block {prev.block_id}"
            assert block.prev_free_block is prev, (
                f"free queue: block {block.block_id}.prev is not block {prev.block_id}")
            blocks.append(block)
            assert len(blocks) <= max_len, f"free queue longer than {max_len} (a cycle?)"
            prev, block = block, block.next_free_block
        assert self._tail.prev_free_block is prev, "free queue: tail.prev is not the last block"
        assert len(blocks) == self.num_free_blocks, (
            f"free queue holds {len(blocks)} blocks but num_free_blocks={self.num_free_blocks}")
        return blocks

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
