"""The router and index (in memory, and in Redis on 127.0.0.1:6379) against real `tiny` workers with a host KV tier
(1 prefill + 1 decode, 19 usable device blocks, --kv-offloading-size 64 blocks): an evicted prefix is advertised on
the host, the index matches each worker's own tiered snapshot, the repeated prompt is routed as a host hit and served
from the host tier with the same greedy tokens, and no request is a false hit."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.auth import ClusterAuth
from cluster.routing.events import Tier
from cluster.routing.index import MemoryIndex, TierMatch
from engine.arg_utils import EngineArgs
from kvflow.launcher import ClusterSpec, WorkerCluster
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc
from router.config import RouterConfig
from router.core import Router

BLOCK = 16
TINY_BLOCK_BYTES = BLOCK * 2 * 2 * 2 * 16 * 4
ENGINE = EngineArgs(model="tiny", num_gpu_blocks_override=20, max_model_len=256, max_num_batched_tokens=256,
                    kv_offloading_size=64 * TINY_BLOCK_BYTES / 2**30)
AUTH = ClusterAuth("tiers-test-cluster-token-01234567")


def wait_for(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(8 * BLOCK)]


def worker_tiers(address: str) -> dict[bytes, int]:
    """The worker's own truth: each cached hash's tier in the snapshot a fresh subscription starts with."""
    with AUTH.channel(address) as channel:
        stream = kvflow_pb2_grpc.PrefillStub(channel).StreamKVEvents(pb.KVEventsRequest(subscriber="test"))
        first = next(iter(stream))
        stream.cancel()
    return {h: e.stored.tier for e in first.events if e.WhichOneof("event") == "stored" for h in e.stored.block_hashes}


@pytest.fixture(scope="module", params=["memory", "redis://127.0.0.1:6379/13"])
def router(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Router]:
    spec = ClusterSpec(ENGINE, prefill_workers=1, decode_workers=1, log_dir=tmp_path_factory.mktemp("workers"),
                       auth=AUTH)
    with WorkerCluster(spec) as workers:
        workers.wait_ready(240, progress=False)
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()

        async def make() -> Router:
            return Router(RouterConfig(decode=("unused",), routing="prefix", cluster=AUTH, disagg_policy="static",
                                       index=request.param))

        router = asyncio.run_coroutine_threadsafe(make(), loop).result(60)
        router.pool.set_addresses("prefill", workers.addresses("prefill"))
        router.pool.set_addresses("decode", workers.addresses("decode"))
        wait_for(lambda: len(router.pool.workers("prefill")) == 1 and router.is_ready(), 60)
        asyncio.run_coroutine_threadsafe(router.ensure_tokenizers(), loop).result(60)
        router.test_loop = loop  # type: ignore[attr-defined]
        yield router
        asyncio.run_coroutine_threadsafe(router.close(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)


def generate(router: Router, token_ids: list[int]) -> pb.GenerateComplete:
    async def run() -> pb.GenerateComplete:
        params = pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        last = None
        async for response in router.generate(f"t{random.random()}", token_ids, params):
            last = response
        assert last is not None and last.WhichOneof("response") == "complete", last
        return last.complete
    return asyncio.run_coroutine_threadsafe(run(), router.test_loop).result(120)  # type: ignore[attr-defined]


def test_an_evicted_prefix_is_routed_and_served_from_the_host_tier(router: Router) -> None:
    index = router.index
    first = generate(router, prompt(0))
    worker = router.pool.workers("prefill")[0]
    hashes = router.tokenizers.hasher.hash_blocks(prompt(0))
    wait_for(lambda: index.match_tiers(hashes, [worker.worker_id])[worker.worker_id] == TierMatch(8, 0), 5)
    for seed in (1, 2, 3):  # 24 more blocks through 19: prompt 0's blocks leave the device, for the host tier
        generate(router, prompt(seed))
    wait_for(lambda: index.match_tiers(hashes, [worker.worker_id])[worker.worker_id] == TierMatch(8, 8), 5)
    time.sleep(0.6)  # one heartbeat: every event has been applied
    truth = worker_tiers(worker.address)
    if isinstance(index, MemoryIndex):
        assert index.blocks_of(worker.worker_id, Tier.HOST) == {h for h, t in truth.items() if t == pb.KV_TIER_HOST}
        assert index.blocks_of(worker.worker_id, Tier.DEVICE) == {h for h, t in truth.items()
                                                                  if t == pb.KV_TIER_DEVICE}
    assert all(truth[h] == pb.KV_TIER_HOST for h in hashes)  # what the index said: all 8 on the host
    route = router.route(prompt(0))
    assert route.prefill is not None and (route.matched_blocks, route.host_blocks) == (8, 8)
    again = generate(router, prompt(0))
    assert again.usage.cached_tokens == 7 * BLOCK  # the last block is recomputed for its logits
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in first.choices]
    assert router.metrics.registry.get_sample_value("kvflow:route_false_hits_total") == 0
    assert router.metrics.registry.get_sample_value("kvflow:route_prefix_matched_host_blocks_total") >= 8


def test_a_recomputed_prefix_counts_as_a_false_hit(router: Router) -> None:
    route = router.route(prompt(0))
    assert route.predicted_cached_tokens == 7 * BLOCK
    before = router.metrics.registry.get_sample_value("kvflow:route_false_hits_total")
    def complete(cached: int, path: int = pb.PREFILL_PATH_DISAGGREGATED) -> pb.GenerateComplete:
        return pb.GenerateComplete(usage=pb.Usage(prompt_tokens=8 * BLOCK, cached_tokens=cached), prefill_path=path)

    router._check_prediction(route, complete(7 * BLOCK), resumed=False)  # as predicted
    router._check_prediction(route, complete(3 * BLOCK), resumed=True)  # not the routed prompt: not judged
    router._check_prediction(route, complete(0, pb.PREFILL_PATH_LOCAL), resumed=False)  # fell back: not judged
    router._check_prediction(route, complete(3 * BLOCK), resumed=False)  # partly recomputed
    assert router.metrics.registry.get_sample_value("kvflow:route_false_hits_total") == before + 1
