"""The process a worker runs, whatever its role: CLI flags, the engine behind its thread, gRPC server, device-touching
health, `Info`, KV events, the KV-link endpoint, `/metrics`, Redis registration and the SIGTERM drain.

A role adds only its servicers (prefill_worker/, decode_worker/) through `serve_worker`. The gRPC port serves only
holders of the cluster credential, but for `Info` and health (kvflow/auth.py); channels to peers present it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from engine.kv_port import KVPort
from engine.llm_engine import LLMEngine
from engine.metrics import EngineMetrics
from engine.stat_logger import StatLogger
from engine.stats import EngineStats, FinishedRequestTiming
from kvflow.auth import ClusterAuth, add_cluster_auth_args, public_info
from kvflow.wire import layout_to_proto
from kvflow.worker.events import KVEventHub
from kvflow.worker.kv_link import PrefillLinks
from protos.kvflow.v1 import kvflow_pb2 as pb

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]
DRAIN_GRACE_S = 30.0
HEALTH_TIMEOUT_S = 5.0
VERSION = "0.1.0"
KV_TRANSFER_BACKENDS = ("auto", "nccl", "grpc")


class ChannelPool:
    """One gRPC channel per peer address, opened on first use and reused (no per-request setup); each presents
    this worker's cluster credential."""

    def __init__(self, auth: ClusterAuth | None = None) -> None:
        self._auth = auth or ClusterAuth()
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._auth.aio_channel(address, GRPC_OPTIONS)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


# ---- health and Info ------------------------------------------------------------------------------------------
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
    probe = torch.ones(2, device=engine.device) * 2
    return float(probe.sum().item()) == 4.0


def info_response(engine: LLMEngine, role: int, worker_id: str, disagg_min_prompt_tokens: int = 0
                  ) -> pb.InfoResponse:
    config = engine.config
    load = engine.load()
    return pb.InfoResponse(
        role=role, model=config.model.model, model_id=config.model.model_id, dtype=config.model.dtype,
        block_size=config.cache.block_size, kv_layout=layout_to_proto(engine.kv_port.layout),
        num_kv_blocks=load.num_kv_blocks, max_model_len=config.model.max_model_len,
        vocab_size=config.model.arch.vocab_size, device=str(engine.device), worker_id=worker_id,
        version=VERSION, num_free_kv_blocks=load.num_free_blocks,
        disagg_min_prompt_tokens=disagg_min_prompt_tokens,
    )


# ---- process lifecycle ----------------------------------------------------------------------------------------
@dataclass
class WorkerContext:
    """What a role's servicers get: the engine (behind its thread), metrics, KV events, peers' channels and the
    KV-link endpoint."""

    engine: AsyncEngine
    kv_port: KVPort  # the engine's KV cache, as transfers may touch it
    metrics: EngineMetrics
    events: KVEventHub
    worker_id: str
    model_name: str
    kv_transfer_backend: str
    channels: ChannelPool
    links: PrefillLinks
    # Awaited at shutdown, after the gRPC server drained (e.g. the decode role's KV transports and links).
    on_shutdown: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    auth: ClusterAuth = field(default_factory=ClusterAuth)


