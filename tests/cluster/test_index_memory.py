"""The in-memory prefix index: longest-prefix lookups, eviction, epochs, liveness, ordering."""

from __future__ import annotations

import pytest

from cluster.routing.events import (
    AllBlocksCleared,
    BatchOrder,
    BatchVerdict,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
)
from cluster.routing.index import MemoryIndex
from engine.core.block_hash import BlockHasher

HASHER = BlockHasher.for_model("test-model", 4)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def snapshot(worker: str, hashes: list[bytes], epoch: int = 1, seq: int = 0) -> EventBatch:
    return EventBatch(worker, epoch, seq, (AllBlocksCleared(), BlocksStored(tuple(hashes))))


@pytest.fixture()
def hashes() -> list[bytes]:
    return HASHER.hash_blocks(list(range(40)))  # 10 blocks


def test_longest_prefix_per_worker(hashes: list[bytes]) -> None:
    index = MemoryIndex()
    assert index.apply(snapshot("a", hashes[:6]))
    assert index.apply(snapshot("b", hashes[:2]))
    assert index.apply(snapshot("c", hashes[3:]))  # no first block: nothing usable
    assert index.match(hashes, ["a", "b", "c", "unknown"]) == {"a": 6, "b": 2, "c": 0, "unknown": 0}
    assert index.match(hashes[:1], ["a"]) == {"a": 1}
    assert index.match([], ["a"]) == {"a": 0}


def test_eviction_and_incremental_events(hashes: list[bytes]) -> None:
    index = MemoryIndex()
    index.apply(snapshot("a", hashes[:4]))
    index.apply(EventBatch("a", 1, 1, (BlocksStored(tuple(hashes[4:8])),)))
    assert index.match(hashes, ["a"]) == {"a": 8}
    index.apply(EventBatch("a", 1, 2, (BlocksRemoved((hashes[5],)),)))  # evicted from the middle
    assert index.match(hashes, ["a"]) == {"a": 5}
    index.apply(EventBatch("a", 1, 3, (BlocksRemoved(tuple(hashes[:8])),)))
    assert index.match(hashes, ["a"]) == {"a": 0}
    assert index.num_blocks("a") == 0


def test_restart_with_new_epoch_drops_old_entries(hashes: list[bytes]) -> None:
    index = MemoryIndex()
    index.apply(snapshot("a", hashes, epoch=1))
    index.apply(EventBatch("a", 2, 0, (BlocksStored(tuple(hashes[:1])),)))  # even without a cleared event
    assert index.match(hashes, ["a"]) == {"a": 1}


def test_dead_worker_ignored_after_ttl_and_forgotten(hashes: list[bytes]) -> None:
    clock = FakeClock()
    index = MemoryIndex(liveness_ttl_s=2.0, clock=clock)
    index.apply(snapshot("a", hashes))
    index.apply(snapshot("b", hashes[:3]))
    clock.now += 1.5
    index.apply(EventBatch("b", 1, 1))  # heartbeat from b only
    clock.now += 1.0
    assert index.match(hashes, ["a", "b"]) == {"a": 0, "b": 3}
    index.forget_worker("b")
    assert index.match(hashes, ["b"]) == {"b": 0}
    assert not index.apply(EventBatch("b", 1, 2))  # state lost: the subscriber must resubscribe
    assert index.apply(snapshot("b", hashes[:2]))  # the freed slot is reused cleanly
    assert index.match(hashes, ["b"]) == {"b": 2}


def test_many_workers_bitmask(hashes: list[bytes]) -> None:
    index = MemoryIndex()
    workers = [f"w{i}" for i in range(100)]
    for i, wid in enumerate(workers):
        index.apply(snapshot(wid, hashes[: i % 11]))
    result = index.match(hashes, workers)
    assert result == {wid: min(i % 11, 10) for i, wid in enumerate(workers)}


def test_batch_order() -> None:
    order = BatchOrder()
    assert order.check(EventBatch("a", 5, 3)) is BatchVerdict.GAP  # must start with a snapshot
    assert order.check(EventBatch("a", 5, 3, (AllBlocksCleared(),))) is BatchVerdict.APPLY
    assert order.check(EventBatch("a", 5, 4)) is BatchVerdict.APPLY
    assert order.check(EventBatch("a", 5, 4)) is BatchVerdict.STALE  # duplicate
    assert order.check(EventBatch("a", 5, 6)) is BatchVerdict.GAP
    assert order.check(EventBatch("a", 4, 9)) is BatchVerdict.STALE  # older epoch
    assert order.check(EventBatch("a", 6, 0)) is BatchVerdict.GAP  # new epoch without a snapshot
    assert order.check(EventBatch("a", 6, 0, (AllBlocksCleared(),))) is BatchVerdict.APPLY
