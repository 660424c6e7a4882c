"""The host-memory KV tier's bookkeeping (`--kv-offloading-size`): which block hash sits in which host slot.

Blocks evicted from the device prefix cache are copied here first; a prefix lookup that misses the device cache
loads them back. This module only decides slots; the block pool queues the copies (engine/core/block_pool.py) and
the runner executes them in order before the step's forward (engine/runner/kv_tier.py).

Invariants:
- A hash is in at most one slot and a slot holds at most one hash; the number of slots is fixed at start.
- Slots are reused least recently used first; a slot being read this step (`protect`) is never reused, nor is one
  reserved for a waiting request's prefix (`reserve`, until `release`). Reservations hold at most half the slots,
  so evicted device blocks always find room.
- Why reservations: a request routed here for a prefix this tier holds may wait in the queue for seconds while
  other requests' evictions fill the tier, and LRU drops first the least recently used blocks, which under
  multi-turn traffic are exactly the conversations whose next turns are queued. Dropping them turns the router's
  prediction into a false hit and the turn into a recompute (2 x H200, 4x-overfull tiers: 23 false hits).
- Storing a hash the tier already holds copies nothing: the same chained hash means the same tokens, so the same
  KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HostHit:
    """A prefix block found in the host tier, not on the device: `allocate_slots` loads it back."""

    block_hash: bytes
    slot: int


@dataclass(frozen=True, slots=True)
class Stored:
    """What `HostKVTier.store` did: the slot to copy the block into (None: nothing to copy), and the hash the tier
    no longer holds because of it (None: none). With every slot protected the stored block itself is dropped:
    slot None, dropped = its hash."""

    slot: int | None
    dropped: bytes | None


class HostKVTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least 1 block, got {num_slots}")
        self.num_slots = num_slots
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self._protected: set[int] = set()
        self._reserved: dict[int, int] = {}  # slot -> waiting requests that reserved it
        self.max_reserved = num_slots // 2

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    @property
    def usage(self) -> float:
        return len(self._slots) / self.num_slots

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot holding `block_hash` (now the most recently used), or None."""
        slot = self._slots.get(block_hash)
        if slot is not None:
            self._slots.move_to_end(block_hash)
        return slot

    def protect(self, slots: Iterable[int]) -> None:
        """Slots whose load is being queued: `store` must not reuse them until `unprotect`."""
        self._protected.update(slots)

    def unprotect(self) -> None:
        self._protected.clear()

    def reserve(self, block_hashes: Iterable[bytes]) -> list[int]:
        """Keep the slots of these held hashes (a waiting request's prefix) from reuse until `release`, and mark
        them recently used; returns the slots reserved, which stop once reservations would pass `max_reserved`
        slots. Hashes not held are skipped."""
        slots = []
        for block_hash in block_hashes:
            slot = self._slots.get(block_hash)
            if slot is None:
                continue
            if slot not in self._reserved and len(self._reserved) >= self.max_reserved:
                break
            self._slots.move_to_end(block_hash)
            self._reserved[slot] = self._reserved.get(slot, 0) + 1
            slots.append(slot)
        return slots

    def release(self, slots: Iterable[int]) -> None:
        """End reservations `reserve` returned."""
        for slot in slots:
            count = self._reserved.get(slot, 0) - 1
            if count > 0:
                self._reserved[slot] = count
            else:
                self._reserved.pop(slot, None)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    def store(self, block_hash: bytes) -> Stored:
        """Make room for `block_hash`: a free slot, else the least recently used unprotected one."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return Stored(None, None)
        if self._free:
            slot = self._free.pop()
            self._slots[block_hash] = slot
            return Stored(slot, None)
        victim = next((h for h, s in self._slots.items() if s not in self._protected and s not in self._reserved),
                      None)
        if victim is None:  # every slot is being read or reserved: the block is simply dropped
            return Stored(None, block_hash)
        slot = self._slots.pop(victim)
        self._slots[block_hash] = slot
        return Stored(slot, victim)

    def hashes(self) -> list[bytes]:
        """Every hash held, least recently used first."""
        return list(self._slots)
