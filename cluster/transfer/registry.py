"""Which KV transport a worker uses, decided in one place: the worker runtime builds a `WorkerTransfer` here, and
the roles use its two ends through the protocols (cluster/transfer/protocols.py).

- Send side (`SendEndpoint`), keyed by the backend a Prefill request names: "grpc" -> `GrpcSender` (bytes in the
  stream), "nccl" / "gloo" -> `LinkSender` over the link that decode worker opened through `KVLink`.
- Receive side (`build_receiver`), keyed by `--kv-transfer-backend`: "grpc" never opens links; "nccl" insists on
  the link (on CPU workers it runs the same path over gloo) and recomputes when it fails; "auto" takes the link
  (NCCL) between GPU workers and gRPC bytes otherwise, or when the link to that peer cannot be opened.
- Tensor-parallel workers move KV over links only, each rank its own heads (cluster/transfer/link/heads.py): "auto"
  is the link there too (gloo on CPUs), "grpc" is refused on either side.

Every worker has both ends: each serves `KVLink` and Prefill senders, each can pull.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import grpc

from cluster.transfer.backends import BACKEND_NAMES, KV_TRANSFER_BACKENDS
from cluster.transfer.contract import PullJob, PullResult
from cluster.transfer.faults import FaultInjector, FaultyReceiver
from cluster.transfer.grpc.recv import GrpcReceiver
from cluster.transfer.grpc.send import GrpcSender, StreamSerializer
from cluster.transfer.link.group import link_backend_available, link_backend_for
from cluster.transfer.link.pull import LinkReceiver
from cluster.transfer.link.send import LinkSender, LinkServer
from cluster.transfer.protocols import FirstTokenCallback, KVReceiver, KVSender
from cluster.worker.channels import ChannelPool
from engine.errors import InvalidRequest
from engine.kv_layout import KVTransferError
from engine.kv_port import KVPort
from protos.kvflow.v1 import kvflow_pb2 as pb


class SendEndpoint:
    """A worker's send side: serves decode workers' `KVLink` RPCs and opens the sender of each Prefill request."""

    def __init__(self, choice: str, port: KVPort, address: str) -> None:
        self.choice = choice
        self.links = LinkServer(port, address)
        self.serializer = StreamSerializer(port)
        self._openers: Mapping[str, Callable[[str, str, str], KVSender]] = MappingProxyType(
            {"grpc": self._grpc_sender, "nccl": self._link_sender, "gloo": self._link_sender})

    def open(self, backend_enum: int, link_id: str, caller_id: str) -> KVSender:
        """The sender of one Prefill request (`caller_id`: the decode worker's id of it). Raises InvalidRequest
        for an unknown backend or a link that is not open here."""
        backend = BACKEND_NAMES.get(backend_enum)
        if backend is None:
            raise InvalidRequest(f"unknown kv_transfer_backend {backend_enum}")
        return self._openers[backend](backend, link_id, caller_id)

    def _grpc_sender(self, backend: str, link_id: str, caller_id: str) -> KVSender:
        if self.links.port.ranks.size > 1:  # the stream would carry rank 0's heads only
            raise InvalidRequest("this worker is tensor-parallel: its KV moves over KV links only (rank to rank), "
                                 "not in the Prefill stream (--kv-transfer-backend grpc)")
        return GrpcSender(self.serializer)

    def _link_sender(self, backend: str, link_id: str, caller_id: str) -> KVSender:
        link = self.links.get(link_id)
        if link is None or link.backend != backend:
            raise InvalidRequest(f"KV link {link_id!r} ({backend}) is not open on this worker")
        return LinkSender(link, caller_id)

    async def serve_link(self, request: pb.KVLinkRequest, context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[pb.KVLinkMessage]:
        """The `KVLink` RPC."""
        if self.choice == "grpc":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker runs --kv-transfer-backend grpc: no KV links")
        async for message in self.links.serve(request, context):
            yield message

    async def serve_link_store(self, request: pb.KVLinkStoreRequest,
                               context: grpc.aio.ServicerContext) -> pb.KVLinkStoreResponse:
        """The `KVLinkStore` RPC: a gloo link's rendezvous, on this authenticated port."""
        return await self.links.stores.serve(request, context)

    def close(self) -> None:
        """Worker shutdown: end every link and wait for its communicator's teardown."""
        self.links.close()


class LinkOrGrpcReceiver:
    """`auto` between GPU workers: the link, or gRPC bytes when no link to that peer can be opened."""

    def __init__(self, port: KVPort, worker_id: str, channels: ChannelPool) -> None:
        self.link = LinkReceiver(port, worker_id, channels)
        self.grpc_bytes = GrpcReceiver(port, worker_id, channels)

    async def pull(self, address: str, job: PullJob, on_first_token: FirstTokenCallback | None = None
                   ) -> PullResult:
        try:
            await self.link.links.get(address)
        except KVTransferError:
            return await self.grpc_bytes.pull(address, job)  # no GPU path to this peer
        return await self.link.pull(address, job, on_first_token)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.grpc_bytes.close()
        await self.link.close()


def _grpc_only(port: KVPort, worker_id: str, channels: ChannelPool) -> KVReceiver:
    if port.ranks.size > 1:
        raise ValueError(f"--kv-transfer-backend grpc with --tensor-parallel-size {port.ranks.size}: the Prefill "
                         "stream carries one rank's KV; tensor-parallel workers move KV rank to rank over KV links "
                         "(--kv-transfer-backend auto or nccl)")
    return GrpcReceiver(port, worker_id, channels)


def _link_only(port: KVPort, worker_id: str, channels: ChannelPool) -> KVReceiver:
    if not link_backend_available(port.device):
        raise ValueError(f"--kv-transfer-backend nccl: torch.distributed {link_backend_for(port.device)} is "
                         "not available in this torch build")
    return LinkReceiver(port, worker_id, channels)


def _link_between_gpus(port: KVPort, worker_id: str, channels: ChannelPool) -> KVReceiver:
    if port.ranks.size > 1:  # rank to rank, or recompute: gRPC bytes would fill rank 0's heads only
        return _link_only(port, worker_id, channels)
    if port.on_cuda and link_backend_available(port.device):
        return LinkOrGrpcReceiver(port, worker_id, channels)
    return GrpcReceiver(port, worker_id, channels)


# `--kv-transfer-backend` -> the receive side it builds.
RECEIVERS: Mapping[str, Callable[[KVPort, str, ChannelPool], KVReceiver]] = MappingProxyType(
    {"auto": _link_between_gpus, "nccl": _link_only, "grpc": _grpc_only})
if tuple(RECEIVERS) != KV_TRANSFER_BACKENDS:  # import-time check: every CLI choice builds a receiver
    raise RuntimeError(f"receivers {tuple(RECEIVERS)} != --kv-transfer-backend choices {KV_TRANSFER_BACKENDS}")


def build_receiver(choice: str, port: KVPort, worker_id: str, channels: ChannelPool,
                   faults: FaultInjector | None = None) -> KVReceiver:
    """The receive side for `--kv-transfer-backend choice`; with a fault rate, it cuts that share of pulls.
    Raises ValueError for an unknown choice, or "nccl" where torch.distributed lacks the device's backend."""
    build = RECEIVERS.get(choice)
    if build is None:
        raise ValueError(f"--kv-transfer-backend must be one of {', '.join(KV_TRANSFER_BACKENDS)}, got {choice!r}")
    receiver = build(port, worker_id, channels)
    return FaultyReceiver(receiver, faults) if faults is not None and faults.rate else receiver


@dataclass(frozen=True)
class WorkerTransfer:
    """One worker's two ends of KV transfer, and the faults both inject (fault tests only)."""

    sender: SendEndpoint
    receiver: KVReceiver
    faults: FaultInjector

    async def close(self) -> None:
        """Worker shutdown, once its gRPC server has stopped: the receiver's links first, then the sender's."""
        await self.receiver.close()
        self.sender.close()


def build_worker_transfer(choice: str, port: KVPort, worker_id: str, address: str, channels: ChannelPool,
                          faults: FaultInjector) -> WorkerTransfer:
    """Both ends for a worker whose `--kv-transfer-backend` is `choice` and whose peers reach it at `address` (its
    advertised host:port: its tensor-parallel ranks dial it for a link's store)."""
    receiver = build_receiver(choice, port, worker_id, channels, faults)
    return WorkerTransfer(SendEndpoint(choice, port, address), receiver, faults)
