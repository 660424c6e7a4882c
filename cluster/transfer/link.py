"""torch.distributed KV links: a prefill worker sends KV slices to a decode worker over NCCL (GPU to GPU) or gloo
(CPU workers, the same code path without GPUs), while gRPC carries the control.

One link per (prefill worker, decode worker) pair, opened by the decode worker on first use through the prefill
worker's `KVLink` RPC. That stream first says where to rendezvous (a c10d TCPStore on the prefill worker), then
carries one notice per link message, then heartbeats. Each link is its own 2-rank process group (prefill rank 0,
decode rank 1), built from the store: no global default group, so a worker can hold links to many peers.

Invariants:
- Message order. The prefill side numbers messages on the engine thread and queues the send and the notice in
  that same order; its link thread sends in that order, and the notices reach the decode side in that order on
  one stream. The decode side receives strictly in notice order, also for a request it no longer wants (it then
  drops the data), so two-sided send/recv always pair up.
- No hang reaches the engine. Sends and receives run on each side's link thread, never on the engine thread or
  the event loop; device waits poll, so a link found dead stops its thread.
- Death is noticed within `LINK_DEAD_S`: the KVLink stream ends when either process dies, and the prefill side
  sends a heartbeat every `HEARTBEAT_S`. A dead link is torn down (its communicator aborted) on both sides; its
  pending pulls fail (the decode side recomputes), and the next pull to that peer opens a new link.
- A pull's blocks are written on the device (the import completed) before the pull succeeds, and no write into
  them starts after `forget(request_id)` returns, so the engine may free or reuse them at once.

Trust: `KVLink` is a worker RPC like the others, served only to holders of the cluster credential
(cluster/auth.py), and decode workers open links only to allowed prefill workers (decode_worker/allowlist.py). The
rendezvous it hands out is NOT authenticated: the c10d TCPStore (an ephemeral port on the prefill worker, any key
readable with `list_keys`) and the NCCL/gloo sockets behind it accept anyone who reaches them, who could then
disturb a link's setup or take the decode worker's place in a new link and receive KV (prompt contents). Only the
network keeps strangers out: the Helm chart's NetworkPolicies admit only decode pods to prefill pods' other ports;
elsewhere, run links between hosts on a private network, or use `--kv-transfer-backend grpc` (KV inside the
authenticated, optionally mTLS, Prefill stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch
import torch.distributed as dist

from cluster.wire import BACKEND_ENUMS, BACKEND_NAMES, layout_from_proto, layout_to_proto
from engine.kv_layout import KVLayout, KVSlice, KVTransferError, check_slice
from engine.kv_port import KVExport, KVPort
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
LINK_DEAD_S = 2.0  # no message on the KVLink stream for this long: the peer is dead
SETUP_TIMEOUT_S = 60.0  # process-group rendezvous and the first message (NCCL communicator creation)
REOPEN_BACKOFF_S = 1.0  # after a failed open, pulls to that peer use the fallback this long
POLL_S = 0.0002

# NVLink multicast (NVLS) serves collectives, never point-to-point; it is also off limits on shared hosts.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
# A timed-out NCCL operation must abort its communicator, not kill the worker (torch's default tears it down).
os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def link_backend_for(device: torch.device) -> str:
    """The torch.distributed backend a link uses from this device: NCCL for GPUs, gloo for CPUs."""
    return "nccl" if device.type == "cuda" else "gloo"


def link_backend_available(device: torch.device) -> bool:
    if not dist.is_available():
        return False
    return dist.is_nccl_available() if device.type == "cuda" else dist.is_gloo_available()



def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """fp8 KV blocks travel as their bytes (gloo has no float8 type); the same storage, so a receive fills them."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor

