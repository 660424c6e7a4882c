"""The process a worker runs, whatever its role: the engine behind its thread, gRPC server, device-touching health,
`Info`, KV events, both ends of KV transfer (built by cluster/transfer/registry.py), `/metrics`, Redis registration
and the SIGTERM drain. Its CLI flags are cluster/worker/args.py.

A role adds only its servicers (prefill_worker/, decode_worker/) through `serve_worker`. The gRPC port serves only
holders of the cluster credential, but for `Info` and health (cluster/auth.py); channels to peers present it.

The drain (SIGTERM or SIGINT): health turns NOT_SERVING and the Redis registration is withdrawn, so no new work is
routed here; request RPCs (`@admitted`: Generate, Prefill) arriving anyway get UNAVAILABLE, which the router and
decode workers treat as "try elsewhere". Those in flight get up to --drain-timeout; the rest are then ended by the
role (`WorkerContext.on_drain_timeout`: a decode worker aborts them in its engine, so each stream still ends with a
complete message, finish_reason ABORT; a prefill worker's streams are cancelled by the server's stop, and their
decode workers prefill locally), and only then does the gRPC server stop. A second signal cuts the wait short.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.auth import ClusterAuth, public_info
from cluster.routing.index import validate_index_url
from cluster.transfer.faults import FaultInjector
from cluster.transfer.link import RANK_MODULE
from cluster.transfer.registry import WorkerTransfer, build_worker_transfer
from cluster.wire import layout_to_proto
from cluster.worker.args import server_engine_args
from cluster.worker.channels import GRPC_OPTIONS, ChannelPool
from cluster.worker.events import KVEventHub
from cluster.worker.threads import in_passing_thread
from engine.async_engine import AsyncEngine
from engine.kv_port import KVPort
from engine.llm_engine import LLMEngine
from engine.metrics.prometheus import EngineMetrics
from engine.metrics.stat_logger import StatLogger
from engine.metrics.stats import EngineStats, FinishedRequestTiming
from engine.parallel.executor import rank_device
from engine.process.gc_heap import freeze_startup_heap
from protos.kvflow.v1 import kvflow_pb2 as pb

if TYPE_CHECKING:
    from cluster.routing.registration import WorkerRegistration

logger = logging.getLogger(__name__)

ABORT_FLUSH_S = 5.0  # after the drain timeout: for the ended requests' last messages, then calls are cancelled
HEALTH_TIMEOUT_S = 5.0
CPU_WORKER_GIL_SWITCH_S = 0.0005  # sys.setswitchinterval on CPU workers (see serve_worker)
VERSION = "0.1.0"
ROLES = {"prefill": pb.WORKER_ROLE_PREFILL, "decode": pb.WORKER_ROLE_DECODE, "worker": pb.WORKER_ROLE_UNIFIED}


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
    engine.check_ranks()  # tensor parallelism: a dead rank makes the worker NOT_SERVING
    probe = torch.ones(2, device=engine.device) * 2
    return float(probe.sum().item()) == 4.0


def info_response(engine: LLMEngine, role: int, worker_id: str, disagg_min_prompt_tokens: int = 0
                  ) -> pb.InfoResponse:
    config = engine.config
    load = engine.load()
    rank_devices = [rank_device(str(engine.device), r) for r in range(
        config.device.tensor_parallel_size * config.device.pipeline_parallel_size)]
    return pb.InfoResponse(
        role=role, model=config.model.model, model_id=config.model.model_id, dtype=config.model.dtype,
        block_size=config.cache.block_size, kv_layout=layout_to_proto(engine.kv_port.layout),
        num_kv_blocks=load.num_kv_blocks, max_model_len=config.model.max_model_len,
        vocab_size=config.model.arch.vocab_size, device=str(engine.device), worker_id=worker_id,
        version=VERSION, num_free_kv_blocks=load.num_free_blocks,
        disagg_min_prompt_tokens=disagg_min_prompt_tokens,
        tensor_parallel_size=config.device.tensor_parallel_size,
        pipeline_parallel_size=config.device.pipeline_parallel_size,
        rank_devices=rank_devices,
        compute_domain=compute_domain([torch.device(d) for d in rank_devices]),
        all_reduce=engine.runner.all_reduce_kind,
    )


def compute_domain(devices: list[torch.device]) -> str:
    """The physical compute a worker runs on: each rank's GPU UUID (the same under any CUDA_VISIBLE_DEVICES
    mapping), sorted and comma-separated, or the host's cores. The router never prefills on one worker for another
    whose domain overlaps (cluster.routing.policy.shares_compute)."""
    if devices and devices[0].type == "cuda":
        return ",".join(sorted({f"gpu-{torch.cuda.get_device_properties(d).uuid}" for d in devices}))
    return f"{devices[0].type if devices else 'cpu'}@{os.uname().nodename}"


# ---- process lifecycle ----------------------------------------------------------------------------------------
class Admission:
    """Whether request RPCs are still taken, and how many run (event loop only)."""

    def __init__(self) -> None:
        self.open = True
        self.in_flight = 0

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    async def wait_idle(self, timeout_s: float, cut_short: asyncio.Event) -> bool:
        """Wait until nothing is in flight (True), `timeout_s` passed or `cut_short` is set (False)."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline and not cut_short.is_set():
            await asyncio.sleep(0.05)
        return not self.in_flight


