"""Prefill worker: runs prompts through its own scheduler (chunked prefill, prefix cache) and sends each request's
KV blocks to the calling decode worker as prefill chunks complete, then the first sampled token.

Right after the step that completed them (a step hook, on the engine thread), newly full blocks are exported
through the engine's `KVPort` into contiguous staging tensors, so the transfer overlaps the remaining prefill
compute. The request's `KVSender` (cluster/transfer/) carries them: over the decode worker's KV link (`KVLink`:
NCCL or gloo) or, with the gRPC backend, as bytes in this stream. A finished request's blocks are held (lease)
until that export is taken; a cancelled stream aborts the request and frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from cluster.transfer.backends import BACKEND_ENUMS, BACKEND_NAMES
from cluster.transfer.contract import DEFAULT_LEASE_S
from cluster.transfer.link.heads import same_but_heads
from cluster.transfer.protocols import KVSender
from cluster.wire import layout_from_proto, layout_to_proto, logprobs_to_proto, sampling_kwargs_from_proto
from cluster.worker.runtime import WorkerContext, WorkerServicer, admitted, info_response
from engine.errors import InvalidRequest
from engine.kv_layout import KV_ORDER
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc

MAX_LEASE_S = 600.0


@dataclass
class _Staged:
    chunks: AsyncIterator[pb.KVChunk]  # gRPC backend: KV messages for this stream to carry


@dataclass
class _Finished:
    output: RequestOutput
    sampler_state: bytes = b""
    at: float = field(default_factory=time.perf_counter)  # when the engine thread saw the first token


@dataclass
class _Transfer:
    """One request's KV stream; `next_block` is touched on the engine thread only."""

    request_id: str  # the engine's id
    num_prompt_tokens: int
    total_blocks: int
    next_block: int
    sender: KVSender
    inbox: asyncio.Queue[_Staged | _Finished] = field(default_factory=asyncio.Queue)

    def send_ready(self, engine: LLMEngine, ready: int) -> AsyncIterator[pb.KVChunk] | None:
        """Engine thread: hand blocks [next_block, ready) to the sender; returns what this stream must carry."""
        chunks = self.sender.send(engine.kv_block_ids(self.request_id), self.next_block, ready)
        self.next_block = ready
        return chunks


