"""The prefix-block index: which worker caches which chained block hash, and the embedded in-memory backend.

A lookup walks the prompt's chained block hashes in order and returns, per worker, how many leading blocks it
holds. Because hashes are chained, a worker that misses block i cannot reuse blocks after i, so the walk stops
as soon as no worker is left. Entries of a worker that stopped heartbeating (`liveness_ttl_s`) or restarted
(a new epoch) are ignored at once.

Each (worker, block) entry keeps the tier the worker advertised it in (cluster/routing/events.py): a leading block
counts in either tier, and `match_tiers` also says how many of them must be loaded back from the host.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cluster.routing.events import AllBlocksCleared, BlocksRemoved, BlocksStored, EventBatch, IndexEvent, Tier

DEFAULT_LIVENESS_TTL_S = 2.0
INDEX_URL_SCHEMES = ("redis://", "rediss://", "unix://")


def validate_index_url(url: str) -> None:
    """--index of every process (router, workers, `kvflow serve`): 'memory' (the embedded index) or a Redis URL."""
    if url != "memory" and not url.startswith(INDEX_URL_SCHEMES):
        raise ValueError(f"--index must be 'memory' or redis://[:password@]host:port/db (or rediss://, unix://), "
                         f"got {url!r}")


class IndexUnavailable(RuntimeError):
    """The index backend cannot be reached; callers route on load alone meanwhile."""


@dataclass(frozen=True, slots=True)
class TierMatch:
    """A worker's leading cached blocks of a prompt, and how many of those sit in its host tier."""

    blocks: int = 0
    host_blocks: int = 0


class PrefixIndex(Protocol):
    def apply(self, batch: EventBatch) -> bool:
        """Apply one in-order batch (the caller checks ordering with `BatchOrder`).

        False: the index lost this worker's state (forgotten, expired, backend restarted) and the batch is not
        a snapshot, so the caller must resubscribe for one.
        """

    def match(self, block_hashes: Sequence[bytes], worker_ids: Sequence[str]) -> dict[str, int]:
        """Leading blocks of `block_hashes` each live worker of `worker_ids` caches (absent workers: 0)."""

    def match_tiers(self, block_hashes: Sequence[bytes], worker_ids: Sequence[str]) -> dict[str, TierMatch]:
        """`match`, with how many of each worker's leading blocks are in its host tier."""

    def forget_worker(self, worker_id: str) -> None:
        """Drop every entry of a worker that went away."""

    def close(self) -> None: ...


@dataclass
class _WorkerEntry:
    bit: int
    epoch: int
    last_seen: float
    blocks: set[bytes]  # every tier
    host: set[bytes] = field(default_factory=set)  # of those, the host tier's