def admitted(method: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """For a servicer's server-streaming request RPC: UNAVAILABLE while the worker drains, else counted in flight
    until its stream ends."""
    @functools.wraps(method)
    async def wrapper(self: WorkerServicer, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        admission = self.ctx.admission
        if not admission.open:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.ctx.worker_id} is shutting down")
        with admission.track():
            async with contextlib.aclosing(method(self, request, context)) as responses:
                async for response in responses:
                    yield response

    return wrapper


@dataclass
class WorkerContext:
    """What a role's servicers get: the engine (behind its thread), metrics, KV events, peers' channels and both
    ends of KV transfer."""

    engine: AsyncEngine
    kv_port: KVPort  # the engine's KV cache, as transfers may touch it
    metrics: EngineMetrics
    events: KVEventHub
    worker_id: str
    model_name: str
    channels: ChannelPool
    transfer: WorkerTransfer  # closed at shutdown, after the gRPC server stopped
    role: int = pb.WORKER_ROLE_UNIFIED  # what `Info` reports: pinned (prefill, decode) or role-free (unified)
    auth: ClusterAuth = field(default_factory=ClusterAuth)
    admission: Admission = field(default_factory=Admission)
    # Called when --drain-timeout passed with requests still in flight: end them (each stream ends by itself).
    on_drain_timeout: list[Callable[[], None]] = field(default_factory=list)


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


def warn_if_open(auth: ClusterAuth, host: str, address: str) -> None:
    if not auth.enabled and host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("no cluster credential (--cluster-token / KVFLOW_CLUSTER_TOKEN, or --tls-*): anyone who "
                       "reaches %s can call every RPC of this worker", address)


async def serve_worker(args: argparse.Namespace, role_name: str,
                       add_servicers: Callable[[grpc.aio.Server, WorkerContext], object]) -> None:
    """Build the engine, serve gRPC (+ health, + /metrics) until SIGTERM/SIGINT, then drain and exit."""
    engine_args = server_engine_args(args)
    validate_index_url(args.index)
    auth = ClusterAuth.from_args(args)  # before the model loads: a bad flag fails at once
    if not args.drain_timeout >= 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    faults = FaultInjector(args.kv_transfer_fault_rate)
    if role_name != "decode" and engine_args.pipeline_parallel_size > 1:  # before any rank starts
        raise ValueError(f"--pipeline-parallel-size {engine_args.pipeline_parallel_size} is not supported on "
                         f"{role_name} workers: each stage holds only its layers' KV; run pipeline-parallel decode "
                         "workers, which prefill locally (kvflow serve --pipeline-parallel-size N --prefill-workers 0)")
    worker_id = args.worker_id or f"{role_name}-{os.uname().nodename}-{args.port}"
    # Tensor parallelism: the other ranks run the KV links' agents too, so each rank moves its own heads (gloo links
    # rendezvous over this worker's or the peer's KVLinkStore RPC: the ranks get the credential in their env). They die
    # with the thread that starts them (engine/process/lifeline.py): a passing thread would take them along when it
    # ends, so a tensor-parallel engine is built on this (main, loop) thread, before the server starts.
    if engine_args.tensor_parallel_size > 1:
        llm_engine = LLMEngine.from_engine_args(engine_args, True, RANK_MODULE, auth.env())
    else:
        llm_engine = await in_passing_thread(LLMEngine.from_engine_args, engine_args, True, RANK_MODULE)
    if llm_engine.device.type == "cpu":
        # The engine thread gives up the GIL inside every torch op and needs it back between ops; with Python's
        # 5 ms default a busy asyncio/gRPC thread can hold it that long each time. 0.5 ms measured +2-4 % req/s
        # served on 2 cores (bench/CPU_PROFILE.md). Process-wide, and this process is the worker alone.
        sys.setswitchinterval(CPU_WORKER_GIL_SWITCH_S)
    freeze_startup_heap(f"{role_name} worker")  # process-wide too: this process serves this engine alone
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
    channels = ChannelPool(auth)
    transfer = build_worker_transfer(args.kv_transfer_backend, llm_engine.kv_port, worker_id, advertised, channels,
                                     faults)
    context = WorkerContext(engine, llm_engine.kv_port, metrics, events, worker_id, model_name, channels, transfer,
                            role=ROLES[role_name], auth=auth)

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
        from cluster.routing.registration import WorkerRegistration  # redis only when it is used

        # A role-free worker joins the decode pool; the router's planner moves it from there.
        registration = WorkerRegistration(args.index, "decode" if role_name == "worker" else role_name, advertised)
        registration.start()

    stop, cut_short = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (cut_short if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    rank_failure: list[BaseException] = []
    watch = asyncio.create_task(_watch_ranks(llm_engine, health, stop, rank_failure)) \
        if engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size > 1 else None
    await stop.wait()
    if watch is not None:
        watch.cancel()
    await _drain(context, health, registration, args.drain_timeout, cut_short)
    await server.stop(ABORT_FLUSH_S)
    await transfer.close()
    await channels.close()
    await engine.stop()
    llm_engine.shutdown()  # the other tensor-parallel ranks, if any
    logger.info("%s worker %s stopped", role_name, worker_id)
    if rank_failure:  # a non-zero exit: a supervisor (kvflow serve, Kubernetes) starts a whole new worker
        raise RuntimeError(f"stopped after a tensor-parallel failure: {rank_failure[0]}")


async def _watch_ranks(llm_engine: LLMEngine, health: DeviceHealth, stop: asyncio.Event,
                       failure: list[BaseException]) -> None:
    """Tensor parallelism: once a rank is gone the engine cannot run a step again, so turn NOT_SERVING at once
    and stop the worker (no new work is routed here; its supervisor restarts it with all its ranks)."""
    while not stop.is_set():
        try:
            llm_engine.check_ranks()  # reads process states and a flag only: safe beside the engine thread
        except Exception as exc:  # noqa: BLE001 - any rank failure ends this worker
            logger.error("%s: this worker turns NOT_SERVING and stops", exc)
            health.draining = True
            failure.append(exc)
            stop.set()
            return
        await asyncio.sleep(0.5)


async def _drain(context: WorkerContext, health: DeviceHealth, registration: WorkerRegistration | None,
                 timeout_s: float, cut_short: asyncio.Event) -> None:
    """Stop admission, let in-flight requests finish for up to `timeout_s`, then end the rest (module docstring)."""
    admission = context.admission
    health.draining = True
    admission.open = False
    if registration is not None:  # routers stop sending new work here first
        registration.stop()
    started = time.monotonic()
    logger.info("draining: %d request(s) in flight, waiting up to %.0f s (--drain-timeout)", admission.in_flight,
                timeout_s)
    if await admission.wait_idle(timeout_s, cut_short):
        logger.info("drained in %.1f s", time.monotonic() - started)
        return
    logger.warning("drain timeout: ending %d request(s) still in flight", admission.in_flight)
    if not context.on_drain_timeout:  # the server's stop cancels them after its grace
        return
    for abort in context.on_drain_timeout:
        abort()
    if not await admission.wait_idle(ABORT_FLUSH_S, asyncio.Event()):
        logger.warning("%d request(s) did not end within %.0f s; cancelling them", admission.in_flight,
                       ABORT_FLUSH_S)
