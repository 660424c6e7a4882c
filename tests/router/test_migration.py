"""Mid-stream migration: a decode worker killed (kill -9) while streaming a request; the router moves the request
to another decode worker with the tokens already streamed, and the caller's stream continues with no token lost
or repeated: greedy and seeded sampling (with penalties) give exactly an undisturbed run's tokens. Past
--max-migrations the caller gets a clean error. Real `tiny` worker processes, the router in-process."""

from __future__ import annotations

import asyncio
import random
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from engine.arg_utils import EngineArgs
from kvflow.launcher import ClusterSpec, WorkerCluster
from protos.kvflow.v1 import kvflow_pb2 as pb
from router.config import RouterConfig
from router.core import Router
from router.delivered import Delivered
from router.errors import RouterError

ENGINE = EngineArgs(model="tiny", num_gpu_blocks_override=200, max_model_len=1024)
MAX_TOKENS = 300
KILL_AFTER = 25  # tokens streamed before the serving worker is killed


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerCluster]:
    spec = ClusterSpec(ENGINE, prefill_workers=0, decode_workers=5, log_dir=tmp_path_factory.mktemp("workers"),
                       drain_timeout_s=1.0)
    with WorkerCluster(spec) as workers:
        workers.wait_ready(300, progress=False)
        yield workers


class RouterThread:
    def __init__(self, config: RouterConfig, cluster: WorkerCluster) -> None:
        self.cluster = cluster
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.router: Router = self.call(self._make(config))
        self.router.pool.set_addresses("decode", [w.address for w in cluster.workers if w.process.poll() is None])
        self.call(self._ready())

    @staticmethod
    async def _make(config: RouterConfig) -> Router:
        return Router(config)

    async def _ready(self) -> None:
        for _ in range(600):
            if self.router.is_ready() and len(self.router.pool.workers("decode")) >= 2:
                break
            await asyncio.sleep(0.05)
        await self.router.ensure_tokenizers()

    def call(self, coro: Any, timeout: float = 180) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stream(self, prompt: list[int], params: pb.SamplingParams, kill: bool,
               sig: signal.Signals = signal.SIGKILL) -> tuple[list[int], pb.GenerateComplete]:
        """All streamed token ids and the complete message; with `kill`, the serving worker gets `sig` after
        KILL_AFTER tokens."""
        request_id = f"r{random.random()}"

        async def run() -> tuple[list[int], pb.GenerateComplete]:
            streamed: list[int] = []
            killed = False
            async for response in self.router.generate(request_id, prompt, params):
                kind = response.WhichOneof("response")
                if kind == "chunk":
                    streamed.extend(response.chunk.token_ids)
                    if kill and not killed and len(streamed) >= KILL_AFTER:
                        (worker,) = self.router._decode_of[("", request_id)].values()
                        address = worker.address
                        victim = next(w for w in self.cluster.workers if w.address == address)
                        victim.process.send_signal(sig)
                        killed = True
                elif kind == "complete":
                    return streamed, response.complete
            raise AssertionError("no complete message")

        return self.call(run())

    def migrations(self) -> float:
        return sum(s.value for m in self.router.metrics.migrations.collect() for s in m.samples
                   if s.name.endswith("_total"))

    def close(self) -> None:
        self.call(self.router.close())
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def router(cluster: WorkerCluster) -> Iterator[RouterThread]:
    harness = RouterThread(RouterConfig(decode=("unused",), routing="round-robin"), cluster)
    yield harness
    harness.close()


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(60)]


@pytest.mark.parametrize("params", [
    pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=11, repetition_penalty=1.2, top_k=40,
                      ignore_eos=True),
], ids=["greedy", "seeded"])
def test_killed_decode_worker_mid_stream_loses_and_repeats_nothing(router: RouterThread, params: pb.SamplingParams
                                                                   ) -> None:
    tokens = prompt(int(params.temperature * 10))
    reference, _ = router.stream(tokens, params, kill=False)
    assert len(reference) == MAX_TOKENS
    before = router.migrations()
    streamed, complete = router.stream(tokens, params, kill=True)
    assert router.migrations() == before + 1
    assert streamed == reference, "the stream continued on another worker exactly where it stopped"
    assert list(complete.choices[0].token_ids) == reference
    assert complete.usage.completion_tokens == MAX_TOKENS
    assert complete.choices[0].finish_reason == pb.FINISH_REASON_LENGTH


def test_a_drained_decode_worker_hands_its_streams_over(router: RouterThread) -> None:
    """SIGTERM (a rolling update): the worker finishes what it can within --drain-timeout (1 s here), then ends the
    rest UNAVAILABLE, and the router continues them elsewhere."""
    params = pb.SamplingParams(max_tokens=MAX_TOKENS * 3, temperature=0.0, ignore_eos=True)
    tokens = prompt(42)
    reference, _ = router.stream(tokens, params, kill=False)
    before = router.migrations()
    streamed, complete = router.stream(tokens, params, kill=True, sig=signal.SIGTERM)
    assert streamed == reference and list(complete.choices[0].token_ids) == reference
    assert router.migrations() == before + 1


def test_past_max_migrations_the_caller_gets_a_clean_error(cluster: WorkerCluster) -> None:
    harness = RouterThread(RouterConfig(decode=("unused",), routing="round-robin", max_migrations=0), cluster)
    try:
        before = harness.migrations()
        with pytest.raises(RouterError, match="not migrated"):
            harness.stream(prompt(3), pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
                           kill=True)
        assert harness.migrations() == before
    finally:
        harness.close()


def test_a_migrated_completion_still_carries_its_whole_text_and_logprobs() -> None:
    delivered = Delivered()
    delivered.start_attempt()
    delivered.add(pb.GenerateChunk(index=0, token_ids=[5, 6], text="Hello",
                                   logprobs=[pb.TokenLogprob(token_id=5), pb.TokenLogprob(token_id=6)]))
    delivered.start_attempt()  # migrated: the next worker knows only its own part
    delivered.add(pb.GenerateChunk(index=0, token_ids=[7], text=" world", logprobs=[pb.TokenLogprob(token_id=7)]))
    complete = pb.GenerateComplete(choices=[pb.CompletionChoice(
        token_ids=[5, 6, 7], text=" world", logprobs=[pb.TokenLogprob(token_id=7)])])
    delivered.complete(complete)
    assert complete.choices[0].text == "Hello world"
    assert [lp.token_id for lp in complete.choices[0].logprobs] == [5, 6, 7]
    assert delivered.token_ids == [5, 6, 7]
