"""How a decode worker gets a prompt's KV from a prefill worker: `KVTransport`, with two implementations.

- `LinkKVTransport`: the blocks arrive over the pair's torch.distributed link (NCCL GPU to GPU, gloo between CPU
  workers); the `Prefill` stream carries only the header and the first token.
- `GrpcKVTransport`: the blocks arrive as raw bytes inside the `Prefill` stream (any two workers that can talk).

`KVTransports` picks one per pull, and first checks the address against the `PrefillAllowlist`: no channel is ever
opened to (and no cluster credential sent to) an address it refuses.

Both write through the engine's `KVPort` on a transfer thread with its own stream, never on the event loop or the
engine thread, and return only once every write has completed on the device. Any failure (peer gone, malformed
stream, layout mismatch) is a `KVTransferError` with a short reason: the caller recomputes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc
import torch

from cluster.transfer.contract import PullJob, PullResult
from cluster.transfer.link import DecodeLinks, link_backend_available, link_backend_for
from cluster.wire import (
    BACKEND_ENUMS,
    BACKEND_NAMES,
    layout_from_proto,
    layout_to_proto,
    logprobs_from_proto,
    sampling_params_to_proto,
)
from cluster.worker.channels import ChannelPool
from cluster.worker.faults import FaultInjector
from cluster.worker.threads import in_passing_thread
from decode_worker.allowlist import PrefillAllowlist
from engine.kv_layout import KVSlice, KVTransferError, check_slice
from engine.kv_port import KVPort
from engine.outputs import PositionLogprobs
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc

REASONS = {
    grpc.StatusCode.UNAVAILABLE: "prefill_unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "prefill_timeout",
    grpc.StatusCode.INVALID_ARGUMENT: "prefill_rejected",
    grpc.StatusCode.FAILED_PRECONDITION: "prefill_rejected",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "prefill_rejected",
    grpc.StatusCode.CANCELLED: "prefill_cancelled",
}
TRANSFER_BACKENDS = ("auto", "nccl", "grpc")


async def finish_uncancelled(future: asyncio.Future) -> object:
    """Await `future` to its end even if this task is cancelled meanwhile (then re-raise the cancellation): a
    write into a pull's blocks must never outlive the pull."""
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(future)
            break
        except asyncio.CancelledError:
            if future.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


# Called with the prefill worker's first token (id, logprobs, sampler state) as soon as it arrives, when that is
# before the KV has landed (link transports), so that the token can stream while the transfer finishes.
FirstTokenCallback = Callable[[int, PositionLogprobs | None, bytes], Awaitable[None]]


class KVTransport(Protocol):
    backend: str

    async def pull(self, address: str, job: PullJob, on_first_token: FirstTokenCallback | None = None
                   ) -> PullResult: ...

    async def close(self) -> None: ...


def _prefill_request(job: PullJob, port: KVPort, worker_id: str, backend: str, link_id: str = ""
                     ) -> pb.PrefillRequest:
    return pb.PrefillRequest(
        request_id=job.request_id, prompt_token_ids=job.prompt_token_ids,
        sampling_params=sampling_params_to_proto(job.sampling_params), skip_blocks=job.skip_blocks,
        decode_worker_id=worker_id, expected_layout=layout_to_proto(port.layout), cache_salt=list(job.extra_keys),
        lease_s=job.lease_s, kv_transfer_backend=BACKEND_ENUMS[backend], link_id=link_id)


