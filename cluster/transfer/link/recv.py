"""The decode end of one KV link (`RecvLink`): it reads the KVLink stream on the event loop, receives slices in
notice order on its own thread and imports each into the blocks of the pull it belongs to (`LinkJob`).

A slice whose pull was forgotten meanwhile is still received, and dropped, so that sends and receives keep pairing
up (cluster/transfer/link/__init__.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc

from cluster.transfer.backends import BACKEND_ENUMS
from cluster.transfer.link.group import (
    LINK_DEAD_S,
    SETUP_TIMEOUT_S,
    RankGroups,
    check_rpc_rendezvous,
    join_groups,
    link_backend_for,
    on_device,
)
from cluster.transfer.link.heads import HeadPlan, assemble, heads_from_proto, heads_to_proto, plan_heads
from cluster.transfer.link.store import RpcLinkStore
from cluster.transfer.link.tell import ack_key, tell_ranks, wait_acks
from cluster.wire import layout_to_proto
from engine.kv_layout import KVSlice, KVTransferError, check_slice
from engine.kv_port import KVPort
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc

logger = logging.getLogger(__name__)


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
        self._groups: RankGroups | None = None
        self.plan: HeadPlan | None = None  # once the prefill side said where its heads are
        self._thread: threading.Thread | None = None
        self._closing = False
        self._stub = stub
        self._call = stub.KVLink(pb.KVLinkRequest(link_id=self.link_id, decode_worker_id=worker_id,
                                                  backend=BACKEND_ENUMS[self.backend],
                                                  layout=layout_to_proto(port.layout),
                                                  rank_heads=heads_to_proto(port.ranks.heads)))
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
                    try:
                        self.plan = plan_heads(heads_from_proto(list(ready.rank_heads), self.port.layout),
                                               self.port.ranks.heads)
                    except ValueError as exc:
                        raise KVTransferError("layout_mismatch", str(exc)) from None
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
            with contextlib.suppress(KVTransferError):
                self._tell_ranks({"op": "close", "link": self.link_id})
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
        if self.plan is None:
            raise KVTransferError("link_unavailable", f"KV link to {self.address} is not ready")
        layout = self.port.layout
        job = LinkJob(request_id, block_ids, skip_blocks,
                      self.plan.total_bytes(layout, KVSlice(skip_blocks, len(block_ids) - skip_blocks, 0,
                                                            layout.num_layers)),
                      self._loop, self._loop.create_future())
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
    @property
    def _tp(self) -> bool:
        return self.port.ranks.size > 1

    def _tell_ranks(self, doc: dict) -> None:
        """Any thread; a rank gone makes the worker stop anyway, so a failure here only ends this link."""
        if self._tp:
            try:
                tell_ranks(self.port.ranks, doc)
            except Exception as exc:  # noqa: BLE001 - the link ends, its pulls recompute
                self.broken.set()
                raise KVTransferError("link_down", f"tensor-parallel ranks unreachable: {exc}") from None

    def _run(self, ready: pb.KVLinkReady, started: float) -> None:
        try:
            with on_device(self.port.device):
                plan = self._plan()
                check_rpc_rendezvous(ready.rpc_store)
                rpc_store = RpcLinkStore(self._stub, self.link_id, self._loop, ready.timeout_s or SETUP_TIMEOUT_S)
                self._tell_ranks({"op": "open_recv", "link": self.link_id, "backend": self.backend,
                                  "address": self.address, "prefix": ready.store_prefix,
                                  "timeout_s": ready.timeout_s or SETUP_TIMEOUT_S, "src": plan.src_heads,
                                  "dst": plan.dst_heads})
                self._groups = join_groups(self.backend, ready, rpc_store, plan.receiving(0))
                with self.port.transfer_stream(self.port.new_stream()):
                    self._receive_all(self._groups, started)
        except Exception as exc:  # noqa: BLE001 - any failure ends this link; its pulls recompute
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._break, f"link thread failed: {exc}")
        finally:
            self.broken.set()
            if self._groups is not None:
                self._groups.close(failed=not self._closing)

    def _plan(self) -> HeadPlan:
        if self.plan is None:  # set from `ready` before the link thread starts
            raise KVTransferError("bad_stream", "the KV link has no head plan yet")
        return self.plan

    def _other_ranks(self, what: str) -> list[str]:
        return [ack_key(self.link_id, rank, what) for rank in range(1, self.port.ranks.size)]

    def _receive_all(self, groups: RankGroups, started: float) -> None:
        """Link thread: the hellos that complete the rendezvous (every rank's: the link is ready), then one slice
        per notice."""
        if not groups.hello(self.port.device, self.broken):
            return
        failure = wait_acks(self.port.ranks, self._other_ranks("ready"), self.broken) if self._tp else None
        if failure is not None:
            raise KVTransferError("link_unavailable", f"a tensor-parallel rank's link: {failure}")
        self.setup_seconds = time.perf_counter() - started
        self._loop.call_soon_threadsafe(self._set_ready)
        while True:
            notice = self._inbox.get()
            if notice is None or self.broken.is_set():
                return
            self._receive(groups, notice)

    def _set_ready(self) -> None:
        if not self.ready.done():
            self.ready.set_result(None)
            logger.info("KV link %s (%s) to %s ready in %.2f s", self.link_id, self.backend, self.address,
                        self.setup_seconds)

    def _receive(self, groups: RankGroups, notice: pb.KVLinkChunk) -> None:
        """One slice: every rank receives its pairs' heads (ranks > 0 told to, and waited for), then, if its pull
        still wants it, every rank imports its heads into the pull's blocks (ranks > 0 before their next step)."""
        part = KVSlice(notice.first_block, notice.num_blocks, notice.first_layer, notice.num_layers)
        layout = self.port.layout
        plan = self._plan()
        if part.num_blocks < 1 or part.num_layers < 1 or notice.num_bytes != plan.total_bytes(layout, part):
            raise KVTransferError("bad_stream", f"link notice {notice.seq} announces {notice.num_bytes} bytes "
                                                f"for {part}: the stream can no longer be paired")
        where = [part.first_block, part.num_blocks, part.first_layer, part.num_layers]
        self._tell_ranks({"op": "recv", "link": self.link_id, "seq": notice.seq, "part": where})
        with self._jobs_lock:
            job = self._jobs.get(notice.request_id)
        started = time.perf_counter()
        buffers = [self.port.empty_wire(part, len(pair.heads)) for pair in groups.pairs]
        if not groups.recv(buffers, self.port.device, self.broken):
            return
        if self._tp:
            failure = wait_acks(self.port.ranks, self._other_ranks(str(notice.seq)), self.broken)
            if failure is not None:
                raise KVTransferError("link_down", f"a tensor-parallel rank's receive failed: {failure}")
        self.bytes_received += notice.num_bytes
        if job is None:
            self._tell_ranks({"op": "drop", "link": self.link_id, "seq": notice.seq})
            return  # cancelled meanwhile: received only to keep the pairing
        with job.lock:
            if not job.active:
                self._tell_ranks({"op": "drop", "link": self.link_id, "seq": notice.seq})
                return
            try:
                check_slice(layout, part, layout.payload_bytes(part.num_blocks, part.num_layers),
                            len(job.block_ids), job.skip_blocks)
                block_ids = job.block_ids[part.first_block : part.first_block + part.num_blocks]
                self._tell_ranks({"op": "import", "link": self.link_id, "seq": notice.seq, "blocks": block_ids})
                if not self.port.import_(block_ids, part, assemble(buffers, plan.assembly(0))).wait():
                    return
            except KVTransferError as exc:
                self._tell_ranks({"op": "drop", "link": self.link_id, "seq": notice.seq})
                job.settle(exc)
                return
            job.received_bytes += notice.num_bytes
            job.wire_seconds += time.perf_counter() - started
            if job.received_bytes >= job.expected_bytes:
                job.settle()
