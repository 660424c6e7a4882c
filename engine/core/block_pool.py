"""The pool of KV blocks: reference counts, an O(1) intrusive free list, and the prefix-cache map.

Free blocks keep their hash and content until they are handed out again, so a freed prefix stays reusable;
the free list is ordered by eviction priority (head = evicted first, LRU). Every block object exists from the
start: allocation moves pointers, it creates nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks themselves: O(1) pop, append and remove-from-middle."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is None or block is self.tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        assert last is not None  # sentinel invariant, not input validation
        last.next_free, block.prev_free = block, last
        block.next_free, self.tail.prev_free = self.tail, block
        self.num_free += 1


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_hash: bytes | None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]


KVEvent = BlockStored | BlockRemoved


class BlockPool:
    """Owns every block. Block 0 is the null block: never allocated, it pads block tables."""

    def __init__(self, num_blocks: int, enable_caching: bool, enable_events: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.enable_caching = enable_caching
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.enable_events = enable_events
        self.events: list[KVEvent] = []

    @property
    def num_usable_blocks(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, count: int) -> list[KVCacheBlock] | None:
        """`count` fresh blocks with ref_cnt 1, evicting cached free blocks LRU-first; None if too few are free."""
        if count > self.free_queue.num_free:
            return None
        blocks = []
        evicted: list[bytes] = []
        for _ in range(count):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            blocks.append(block)
        if evicted and self.enable_events:
            self.events.append(BlockRemoved(evicted))
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVCacheBlock]) -> None:
        for block in blocks_in_eviction_order:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes, parent_hash: bytes | None) -> None:
        """Register a block whose KV is complete; a duplicate of an already cached hash stays uncached."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.enable_events:
            self.events.append(BlockStored([block_hash], parent_hash))

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
