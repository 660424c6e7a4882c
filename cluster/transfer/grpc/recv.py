"""The decode side of the gRPC backend: the blocks arrive inside the `Prefill` stream, after its header and before
its PrefillDone.

Each chunk is checked against the pull (slice inside the request, byte count of the layout) and written through
the engine's `KVPort` on a thread that ends with the write, one write at a time (its own CUDA stream on GPUs, the
same for every write). When the pull ends, for any reason, no write into its blocks is still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import grpc
import torch

from cluster.transfer.contract import PullJob, PullResult
from cluster.transfer.prefill_stream import (
    PrefillStreamReader,
    finish_uncancelled,
    prefill_request,
    rpc_error,
)
from cluster.transfer.protocols import FirstTokenCallback
from cluster.worker.channels import ChannelPool
from cluster.worker.threads import in_passing_thread
from engine.kv_layout import KVSlice, KVTransferError, check_slice
from engine.kv_port import KVPort
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc


class GrpcReceiver:
    """KV bytes inside the `Prefill` stream (a `KVReceiver`)."""

    backend = "grpc"

    def __init__(self, port: KVPort, worker_id: str, channels: ChannelPool) -> None:
        self.port = port
        self.worker_id = worker_id
        self._channels = channels
        self._write_lock = threading.Lock()  # one write at a time (and one CUDA stream user)
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
        reader = PrefillStreamReader(job, self.port, self.backend)
        stub = kvflow_pb2_grpc.PrefillStub(self._channels.get(address))
        call = stub.Prefill(prefill_request(job, self.port, self.worker_id, self.backend))
        expected = self.port.layout.payload_bytes(len(job.block_ids) - job.skip_blocks, self.port.layout.num_layers)
        received = 0
        wire_seconds = 0.0
        try:
            async with contextlib.aclosing(reader.messages(call)) as messages:
                async for kind, response in messages:
                    if kind == "kv":
                        if not reader.header_seen:
                            raise KVTransferError("bad_stream", "KV chunk before the header")
                        slice_started = time.perf_counter()
                        await self._write_chunk(job, response.kv)
                        wire_seconds += time.perf_counter() - slice_started
                        received += len(response.kv.data)
                    elif kind == "done":
                        if received != expected:
                            raise KVTransferError("incomplete", f"got {received} of {expected} KV bytes")
                        return reader.result(response.done, received, started, wire_seconds)
            raise reader.ended_early()
        except grpc.aio.AioRpcError as exc:
            raise rpc_error(address, exc) from exc
        finally:
            call.cancel()  # no-op once finished; otherwise tells the prefill worker to free the blocks now

    async def _write_chunk(self, job: PullJob, chunk: pb.KVChunk) -> None:
        part = KVSlice(chunk.first_block, chunk.num_blocks, chunk.first_layer, chunk.num_layers)
        check_slice(self.port.layout, part, len(chunk.data), len(job.block_ids), job.skip_blocks)
        block_ids = job.block_ids[part.first_block : part.first_block + part.num_blocks]
        # A passing thread: on CPU a long-lived one keeps an OpenMP pool beside the engine thread's once a copy runs
        # in parallel (bench/CPU_PROFILE.md). Awaited to its end even when the pull is cancelled meanwhile.
        await finish_uncancelled(asyncio.ensure_future(in_passing_thread(self._write, block_ids, part, chunk.data)))

    async def close(self) -> None:
        """Nothing to end: no thread outlives its write."""
