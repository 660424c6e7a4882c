"""The index knows tiers: both backends (in-memory, and Redis on 127.0.0.1:6379) keep each worker's tier per block
through moves to the host, reloads, drops, restarts and forgets; the worker's event hub puts the tier on the wire
and in its snapshots; the prefix policy scores a host hit between a device hit and a miss, using the worker's
measured reload cost."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis

from cluster.routing.events import AllBlocksCleared, BlocksRemoved, BlocksStored, EventBatch, Tier, WorkerLoad
from cluster.routing.index import MemoryIndex, PrefixIndex, TierMatch
from cluster.routing.policy import CostWeights, WorkerView, make_policy, prefill_cost
from cluster.routing.redis_index import RedisIndex
from cluster.worker.events import KVEventHub
from engine.core.block_hash import BlockHasher
from engine.core.block_pool import BlockRemoved, BlockStored, KVTier
from engine.llm_engine import EngineLoad
from protos.kvflow.v1 import kvflow_pb2 as pb
from router.workers import batch_from_proto
from tests.helpers.redis_index import REDIS_URL, scratch_redis_index

HASHES = BlockHasher.for_model("test-model", 4).hash_blocks(list(range(40)))  # 10 chained blocks


@pytest.fixture(params=["memory", "redis"])
def index(request: pytest.FixtureRequest) -> Iterator[PrefixIndex]:
    if request.param == "memory":
        yield MemoryIndex()
        return
    with scratch_redis_index() as idx:
        yield idx


def batch(worker: str, sequence: int, *events: object, epoch: int = 1) -> EventBatch:
    return EventBatch(worker, epoch, sequence, tuple(events))  # type: ignore[arg-type]


def test_each_worker_and_block_keeps_its_tier(index: PrefixIndex) -> None:
    h = HASHES
    assert index.apply(batch("a", 0, AllBlocksCleared(), BlocksStored(tuple(h[:6]))))
    assert index.apply(batch("b", 0, AllBlocksCleared(), BlocksStored(tuple(h[:2])),
                             BlocksStored(tuple(h[2:4]), Tier.HOST)))
    assert index.apply(batch("a", 1, BlocksStored(tuple(h[3:6]), Tier.HOST)))  # evicted, copied to the host
    assert index.match_tiers(h, ["a", "b", "zz"]) == {"a": TierMatch(6, 3), "b": TierMatch(4, 2),
                                                     "zz": TierMatch(0, 0)}
    assert index.match(h, ["a", "b"]) == {"a": 6, "b": 4}  # the tier-blind lookup still counts both tiers
    assert index.apply(batch("a", 2, BlocksStored((h[3],))))  # loaded back: on the device again
    assert index.match_tiers(h, ["a"]) == {"a": TierMatch(6, 2)}
    assert index.apply(batch("a", 3, BlocksRemoved((h[4],))))  # dropped by the host tier's LRU
    assert index.match_tiers(h, ["a"]) == {"a": TierMatch(4, 0)}
    # a restart (new epoch) forgets the old epoch's host entries as well
    assert index.apply(batch("b", 0, AllBlocksCleared(), BlocksStored((h[0],)), epoch=2))
    assert index.match_tiers(h, ["b"]) == {"b": TierMatch(1, 0)}
    assert index.apply(batch("b", 1, BlocksStored(tuple(h[1:3]), Tier.HOST), epoch=2))
    index.forget_worker("b")
    assert index.match_tiers(h, ["a", "b"]) == {"a": TierMatch(4, 0), "b": TierMatch(0, 0)}
    if isinstance(index, RedisIndex):  # nothing of b is left behind in the host sets
        client = redis.Redis.from_url(REDIS_URL)
        members = [m for k in client.scan_iter(match=index.prefix + "h:*") for m in client.smembers(k)]
        assert not [m for m in members if m.startswith(b"b|")]


def test_hub_puts_the_tier_on_the_wire_and_in_snapshots() -> None:
    hub = KVEventHub("w")
    h = HASHES
    load = EngineLoad(0, 0, 0, 0.0, 10, 10, 0, host_reload_cost=0.05)
    hub.transfer_pace.observe(1000, 0.004)  # the decode side's pulls: 4 us of wire time a token
    hub.publish([BlockStored(list(h[:3]), None), BlockStored(list(h[1:3]), None, KVTier.HOST),
                 BlockRemoved([h[2]])], load)

    async def first_batch() -> pb.KVEventBatch:
        stream = hub.subscribe()
        snapshot = await anext(stream)
        await stream.aclose()
        return snapshot

    snapshot = batch_from_proto(asyncio.run(first_batch()))
    index = MemoryIndex()
    assert index.apply(snapshot)
    assert index.match_tiers(h, ["w"]) == {"w": TierMatch(2, 1)}
    assert hub.cached[h[1]] == (h[0], KVTier.HOST)  # the move kept the parent the device store gave
    assert snapshot.load is not None and snapshot.load.host_reload_cost == pytest.approx(0.05)
    assert snapshot.load.kv_receive_s_per_token == pytest.approx(4e-6)


def view(wid: str, reload_cost: float = 0.0) -> WorkerView:
    return WorkerView(wid, f"{wid}:1", WorkerLoad(num_kv_blocks=100, host_reload_cost=reload_cost))


def test_a_host_hit_scores_between_a_device_hit_and_a_miss() -> None:
    w = CostWeights()
    device = prefill_cost(view("a"), 320, 10, 16, w)
    host = prefill_cost(view("a"), 320, 10, 16, w, host_blocks=10)
    miss = prefill_cost(view("a"), 320, 0, 16, w)
    assert device < host < miss
    assert host == pytest.approx((320 - 160 * (1 - w.host_reload_cost)) / 16)
    # the worker's measured cost replaces the default
    assert prefill_cost(view("a", 0.5), 320, 10, 16, w, host_blocks=10) == pytest.approx((320 - 80) / 16)
    policy = make_policy("prefix", seed=0)
    workers = [view("dev"), view("host"), view("none")]
    matched, on_host = {"dev": 10, "host": 10}, {"host": 10}
    assert policy.choose_prefill(workers, matched, 320, 16, on_host).worker.worker_id == "dev"
    choice = policy.choose_prefill(workers[1:], matched, 320, 16, on_host)
    assert choice.worker.worker_id == "host" and choice.host_blocks == 10
    with pytest.raises(ValueError, match="host_reload_cost"):
        CostWeights(host_reload_cost=1.0)