class _Group:
    """A 2-rank process group of its own (never the global default group)."""

    def __init__(self, backend: str, store: dist.Store, prefix: str, rank: int, timeout_s: float) -> None:
        self.backend = backend
        prefixed = dist.PrefixStore(prefix, store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg: Any = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
        self.peer = 1 - rank

    def send(self, tensor: torch.Tensor) -> Any:
        return self.pg.send([_raw(tensor)], self.peer, 0)

    def recv(self, tensor: torch.Tensor) -> Any:
        return self.pg.recv([_raw(tensor)], self.peer, 0)

    def close(self, failed: bool) -> None:
        """Tear the communicator down: `abort` after a failure (pending operations end with an error), else a
        clean `shutdown`. Either way no NCCL thread outlives the link (one left at exit kills the process)."""
        for name in (("abort", "shutdown") if failed else ("shutdown", "abort")):
            method = getattr(self.pg, name, None)
            if method is not None:
                with contextlib.suppress(Exception):  # already broken: nothing left to release
                    method()
                return


def _complete(work: Any, device: torch.device, broken: threading.Event) -> bool:
    """Wait on this thread until `work` (a send or recv just issued on the current stream) has finished on the
    device; False if the link broke first. Gloo's wait blocks until done or raises when the peer is gone."""
    if device.type != "cuda":
        work.wait()
        return True
    work.wait()  # device side: the current stream waits for NCCL's
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    while not done.query():
        if broken.is_set():
            return False
        time.sleep(POLL_S)
    return True


# ---- prefill side -----------------------------------------------------------------------------------------------
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
            with _on_device(self.port.device):
                group = _Group(self.backend, store, prefix, 0, SETUP_TIMEOUT_S)
                stream = self.port.new_stream()
                with self.port.transfer_stream(stream):
                    hello = torch.ones(1, device=self.port.device)
                    if not _complete(group.send(hello), self.port.device, self.broken):
                        return
                    while not self.broken.is_set():
                        item = self._outbox.get()
                        if item is None:
                            return
                        started = time.perf_counter()
                        item.export.wait()
                        if not _complete(group.send(item.export.tensor), self.port.device, self.broken):
                            return
                        self.send_seconds += time.perf_counter() - started
                        self.bytes_sent += item.export.tensor.nbytes
        except Exception as exc:  # noqa: BLE001 - any failure ends this link; the decode side recomputes
            logger.warning("KV link %s (send side) failed: %s", self.link_id, exc)
        finally:
            self.broken.set()
            if group is not None:
                group.close(failed=not self._closing)
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self.notices.put_nowait, None)


