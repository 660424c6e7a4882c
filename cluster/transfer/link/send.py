"""The prefill end of KV links: each link's send thread (`SendLink`), the `KVLink` RPC that opens links and
carries their notices (`LinkServer`), and one request's sender over its decode worker's link (`LinkSender`).

`stage` runs on the engine thread and numbers each slice; the link thread sends in that order and the notices go
out on the KVLink stream in that same order (cluster/transfer/link/__init__.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

import grpc
import torch.distributed as dist

from cluster.transfer.backends import BACKEND_NAMES
from cluster.transfer.contract import LINK_MAX_CHUNK_BYTES, plan_slices
from cluster.transfer.link.group import (
    PREFILL_RANK,
    SETUP_TIMEOUT_S,
    RankGroups,
    link_backend_available,
    link_backend_for,
    notices_and_heartbeats,
    on_device,
)
from cluster.transfer.link.heads import (
    HeadPair,
    HeadPlan,
    heads_from_proto,
    heads_to_proto,
    plan_heads,
    same_but_heads,
)
from cluster.transfer.link.store import LinkStores, link_prefix
from cluster.transfer.link.tell import ranks_alive, tell_ranks
from cluster.wire import layout_from_proto
from engine.kv_layout import KVSlice
from engine.kv_port import KVExport, KVPort
from engine.parallel.executor import TensorParallelError
from protos.kvflow.v1 import kvflow_pb2 as pb

logger = logging.getLogger(__name__)


class SendLoop:
    """One prefill rank's sends of a link: its pair groups (cluster/transfer/link/heads.py) and the thread that
    sends each staged slice's exports, one per pair, in staging order. Rank 0's `SendLink` and the other ranks'
    agents (cluster/transfer/link/ranks.py) each run one."""

    def __init__(self, name: str, backend: str, port: KVPort, pairs: tuple[HeadPair, ...]) -> None:
        self.name = name
        self.backend = backend
        self.port = port
        self.pairs = pairs
        self.broken = threading.Event()
        self.bytes_sent = 0
        self.send_seconds = 0.0
        self.closing = False  # closed on purpose (worker shutdown), not broken
        self._outbox: queue.SimpleQueue[list[KVExport] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, connect: Callable[[], dist.Store], prefix: str, timeout_s: float,
              on_exit: Callable[[], None]) -> None:
        """`connect` returns the rendezvous store; it runs on the link thread (it may wait for the store)."""
        self._thread = threading.Thread(target=self._run, args=(connect, prefix, timeout_s, on_exit),
                                        name=f"kv-link-send-{self.name}", daemon=True)
        self._thread.start()

    def put(self, exports: list[KVExport]) -> None:
        self._outbox.put(exports)

    def close(self, wait_s: float = 0.0, graceful: bool = False) -> None:
        self.closing = graceful
        self.broken.set()
        self._outbox.put(None)
        if wait_s and self._thread is not None:
            self._thread.join(wait_s)

    def _run(self, connect: Callable[[], dist.Store], prefix: str, timeout_s: float,
             on_exit: Callable[[], None]) -> None:
        groups = None
        try:
            with on_device(self.port.device):
                groups = RankGroups(self.backend, connect(), prefix, self.pairs, PREFILL_RANK, timeout_s)
                with self.port.transfer_stream(self.port.new_stream()):
                    self._send_all(groups)
        except Exception as exc:  # noqa: BLE001 - any failure ends this link; the decode side recomputes
            logger.warning("KV link %s (send side) failed: %s", self.name, exc)
        finally:
            self.broken.set()
            if groups is not None:
                groups.close(failed=not self.closing)
            on_exit()

    def _send_all(self, groups: RankGroups) -> None:
        """Link thread: the hellos that complete the rendezvous, then each staged slice in order until closed."""
        if not groups.hello(self.port.device, self.broken):
            return
        while not self.broken.is_set():
            exports = self._outbox.get()
            if exports is None:
                return
            started = time.perf_counter()
            for export in exports:
                export.wait()
            if not groups.send([export.tensor for export in exports], self.port.device, self.broken):
                return
            self.send_seconds += time.perf_counter() - started
            self.bytes_sent += sum(export.tensor.nbytes for export in exports)


class SendLink:
    """Prefill side of one link, on rank 0. `stage` is called on the engine thread: it numbers the slice, exports
    rank 0's pairs' heads, tells the other ranks to export theirs (in order with the steps) and queues the notice;
    each rank's `SendLoop` sends on its own thread."""

    def __init__(self, link_id: str, backend: str, port: KVPort, loop: asyncio.AbstractEventLoop,
                 plan: HeadPlan) -> None:
        self.link_id = link_id
        self.backend = backend
        self.port = port
        self.plan = plan
        self.notices: asyncio.Queue[pb.KVLinkChunk | None] = asyncio.Queue()
        self.sends = SendLoop(link_id, backend, port, plan.sending(port.rank))
        # Slices are cut so that the largest pair's message stays within the link's message size.
        self.slice_layout = port.heads_layout(max(len(pair.heads) for pair in plan.pairs))
        self.broken = self.sends.broken
        self._loop = loop
        self._lock = threading.Lock()
        self._next_seq = 0

    @property
    def bytes_sent(self) -> int:
        return self.sends.bytes_sent

    def start(self, store: dist.Store, prefix: str, ready: pb.KVLinkReady, address: str) -> None:
        """Join rank 0's pairs on `store`; the other ranks join theirs through this worker's KVLinkStore RPC at
        `address`."""
        if len(self.plan.src_heads) > 1:
            tell_ranks(self.port.ranks, {"op": "open_send", "link": self.link_id, "backend": self.backend,
                                         "address": address, "prefix": prefix,
                                         "timeout_s": ready.timeout_s, "src": self.plan.src_heads,
                                         "dst": self.plan.dst_heads})
        self.sends.start(lambda: store, prefix, ready.timeout_s, self._on_exit)

    def stage(self, request_id: str, block_ids: list[int], part: KVSlice) -> int:
        """Engine thread: export one slice (`block_ids`: its blocks) on every rank and queue its send; its notice
        goes out in the same order. Returns the slice's bytes over every pair."""
        with self._lock:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            exports = [self.port.export(block_ids, part, self.plan.export_heads(pair)) for pair in self.sends.pairs]
            if len(self.plan.src_heads) > 1:
                tell_ranks(self.port.ranks, {"op": "export", "link": self.link_id, "seq": seq, "blocks": block_ids,
                                             "part": [part.first_block, part.num_blocks, part.first_layer,
                                                      part.num_layers]})
            self.sends.put(exports)
            num_bytes = self.plan.total_bytes(self.port.layout, part)
            notice = pb.KVLinkChunk(request_id=request_id, seq=seq, first_block=part.first_block,
                                    num_blocks=part.num_blocks, first_layer=part.first_layer,
                                    num_layers=part.num_layers, num_bytes=num_bytes)
            self._loop.call_soon_threadsafe(self.notices.put_nowait, notice)
        return num_bytes

    def close(self, wait_s: float = 0.0, graceful: bool = False) -> None:
        """Stop the link on every rank; with `wait_s`, wait that long for rank 0's thread to tear its groups down
        (a clean shutdown if `graceful`: nothing is pending at a worker's shutdown; else an abort)."""
        if len(self.plan.src_heads) > 1:
            with contextlib.suppress(Exception):  # a rank gone: the worker stops anyway
                tell_ranks(self.port.ranks, {"op": "close", "link": self.link_id})
        self.sends.close(wait_s, graceful)
        with contextlib.suppress(RuntimeError):  # the loop is already closed at shutdown
            self._loop.call_soon_threadsafe(self.notices.put_nowait, None)

    def _on_exit(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self.notices.put_nowait, None)


