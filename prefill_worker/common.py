"""What both worker roles share: wire conversions, `Info`, device-touching health, KV-event streaming, and the
process lifecycle (gRPC server, metrics endpoint, SIGTERM drain).

The decode worker imports this module too: it is a prefill worker plus local decoding.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.async_engine import AsyncEngine, EngineLoad
from engine.block_pool import BlockRemoved, BlockStored, KVEvent
from engine.config import EngineArgs
from engine.errors import InvalidRequest
from engine.kv_transfer import KVLayout
from engine.llm_engine import LLMEngine
from engine.metrics import EngineMetrics
from engine.outputs import Logprob, PositionLogprobs
from engine.sampling_params import SamplingParams
from protos.kvflow.v1 import kvflow_pb2 as pb

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]
HEARTBEAT_S = 0.5
DRAIN_GRACE_S = 30.0
HEALTH_TIMEOUT_S = 5.0
VERSION = "0.1.0"


# ---- wire conversions ---------------------------------------------------------------------------------------
def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Only fields the caller set count as explicit (generation-config defaults fill the rest, as in vLLM)."""
    return SamplingParams(**sampling_kwargs_from_proto(msg))  # type: ignore[arg-type]


def sampling_kwargs_from_proto(msg: pb.SamplingParams) -> dict[str, object]:
    kwargs: dict[str, object] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "max_tokens", "logprobs", "prompt_logprobs"):
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    if msg.n:
        kwargs["n"] = msg.n
    if msg.stop:
        kwargs["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.include_stop_str_in_output:
        kwargs["include_stop_str_in_output"] = True
    if msg.ignore_eos:
        kwargs["ignore_eos"] = True
    if msg.min_tokens:
        kwargs["min_tokens"] = msg.min_tokens
    if msg.skip_special_tokens_false:
        kwargs["skip_special_tokens"] = False
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = kwargs.get(name)
        if isinstance(value, float) and value != value:
            raise InvalidRequest(f"{name} must be a number, got NaN")
    return kwargs


def sampling_params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """Every effective value, so the peer samples exactly as this side would (defaults already applied)."""
    return pb.SamplingParams(
        n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, seed=params.seed, stop=list(params.stop or []),
        stop_token_ids=list(params.stop_token_ids or []), include_stop_str_in_output=params.include_stop_str_in_output,
        ignore_eos=params.ignore_eos, max_tokens=params.max_tokens, min_tokens=params.min_tokens,
        logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs,
        skip_special_tokens_false=not params.skip_special_tokens, logit_bias=params.logit_bias,
    )


def logprobs_to_proto(token_id: int, entry: PositionLogprobs) -> pb.TokenLogprob:
    chosen = entry.get(token_id)
    top = [pb.TopLogprob(token_id=t, logprob=lp.logprob, rank=lp.rank, token=lp.decoded_token or "")
           for t, lp in entry.items()]
    return pb.TokenLogprob(token_id=token_id, logprob=chosen.logprob if chosen else 0.0,
                           rank=chosen.rank if chosen else 0, top=top)


def logprobs_from_proto(msg: pb.TokenLogprob) -> PositionLogprobs:
    entry = {t.token_id: Logprob(t.logprob, t.rank, t.token or None) for t in msg.top}
    entry.setdefault(msg.token_id, Logprob(msg.logprob, msg.rank))
    return entry


def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(dtype=layout.dtype, num_layers=layout.num_layers, block_size=layout.block_size,
                       num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, order=layout.order)


def layout_from_proto(msg: pb.KVLayout) -> KVLayout:
    return KVLayout(msg.dtype, msg.num_layers, msg.block_size, msg.num_kv_heads, msg.head_dim, msg.order)


def engine_layout(engine: LLMEngine) -> KVLayout:
    return KVLayout.of_caches(engine.runner.kv_caches, engine.config.model.dtype)


# ---- KV events ----------------------------------------------------------------------------------------------
class KVEventHub:
    """Fans the engine's prefix-cache events out to any number of `StreamKVEvents` subscribers.

    It mirrors the cached set (hash -> parent) from the event stream itself, so a new subscriber's snapshot is
    exactly consistent with the events that follow it. Sequence numbers count batches per subscription.
    """

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.epoch = time.time_ns()  # new on every process start
        self.cached: dict[bytes, bytes | None] = {}
        self.load: EngineLoad | None = None
        self._subscribers: set[asyncio.Queue[list[pb.KVEvent]]] = set()

    def publish(self, events: list[KVEvent], load: EngineLoad) -> None:
        """Called on the event loop with each batch drained from the engine."""
        self.load = load
        if not events:
            return
        wire = []
        for event in events:
            if isinstance(event, BlockStored):
                parent = event.parent_hash
                for block_hash in event.block_hashes:
                    self.cached[block_hash] = parent
                    parent = block_hash
                wire.append(pb.KVEvent(stored=pb.BlockStoredEvent(block_hashes=event.block_hashes,
                                                                  parent_hash=event.parent_hash or b"")))
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self.cached.pop(block_hash, None)
                wire.append(pb.KVEvent(removed=pb.BlockRemovedEvent(block_hashes=event.block_hashes)))
        for subscriber in self._subscribers:
            subscriber.put_nowait(wire)

    def _load_proto(self) -> pb.WorkerLoad:
        load = self.load
        if load is None:
            return pb.WorkerLoad()
        return pb.WorkerLoad(num_running=load.num_running, num_waiting=load.num_waiting,
                             queued_prefill_tokens=load.queued_prefill_tokens, kv_cache_usage=load.kv_cache_usage,
                             num_kv_blocks=load.num_kv_blocks, num_preemptions=load.num_preemptions)

    def _batch(self, sequence: int, events: list[pb.KVEvent]) -> pb.KVEventBatch:
        return pb.KVEventBatch(worker_id=self.worker_id, epoch=self.epoch, sequence=sequence, events=events,
                               load=self._load_proto(), sent_unix_s=time.time())

    async def subscribe(self) -> AsyncIterator[pb.KVEventBatch]:
        """Snapshot first (cleared + every cached block), then event batches, heartbeats at least every 500 ms."""
        inbox: asyncio.Queue[list[pb.KVEvent]] = asyncio.Queue()
        snapshot = [pb.KVEvent(cleared=pb.AllBlocksClearedEvent())]
        snapshot += [pb.KVEvent(stored=pb.BlockStoredEvent(block_hashes=[h], parent_hash=p or b""))
                     for h, p in self.cached.items()]
        self._subscribers.add(inbox)
        try:
            sequence = 0
            yield self._batch(sequence, snapshot)
            while True:
                try:
                    events = await asyncio.wait_for(inbox.get(), HEARTBEAT_S)
                except asyncio.TimeoutError:
                    events = []
                while not inbox.empty():
                    events = events + inbox.get_nowait()
                sequence += 1
                yield self._batch(sequence, events)
        finally:
            self._subscribers.discard(inbox)


# ---- health ---------------------------------------------------------------------------------------------------
class DeviceHealth(health_pb2_grpc.HealthServicer):
    """grpc.health.v1: SERVING only if the engine thread answers and a tensor op on its device succeeds."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.draining = False

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
                    ) -> health_pb2.HealthCheckResponse:
        status = health_pb2.HealthCheckResponse.NOT_SERVING
        if not self.draining:
            try:
                ok = await asyncio.wait_for(self.engine.call(_touch_device), HEALTH_TIMEOUT_S)
                if ok:
                    status = health_pb2.HealthCheckResponse.SERVING
            except Exception as exc:  # any failure is "not serving", reported to the prober
                logger.warning("health check failed: %s", exc)
        return health_pb2.HealthCheckResponse(status=status)


def _touch_device(engine: LLMEngine) -> bool:
    probe = torch.ones(2, device=engine.runner.device) * 2
    return float(probe.sum().item()) == 4.0


# ---- Info -----------------------------------------------------------------------------------------------------
def info_response(engine: LLMEngine, role: int, worker_id: str, disagg_min_prompt_tokens: int = 0
                  ) -> pb.InfoResponse:
    config = engine.config
    return pb.InfoResponse(
        role=role, model=config.model.model, model_id=config.model.model_id, dtype=config.model.dtype,
        block_size=config.cache.block_size, kv_layout=layout_to_proto(engine_layout(engine)),
        num_kv_blocks=engine.kv_manager.pool.num_usable_blocks, max_model_len=config.model.max_model_len,
        vocab_size=config.model.arch.vocab_size, device=str(engine.runner.device), worker_id=worker_id,
        version=VERSION, num_free_kv_blocks=engine.kv_manager.pool.num_free_blocks,
        disagg_min_prompt_tokens=disagg_min_prompt_tokens,
    )


# ---- process lifecycle ----------------------------------------------------------------------------------------
@dataclass
class WorkerContext:
    """What a role's servicers get: the engine (behind its thread), metrics and KV events."""

    engine: AsyncEngine
    metrics: EngineMetrics
    events: KVEventHub
    worker_id: str
    model_name: str


def add_worker_args(parser: object) -> None:
    parser.add_argument("--host", default="127.0.0.1")  # type: ignore[attr-defined]
    parser.add_argument("--port", type=int, required=True)  # type: ignore[attr-defined]
    parser.add_argument("--metrics-port", type=int, default=None)  # type: ignore[attr-defined]
    parser.add_argument("--index", default="memory",  # type: ignore[attr-defined]
                        help="prefix index the router reads ('memory' or redis://...); workers always serve "
                             "StreamKVEvents, which the router consumes")
    parser.add_argument("--worker-id", default=None)  # type: ignore[attr-defined]
    parser.add_argument("--advertise-address", default=None,  # type: ignore[attr-defined]
                        help="host:port routers should dial (default --host:--port); registered in Redis when "
                             "--index is redis://")


def validate_index_url(url: str) -> None:
    if url != "memory" and not url.startswith(("redis://", "rediss://")):
        raise ValueError(f"--index must be 'memory' or redis://[:password@]host:port/db, got {url!r}")


def server_engine_args(args: object) -> EngineArgs:
    """A worker serves the API (prefill and decode roles alike): vLLM's server batch defaults."""
    return dataclasses.replace(EngineArgs.from_cli_args(args), usage_context="server")  # type: ignore[arg-type]


async def serve_worker(args: object, role_name: str,
                       add_servicers: Callable[[grpc.aio.Server, WorkerContext], object]) -> None:
    """Build the engine, serve gRPC (+ health, + /metrics) until SIGTERM/SIGINT, then drain and exit."""
    engine_args = server_engine_args(args)
    validate_index_url(args.index)  # type: ignore[attr-defined]
    worker_id = args.worker_id or f"{role_name}-{os.uname().nodename}-{args.port}"  # type: ignore[attr-defined]
    llm_engine = await asyncio.to_thread(LLMEngine.from_engine_args, engine_args, True)
    model_name = engine_args.model
    metrics = EngineMetrics(model_name)
    events = KVEventHub(worker_id)
    engine = AsyncEngine(llm_engine, on_stats=metrics.update, on_kv_events=events.publish)
    engine.start()
    context = WorkerContext(engine, metrics, events, worker_id, model_name)

    server = grpc.aio.server(options=GRPC_OPTIONS)
    add_servicers(server, context)
    health = DeviceHealth(engine)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    address = f"{args.host}:{args.port}"  # type: ignore[attr-defined]
    if server.add_insecure_port(address) == 0:
        raise ValueError(f"cannot listen on {address}")
    await server.start()
    if args.metrics_port is not None:  # type: ignore[attr-defined]
        metrics.serve(args.metrics_port, args.host)  # type: ignore[attr-defined]
    logger.info("%s worker %s serving %s on %s", role_name, worker_id, model_name, address)
    registration = None
    if args.index.startswith(("redis://", "rediss://")):  # type: ignore[attr-defined]
        from engine.routing.registration import WorkerRegistration  # redis only when it is used

        registration = WorkerRegistration(args.index, role_name,  # type: ignore[attr-defined]
                                          args.advertise_address or address)  # type: ignore[attr-defined]
        registration.start()

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("draining in-flight requests (up to %.0f s)", DRAIN_GRACE_S)
    health.draining = True
    if registration is not None:  # routers stop sending new work here first
        registration.stop()
    await server.stop(DRAIN_GRACE_S)
    await engine.stop()
    logger.info("%s worker %s stopped", role_name, worker_id)
