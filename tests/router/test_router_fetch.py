"""Cross-worker prefix fetch: two role-free `tiny` workers A and B (both in the decode pool, each allowed to pull
from the other, a host KV tier on each), the router in-process. A conversation's first turn runs on A; its next
turn is routed to B (A is busier), which pulls A's cached blocks instead of recomputing them: A prefills only the
new tokens (from its device cache, and again after the prefix was evicted to its host tier), B computes no prompt
token, the output equals a recompute with no cache anywhere, A's leased blocks are all freed, and no request is a
false hit; over gRPC bytes and over a KV link (gloo between CPU workers, NCCL's code path)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from cluster.auth import ClusterAuth
from cluster.routing.index import TierMatch
from kvflow.cli import build_parser
from kvflow.commands.router import config_from_args
from protos.kvflow.v1 import kvflow_pb2 as pb
from router.config import RouterConfig
from router.core import Route, Router
from tests.helpers.pd import Worker, free_port, metric, settled_metric, start_worker, wait_healthy, wait_until

BLOCK = 16
TINY_BLOCK_BYTES = BLOCK * 2 * 2 * 2 * 16 * 4
TOKEN = "fetch-test-cluster-token-0123456789"
AUTH = ClusterAuth(TOKEN)
DEVICE_BLOCKS = 48  # 47 usable
FLAGS = ("--num-gpu-blocks-override", str(DEVICE_BLOCKS), "--max-model-len", "512", "--max-num-batched-tokens",
         "512", "--kv-cache-memory-bytes", str(DEVICE_BLOCKS * TINY_BLOCK_BYTES),
         "--kv-offloading-size", str(128 * TINY_BLOCK_BYTES / 2**30))
# Long enough that the pull beats a recompute by the router's token-unit cost (no prefill rate reported yet: the
# hop alone weighs 192 tokens, cluster/routing/disagg.py).
HISTORY_BLOCKS = 20


def tokens(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(blocks * BLOCK)]


@pytest.fixture(scope="module", params=["grpc", "nccl"])  # bytes in the Prefill stream; a link (gloo on CPU)
def workers(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
            ) -> Iterator[tuple[Worker, Worker, str]]:
    """A, B and the backend label their KV bytes are counted under."""
    tmp: Path = tmp_path_factory.mktemp("fetch")
    ports = free_port(), free_port()
    started = [start_worker("worker", tmp, *FLAGS, "--prefill-allowlist", f"127.0.0.1:{ports[1 - i]}",
                            "--kv-transfer-backend", request.param, port=ports[i],
                            env={"KVFLOW_CLUSTER_TOKEN": TOKEN}, model="tiny") for i in range(2)]
    try:
        for worker in started:
            wait_healthy(worker, auth=AUTH)
        yield started[0], started[1], "grpc" if request.param == "grpc" else "gloo"
    finally:
        for worker in started:
            worker.stop()


@pytest.fixture(scope="module")
def router(workers: tuple[Worker, Worker, str]) -> Iterator[Router]:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    async def make() -> Router:
        return Router(RouterConfig(decode=("unused",), routing="prefix", cluster=AUTH, index="memory"))

    router = asyncio.run_coroutine_threadsafe(make(), loop).result(60)
    router.pool.set_addresses("decode", [w.address for w in workers[:2]])
    wait_until(lambda: len(router.pool.workers("decode")) == 2 and router.is_ready(), 60, "both workers")
    asyncio.run_coroutine_threadsafe(router.ensure_tokenizers(), loop).result(60)
    router.test_loop = loop  # type: ignore[attr-defined]
    yield router
    asyncio.run_coroutine_threadsafe(router.close(), loop).result(60)
    loop.call_soon_threadsafe(loop.stop)


def generate(router: Router, token_ids: list[int], cache_salt: tuple[str, ...] = ()) -> pb.GenerateComplete:
    async def run() -> pb.GenerateComplete:
        params = pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        last = None
        async for response in router.generate(f"f{random.random()}", token_ids, params, cache_salt):
            last = response
        assert last is not None and last.WhichOneof("response") == "complete", last
        return last.complete
    return asyncio.run_coroutine_threadsafe(run(), router.test_loop).result(120)  # type: ignore[attr-defined]


def pool_worker(router: Router, worker: Worker) -> Any:
    return next(w for w in router.pool.workers("decode") if w.address == worker.address)


@contextmanager
def busy(router: Router, worker: Worker) -> Iterator[None]:
    """`worker` looks loaded to the router (100 of its requests in flight there, which its heartbeats do not show:
    out of balance by the replica rule's thresholds): the other worker decodes."""
    target = pool_worker(router, worker)
    target.pending_requests += 100
    try:
        yield
    finally:
        target.pending_requests -= 100


def on(router: Router, busy_worker: Worker, token_ids: list[int], cache_salt: tuple[str, ...] = ()
       ) -> pb.GenerateComplete:
    with busy(router, busy_worker):
        return generate(router, token_ids, cache_salt)


def route_away(router: Router, busy_worker: Worker, token_ids: list[int]) -> Route:
    with busy(router, busy_worker):
        return router.route(token_ids)


def matched(router: Router, worker: Worker, token_ids: list[int]) -> TierMatch:
    wid = pool_worker(router, worker).worker_id
    return router.index.match_tiers(router.tokenizers.hasher.hash_blocks(token_ids), [wid])[wid]


def fetch_turn(router: Router, workers: tuple[Worker, Worker, str], history: list[int], cached_blocks: int,
               host: int) -> None:
    """The next turn of `history` (cached on A, `host` of its blocks in A's host tier) goes to B, fetched."""
    a, b, wire = workers
    turn = history + tokens(len(history) + 7, 2)
    route = route_away(router, a, turn)
    assert route.decode.address == b.address
    assert route.fetch and route.prefill is not None and route.prefill.address == a.address
    assert (route.matched_blocks, route.host_blocks) == (cached_blocks, host)
    # Workers export their counters every ~0.5 s: read them once the earlier requests' counts have landed.
    a_prompt, b_prompt = settled_metric(a, "vllm:prompt_tokens_total"), settled_metric(b, "vllm:prompt_tokens_total")
    fetched, hits = metric(b, "kvflow:kv_fetched_tokens_total"), metric(a, "vllm:prefix_cache_hits_total")
    freed = metric(a, "kvflow:kv_blocks_freed_total")
    loaded = metric(a, "vllm:external_prefix_cache_hits_total")
    moved = metric(b, "kvflow:kv_transfer_bytes_total", f'backend="{wire}"')
    done = on(router, a, turn)
    assert done.prefill_path == pb.PREFILL_PATH_DISAGGREGATED
    assert done.usage.cached_tokens == cached_blocks * BLOCK  # A computed only the new turn's tokens
    reference = on(router, a, turn, cache_salt=("no-cache",))  # no worker caches it under this salt
    assert reference.usage.cached_tokens == 0
    assert [c.token_ids for c in done.choices] == [c.token_ids for c in reference.choices]
    settled_metric(a, "vllm:prompt_tokens_total")
    assert settled_metric(b, "vllm:prompt_tokens_total") - b_prompt == len(turn)  # the reference's alone
    assert metric(b, "kvflow:kv_fetched_tokens_total") - fetched == cached_blocks * BLOCK
    assert metric(b, "kvflow:kv_transfer_bytes_total", f'backend="{wire}"') - moved > 0  # over the path asked for
    # A served the prefix from its device cache and its host tier, and computed only the rest.
    assert metric(a, "vllm:prompt_tokens_total") - a_prompt == len(turn) - cached_blocks * BLOCK
    served = metric(a, "vllm:prefix_cache_hits_total") - hits
    assert served + metric(a, "vllm:external_prefix_cache_hits_total") - loaded == cached_blocks * BLOCK
    assert metric(a, "vllm:external_prefix_cache_hits_total") - loaded == host * BLOCK
    # A's blocks for the prompt were leased until exported, then freed; A holds nothing now.
    assert metric(a, "kvflow:kv_blocks_freed_total") - freed == -(-len(turn) // BLOCK)
    held = lambda: (pool_worker(router, a).load.kv_cache_usage, pool_worker(router, a).load.num_running)  # noqa: E731
    wait_until(lambda: held() == (0.0, 0), 5, "A to hold no block")  # its heartbeats: its engine's state now
    assert router.metrics.registry.get_sample_value("kvflow:route_false_hits_total") == 0


def test_the_next_turn_pulls_the_prefix_from_the_device_cache_of_the_worker_holding_it(
        router: Router, workers: tuple[Worker, Worker, str]) -> None:
    a, b, _ = workers
    first = tokens(0, HISTORY_BLOCKS)
    on(router, b, first)  # B busy: turn one runs on A
    wait_until(lambda: matched(router, a, first) == TierMatch(HISTORY_BLOCKS, 0), 5, "A's blocks in the index")
    assert matched(router, b, first).blocks == 0
    fetch_turn(router, workers, first, cached_blocks=HISTORY_BLOCKS, host=0)
    fetch = router.metrics.registry.get_sample_value
    assert fetch("kvflow:prefix_fetch_decisions_total", {"path": "fetch", "reason": "cheaper_fetch"}) >= 1


def test_the_prefix_is_pulled_from_the_host_tier_of_the_worker_holding_it(
        router: Router, workers: tuple[Worker, Worker, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The router weighs host blocks at each worker's measured reload cost (copy over recompute time per block).
    On a loaded CI box that measurement once made the pull look dearer than a recompute (with no prefill rate
    reported, a reload cost near 1 weighs the 20 host blocks like the 22 the decode worker would compute), and the
    router rightly recomputed. Here it uses the default weight: this test is about the pull from the host tier;
    the decision is tested in tests/cluster/test_routing_policy.py."""
    import cluster.routing.policy as policy
    import router.core as core

    fixed = lambda worker, weights: weights.host_reload_cost  # noqa: E731
    monkeypatch.setattr(policy, "reload_cost", fixed)
    monkeypatch.setattr(core, "reload_cost", fixed)
    a, b, _ = workers
    first = tokens(100, HISTORY_BLOCKS)
    on(router, b, first)
    for seed in (101, 102, 103, 104):  # 64 more blocks through A's 47: the first turn's go to its host tier
        on(router, b, tokens(seed, 16))
    wait_until(lambda: matched(router, a, first) == TierMatch(HISTORY_BLOCKS, HISTORY_BLOCKS), 5,
               "A's blocks on its host tier")
    fetch_turn(router, workers, first, cached_blocks=HISTORY_BLOCKS, host=HISTORY_BLOCKS)


def test_a_short_cached_prefix_is_recomputed_and_fetch_can_be_turned_off(
        router: Router, workers: tuple[Worker, Worker, str]) -> None:
    a, b, _ = workers
    short, long = tokens(200, 1), tokens(300, HISTORY_BLOCKS)
    on(router, b, short)
    on(router, b, long)
    wait_until(lambda: matched(router, a, short).blocks == 1 and matched(router, a, long).blocks == HISTORY_BLOCKS, 5,
               "A's blocks in the index")
    route = route_away(router, a, short + tokens(201, 12))  # 1 of 13 blocks cached on A
    assert not route.fetch and route.prefill is None
    assert route_away(router, a, long + tokens(301, 2)).fetch
    # A failed decode attempt's worker is no holder either.
    assert not router.route(long + tokens(301, 2), exclude_decode=frozenset({a.address})).fetch
    config = router.config
    try:
        router.config = dataclasses.replace(config, disagg_policy="static")  # role-free holders are fetched from too
        route = route_away(router, a, long + tokens(301, 2))
        assert route.fetch and router._disaggregation(route, resumed=False).min_prompt_tokens == 1  # final
        router.config = dataclasses.replace(config, prefix_fetch=False)
        route = route_away(router, a, long + tokens(301, 2))
        assert not route.fetch and route.prefill is None
    finally:
        router.config = config


def test_with_no_prefill_pool_a_turn_goes_to_the_replica_caching_its_prefix(
        router: Router, workers: tuple[Worker, Worker, str]) -> None:
    """Replicas are chosen as prefill workers are (cached prefix, then load): an idle pair sends the next turn to
    the worker holding the conversation, which computes only the new tokens; no fetch, no transfer."""
    a, b, _ = workers
    history = tokens(400, HISTORY_BLOCKS)
    on(router, b, history)  # turn one on A
    wait_until(lambda: matched(router, a, history).blocks == HISTORY_BLOCKS, 5, "A's blocks in the index")
    idle = lambda w: (pool_worker(router, w).load.num_running, pool_worker(router, w).load.kv_cache_usage)  # noqa: E731
    wait_until(lambda: idle(a) == idle(b) == (0, 0.0), 5, "heartbeats showing both idle")
    turn = history + tokens(401, 2)
    for _ in range(8):  # not a tie broken at random: every pick
        route = router.route(turn)
        assert route.decode.address == a.address and route.prefill is None and not route.fetch
        assert route.matched_blocks == HISTORY_BLOCKS
    done = generate(router, turn)
    assert done.usage.cached_tokens == HISTORY_BLOCKS * BLOCK


def test_the_flag_reaches_the_router_config() -> None:
    parser = build_parser()
    assert config_from_args(parser.parse_args(["router", "--decode", "127.0.0.1:1"])).prefix_fetch
    args = parser.parse_args(["router", "--decode", "127.0.0.1:1", "--no-prefix-fetch"])
    assert config_from_args(args).prefix_fetch is False
