"""The router's view of its workers: addresses from discovery, `Info`, load, and a KV-event subscription each.

Each worker gets one daemon thread that asks `Info`, then follows `StreamKVEvents` and applies batches to the
prefix index in order; a broken stream or a sequence gap forgets the worker's index entries and resubscribes
(the first batch of every subscription is a snapshot). Request traffic uses separate grpc.aio channels owned by
the event loop (`router.core`). Every channel presents the cluster credential (cluster/auth.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from cluster.auth import ClusterAuth
from cluster.routing import events
from cluster.routing.index import IndexUnavailable, PrefixIndex
from cluster.routing.policy import WorkerView
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc

logger = logging.getLogger(__name__)

LOAD_STALE_S = 2.0  # no batch for this long: the worker is considered down


@dataclass(frozen=True)
class ModelInfo:
    """What every worker of the cluster must agree on (block hashes depend on it)."""

    model: str
    model_id: str
    block_size: int
    max_model_len: int
    vocab_size: int = 0  # 0: not reported (token ids are then only checked to fit uint32)


@dataclass
class Worker:
    """One worker as the router follows it. `role` is where discovery listed it (its starting pool); `pool` is where
    new work is routed now: the same for a pinned worker (`kvflow prefill` / `kvflow decode`), changed by the pool
    planner (router/pools.py) for a role-free one (`kvflow worker`)."""

    address: str
    role: str
    pool: str = ""
    pool_since: float = field(default_factory=time.monotonic)
    worker_id: str = ""
    info: pb.InfoResponse | None = None
    load: events.WorkerLoad = field(default_factory=events.WorkerLoad)
    last_batch: float = 0.0  # monotonic time of the last batch (heartbeats included)
    pending_prefill_tokens: int = 0
    pending_requests: int = 0
    failures: int = 0
    stopped: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.pool = self.pool or self.role

    @property
    def healthy(self) -> bool:
        return self.info is not None and time.monotonic() - self.last_batch <= LOAD_STALE_S

    @property
    def role_free(self) -> bool:
        """It serves both roles (its `Info` says so), so the planner may move it between pools."""
        return self.info is not None and self.info.role == pb.WORKER_ROLE_UNIFIED

    @property
    def serves_prefill(self) -> bool:
        """It answers `Prefill` (a prefill or role-free worker), so another worker may pull KV from it."""
        return self.role == "prefill" or self.role_free

    def view(self) -> WorkerView:
        return WorkerView(self.worker_id or self.address, self.address, self.load, self.pending_prefill_tokens,
                          self.pending_requests, self.info.compute_domain if self.info is not None else "")


def batch_from_proto(msg: pb.KVEventBatch) -> events.EventBatch:
    """A worker's batch in the index's vocabulary (kinds the router does not know are skipped)."""
    index_events: list[events.IndexEvent] = []
    for event in msg.events:
        kind = event.WhichOneof("event")
        if kind == "stored":
            tier = events.Tier.HOST if event.stored.tier == pb.KV_TIER_HOST else events.Tier.DEVICE
            index_events.append(events.BlocksStored(tuple(event.stored.block_hashes), tier))
        elif kind == "removed":
            index_events.append(events.BlocksRemoved(tuple(event.removed.block_hashes)))
        elif kind == "cleared":
            index_events.append(events.AllBlocksCleared())
    load = None
    if msg.HasField("load"):
        lo = msg.load
        load = events.WorkerLoad(lo.num_running, lo.num_waiting, lo.queued_prefill_tokens, lo.kv_cache_usage,
                                 lo.num_kv_blocks, lo.num_preemptions, lo.busy_fraction, lo.prefill_tokens_per_s,
                                 lo.host_reload_cost, lo.external_prefix_cache_hits, lo.kv_receive_s_per_token,
                                 lo.host_dropped_blocks)
    return events.EventBatch(msg.worker_id, msg.epoch, msg.sequence, tuple(index_events), load, msg.sent_unix_s)


class WorkerPool:
    """Workers by role; `set_addresses` (from discovery) starts and stops their subscriptions."""

    def __init__(self, index: PrefixIndex, subscriber: str,
                 on_batch: Callable[[Worker, events.EventBatch, float], None] | None = None,
                 on_index_error: Callable[[IndexUnavailable], None] | None = None,
                 auth: ClusterAuth | None = None) -> None:
        self.index = index
        self.auth = auth or ClusterAuth()
        self.subscriber = subscriber
        self._on_batch = on_batch
        self._on_index_error = on_index_error
        self._lock = threading.Lock()
        self._workers: dict[str, Worker] = {}  # address -> worker
        self._threads: dict[str, threading.Thread] = {}
        self.model_info: ModelInfo | None = None

    def set_addresses(self, role: str, addresses: list[str]) -> None:
        wanted = set(addresses)
        with self._lock:
            for address, worker in list(self._workers.items()):
                if worker.role == role and address not in wanted:
                    worker.stopped.set()
                    del self._workers[address]
                    self._threads.pop(address, None)
                    logger.info("%s worker %s left", role, address)
            for address in sorted(wanted - set(self._workers)):
                worker = Worker(address, role)
                self._workers[address] = worker
                thread = threading.Thread(target=self._follow, args=(worker,), name=f"kv-events-{address}",
                                          daemon=True)
                self._threads[address] = thread
                thread.start()
                logger.info("%s worker %s joined", role, address)

    def workers(self, pool: str, healthy_only: bool = True) -> list[Worker]:
        """The workers new work of `pool` ("prefill" / "decode") is routed to now."""
        with self._lock:
            return [w for w in self._workers.values() if w.pool == pool and (w.healthy or not healthy_only)]

    def all_workers(self) -> list[Worker]:
        with self._lock:
            return list(self._workers.values())

    def parallel_layout(self, worker_name: Callable[[str], str] | None = None) -> dict[str, object]:
        """Each worker's parallel layout as its `Info` reported it, and the data-parallel degree (serving decode
        workers, each a replica): shown in the router's /v1/models. With `worker_name` (router.metrics.worker_namer)
        workers are listed by that name, without their addresses."""
        workers = sorted(self.all_workers(), key=lambda w: (w.role, w.address))
        listing = []
        for w in workers:
            info = w.info
            where = {"address": w.address, "worker_id": w.worker_id} if worker_name is None else \
                {"worker_id": worker_name(w.worker_id or w.address)}
            listing.append({
                **where, "role": w.role, "pool": w.pool, "role_free": w.role_free, "healthy": w.healthy,
                "tensor_parallel_size": (info.tensor_parallel_size or 1) if info is not None else None,
                "pipeline_parallel_size": (info.pipeline_parallel_size or 1) if info is not None else None,
                "devices": list(info.rank_devices) if info is not None and info.rank_devices else
                ([info.device] if info is not None else []),
                "all_reduce": (info.all_reduce or None) if info is not None else None,  # None: an older worker
            })
        return {"data_parallel_size": sum(1 for w in workers if w.pool == "decode" and w.healthy),
                "workers": listing}

    def stop(self) -> None:
        with self._lock:
            for worker in self._workers.values():
                worker.stopped.set()

    # ---- one thread per worker -----------------------------------------------------------------------
    def _follow(self, worker: Worker) -> None:
        backoff = 0.1
        while not worker.stopped.is_set():
            channel = self.auth.channel(worker.address)
            try:
                self._subscribe(worker, channel)
                backoff = 0.1
            except grpc.RpcError as exc:
                if worker.failures == 0 or worker.info is not None:
                    logger.warning("%s worker %s: %s", worker.role, worker.address,
                                   exc.details() if hasattr(exc, "details") else exc)
                worker.failures += 1
            except _Resubscribe as exc:
                logger.info("%s worker %s: resubscribing (%s)", worker.role, worker.address, exc)
            finally:
                channel.close()
            self._drop(worker)
            worker.stopped.wait(backoff)
            backoff = min(backoff * 2, 2.0)
        self._drop(worker)

    def _subscribe(self, worker: Worker, channel: grpc.Channel) -> None:
        stub = kvflow_pb2_grpc.GenerationStub(channel) if worker.role == "decode" else \
            kvflow_pb2_grpc.PrefillStub(channel)
        info = stub.Info(pb.InfoRequest(), timeout=5.0)
        if not self._accept_info(worker, info):
            raise _Resubscribe("model mismatch")
        order = events.BatchOrder()
        stream = stub.StreamKVEvents(pb.KVEventsRequest(subscriber=self.subscriber))
        try:
            for msg in _events_or_info_polls(stream, stub, worker):
                if worker.stopped.is_set():
                    return
                batch = batch_from_proto(msg)
                verdict = order.check(batch)
                if verdict is events.BatchVerdict.GAP:
                    raise _Resubscribe(f"sequence gap at epoch {batch.epoch} seq {batch.sequence}")
                if verdict is events.BatchVerdict.STALE:
                    continue
                worker.worker_id = batch.worker_id or worker.worker_id
                worker.last_batch = time.monotonic()
                if batch.load is not None:
                    worker.load = batch.load
                try:
                    in_sync = self.index.apply(batch)
                except IndexUnavailable as exc:
                    if self._on_index_error is not None:
                        self._on_index_error(exc)
                    continue  # keep serving load; the index is resynced once the backend is back
                if not in_sync:
                    raise _Resubscribe("index lost this worker's state")
                if self._on_batch is not None:
                    self._on_batch(worker, batch, time.time() - batch.sent_unix_s if batch.sent_unix_s else 0.0)
        finally:
            stream.cancel()

    def _accept_info(self, worker: Worker, info: pb.InfoResponse) -> bool:
        if not info.model_id:  # what a worker tells a caller without its cluster token: role and version only
            logger.error("%s worker %s withholds its Info: this router does not present the cluster token the "
                         "worker holds (KVFLOW_CLUSTER_TOKEN / --cluster-token)", worker.role, worker.address)
            return False
        seen = ModelInfo(info.model, info.model_id, info.block_size, info.max_model_len, info.vocab_size)
        with self._lock:
            if self.model_info is None:
                self.model_info = seen
            elif (seen.model_id, seen.block_size) != (self.model_info.model_id, self.model_info.block_size):
                logger.error("%s worker %s serves model_id=%s block_size=%d but the cluster has %s/%d: ignored",
                             worker.role, worker.address, seen.model_id, seen.block_size,
                             self.model_info.model_id, self.model_info.block_size)
                return False
        worker.info = info
        worker.worker_id = info.worker_id or worker.address
        worker.failures = 0
        return True

    def _drop(self, worker: Worker) -> None:
        worker.last_batch = 0.0
        if worker.worker_id:
            try:
                self.index.forget_worker(worker.worker_id)
            except IndexUnavailable as exc:
                if self._on_index_error is not None:
                    self._on_index_error(exc)


def _events_or_info_polls(stream: grpc.Future, stub: object, worker: Worker) -> object:
    """The event stream; a worker without one (UNIMPLEMENTED) is kept alive by polling `Info` instead."""
    try:
        yield from stream  # type: ignore[misc]
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # type: ignore[attr-defined]
            raise
        logger.warning("%s worker %s has no KV event stream: load-only routing for it", worker.role,
                       worker.address)
        while not worker.stopped.is_set():
            stub.Info(pb.InfoRequest(), timeout=2.0)  # type: ignore[attr-defined]
            worker.last_batch = time.monotonic()
            worker.stopped.wait(0.5)


class _Resubscribe(Exception):
    """Leave the current stream and start a fresh subscription (which begins with a snapshot)."""