class _PrefillStream:
    """Reads one `Prefill` stream: the header, KV chunks (gRPC backend only), then the first token."""

    def __init__(self, job: PullJob, port: KVPort, backend: str) -> None:
        self.job = job
        self.port = port
        self.backend = backend
        self.header_seen = False

    def check_header(self, header: pb.KVHeader) -> None:
        job = self.job
        remote = layout_from_proto(header.layout)
        if remote != self.port.layout:
            raise KVTransferError("layout_mismatch", f"prefill layout {remote} != local {self.port.layout}")
        if BACKEND_NAMES.get(header.backend, "") != self.backend:
            raise KVTransferError("bad_stream", f"prefill worker sends over {BACKEND_NAMES.get(header.backend)}, "
                                                f"asked {self.backend}")
        if header.first_block != job.skip_blocks or header.num_blocks != len(job.block_ids) - job.skip_blocks:
            raise KVTransferError("bad_stream", f"header announces blocks [{header.first_block}, "
                                                f"+{header.num_blocks}), expected [{job.skip_blocks}, "
                                                f"+{len(job.block_ids) - job.skip_blocks})")
        self.header_seen = True

    @staticmethod
    def first_token_logprobs(done: pb.PrefillDone) -> PositionLogprobs | None:
        return logprobs_from_proto(done.first_token_logprob) if done.HasField("first_token_logprob") else None

    def result(self, done: pb.PrefillDone, num_bytes: int, started: float, wire_seconds: float) -> PullResult:
        return PullResult(done.first_token_id, self.first_token_logprobs(done), len(self.job.block_ids) - self.job.skip_blocks, num_bytes,
                          done.num_cached_tokens, time.perf_counter() - started, wire_seconds, self.backend,
                          done.sampler_state, done.timings if done.HasField("timings") else None)


def _rpc_error(address: str, exc: grpc.aio.AioRpcError) -> KVTransferError:
    reason = REASONS.get(exc.code(), "rpc_error")
    return KVTransferError(reason, f"prefill worker {address}: {exc.code().name}: {exc.details()}")


class GrpcKVTransport:
    """KV bytes inside the `Prefill` stream; each write on a thread that ends with it, one write at a time (its own
    CUDA stream on GPUs, the same for every write)."""

    backend = "grpc"

    def __init__(self, port: KVPort, worker_id: str, channels: ChannelPool) -> None:
        self.port = port
        self.worker_id = worker_id
        self._channels = channels
        self._write_lock = threading.Lock()  # one write at a time (and one CUDA stream user), as before
        self._stream: torch.cuda.Stream | None = None

    def _write(self, block_ids: list[int], part: KVSlice, data: bytes) -> None:
        with self._write_lock:
            if self.port.on_cuda and self._stream is None:
                self._stream = self.port.new_stream()
            with self.port.transfer_stream(self._stream):
                self.port.import_(block_ids, part, self.port.wire_from_bytes(part, data)).wait()

    async def pull(self, address: str, job: PullJob, on_first_token: FirstTokenCallback | None = None
                   ) -> PullResult:
        # The first token comes after the KV on this stream: no early delivery (the caller takes it from the result).
        started = time.perf_counter()
        reader = _PrefillStream(job, self.port, self.backend)
        stub = kvflow_pb2_grpc.PrefillStub(self._channels.get(address))
        call = stub.Prefill(_prefill_request(job, self.port, self.worker_id, self.backend))
        total_blocks = len(job.block_ids)
        expected = self.port.layout.payload_bytes(total_blocks - job.skip_blocks, self.port.layout.num_layers)
        received = 0
        wire_seconds = 0.0
        try:
            async for response in call:
                kind = response.WhichOneof("response")
                if kind == "header":
                    reader.check_header(response.header)
                elif kind == "kv":
                    if not reader.header_seen:
                        raise KVTransferError("bad_stream", "KV chunk before the header")
                    chunk = response.kv
                    slice_started = time.perf_counter()
                    part = KVSlice(chunk.first_block, chunk.num_blocks, chunk.first_layer, chunk.num_layers)
                    check_slice(self.port.layout, part, len(chunk.data), total_blocks, job.skip_blocks)
                    block_ids = job.block_ids[part.first_block : part.first_block + part.num_blocks]
                    # When the pull ends, for any reason, no write into its blocks is still running. A passing
                    # thread: on CPU a long-lived one keeps an OpenMP pool beside the engine thread's once a copy
                    # runs in parallel (bench/CPU_PROFILE.md).
                    await finish_uncancelled(asyncio.ensure_future(in_passing_thread(self._write, block_ids, part,
                                                                                     chunk.data)))
                    wire_seconds += time.perf_counter() - slice_started
                    received += len(chunk.data)
                elif kind == "done":
                    if received != expected:
                        raise KVTransferError("incomplete", f"got {received} of {expected} KV bytes")
                    return reader.result(response.done, received, started, wire_seconds)
                elif kind == "error":
                    raise KVTransferError("prefill_error", f"{response.error.code}: {response.error.message}")
            raise KVTransferError("incomplete", "the prefill stream ended without PrefillDone")
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error(address, exc) from exc
        finally:
            call.cancel()  # no-op once finished; otherwise tells the prefill worker to free the blocks now

    async def close(self) -> None:
        pass  # no thread outlives its write