class PrefillLinks:
    """The prefill worker's links, keyed by link id, and the TCPStore decode workers rendezvous at."""

    def __init__(self, port: KVPort, store_host: str) -> None:
        self.port = port
        self.backend = link_backend_for(port.device)
        self.store_host = store_host
        self._store: dist.TCPStore | None = None
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

    async def serve(self, request: pb.KVLinkRequest, context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[pb.KVLinkMessage]:
        problem = self._check(request)
        if problem is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        if self._store is None:
            self._store = await asyncio.to_thread(dist.TCPStore, self.store_host, 0, is_master=True,
                                                  wait_for_workers=False)
        link = SendLink(request.link_id, self.backend, self.port, asyncio.get_running_loop())
        prefix = f"kvflow/link/{request.link_id}/"
        self._links[request.link_id] = link
        logger.info("KV link %s (%s) to decode worker %s", request.link_id, self.backend, request.decode_worker_id)
        try:
            yield pb.KVLinkMessage(ready=pb.KVLinkReady(store_host=self.store_host, store_port=self._store.port,
                                                        store_prefix=prefix, timeout_s=SETUP_TIMEOUT_S))
            link.start(self._store, prefix)
            while True:
                try:
                    notice = await asyncio.wait_for(link.notices.get(), HEARTBEAT_S)
                except asyncio.TimeoutError:
                    yield pb.KVLinkMessage(heartbeat=pb.KVLinkHeartbeat(sent_unix_s=time.time()))
                    continue
                if notice is None:
                    return  # the link broke: ending the stream tells the decode side
                yield pb.KVLinkMessage(chunk=notice)
        finally:
            link.close()
            self._links.pop(request.link_id, None)
            logger.info("KV link %s closed (%d bytes sent)", request.link_id, link.bytes_sent)

    def close(self) -> None:
        """Worker shutdown: end every link and wait for its communicator's teardown."""
        for link in list(self._links.values()):
            link.close(wait_s=5.0, graceful=True)


# ---- decode side ------------------------------------------------------------------------------------------------
@dataclass
class LinkJob:
    """One pull waiting for its slices on a link."""

    request_id: str
    block_ids: list[int]
    skip_blocks: int
    expected_bytes: int
    loop: asyncio.AbstractEventLoop
    all_received: asyncio.Future[None]
    received_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    active: bool = True
    wire_seconds: float = 0.0  # summed over its slices: receive posted -> written into the cache

    def _settle(self, error: BaseException | None) -> None:
        if self.all_received.done():
            return
        if error is None:
            self.all_received.set_result(None)
        else:
            self.all_received.set_exception(error)

    def settle(self, error: BaseException | None = None) -> None:
        """From any thread."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._settle, error)


class RecvLink:
    """Decode side of one link: reads the KVLink stream, receives slices in notice order on its own thread and
    imports them into the pulls' blocks."""

    def __init__(self, address: str, port: KVPort, stub: kvflow_pb2_grpc.PrefillStub, worker_id: str) -> None:
        self.address = address
        self.port = port
        self.backend = link_backend_for(port.device)
        self.link_id = uuid.uuid4().hex
        self.broken = threading.Event()
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.bytes_received = 0
        self.setup_seconds = 0.0
        self._loop = asyncio.get_running_loop()
        self._jobs: dict[str, LinkJob] = {}
        self._jobs_lock = threading.Lock()
        self._inbox: queue.SimpleQueue[pb.KVLinkChunk | None] = queue.SimpleQueue()
        self._group: _Group | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._call = stub.KVLink(pb.KVLinkRequest(link_id=self.link_id, decode_worker_id=worker_id,
                                                  backend=BACKEND_ENUMS[self.backend],
                                                  layout=layout_to_proto(port.layout)))
        self._reader = asyncio.create_task(self._read())

    # ---- event loop ----------------------------------------------------------------------------------------
    async def _read(self) -> None:
        started = time.perf_counter()
        thread: threading.Thread | None = None
        try:
            stream = self._call.__aiter__()
            while True:
                message = await asyncio.wait_for(stream.__anext__(), LINK_DEAD_S if thread else SETUP_TIMEOUT_S)
                kind = message.WhichOneof("message")
                if kind == "ready" and thread is None:
                    ready = message.ready
                    thread = threading.Thread(target=self._run, args=(ready, started), daemon=True,
                                              name=f"kv-link-recv-{self.link_id}")
                    self._thread = thread
                    thread.start()
                elif kind == "chunk" and thread is not None:
                    self._inbox.put(message.chunk)
                elif kind != "heartbeat":
                    raise KVTransferError("bad_stream", f"unexpected KVLink message {kind!r}")
        except StopAsyncIteration:
            reason = "the prefill worker ended the link"
        except asyncio.TimeoutError:
            reason = f"no heartbeat from the prefill worker for {LINK_DEAD_S:.0f} s"
        except asyncio.CancelledError:
            reason = "closed"
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except KVTransferError as exc:
            reason = str(exc)
        self._break(reason)

    def _break(self, reason: str) -> None:
        if not self.broken.is_set():
            logger.warning("KV link %s to %s is down: %s", self.link_id, self.address, reason)
        self.broken.set()
        self._inbox.put(None)
        self._call.cancel()
        if not self.ready.done():
            self.ready.set_exception(KVTransferError("link_unavailable", f"KV link to {self.address}: {reason}"))
            self.ready.exception()  # retrieved: a link nobody waited on must not warn at exit
        with self._jobs_lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.settle(KVTransferError("link_down", f"KV link to {self.address} went down: {reason}"))

    def expect(self, request_id: str, block_ids: list[int], skip_blocks: int) -> LinkJob:
        """Register a pull before asking for its KV, so no notice of it can arrive unannounced."""
        layout = self.port.layout
        job = LinkJob(request_id, block_ids, skip_blocks,
                      layout.payload_bytes(len(block_ids) - skip_blocks, layout.num_layers), self._loop,
                      self._loop.create_future())
        with self._jobs_lock:
            if request_id in self._jobs:
                raise KVTransferError("duplicate", f"request {request_id} is already pulling on this link")
            self._jobs[request_id] = job
        if self.broken.is_set():
            job.settle(KVTransferError("link_down", f"KV link to {self.address} is down"))
        return job

    def forget(self, request_id: str) -> None:
        """Stop writing for this pull. Blocks until an import into its blocks in progress has completed: call it
        off the event loop (it is quick: at most one slice's copy)."""
        with self._jobs_lock:
            job = self._jobs.pop(request_id, None)
        if job is not None:
            with job.lock:
                job.active = False

    async def close(self) -> None:
        self._closing = True
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        if self._thread is not None:  # it tears the communicator down on its way out
            await asyncio.to_thread(self._thread.join, 5.0)

    # ---- link thread ---------------------------------------------------------------------------------------
    def _run(self, ready: pb.KVLinkReady, started: float) -> None:
        try:
            with _on_device(self.port.device):
                store = dist.TCPStore(ready.store_host, ready.store_port, is_master=False,
                                      timeout=datetime.timedelta(seconds=ready.timeout_s or SETUP_TIMEOUT_S))
                self._group = _Group(self.backend, store, ready.store_prefix, 1, ready.timeout_s or SETUP_TIMEOUT_S)
                stream = self.port.new_stream()
                with self.port.transfer_stream(stream):
                    hello = torch.zeros(1, device=self.port.device)
                    if not _complete(self._group.recv(hello), self.port.device, self.broken):
                        return
                    self.setup_seconds = time.perf_counter() - started
                    self._loop.call_soon_threadsafe(self._set_ready)
                    while True:
                        notice = self._inbox.get()
                        if notice is None or self.broken.is_set():
                            return
                        self._receive(notice)
        except Exception as exc:  # noqa: BLE001 - any failure ends this link; its pulls recompute
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._break, f"link thread failed: {exc}")
        finally:
            self.broken.set()
            if self._group is not None:
                self._group.close(failed=not self._closing)

    def _set_ready(self) -> None:
        if not self.ready.done():
            self.ready.set_result(None)
            logger.info("KV link %s (%s) to %s ready in %.2f s", self.link_id, self.backend, self.address,
                        self.setup_seconds)

    def _receive(self, notice: pb.KVLinkChunk) -> None:
        assert self._group is not None  # set before the first notice is read
        part = KVSlice(notice.first_block, notice.num_blocks, notice.first_layer, notice.num_layers)
        layout: KVLayout = self.port.layout
        if notice.num_bytes != layout.payload_bytes(part.num_blocks, part.num_layers) or part.num_blocks < 1 \
                or part.num_layers < 1:
            raise KVTransferError("bad_stream", f"link notice {notice.seq} announces {notice.num_bytes} bytes "
                                                f"for {part}: the stream can no longer be paired")
        with self._jobs_lock:
            job = self._jobs.get(notice.request_id)
        started = time.perf_counter()
        buffer = self.port.empty_wire(part)
        if not _complete(self._group.recv(buffer), self.port.device, self.broken):
            return
        self.bytes_received += notice.num_bytes
        if job is None:
            return  # cancelled meanwhile: received only to keep the pairing
        with job.lock:
            if not job.active:
                return
            try:
                check_slice(layout, part, notice.num_bytes, len(job.block_ids), job.skip_blocks)
                block_ids = job.block_ids[part.first_block : part.first_block + part.num_blocks]
                if not self.port.import_(block_ids, part, buffer).wait():
                    return
            except KVTransferError as exc:
                job.settle(exc)
                return
            job.received_bytes += notice.num_bytes
            job.wire_seconds += time.perf_counter() - started
            if job.received_bytes >= job.expected_bytes:
                job.settle()