class PrefillServicer(WorkerServicer, kvflow_pb2_grpc.PrefillServicer):
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.engine = ctx.engine
        self.layout = ctx.kv_port.layout
        self.block_size = self.layout.block_size
        self._transfers: dict[str, _Transfer] = {}  # engine thread only
        self._by_caller_id: dict[str, str] = {}  # caller request id -> internal id (event loop only)
        ctx.engine.step_hooks.append(self._stage_ready_blocks)

    # ---- engine thread -------------------------------------------------------------------------------------
    def _stage_ready_blocks(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """After each step: export newly completed blocks; on finish, the rest, then release the hold."""
        finished = {o.request_id: o for o in outputs if o.finished}
        for request_id, transfer in list(self._transfers.items()):
            output = finished.get(request_id)
            if output is not None and output.outputs[0].finish_reason == "abort":
                del self._transfers[request_id]
                self.engine.post(transfer.inbox.put_nowait, _Finished(output))
                continue
            ready = transfer.total_blocks if output is not None else engine.computed_prompt_blocks(request_id)
            if ready is not None and ready > transfer.next_block:
                chunks = transfer.send_ready(engine, ready)
                if chunks is not None:
                    self.engine.post(transfer.inbox.put_nowait, _Staged(chunks))
            if output is not None:
                freed = engine.release_kv(request_id)  # the exports were queued before any reuse of the blocks
                self.engine.post(self.ctx.metrics.blocks_freed.inc, freed)
                del self._transfers[request_id]
                self.engine.post(transfer.inbox.put_nowait, _Finished(output, engine.sampler_state(request_id)))

    def _cancel(self, request_id: str) -> None:
        """Engine thread: drop the stream's transfer and free the request's blocks, whatever its state."""
        def cancel(engine: LLMEngine) -> None:
            self._transfers.pop(request_id, None)
            held = len(engine.kv_block_ids(request_id))
            engine.abort_request(request_id)
            engine.release_kv(request_id)
            if held:
                self.engine.post(self.ctx.metrics.blocks_freed.inc, held)
        self.engine.submit(cancel)

    # ---- RPCs ----------------------------------------------------------------------------------------------
    @admitted
    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[pb.PrefillResponse]:
        caller_id = request.request_id or uuid.uuid4().hex
        request_id = f"{caller_id}@{uuid.uuid4().hex[:12]}"  # callers may reuse ids; blocks are keyed by this
        try:
            params, lease_s, sender = self._validate(request, caller_id)
        except InvalidRequest as exc:
            code = grpc.StatusCode.FAILED_PRECONDITION if "KV link" in str(exc) else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(exc))
            return
        prompt = list(request.prompt_token_ids)
        total_blocks = -(-len(prompt) // self.block_size)
        transfer = _Transfer(request_id, len(prompt), total_blocks, request.skip_blocks, sender)

        def admit(engine: LLMEngine) -> None:
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params, output_kind="final",
                               extra_keys=tuple(request.cache_salt), kv_lease_s=lease_s)
            self._transfers[request_id] = transfer

        started = time.perf_counter()
        try:
            await self.engine.ready_grammar(params)  # compiled off the engine loop, within the budget
            await self.engine.call(admit)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        admitted = time.perf_counter() - started
        self._by_caller_id[caller_id] = request_id
        done = False
        try:
            yield pb.PrefillResponse(request_id=caller_id, header=pb.KVHeader(
                layout=layout_to_proto(self.layout), num_prompt_tokens=len(prompt),
                num_blocks=total_blocks - request.skip_blocks, first_block=request.skip_blocks,
                backend=BACKEND_ENUMS[sender.backend]))
            fault = self.ctx.transfer.faults.strike()  # fault tests: end this stream after its first KV or token
            while True:
                item = await transfer.inbox.get()
                if fault:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "injected KV-transfer fault")
                if isinstance(item, _Staged):
                    async with contextlib.aclosing(item.chunks) as chunks:
                        async for chunk in chunks:
                            yield pb.PrefillResponse(request_id=caller_id, kv=chunk)
                    continue
                done = True
                timings = pb.Timings(queue_s=admitted, prefill_s=item.at - started,
                                     e2e_s=time.perf_counter() - started)
                # Counted before the last message: once the caller has it, it may end the call, and gRPC then
                # closes this generator at that yield (the count was lost for 1 transfer in 139 under CI load).
                self.ctx.metrics.record_transfer(sender.backend, sender.num_bytes, time.perf_counter() - started)
                yield self._final_message(caller_id, item, timings)
                break
        finally:
            self._by_caller_id.pop(caller_id, None)
            if not done:
                self._cancel(request_id)

    def _final_message(self, caller_id: str, finished: _Finished, timings: pb.Timings) -> pb.PrefillResponse:
        output = finished.output
        completion = output.outputs[0]
        if completion.finish_reason == "abort" or not completion.token_ids:
            return pb.PrefillResponse(request_id=caller_id, error=pb.GenerateError(
                code="ABORTED", message="the prefill was aborted"))
        token = completion.token_ids[0]
        logprob = logprobs_to_proto(token, completion.logprobs[0]) if completion.logprobs else None
        return pb.PrefillResponse(request_id=caller_id, done=pb.PrefillDone(
            first_token_id=token, first_token_logprob=logprob, num_cached_tokens=output.num_cached_tokens,
            timings=timings, sampler_state=finished.sampler_state))

    def _validate(self, request: pb.PrefillRequest, caller_id: str) -> tuple[SamplingParams, float, KVSender]:
        if not request.prompt_token_ids:
            raise InvalidRequest("prompt_token_ids is empty")
        if request.HasField("expected_layout"):
            expected = layout_from_proto(request.expected_layout)
            if expected.order and expected.order != KV_ORDER:
                raise InvalidRequest(f"KV layout order {expected.order!r} is not supported; use {KV_ORDER!r}")
            # Over a link, tensor-parallel ranks may hold different heads: the link matched them (its HeadPlan).
            over_link = BACKEND_NAMES.get(request.kv_transfer_backend) in ("nccl", "gloo")
            if expected != self.layout and not (over_link and same_but_heads(expected, self.layout)):
                raise InvalidRequest(f"KV layout mismatch: decode expects {expected}, this worker has {self.layout}")
        if request.skip_blocks * self.block_size >= len(request.prompt_token_ids):
            raise InvalidRequest(f"skip_blocks={request.skip_blocks} covers the whole prompt; at least its last "
                                 "token must be prefilled")
        if not (request.lease_s >= 0 and request.lease_s <= MAX_LEASE_S):
            raise InvalidRequest(f"lease_s must be in [0, {MAX_LEASE_S:.0f}], got {request.lease_s}")
        sender = self.ctx.transfer.sender.open(request.kv_transfer_backend, request.link_id, caller_id)
        kwargs = sampling_kwargs_from_proto(request.sampling_params)
        if kwargs.get("n", 1) != 1:
            raise InvalidRequest("a prefill serves one sequence (n must be 1)")
        kwargs.pop("prompt_logprobs", None)  # decode workers prefill prompt_logprobs requests themselves
        kwargs.update(max_tokens=1, min_tokens=0)  # only the first token is sampled here
        return SamplingParams(**kwargs), request.lease_s or DEFAULT_LEASE_S, sender

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        request_id = self._by_caller_id.get(request.request_id)
        if request_id is not None:
            self._cancel(request_id)
        return pb.AbortResponse(found=request_id is not None)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        info = await self.engine.call(lambda e: info_response(e, self.ctx.role, self.ctx.worker_id))
        return self.info_for_caller(info, context)

    async def KVLink(self, request: pb.KVLinkRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[pb.KVLinkMessage]:
        async for message in self.ctx.transfer.sender.serve_link(request, context):
            yield message

    async def KVLinkStore(self, request: pb.KVLinkStoreRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> pb.KVLinkStoreResponse:
        return await self.ctx.transfer.sender.serve_link_store(request, context)


def add_prefill_servicer(server: grpc.aio.Server, ctx: WorkerContext) -> PrefillServicer:
    servicer = PrefillServicer(ctx)
    kvflow_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
    return servicer