class LinkKVTransport:
    """KV over the pair's torch.distributed link; the `Prefill` stream carries the header and the first token."""

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
        reader = _PrefillStream(job, self.port, self.backend)
        stub = kvflow_pb2_grpc.PrefillStub(self._channels.get(address))
        call = stub.Prefill(_prefill_request(job, self.port, self.worker_id, self.backend, link.link_id))
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
            raise _rpc_error(address, exc) from exc
        finally:
            first_token.cancel()
            call.cancel()
            if waiter.all_received.done() and not waiter.all_received.cancelled() \
                    and waiter.all_received.exception() is None:
                link.forget(job.request_id)  # every slice is written: no import can hold the job's lock
            else:  # even a cancelled pull waits until no write into its blocks can start or is running
                await finish_uncancelled(asyncio.ensure_future(asyncio.to_thread(link.forget, job.request_id)))

    @staticmethod
    async def _first_token(call: grpc.aio.UnaryStreamCall, reader: _PrefillStream) -> pb.PrefillDone:
        async for response in call:
            kind = response.WhichOneof("response")
            if kind == "header":
                reader.check_header(response.header)
            elif kind == "done":
                if not reader.header_seen:
                    raise KVTransferError("bad_stream", "PrefillDone before the header")
                return response.done
            elif kind == "error":
                raise KVTransferError("prefill_error", f"{response.error.code}: {response.error.message}")
            else:
                raise KVTransferError("bad_stream", f"unexpected {kind!r} on a link transfer")
        raise KVTransferError("incomplete", "the prefill stream ended without PrefillDone")

    async def close(self) -> None:
        await self.links.close()


class KVTransports:
    """`--kv-transfer-backend`: which transport a pull uses. `auto` takes the link (NCCL) between GPU workers and
    gRPC bytes otherwise, or when the link to that peer cannot be opened; `nccl` insists on the link (on CPU
    workers it runs the same path over gloo) and recomputes when it fails; `grpc` never opens links."""

    def __init__(self, choice: str, port: KVPort, worker_id: str, channels: ChannelPool,
                 allowlist: PrefillAllowlist | None = None, faults: FaultInjector | None = None) -> None:
        if choice not in TRANSFER_BACKENDS:
            raise ValueError(f"--kv-transfer-backend must be one of {', '.join(TRANSFER_BACKENDS)}, got {choice!r}")
        if choice == "nccl" and not link_backend_available(port.device):
            raise ValueError(f"--kv-transfer-backend nccl: torch.distributed {link_backend_for(port.device)} is "
                             "not available in this torch build")
        self.choice = choice
        self.allowlist = allowlist or PrefillAllowlist((), holds_token=False)
        self.faults = faults or FaultInjector()
        self.grpc = GrpcKVTransport(port, worker_id, channels)
        use_link = choice == "nccl" or (choice == "auto" and port.on_cuda and link_backend_available(port.device))
        self.link = LinkKVTransport(port, worker_id, channels) if use_link else None

    async def pull(self, address: str, job: PullJob, on_first_token: FirstTokenCallback | None = None
                   ) -> PullResult:
        if not await self.allowlist.allows(address):
            raise KVTransferError("prefill_not_allowed", f"prefill address {address} is not in --prefill-allowlist")
        if self.faults.strike():  # fault tests: cut the pull at a random point, as a peer failure would
            pull = asyncio.ensure_future(self._pull(address, job, on_first_token))
            await asyncio.wait({pull}, timeout=self.faults.delay_s())
            pull.cancel()
            with contextlib.suppress(BaseException):
                await pull
            raise KVTransferError("injected_fault", "injected KV-transfer fault (--kv-transfer-fault-rate)")
        return await self._pull(address, job, on_first_token)

    async def _pull(self, address: str, job: PullJob, on_first_token: FirstTokenCallback | None) -> PullResult:
        if self.link is None:
            return await self.grpc.pull(address, job)
        if self.choice == "auto":
            try:
                await self.link.links.get(address)
            except KVTransferError:
                return await self.grpc.pull(address, job)  # no GPU path to this peer
        return await self.link.pull(address, job, on_first_token)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.grpc.close()
        if self.link is not None:
            await self.link.close()
