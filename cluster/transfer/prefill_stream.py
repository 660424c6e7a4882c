"""The decode side of the `Prefill` call every pull makes, whatever carries the blocks: the request, the checks on
the stream's header, the reading of its messages, and how a failed call becomes a `KVTransferError`.

On the gRPC backend the stream carries header, KV chunks, then PrefillDone; on a link it carries the header and
PrefillDone only (the blocks travel on the link).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from cluster.transfer.backends import BACKEND_ENUMS, BACKEND_NAMES
from cluster.transfer.contract import PullJob, PullResult
from cluster.transfer.link.heads import same_but_heads
from cluster.wire import layout_from_proto, layout_to_proto, logprobs_from_proto, sampling_params_to_proto
from engine.kv_layout import KVTransferError
from engine.kv_port import KVPort
from engine.outputs import PositionLogprobs
from protos.kvflow.v1 import kvflow_pb2 as pb

# A failed Prefill call's status -> the fallback reason it is counted under (kvflow:disagg_fallback_total{reason})
RPC_FAILURE_REASONS = {
    grpc.StatusCode.UNAVAILABLE: "prefill_unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "prefill_timeout",
    grpc.StatusCode.INVALID_ARGUMENT: "prefill_rejected",
    grpc.StatusCode.FAILED_PRECONDITION: "prefill_rejected",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "prefill_rejected",
    grpc.StatusCode.CANCELLED: "prefill_cancelled",
}


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


def prefill_request(job: PullJob, port: KVPort, worker_id: str, backend: str, link_id: str = ""
                    ) -> pb.PrefillRequest:
    return pb.PrefillRequest(
        request_id=job.request_id, prompt_token_ids=job.prompt_token_ids,
        sampling_params=sampling_params_to_proto(job.sampling_params), skip_blocks=job.skip_blocks,
        decode_worker_id=worker_id, expected_layout=layout_to_proto(port.layout), cache_salt=list(job.extra_keys),
        lease_s=job.lease_s, kv_transfer_backend=BACKEND_ENUMS[backend], link_id=link_id)


def rpc_error(address: str, exc: grpc.aio.AioRpcError) -> KVTransferError:
    reason = RPC_FAILURE_REASONS.get(exc.code(), "rpc_error")
    return KVTransferError(reason, f"prefill worker {address}: {exc.code().name}: {exc.details()}")


class PrefillStreamReader:
    """Reads one `Prefill` stream: checks its header against the pull, raises its error message, and hands the
    rest (KV chunks, PrefillDone) to the caller."""

    def __init__(self, job: PullJob, port: KVPort, backend: str) -> None:
        self.job = job
        self.port = port
        self.backend = backend
        self.header_seen = False

    async def messages(self, call: grpc.aio.UnaryStreamCall) -> AsyncIterator[tuple[str | None, pb.PrefillResponse]]:
        """(kind, message) of each message but the header (checked here) and an error message (raised here)."""
        async for response in call:
            kind = response.WhichOneof("response")
            if kind == "header":
                self._check_header(response.header)
            elif kind == "error":
                raise KVTransferError("prefill_error", f"{response.error.code}: {response.error.message}")
            else:
                yield kind, response

    @staticmethod
    def ended_early() -> KVTransferError:
        return KVTransferError("incomplete", "the prefill stream ended without PrefillDone")

    def _check_header(self, header: pb.KVHeader) -> None:
        job = self.job
        remote = layout_from_proto(header.layout)
        # Over a link, tensor-parallel ranks may hold different heads: the link matched them (its HeadPlan).
        if remote != self.port.layout and not (self.backend != "grpc" and same_but_heads(remote, self.port.layout)):
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
        job = self.job
        return PullResult(done.first_token_id, self.first_token_logprobs(done), len(job.block_ids) - job.skip_blocks,
                          num_bytes, done.num_cached_tokens, time.perf_counter() - started, wire_seconds,
                          self.backend, done.sampler_state, done.timings if done.HasField("timings") else None)
