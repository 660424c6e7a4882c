"""`KVTransport` over gRPC: call a prefill worker's `Prefill` stream and write the KV chunks as they arrive.

One channel per prefill address, opened lazily and reused (no per-request setup). Any failure (peer gone,
malformed stream, layout mismatch) becomes a `KVTransferError` with a short reason: the caller recomputes.
"""

from __future__ import annotations

import time

import grpc

from engine.kv_transfer import KVLayout, KVSink, KVSlice, KVTransferError, PullJob, PullResult
from prefill_worker.common import (
    GRPC_OPTIONS,
    layout_from_proto,
    layout_to_proto,
    logprobs_from_proto,
    sampling_params_to_proto,
)
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc

REASONS = {
    grpc.StatusCode.UNAVAILABLE: "prefill_unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "prefill_timeout",
    grpc.StatusCode.INVALID_ARGUMENT: "prefill_rejected",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "prefill_rejected",
    grpc.StatusCode.CANCELLED: "prefill_cancelled",
}


class GrpcKVTransport:
    def __init__(self, layout: KVLayout, worker_id: str) -> None:
        self.layout = layout
        self.worker_id = worker_id
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> kvflow_pb2_grpc.PrefillStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
            self._channels[address] = channel
        return kvflow_pb2_grpc.PrefillStub(channel)

    async def pull(self, address: str, job: PullJob, sink: KVSink) -> PullResult:
        started = time.perf_counter()
        message = pb.PrefillRequest(
            request_id=job.request_id, prompt_token_ids=job.prompt_token_ids,
            sampling_params=sampling_params_to_proto(job.sampling_params),  # type: ignore[arg-type]
            skip_blocks=job.skip_blocks, decode_worker_id=self.worker_id,
            expected_layout=layout_to_proto(self.layout), cache_salt=list(job.extra_keys), lease_s=job.lease_s)
        total_blocks = len(job.block_ids)
        expected_bytes = self.layout.payload_bytes(total_blocks - job.skip_blocks, self.layout.num_layers)
        call = self._stub(address).Prefill(message)
        received = 0
        header_seen = False
        try:
            async for response in call:
                kind = response.WhichOneof("response")
                if kind == "header":
                    self._check_header(response.header, job)
                    header_seen = True
                elif kind == "kv":
                    if not header_seen:
                        raise KVTransferError("bad_stream", "KV chunk before the header")
                    chunk = response.kv
                    if chunk.first_block < job.skip_blocks or chunk.first_block + chunk.num_blocks > total_blocks:
                        raise KVTransferError("bad_stream", f"KV chunk blocks [{chunk.first_block}, "
                                                            f"{chunk.first_block + chunk.num_blocks}) out of range")
                    part = KVSlice(chunk.first_block, chunk.num_blocks, chunk.first_layer, chunk.num_layers)
                    sink(job.block_ids[chunk.first_block : chunk.first_block + chunk.num_blocks], part, chunk.data)
                    received += len(chunk.data)
                elif kind == "done":
                    if received != expected_bytes:
                        raise KVTransferError("incomplete", f"got {received} of {expected_bytes} KV bytes")
                    done = response.done
                    logprobs = logprobs_from_proto(done.first_token_logprob) \
                        if done.HasField("first_token_logprob") else None
                    return PullResult(done.first_token_id, logprobs, total_blocks - job.skip_blocks, received,
                                      done.num_cached_tokens, time.perf_counter() - started, done.sampler_state)
                elif kind == "error":
                    raise KVTransferError("prefill_error", f"{response.error.code}: {response.error.message}")
            raise KVTransferError("incomplete", "the prefill stream ended without PrefillDone")
        except grpc.aio.AioRpcError as exc:
            reason = REASONS.get(exc.code(), "rpc_error")
            raise KVTransferError(reason, f"prefill worker {address}: {exc.code().name}: {exc.details()}") from exc
        finally:
            call.cancel()  # no-op once finished; otherwise tells the prefill worker to free the blocks now

    def _check_header(self, header: pb.KVHeader, job: PullJob) -> None:
        remote = layout_from_proto(header.layout)
        if remote != self.layout:
            raise KVTransferError("layout_mismatch", f"prefill layout {remote} != local {self.layout}")
        if header.first_block != job.skip_blocks or header.num_blocks != len(job.block_ids) - job.skip_blocks:
            raise KVTransferError("bad_stream", f"header announces blocks [{header.first_block}, "
                                                f"+{header.num_blocks}), expected [{job.skip_blocks}, "
                                                f"+{len(job.block_ids) - job.skip_blocks})")

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