class DecodeLinks:
    """The decode worker's links, one per prefill address, opened on first use and reopened after a failure."""

    def __init__(self, port: KVPort, worker_id: str,
                 channel_for: Any) -> None:  # Callable[[str], grpc.aio.Channel]
        self.port = port
        self.worker_id = worker_id
        self.backend = link_backend_for(port.device)
        self._channel_for = channel_for
        self._links: dict[str, RecvLink] = {}
        self._failed_at: dict[str, float] = {}

    async def get(self, address: str) -> RecvLink:
        """A ready link to `address`, opening one if needed. Raises KVTransferError("link_unavailable")."""
        link = self._links.get(address)
        if link is not None and link.broken.is_set():
            await link.close()
            del self._links[address]
            link = None
        if link is None:
            failed = self._failed_at.get(address)
            if failed is not None and time.monotonic() - failed < REOPEN_BACKOFF_S:
                raise KVTransferError("link_unavailable", f"KV link to {address} failed moments ago")
            link = RecvLink(address, self.port, kvflow_pb2_grpc.PrefillStub(self._channel_for(address)),
                            self.worker_id)
            self._links[address] = link
        try:
            await asyncio.shield(link.ready)
        except KVTransferError:
            self._failed_at[address] = time.monotonic()
            raise
        return link

    async def close(self) -> None:
        for link in self._links.values():
            await link.close()
        self._links.clear()


@contextlib.contextmanager
def _on_device(device: torch.device) -> Any:
    """NCCL and CUDA streams bind to the calling thread's current device: make it the worker's."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield
