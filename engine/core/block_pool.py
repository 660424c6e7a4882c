"""The pool of KV blocks: reference counts, an O(1) intrusive free list, and the prefix-cache map.

Free blocks keep their hash and content until they are handed out again, so a freed prefix stays reusable;
the free list is ordered by eviction priority (head = evicted first, LRU). Every block object exists from the
start: allocation moves pointers, it creates nothing.

With a host tier (engine/core/host_tier.py), an evicted cached block is first queued for a copy to a host slot
(`tier_copies`, in the order the copies must run); its event then says it moved to the host, and a block is
reported removed only once neither tier holds it. Events describe what the worker can serve: a block is
advertised in the tier its next lookup will find it in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from engine.core.host_tier import HostKVTier
from engine.outputs import TierCopy


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


class KVTier(Enum):
    DEVICE = "device"  # the engine's own KV cache (GPU memory, or the CPU engine's)
    HOST = "host"  # the host-memory tier: served after a copy back


@dataclass(frozen=True)
class BlockStored:
    """The blocks are now served from `tier` (a move to the host tier is a store there)."""

    block_hashes: list[bytes]
    parent_hash: bytes | None  # None for a first block, and for moves to the host (the parent is known already)
    tier: KVTier = KVTier.DEVICE


@dataclass(frozen=True)
class BlockRemoved:
    """The worker no longer holds these blocks in any tier."""

    block_hashes: list[bytes]


KVEvent = BlockStored | BlockRemoved


class BlockPool:
    """Owns every block. Block 0 is the null block: never allocated, it pads block tables."""

    def __init__(self, num_blocks: int, enable_caching: bool, enable_events: bool = False,
                 host_tier: HostKVTier | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.enable_caching = enable_caching
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.enable_events = enable_events
        self.events: list[KVEvent] = []
        self.host_tier = host_tier
        self.tier_copies: list[TierCopy] = []  # queued since the last `take_tier_copies`, in order
        self.num_offloaded_blocks = 0  # blocks copied to the host tier (cumulative)
        self.num_host_dropped_blocks = 0  # blocks the full host tier let go (LRU, or all slots held), cumulative

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
        changes: list[tuple[KVTier | None, bytes]] = []  # (new tier, None: removed) in order
        for _ in range(count):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                changes += self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        if changes and self.enable_events:
            self._emit(changes)
        return blocks

    def _evict(self, block: KVCacheBlock) -> list[tuple[KVTier | None, bytes]]:
        """Drop a free block's hash from the device cache, offering it to the host tier first."""
        block_hash = block.block_hash
        assert block_hash is not None  # callers evict cached blocks only
        del self.cached[block_hash]
        block.block_hash = None
        if self.host_tier is None:
            return [(None, block_hash)]
        stored = self.host_tier.store(block_hash)
        if stored.slot is not None:  # the copy runs before this step's forward can overwrite the block
            self.tier_copies.append((True, block.block_id, stored.slot))
            self.num_offloaded_blocks += 1
        if stored.dropped is not None:
            self.num_host_dropped_blocks += 1
        if stored.dropped == block_hash:
            return [(None, block_hash)]
        changes: list[tuple[KVTier | None, bytes]] = [(KVTier.HOST, block_hash)]
        if stored.dropped is not None and stored.dropped not in self.cached:  # else still served from the device
            changes.append((None, stored.dropped))
        return changes

    def _emit(self, changes: list[tuple[KVTier | None, bytes]]) -> None:
        """Events for tier changes, consecutive changes of one kind in one event."""
        run: list[bytes] = []
        for i, (tier, block_hash) in enumerate(changes):
            run.append(block_hash)
            if i + 1 == len(changes) or changes[i + 1][0] is not tier:
                self.events.append(BlockRemoved(run) if tier is None else BlockStored(run, None, tier))
                run = []

    def take_tier_copies(self) -> list[TierCopy]:
        copies, self.tier_copies = self.tier_copies, []
        return copies

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