class MemoryIndex:
    """Single-process index: block hash -> bitmask of worker slots, so a lookup step is one integer AND."""

    def __init__(self, liveness_ttl_s: float = DEFAULT_LIVENESS_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.liveness_ttl_s = liveness_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._masks: dict[bytes, int] = {}  # block -> workers holding it in any tier
        self._host_masks: dict[bytes, int] = {}  # block -> workers holding it in their host tier only
        self._workers: dict[str, _WorkerEntry] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0

    def apply(self, batch: EventBatch) -> bool:
        with self._lock:
            entry = self._workers.get(batch.worker_id)
            if entry is None and not batch.is_snapshot:
                return False
            if entry is not None and entry.epoch != batch.epoch:
                self._clear(entry)  # a restarted worker's old blocks are gone
                entry.epoch = batch.epoch
            if entry is None:
                entry = _WorkerEntry(self._take_bit(), batch.epoch, 0.0, set())
                self._workers[batch.worker_id] = entry
            entry.last_seen = self._clock()
            for event in batch.events:
                self._apply_event(entry, event)
        return True

    def _apply_event(self, entry: _WorkerEntry, event: IndexEvent) -> None:
        bit = 1 << entry.bit
        if isinstance(event, BlocksStored):
            host = event.tier is Tier.HOST
            for h in event.block_hashes:
                self._masks[h] = self._masks.get(h, 0) | bit
                if host:
                    self._host_masks[h] = self._host_masks.get(h, 0) | bit
                else:
                    _unset(self._host_masks, h, bit)
            entry.blocks.update(event.block_hashes)
            if host:
                entry.host.update(event.block_hashes)
            else:
                entry.host.difference_update(event.block_hashes)
        elif isinstance(event, BlocksRemoved):
            for h in event.block_hashes:
                self._unset(h, bit)
            entry.blocks.difference_update(event.block_hashes)
            entry.host.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self._clear(entry)

    def match(self, block_hashes: Sequence[bytes], worker_ids: Sequence[str]) -> dict[str, int]:
        return self._walk(block_hashes, worker_ids)[0]

    def match_tiers(self, block_hashes: Sequence[bytes], worker_ids: Sequence[str]) -> dict[str, TierMatch]:
        blocks, host = self._walk(block_hashes, worker_ids)
        return {wid: TierMatch(blocks[wid], host[wid]) for wid in worker_ids}

    def _walk(self, block_hashes: Sequence[bytes], worker_ids: Sequence[str]) -> tuple[dict[str, int], dict[str, int]]:
        """Per worker: leading blocks held, and how many of those on the host."""
        result = dict.fromkeys(worker_ids, 0)
        host = dict.fromkeys(worker_ids, 0)
        now = self._clock()
        with self._lock:
            bits = {}
            for wid in worker_ids:
                entry = self._workers.get(wid)
                if entry is not None and now - entry.last_seen <= self.liveness_ttl_s:
                    bits[entry.bit] = wid
            alive = sum(1 << b for b in bits)
            masks, host_masks = self._masks, self._host_masks
            matched = 0
            for h in block_hashes:
                still = alive & masks.get(h, 0)
                if still != alive:
                    _record(result, bits, alive & ~still, matched)
                    alive = still
                    if not alive:
                        break
                matched += 1
                on_host = alive & host_masks.get(h, 0) if host_masks else 0  # no host tiers: one test per block
                if on_host:
                    _count(host, bits, on_host)
            if alive:
                _record(result, bits, alive, matched)
        return result, host

    def forget_worker(self, worker_id: str) -> None:
        with self._lock:
            entry = self._workers.pop(worker_id, None)
            if entry is not None:
                self._clear(entry)
                self._free_bits.append(entry.bit)

    def num_blocks(self, worker_id: str) -> int:
        return len(self.blocks_of(worker_id))

    def blocks_of(self, worker_id: str, tier: Tier | None = None) -> frozenset[bytes]:
        """The worker's blocks in `tier` (None: every tier)."""
        with self._lock:
            entry = self._workers.get(worker_id)
            if entry is None:
                return frozenset()
            if tier is None:
                return frozenset(entry.blocks)
            return frozenset(entry.host if tier is Tier.HOST else entry.blocks - entry.host)

    def close(self) -> None:
        pass

    def _take_bit(self) -> int:
        if self._free_bits:
            return self._free_bits.pop()
        self._next_bit += 1
        return self._next_bit - 1

    def _clear(self, entry: _WorkerEntry) -> None:
        bit = 1 << entry.bit
        for h in entry.blocks:
            self._unset(h, bit)
        entry.blocks.clear()
        entry.host.clear()

    def _unset(self, block_hash: bytes, bit: int) -> None:
        _unset(self._masks, block_hash, bit)
        _unset(self._host_masks, block_hash, bit)


def _unset(masks: dict[bytes, int], block_hash: bytes, bit: int) -> None:
    mask = masks.get(block_hash, 0) & ~bit
    if mask:
        masks[block_hash] = mask
    else:
        masks.pop(block_hash, None)


def _count(counts: dict[str, int], bits: dict[int, str], mask: int) -> None:
    while mask:
        low = mask & -mask
        counts[bits[low.bit_length() - 1]] += 1
        mask ^= low


def _record(result: dict[str, int], bits: dict[int, str], dropped: int, matched: int) -> None:
    while dropped:
        low = dropped & -dropped
        result[bits[low.bit_length() - 1]] = matched
        dropped ^= low
