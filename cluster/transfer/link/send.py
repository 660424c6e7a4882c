"""The prefill end of KV links: each link's send thread (`SendLink`), the `KVLink` RPC that opens links and
carries their notices (`LinkServer`), and one request's sender over its decode worker's link (`LinkSender`).

`stage` runs on the engine thread and numbers each slice; the link thread sends in that order and the notices go
out on the KVLink stream in that same order (cluster/transfer/link/__init__.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import torch
import torch.distributed as dist

from cluster.transfer.backends import BACKEND_NAMES
from cluster.transfer.contract import LINK_MAX_CHUNK_BYTES, export_slices
from cluster.transfer.link.group import (
    PREFILL_RANK,
    SETUP_TIMEOUT_S,
    PairGroup,
    complete,
    link_backend_available,
    link_backend_for,
    link_prefix,
    notices_and_heartbeats,
    on_device,
    serve_store,
)
from cluster.transfer.link.store import LinkStores
from cluster.wire import layout_from_proto
from engine.kv_port import KVExport, KVPort
from protos.kvflow.v1 import kvflow_pb2 as pb

logger = logging.getLogger(__name__)


@dataclass
class _Outgoing:
    seq: int
    request_id: str
    export: KVExport


class SendLink:
    """Prefill side of one link. `stage` is called on the engine thread; sends run on the link's thread."""

    def __init__(self, link_id: str, backend: str, port: KVPort, loop: asyncio.AbstractEventLoop) -> None:
        self.link_id = link_id
        self.backend = backend
        self.port = port
        self.notices: asyncio.Queue[pb.KVLinkChunk | None] = asyncio.Queue()
        self.broken = threading.Event()
        self.bytes_sent = 0
        self.send_seconds = 0.0
        self._loop = loop
        self._lock = threading.Lock()
        self._next_seq = 0
        self._outbox: queue.SimpleQueue[_Outgoing | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closing = False  # closed on purpose (worker shutdown), not broken

    def start(self, store: dist.Store, prefix: str) -> None:
        self._thread = threading.Thread(target=self._run, args=(store, prefix), name=f"kv-link-send-{self.link_id}",
                                        daemon=True)
        self._thread.start()

    def stage(self, request_id: str, export: KVExport) -> None:
        """Engine thread: queue one slice. Its notice goes out in the same order as the send."""
        part = export.part
        with self._lock:
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            self._outbox.put(_Outgoing(seq, request_id, export))
            notice = pb.KVLinkChunk(request_id=request_id, seq=seq, first_block=part.first_block,
                                    num_blocks=part.num_blocks, first_layer=part.first_layer,
                                    num_layers=part.num_layers, num_bytes=export.tensor.nbytes)
            self._loop.call_soon_threadsafe(self.notices.put_nowait, notice)

    def close(self, wait_s: float = 0.0, graceful: bool = False) -> None:
        """Stop the link; with `wait_s`, wait that long for its thread to tear the communicator down (a clean
        shutdown if `graceful`: nothing is pending at a worker's shutdown; else an abort)."""
        self._closing = graceful
        self.broken.set()
        self._outbox.put(None)
        with contextlib.suppress(RuntimeError):  # the loop is already closed at shutdown
            self._loop.call_soon_threadsafe(self.notices.put_nowait, None)
        if wait_s and self._thread is not None:
            self._thread.join(wait_s)

    def _run(self, store: dist.Store, prefix: str) -> None:
        group = None
        try:
            with on_device(self.port.device):
                group = PairGroup(self.backend, store, prefix, PREFILL_RANK, SETUP_TIMEOUT_S)
                with self.port.transfer_stream(self.port.new_stream()):
                    self._send_all(group)
        except Exception as exc:  # noqa: BLE001 - any failure ends this link; the decode side recomputes
            logger.warning("KV link %s (send side) failed: %s", self.link_id, exc)
        finally:
            self.broken.set()
            if group is not None:
                group.close(failed=not self._closing)
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self.notices.put_nowait, None)

    def _send_all(self, group: PairGroup) -> None:
        """Link thread: the hello that completes the rendezvous, then each staged slice in order until closed."""
        hello = torch.ones(1, device=self.port.device)
        if not complete(group.send(hello), self.port.device, self.broken):
            return
        while not self.broken.is_set():
            item = self._outbox.get()
            if item is None:
                return
            started = time.perf_counter()
            item.export.wait()
            if not complete(group.send(item.export.tensor), self.port.device, self.broken):
                return
            self.send_seconds += time.perf_counter() - started
            self.bytes_sent += item.export.tensor.nbytes


class LinkSender:
    """One Prefill request's `KVSender` over its decode worker's link: each slice is staged on the link as soon as
    it is exported, so the link's order is the send order."""

    def __init__(self, link: SendLink, caller_id: str) -> None:
        self.backend = link.backend
        self.num_bytes = 0
        self._link = link
        self._caller_id = caller_id  # the decode worker's request id, which the link's notices carry

    def send(self, block_ids: list[int], first_block: int, end_block: int) -> None:
        for export in export_slices(self._link.port, block_ids, first_block, end_block, LINK_MAX_CHUNK_BYTES):
            self.num_bytes += export.tensor.nbytes
            self._link.stage(self._caller_id, export)


class LinkServer:
    """The prefill worker's links, keyed by link id, and where decode workers rendezvous: gloo links in a store per
    link, served over the authenticated `KVLinkStore` RPC; NCCL links at a TCPStore on `store_host` (until the RPC
    store is checked on GPUs: a heartbeat thread of ProcessGroupNCCL reads the store too)."""

    def __init__(self, port: KVPort, store_host: str) -> None:
        self.port = port
        self.backend = link_backend_for(port.device)
        self.store_host = store_host
        self.stores = LinkStores(SETUP_TIMEOUT_S)
        self._tcp_store: dist.TCPStore | None = None
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
        if layout_from_proto(request.layout) != self.port.layout:
            return f"KV layout mismatch: decode has {layout_from_proto(request.layout)}, this worker {self.port.layout}"
        if not request.link_id or request.link_id in self._links:
            return "link_id must be new and non-empty"
        return None

    async def _rendezvous(self, link_id: str, prefix: str) -> tuple[dist.Store, pb.KVLinkReady]:
        """The store the prefill rank joins through, and what the decode rank is told."""
        if self.backend == "gloo":
            return self.stores.open(link_id, prefix), pb.KVLinkReady(store_prefix=prefix, timeout_s=SETUP_TIMEOUT_S,
                                                                     rpc_store=True)
        if self._tcp_store is None:
            self._tcp_store = await asyncio.to_thread(serve_store, self.store_host)
        return self._tcp_store, pb.KVLinkReady(store_host=self.store_host, store_port=self._tcp_store.port,
                                               store_prefix=prefix, timeout_s=SETUP_TIMEOUT_S)

    async def serve(self, request: pb.KVLinkRequest, context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[pb.KVLinkMessage]:
        """The `KVLink` RPC: where to rendezvous, then the link's notices and heartbeats until it breaks."""
        problem = self._check(request)
        if problem is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        link = SendLink(request.link_id, self.backend, self.port, asyncio.get_running_loop())
        prefix = link_prefix(request.link_id)
        store, ready = await self._rendezvous(request.link_id, prefix)
        self._links[request.link_id] = link
        logger.info("KV link %s (%s) to decode worker %s", request.link_id, self.backend, request.decode_worker_id)
        try:
            yield pb.KVLinkMessage(ready=ready)
            link.start(store, prefix)
            async with contextlib.aclosing(notices_and_heartbeats(link.notices)) as messages:
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