class LinkSender:
    """One Prefill request's `KVSender` over its decode worker's link: each slice is staged on the link as soon as
    it is planned, so the link's order is the send order."""

    def __init__(self, link: SendLink, caller_id: str) -> None:
        self.backend = link.backend
        self.num_bytes = 0
        self._link = link
        self._caller_id = caller_id  # the decode worker's request id, which the link's notices carry

    def send(self, block_ids: list[int], first_block: int, end_block: int) -> None:
        for part in plan_slices(first_block, end_block - first_block, self._link.slice_layout, LINK_MAX_CHUNK_BYTES):
            blocks = block_ids[part.first_block : part.first_block + part.num_blocks]
            try:
                self.num_bytes += self._link.stage(self._caller_id, blocks, part)
            except TensorParallelError as exc:  # a rank is gone: the link ends, the decode side recomputes
                logger.warning("KV link %s: %s", self._link.link_id, exc)
                self._link.close()
                return


class LinkServer:
    """The prefill worker's links, keyed by link id, and where every rank of both workers rendezvouses: a store per
    link, served over the authenticated `KVLinkStore` RPC at `address` (this worker's advertised gRPC address, which
    its own tensor-parallel ranks dial too), for NCCL and gloo links alike."""

    def __init__(self, port: KVPort, address: str) -> None:
        self.port = port
        self.backend = link_backend_for(port.device)
        self.address = address
        self.stores = LinkStores(SETUP_TIMEOUT_S)
        self._links: dict[str, SendLink] = {}

    def get(self, link_id: str) -> SendLink | None:
        link = self._links.get(link_id)
        return None if link is None or link.broken.is_set() else link

    def _check(self, request: pb.KVLinkRequest) -> str | None:
        backend = BACKEND_NAMES.get(request.backend, "")
        if backend != self.backend:
            return f"this worker's KV links use {self.backend!r} (its device is {self.port.device}); asked {backend!r}"
        if not link_backend_available(self.port.device):
            return f"torch.distributed {self.backend} is not available in this worker"
        remote = layout_from_proto(request.layout)
        if not same_but_heads(remote, self.port.layout):
            return f"KV layout mismatch: decode has {remote}, this worker {self.port.layout}"
        if len(heads_from_proto(list(request.rank_heads), remote)[0]) != remote.num_kv_heads:
            return f"the decode worker's rank 0 heads do not match its layout's {remote.num_kv_heads} KV heads"
        if not request.link_id or request.link_id in self._links:
            return "link_id must be new and non-empty"
        return None

    def _plan(self, request: pb.KVLinkRequest) -> HeadPlan:
        """Raises ValueError when the decode ranks need heads no rank here holds."""
        return plan_heads(self.port.ranks.heads, heads_from_proto(list(request.rank_heads),
                                                                  layout_from_proto(request.layout)))

    def _rendezvous(self, link_id: str, prefix: str) -> tuple[dist.Store, pb.KVLinkReady]:
        """The store the prefill rank joins through, and what the decode side is told: every link, NCCL or gloo,
        rendezvouses in its own store served over the authenticated KVLinkStore RPC (every rank of both workers,
        tensor-parallel ones included), so no store port is open."""
        return self.stores.open(link_id, prefix), pb.KVLinkReady(
            store_prefix=prefix, timeout_s=SETUP_TIMEOUT_S, rpc_store=True,
            rank_heads=heads_to_proto(self.port.ranks.heads))

    async def serve(self, request: pb.KVLinkRequest, context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[pb.KVLinkMessage]:
        """The `KVLink` RPC: where to rendezvous, then the link's notices and heartbeats until it breaks (or a
        tensor-parallel rank of this worker is gone)."""
        problem = self._check(request)
        plan: HeadPlan | None = None
        if problem is None:
            try:
                plan = self._plan(request)
            except ValueError as exc:
                problem = str(exc)
        if problem is not None or plan is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem or "no plan")
            return
        link = SendLink(request.link_id, self.backend, self.port, asyncio.get_running_loop(), plan)
        prefix = link_prefix(request.link_id)
        store, ready = self._rendezvous(request.link_id, prefix)
        self._links[request.link_id] = link
        logger.info("KV link %s (%s) to decode worker %s: %d prefill x %d decode ranks, %d pairs", request.link_id,
                    self.backend, request.decode_worker_id, len(plan.src_heads), len(plan.dst_heads),
                    len(plan.pairs))
        try:
            yield pb.KVLinkMessage(ready=ready)
            link.start(store, prefix, ready, self.address)
            alive = functools.partial(ranks_alive, self.port.ranks)
            async with contextlib.aclosing(notices_and_heartbeats(link.notices, alive)) as messages:
                async for message in messages:
                    yield message
        finally:
            link.close()
            self._links.pop(request.link_id, None)
            self.stores.close(request.link_id)
            logger.info("KV link %s closed (%d bytes sent)", request.link_id, link.bytes_sent)

    def close(self) -> None:
        """Worker shutdown: end every link and wait for its communicator's teardown."""
        for link in list(self._links.values()):
            link.close(wait_s=5.0, graceful=True)
