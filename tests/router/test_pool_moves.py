"""Role-free workers moved between the prefill and the decode pool while requests stream: nothing fails, nothing is
lost, nothing repeats. Greedy streams equal an undisturbed run's tokens whichever worker prefilled them and however
often the pools changed under them; KV moves in both directions between the two workers. Real `tiny` worker
processes (`kvflow worker`), the router in-process; moves forced through `PoolManager.move`, as the planner makes
them."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from engine.arg_utils import EngineArgs
from kvflow.launcher import ClusterSpec, WorkerCluster
from protos.kvflow.v1 import kvflow_pb2 as pb
from router.config import RouterConfig
from router.core import Router

ENGINE = EngineArgs(model="tiny", num_gpu_blocks_override=400, max_model_len=1024)
MAX_TOKENS = 120
PARAMS = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
NUM_STREAMS = 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerCluster]:
    spec = ClusterSpec(ENGINE, prefill_workers=1, decode_workers=1, log_dir=tmp_path_factory.mktemp("workers"),
                       role_free=True)
    with WorkerCluster(spec) as workers:
        workers.wait_ready(300, progress=False)
        yield workers


class RouterThread:
    """The router on its own event loop, the two workers in their starting pools. `static`: every request whose
    decode worker has a prefill-pool worker beside it takes the P/D path (on one host, `adaptive` would prefill all
    locally), so the moves decide which path each request takes."""

    def __init__(self, cluster: WorkerCluster) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.router: Router = self.call(self._make())
        for role in ("prefill", "decode"):
            self.router.pool.set_addresses(role, cluster.addresses(role))
        self.call(self._ready())

    @staticmethod
    async def _make() -> Router:
        return Router(RouterConfig(decode=("unused",), routing="round-robin", disagg_policy="static"))

    async def _ready(self) -> None:
        for _ in range(600):
            workers = self.router.pool.all_workers()
            if self.router.is_ready() and len(workers) == 2 and all(w.healthy and w.role_free for w in workers):
                break
            await asyncio.sleep(0.05)
        await self.router.ensure_tokenizers()

    def call(self, coro: Any, timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def stream(self, prompt: list[int], delay_s: float) -> tuple[list[int], pb.GenerateComplete]:
        await asyncio.sleep(delay_s)
        streamed: list[int] = []
        async for response in self.router.generate(f"r{random.random()}", prompt, PARAMS):
            kind = response.WhichOneof("response")
            if kind == "chunk":
                streamed.extend(response.chunk.token_ids)
            elif kind == "complete":
                return streamed, response.complete
        raise AssertionError("no complete message")

    async def flip_pools(self, done: asyncio.Event, every_s: float) -> int:
        """Swap the two workers' pools until `done`: the prefill worker joins the decode pool first, then the other
        leaves it (the decode pool is never empty). Returns the moves made."""
        moves = 0
        while not done.is_set():
            await asyncio.sleep(every_s)
            (prefill,) = self.router.pool.workers("prefill") or (None,)
            if prefill is None:
                continue
            (other,) = [w for w in self.router.pool.workers("decode") if w is not prefill]
            moves += self.router.pools.move(prefill, "decode", "test: forced")
            moves += self.router.pools.move(other, "prefill", "test: forced")
        return moves

    def run(self, prompts: list[list[int]], flip_every_s: float | None) -> tuple[list[Any], int]:
        async def go() -> tuple[list[Any], int]:
            done = asyncio.Event()
            mover = asyncio.ensure_future(self.flip_pools(done, flip_every_s)) if flip_every_s else None
            results = await asyncio.gather(*(self.stream(p, 0.15 * i) for i, p in enumerate(prompts)))
            done.set()
            return list(results), (await mover if mover is not None else 0)

        return self.call(go())

    def paths(self) -> dict[str, float]:
        return {s.labels["path"]: s.value for m in self.router.metrics.requests.collect() for s in m.samples
                if s.name.endswith("_total")}

    def close(self) -> None:
        self.call(self.router.close())
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def router(cluster: WorkerCluster) -> Iterator[RouterThread]:
    harness = RouterThread(cluster)
    yield harness
    harness.close()


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(40, 200))] for _ in range(NUM_STREAMS)]


def test_moves_mid_stream_lose_and_repeat_nothing(router: RouterThread) -> None:
    reference, moved = router.run(prompts(), None)
    assert moved == 0
    assert router.paths().get("disaggregated", 0) == NUM_STREAMS  # undisturbed: 1 prefill + 1 decode worker
    results, moves = router.run(prompts(), flip_every_s=0.4)
    assert moves >= 4, "the pools changed several times while the streams ran"
    assert router.paths().get("disaggregated", 0) == 2 * NUM_STREAMS, "every transfer worked, either direction"
    for (ref_tokens, _), (tokens, complete) in zip(reference, results, strict=True):
        assert tokens == ref_tokens
        assert list(complete.choices[0].token_ids) == ref_tokens
        assert complete.usage.completion_tokens == MAX_TOKENS
        assert complete.choices[0].finish_reason == pb.FINISH_REASON_LENGTH
    moves_total = {s.labels["from"] + "->" + s.labels["to"]: s.value
                   for m in router.router.metrics.pool_moves.collect() for s in m.samples if s.name.endswith("_total")}
    assert moves_total["prefill->decode"] >= 2 and moves_total["decode->prefill"] >= 2


def test_a_pinned_worker_or_the_last_decode_worker_is_not_moved(router: RouterThread) -> None:
    (decode,) = router.router.pool.workers("decode")
    with pytest.raises(ValueError, match="last decode worker"):
        router.router.pools.move(decode, "prefill", "test")
    with pytest.raises(ValueError, match="pool must be one of"):
        router.router.pools.move(decode, "both", "test")
