"""The prefill side of the gRPC backend: a request's exported slices become `KVChunk` messages of its own
`Prefill` stream.

Exports happen on the engine thread (a step hook); the device -> host copy and the serialization run on one
worker-wide thread (`StreamSerializer`), never on the event loop, and only as the stream reads them: a slow
caller holds back its own stream, not the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import torch

from cluster.transfer.contract import GRPC_MAX_CHUNK_BYTES, export_slices, tensor_bytes
from engine.kv_port import KVExport, KVPort
from protos.kvflow.v1 import kvflow_pb2 as pb


class StreamSerializer:
    """Turns exported slices into KV messages on one thread of its own, for every gRPC stream of the worker."""

    def __init__(self, port: KVPort) -> None:
        self.port = port
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-serialize")
        self._stream: torch.cuda.Stream | None = None  # its own CUDA stream, made on first use

    def _to_bytes(self, export: KVExport) -> bytes:
        if not self.port.on_cuda:
            return tensor_bytes(export.tensor)
        if self._stream is None:
            self._stream = self.port.new_stream()
        with self.port.transfer_stream(self._stream):
            export.wait()
            host = export.tensor.to("cpu", non_blocking=False)  # waits for this stream only
        return tensor_bytes(host)

    async def chunks(self, exports: list[KVExport]) -> AsyncIterator[pb.KVChunk]:
        """Event loop: one KV message per slice, in order, each serialized as the stream asks for it."""
        loop = asyncio.get_running_loop()
        for export in exports:
            data = await loop.run_in_executor(self._executor, self._to_bytes, export)
            part = export.part
            yield pb.KVChunk(first_block=part.first_block, num_blocks=part.num_blocks, first_layer=part.first_layer,
                             num_layers=part.num_layers, data=data)


class GrpcSender:
    """One Prefill request's `KVSender` on the gRPC backend: its slices go back to its own stream to be carried."""

    backend = "grpc"

    def __init__(self, serializer: StreamSerializer) -> None:
        self.num_bytes = 0
        self._serializer = serializer

    def send(self, block_ids: list[int], first_block: int, end_block: int) -> AsyncIterator[pb.KVChunk] | None:
        port = self._serializer.port
        exports = list(export_slices(port, block_ids, first_block, end_block, GRPC_MAX_CHUNK_BYTES))
        self.num_bytes += sum(export.tensor.nbytes for export in exports)
        return self._serializer.chunks(exports) if exports else None
