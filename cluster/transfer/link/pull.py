"""The decode worker's pulls over KV links: its links, one per prefill address, opened on first use and reopened
after a failure (`DecodeLinks`), and the `KVReceiver` over them (`LinkReceiver`).

A pull registers with the link before its Prefill call starts, so no notice of it arrives unannounced; the Prefill
stream then carries only the header and the first token, which may arrive (and stream to the caller) before the
last slice has landed. The pull succeeds once both have; either failing ends it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import grpc

from cluster.transfer.contract import PullJob, PullResult
from cluster.transfer.link.group import REOPEN_BACKOFF_S, link_backend_for
from cluster.transfer.link.recv import LinkJob, RecvLink
from cluster.transfer.prefill_stream import (
    PrefillStreamReader,
    finish_uncancelled,
    prefill_request,
    rpc_error,
)
from cluster.transfer.protocols import FirstTokenCallback
from cluster.worker.channels import ChannelPool
from engine.kv_layout import KVTransferError
from engine.kv_port import KVPort
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc


class DecodeLinks:
    """The decode worker's links, one per prefill address, opened on first use and reopened after a failure."""

    def __init__(self, port: KVPort, worker_id: str, channel_for: Callable[[str], grpc.aio.Channel]) -> None:
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


class LinkReceiver:
    """KV over the pair's torch.distributed link; the `Prefill` stream carries the header and the first token (a
    `KVReceiver`)."""

    def __init__(self, port: KVPort, worker_id: str, channels: ChannelPool) -> None:
        self.port = port
        self.worker_id = worker_id
        self.backend = link_backend_for(port.device)
        self._channels = channels
        self.links = DecodeLinks(port, worker_id, channels.get)

    async def pull(self, address: str, job: PullJob, on_first_token: FirstTokenCallback | None = None
                   ) -> PullResult:
        started = time.perf_counter()
        link = await self.links.get(address)
        waiter = link.expect(job.request_id, job.block_ids, job.skip_blocks)
        reader = PrefillStreamReader(job, self.port, self.backend)
        stub = kvflow_pb2_grpc.PrefillStub(self._channels.get(address))
        call = stub.Prefill(prefill_request(job, self.port, self.worker_id, self.backend, link.link_id))
        first_token = asyncio.ensure_future(self._first_token(call, reader))
        try:
            # Both must finish; either failing ends the pull at once (a hung peer stops the link's heartbeats
            # while its Prefill stream just stays silent).
            pending: set[asyncio.Future] = {first_token, waiter.all_received}
            while pending:
                finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in finished:
                    future.result()  # raises its failure
                if first_token in finished and on_first_token is not None and pending:
                    done = first_token.result()
                    await on_first_token(done.first_token_id, reader.first_token_logprobs(done), done.sampler_state)
            return reader.result(first_token.result(), waiter.received_bytes, started, waiter.wire_seconds)
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(address, exc) from exc
        finally:
            first_token.cancel()
            call.cancel()
            await self._forget(link, job.request_id, waiter)

    @staticmethod
    async def _forget(link: RecvLink, request_id: str, waiter: LinkJob) -> None:
        """Once this returns, no write into the pull's blocks can start or is running."""
        received = waiter.all_received
        if received.done() and not received.cancelled() and received.exception() is None:
            link.forget(request_id)  # every slice is written: no import can hold the job's lock
        else:  # even a cancelled pull waits until no write into its blocks can start or is running
            await finish_uncancelled(asyncio.ensure_future(asyncio.to_thread(link.forget, request_id)))

    @staticmethod
    async def _first_token(call: grpc.aio.UnaryStreamCall, reader: PrefillStreamReader) -> pb.PrefillDone:
        async with contextlib.aclosing(reader.messages(call)) as messages:
            async for kind, response in messages:
                if kind != "done":
                    raise KVTransferError("bad_stream", f"unexpected {kind!r} on a link transfer")
                if not reader.header_seen:
                    raise KVTransferError("bad_stream", "PrefillDone before the header")
                return response.done
        raise reader.ended_early()

    async def close(self) -> None:
        await self.links.close()
