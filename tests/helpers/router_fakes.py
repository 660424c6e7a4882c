"""A real router (`router.server.serve_router`: HTTP + gRPC fronts) in front of fake workers, for input tests.

The fake decode worker parses every request with the real workers' own conversion and checks it as a worker
would (token ids in the vocabulary, lengths within max_model_len), then answers a canned completion. A request the
router forwards but a real worker would refuse is answered INTERNAL, which the router turns into a 5xx: so a test
asserting "never 5xx" also asserts the router validated everything itself. `SLOW_PROMPT` streams one chunk, then
waits until the router aborts it (or the call ends); every call's metadata is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import httpx

from cluster.wire import sampling_params_from_proto
from kvflow.launcher import free_port
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc
from router.config import RouterConfig
from router.core import Router

MODEL = "smollm2"  # the router loads this model's tokenizer (the built-in SmolLM2 package ships it)
MODEL_ID = "fake-model"
VOCAB_SIZE = 49152  # SmolLM2's
MAX_MODEL_LEN = 1024
BLOCK_SIZE = 16
REFUSED_PROMPT = [31337] * 5  # the fake decode worker answers INVALID_ARGUMENT to this prompt, as a worker may
SLOW_PROMPT = [4242] * 5  # streams one chunk, then runs until aborted


def _info(role: int) -> pb.InfoResponse:
    return pb.InfoResponse(role=role, model=MODEL, model_id=MODEL_ID, block_size=BLOCK_SIZE,
                           max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB_SIZE, worker_id=f"fake-{role}")


def _heartbeats(role: int, context: grpc.ServicerContext) -> Iterator[pb.KVEventBatch]:
    worker_id, epoch, sequence = f"fake-{role}", int(time.time() * 1000), 0
    yield pb.KVEventBatch(worker_id=worker_id, epoch=epoch, sequence=sequence, load=pb.WorkerLoad(),
                          events=[pb.KVEvent(cleared=pb.AllBlocksClearedEvent())])
    while context.is_active():
        time.sleep(0.2)
        sequence += 1
        yield pb.KVEventBatch(worker_id=worker_id, epoch=epoch, sequence=sequence, load=pb.WorkerLoad())


class FakeDecode(kvflow_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[tuple[str, dict[str, str]]] = []  # (RPC, its invocation metadata) of every call
        self.running: dict[str, threading.Event] = {}  # SLOW_PROMPT requests by id: set = aborted

    def _seen(self, name: str, context: grpc.ServicerContext) -> None:
        self.metadata.append((name, dict(context.invocation_metadata() or ())))

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:  # noqa: N802
        self._seen("Info", context)
        return _info(pb.WORKER_ROLE_DECODE)

    def StreamKVEvents(self, request: pb.KVEventsRequest, context: grpc.ServicerContext):  # noqa: N802
        self._seen("StreamKVEvents", context)
        yield from _heartbeats(pb.WORKER_ROLE_DECODE, context)

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:  # noqa: N802
        self._seen("Abort", context)
        aborted = self.running.get(request.request_id)
        if aborted is not None:
            aborted.set()
        return pb.AbortResponse(found=aborted is not None)

    def _slow(self, request: pb.GenerateRequest, context: grpc.ServicerContext):  # noqa: ANN202
        aborted = self.running.setdefault(request.request_id, threading.Event())
        try:
            yield pb.GenerateResponse(chunk=pb.GenerateChunk(token_ids=[7], text="ok"))
            while context.is_active() and not aborted.wait(0.05):
                pass
            yield pb.GenerateResponse(complete=pb.GenerateComplete(choices=[pb.CompletionChoice(
                token_ids=[7], text="ok", finish_reason=pb.FINISH_REASON_ABORT)], usage=pb.Usage(prompt_tokens=5)))
        finally:
            self.running.pop(request.request_id, None)

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):  # noqa: N802
        self._seen("Generate", context)
        self.requests.append(request)
        if list(request.token_ids.ids) == SLOW_PROMPT:
            yield from self._slow(request, context)
            return
        try:
            params = sampling_params_from_proto(request.sampling_params)
            ids = list(request.token_ids.ids)
            if not ids or max(ids) >= VOCAB_SIZE:
                raise ValueError(f"prompt token ids must be in [0, {VOCAB_SIZE})")
            if len(ids) + (params.max_tokens or 1) > MAX_MODEL_LEN:
                raise ValueError("prompt + max_tokens exceed max_model_len")
            if params.logit_bias and max(params.logit_bias) >= VOCAB_SIZE:
                raise ValueError("logit_bias token ids out of range")
        except ValueError as exc:  # a real worker would refuse it: the router should have
            context.abort(grpc.StatusCode.INTERNAL, f"fake worker: router forwarded an invalid request: {exc}")
        if ids == REFUSED_PROMPT:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fake worker: this prompt is refused")
        top = [pb.TopLogprob(token_id=t, logprob=-1.0 - t, rank=t + 1) for t in range(params.logprobs or 0)]
        logprobs = [pb.TokenLogprob(token_id=7, logprob=-0.5, rank=1, top=top)] if params.logprobs is not None else []
        for index in range(params.n):
            if request.stream:
                yield pb.GenerateResponse(chunk=pb.GenerateChunk(index=index, token_ids=[7], text="ok",
                                                                 logprobs=logprobs))
        choices = [pb.CompletionChoice(index=i, token_ids=[7], text="ok", finish_reason=pb.FINISH_REASON_LENGTH,
                                       logprobs=logprobs) for i in range(params.n)]
        yield pb.GenerateResponse(complete=pb.GenerateComplete(
            choices=choices, usage=pb.Usage(prompt_tokens=len(ids), completion_tokens=params.n),
            prefill_path=pb.PREFILL_PATH_DISAGGREGATED))


class FakePrefill(kvflow_pb2_grpc.PrefillServicer):
    """Only Info and KV events: the router never calls Prefill itself (decode workers do)."""

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:  # noqa: N802
        return _info(pb.WORKER_ROLE_PREFILL)

    def StreamKVEvents(self, request: pb.KVEventsRequest, context: grpc.ServicerContext):  # noqa: N802
        yield from _heartbeats(pb.WORKER_ROLE_PREFILL, context)


class PacedDecode(FakeDecode):
    """A fake decode worker that generates at a set pace: `first_gap_s` before the first token, then one token per
    `interval_s` up to max_tokens; it counts calls that ended before their last token (the caller cancelled)."""

    def __init__(self) -> None:
        super().__init__()
        self.first_gap_s, self.interval_s = 0.0, 0.0
        self.running = 0
        self.cancelled = 0
        self._lock = threading.Lock()

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):  # noqa: N802
        params = sampling_params_from_proto(request.sampling_params)
        with self._lock:
            self.running += 1
        completed = False
        try:
            for step in range(params.max_tokens or 1):
                if not _sleep_while_active(context, self.first_gap_s if step == 0 else self.interval_s):
                    return
                if request.stream:
                    yield pb.GenerateResponse(chunk=pb.GenerateChunk(index=0, token_ids=[7], text="ok"))
            tokens = params.max_tokens or 1
            yield pb.GenerateResponse(complete=pb.GenerateComplete(
                choices=[pb.CompletionChoice(index=0, token_ids=[7] * tokens, text="ok" * tokens,
                                             finish_reason=pb.FINISH_REASON_LENGTH)],
                usage=pb.Usage(prompt_tokens=len(request.token_ids.ids), completion_tokens=tokens)))
            completed = True
        finally:  # also when the call was cancelled while the generator waited at a yield (GeneratorExit)
            with self._lock:
                self.running -= 1
                self.cancelled += not completed


def _sleep_while_active(context: grpc.ServicerContext, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while context.is_active():
        left = deadline - time.monotonic()
        if left <= 0:
            return True
        time.sleep(min(left, 0.01))
    return False


class FakeWorkers:
    """One fake decode and one fake prefill worker on a thread-pool gRPC server each."""

    def __init__(self, decode: FakeDecode | None = None) -> None:
        self.decode = decode or FakeDecode()
        self.decode_address, self.prefill_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self._servers = [grpc.server(futures.ThreadPoolExecutor(max_workers=16)) for _ in range(2)]
        kvflow_pb2_grpc.add_GenerationServicer_to_server(self.decode, self._servers[0])
        kvflow_pb2_grpc.add_PrefillServicer_to_server(FakePrefill(), self._servers[1])
        for server, address in zip(self._servers, (self.decode_address, self.prefill_address), strict=True):
            server.add_insecure_port(address)
            server.start()

    def close(self) -> None:
        for server in self._servers:
            server.stop(grace=None)


async def _make_router(config: RouterConfig) -> Router:
    return Router(config)  # on the router's loop


class RouterHarness:
    """`serve_router` on its own event loop thread; the test talks to it over real HTTP and gRPC."""

    def __init__(self, workers: FakeWorkers, **overrides: Any) -> None:
        from router.server import serve_router

        self.config = dataclasses.replace(
            RouterConfig(prefill=(workers.prefill_address,), decode=(workers.decode_address,), port=free_port(),
                         grpc_port=free_port(), disable_log_requests=True, disable_log_stats=True), **overrides)
        self.url = f"http://127.0.0.1:{self.config.port}"
        self.grpc_address = f"127.0.0.1:{self.config.grpc_port}"
        key = next(iter(self.config.accepted_keys), None)  # the first of several
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="router-loop", daemon=True)
        self._thread.start()
        self.router = asyncio.run_coroutine_threadsafe(_make_router(self.config), self._loop).result(30)
        self._task = asyncio.run_coroutine_threadsafe(serve_router(self.config, router=self.router), self._loop)
        self.http = httpx.Client(base_url=self.url, timeout=30,
                                 headers={"Authorization": f"Bearer {key}"} if key else None)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 120
        while True:
            assert not self._task.done(), f"the router stopped: {self._task.exception()}"
            try:  # ready means a worker answered and the tokenizer is loaded (a chat request needs both)
                if self.http.get("/health").status_code == 200 and self.post(
                        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the router did not become ready"
            time.sleep(0.1)

    def post(self, path: str, body: Any = None, content: bytes | None = None, **kwargs: Any) -> httpx.Response:
        if content is not None:
            return self.http.post(path, content=content, headers={"content-type": "application/json"}, **kwargs)
        return self.http.post(path, json=body, **kwargs)

    def request_stop(self) -> None:
        """What SIGTERM does to a router process: start the drain."""
        self._loop.call_soon_threadsafe(self.router.lifecycle.request_stop)

    def stopped(self, timeout: float) -> bool:
        try:
            self._task.result(timeout)
        except futures.TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.http.close()
        self._loop.call_soon_threadsafe(self._task.cancel)
        with contextlib.suppress(futures.CancelledError, asyncio.CancelledError):
            self._task.result(timeout=15)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