class WorkerServicer:
    """The RPCs every role serves the same way (mixed into each role's servicer)."""

    ctx: WorkerContext

    def info_for_caller(self, info: pb.InfoResponse, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        """`Info` is open to probes; a caller without the cluster token learns only the role and version."""
        return info if self.ctx.auth.accepts(context.invocation_metadata()) else public_info(info)

    async def StreamKVEvents(self, request: pb.KVEventsRequest, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[pb.KVEventBatch]:
        async for batch in self.ctx.events.subscribe():
            yield batch


def add_worker_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, default=None)
    parser.add_argument("--index", default="memory",
                        help="prefix index the router reads ('memory' or redis://...); workers always serve "
                             "StreamKVEvents, which the router consumes")
    parser.add_argument("--worker-id", default=None)
    parser.add_argument("--advertise-address", default=None,
                        help="host:port routers should dial (default --host:--port); registered in Redis when "
                             "--index is redis://; its host is also where decode workers reach this worker's KV-link "
                             "rendezvous")
    parser.add_argument("--kv-transfer-backend", choices=KV_TRANSFER_BACKENDS, default="auto",
                        help="how prompt KV moves from prefill to decode workers: 'nccl' (a torch.distributed link: "
                             "NCCL between GPUs, gloo between CPU workers), 'grpc' (bytes in the gRPC stream), or "
                             "'auto' (NCCL between GPU workers, gRPC otherwise or when no link can be opened)")
    add_cluster_auth_args(parser)


def warn_if_open(auth: ClusterAuth, host: str, address: str) -> None:
    if not auth.enabled and host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("no cluster credential (--cluster-token / KVFLOW_CLUSTER_TOKEN, or --tls-*): anyone who "
                       "reaches %s can call every RPC of this worker", address)


def validate_index_url(url: str) -> None:
    if url != "memory" and not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"--index must be 'memory' or redis://[:password@]host:port/db, got {url!r}")


def server_engine_args(args: argparse.Namespace) -> EngineArgs:
    """The engine arguments of an API server (every worker, `kvflow serve`): vLLM's server batch defaults."""
    return dataclasses.replace(EngineArgs.from_cli_args(args), usage_context="server")


async def serve_worker(args: argparse.Namespace, role_name: str,
                       add_servicers: Callable[[grpc.aio.Server, WorkerContext], object]) -> None:
    """Build the engine, serve gRPC (+ health, + /metrics) until SIGTERM/SIGINT, then drain and exit."""
    engine_args = server_engine_args(args)
    validate_index_url(args.index)
    auth = ClusterAuth.from_args(args)  # before the model loads: a bad flag fails at once
    worker_id = args.worker_id or f"{role_name}-{os.uname().nodename}-{args.port}"
    llm_engine = await asyncio.to_thread(LLMEngine.from_engine_args, engine_args, True)
    model_name = engine_args.model
    metrics = EngineMetrics(model_name)
    events = KVEventHub(worker_id)
    stat_logger = None if engine_args.disable_log_stats else StatLogger(llm_engine.device.type)

    def on_stats(stats: EngineStats, timings: list[FinishedRequestTiming]) -> None:
        metrics.update(stats, timings)
        if stat_logger is not None:
            stat_logger.observe(stats)

    engine = AsyncEngine(llm_engine, on_stats=on_stats, on_kv_events=events.publish)
    engine.start()
    address = f"{args.host}:{args.port}"
    advertised = args.advertise_address or address
    links = PrefillLinks(llm_engine.kv_port, advertised.rsplit(":", 1)[0])
    channels = ChannelPool(auth)
    context = WorkerContext(engine, llm_engine.kv_port, metrics, events, worker_id, model_name, args.kv_transfer_backend, channels,
                            links, auth=auth)

    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=auth.server_interceptors())
    add_servicers(server, context)
    health = DeviceHealth(engine)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if auth.add_port(server, address) == 0:
        raise ValueError(f"cannot listen on {address}")
    warn_if_open(auth, args.host, address)
    await server.start()
    if args.metrics_port is not None:
        metrics.serve(args.metrics_port, args.host)
    logger.info("%s worker %s serving %s on %s (device %s, KV transfer %s)", role_name, worker_id, model_name,
                address, llm_engine.device, args.kv_transfer_backend)
    registration = None
    if args.index.startswith(("redis://", "rediss://")):
        from engine.routing.registration import WorkerRegistration  # redis only when it is used

        registration = WorkerRegistration(args.index, role_name, advertised)
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
    for close in context.on_shutdown:
        await close()
    links.close()
    await channels.close()
    await engine.stop()
    logger.info("%s worker %s stopped", role_name, worker_id)
