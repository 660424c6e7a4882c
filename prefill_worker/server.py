"""Prefill worker: runs prompts through its own scheduler (chunked prefill, prefix cache), streams each request's
KV blocks to the calling decode worker as prefill chunks complete, then the first sampled token.

KV of full blocks is copied out on the engine thread right after the step that completed them (a step hook),
so the transfer overlaps the remaining prefill compute. A finished request's blocks are held (lease) until that
copy is taken; a cancelled stream aborts the request and frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import torch

from engine.errors import InvalidRequest
from engine.kv_transfer import KV_ORDER, KVLayout, KVSlice, gather_slices, tensor_bytes
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from prefill_worker.common import (
    WorkerContext,
    engine_layout,
    info_response,
    layout_from_proto,
    layout_to_proto,
    logprobs_to_proto,
    sampling_kwargs_from_proto,
)
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 10.0


@dataclass
class _Staged:
    slices: list[tuple[KVSlice, torch.Tensor]]  # wire-layout copies: the cache may move on


@dataclass
class _Finished:
    output: RequestOutput
    sampler_state: bytes = b""


@dataclass
class _Transfer:
    """One request's KV stream; `next_block` is touched on the engine thread only."""

    request_id: str
    num_prompt_tokens: int
    total_blocks: int
    next_block: int
    inbox: asyncio.Queue[_Staged | _Finished] = field(default_factory=asyncio.Queue)


class PrefillServicer(kvflow_pb2_grpc.PrefillServicer):
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.engine = ctx.engine
        self.layout: KVLayout = engine_layout(ctx.engine.engine)
        self.block_size = self.layout.block_size
        self._transfers: dict[str, _Transfer] = {}  # engine thread only
        self._by_caller_id: dict[str, str] = {}  # caller request id -> internal id (event loop only)
        ctx.engine.step_hooks.append(self._stage_ready_blocks)

    # ---- engine thread -------------------------------------------------------------------------------------
    def _stage_ready_blocks(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """After each step: copy out newly completed blocks; on finish, the rest, then release the hold."""
        finished = {o.request_id: o for o in outputs if o.finished}
        for request_id, transfer in list(self._transfers.items()):
            output = finished.get(request_id)
            if output is not None and output.outputs[0].finish_reason == "abort":
                del self._transfers[request_id]
                self.engine.post(transfer.inbox.put_nowait, _Finished(output))
                continue
            if output is not None:
                ready = transfer.total_blocks
            else:
                request = engine.scheduler.requests.get(request_id)
                if request is None:
                    continue
                ready = min(request.num_computed_tokens, transfer.num_prompt_tokens) // self.block_size
            if ready > transfer.next_block:
                block_ids = engine.kv_manager.block_ids(request_id)[transfer.next_block : ready]
                slices = gather_slices(engine.runner.kv_caches, block_ids, transfer.next_block, self.layout)
                self.engine.post(transfer.inbox.put_nowait, _Staged(slices))
                transfer.next_block = ready
            if output is not None:
                freed = engine.release_kv(request_id)
                self.engine.post(self.ctx.metrics.blocks_freed.inc, freed)
                del self._transfers[request_id]
                self.engine.post(transfer.inbox.put_nowait, _Finished(output, engine.sampler_state(request_id)))

    def _cancel(self, request_id: str) -> None:
        """Engine thread: drop the stream's transfer and free the request's blocks, whatever its state."""
        def cancel(engine: LLMEngine) -> None:
            self._transfers.pop(request_id, None)
            held = len(engine.kv_manager.block_ids(request_id))
            engine.abort_request(request_id)
            engine.release_kv(request_id)
            if held:
                self.engine.post(self.ctx.metrics.blocks_freed.inc, held)
        self.engine.submit(cancel)

    # ---- RPCs ----------------------------------------------------------------------------------------------
    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[pb.PrefillResponse]:
        caller_id = request.request_id or uuid.uuid4().hex
        request_id = f"{caller_id}@{uuid.uuid4().hex[:12]}"  # callers may reuse ids; blocks are keyed by this
        try:
            params, lease_s = self._validate(request)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        prompt = list(request.prompt_token_ids)
        total_blocks = -(-len(prompt) // self.block_size)
        transfer = _Transfer(request_id, len(prompt), total_blocks, request.skip_blocks)

        def admit(engine: LLMEngine) -> None:
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params, output_kind="final",
                               extra_keys=tuple(request.cache_salt), kv_lease_s=lease_s)
            self._transfers[request_id] = transfer

        started = time.perf_counter()
        try:
            await self.engine.call(admit)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        self._by_caller_id[caller_id] = request_id
        done = False
        num_bytes = 0
        try:
            yield pb.PrefillResponse(request_id=caller_id, header=pb.KVHeader(
                layout=layout_to_proto(self.layout), num_prompt_tokens=len(prompt),
                num_blocks=total_blocks - request.skip_blocks, first_block=request.skip_blocks))
            while True:
                item = await transfer.inbox.get()
                if isinstance(item, _Staged):
                    for part, wire in item.slices:
                        data = tensor_bytes(wire)
                        num_bytes += len(data)
                        yield pb.PrefillResponse(request_id=caller_id, kv=pb.KVChunk(
                            first_block=part.first_block, num_blocks=part.num_blocks, first_layer=part.first_layer,
                            num_layers=part.num_layers, data=data))
                    continue
                done = True
                yield self._final_message(caller_id, item, time.perf_counter() - started)
                break
            self.ctx.metrics.record_transfer(num_bytes, time.perf_counter() - started)
        finally:
            self._by_caller_id.pop(caller_id, None)
            if not done:
                self._cancel(request_id)

    def _final_message(self, caller_id: str, finished: _Finished, seconds: float) -> pb.PrefillResponse:
        output = finished.output
        completion = output.outputs[0]
        if completion.finish_reason == "abort" or not completion.token_ids:
            return pb.PrefillResponse(request_id=caller_id, error=pb.GenerateError(
                code="ABORTED", message="the prefill was aborted"))
        token = completion.token_ids[0]
        logprob = logprobs_to_proto(token, completion.logprobs[0]) if completion.logprobs else None
        return pb.PrefillResponse(request_id=caller_id, done=pb.PrefillDone(
            first_token_id=token, first_token_logprob=logprob, num_cached_tokens=output.num_cached_tokens,
            timings=pb.Timings(prefill_s=seconds), sampler_state=finished.sampler_state))

    def _validate(self, request: pb.PrefillRequest) -> tuple[SamplingParams, float]:
        if not request.prompt_token_ids:
            raise InvalidRequest("prompt_token_ids is empty")
        if request.HasField("expected_layout"):
            expected = layout_from_proto(request.expected_layout)
            if expected.order and expected.order != KV_ORDER:
                raise InvalidRequest(f"KV layout order {expected.order!r} is not supported; use {KV_ORDER!r}")
            if (expected.dtype, expected.num_layers, expected.block_size, expected.num_kv_heads,
                    expected.head_dim) != (self.layout.dtype, self.layout.num_layers, self.layout.block_size,
                                           self.layout.num_kv_heads, self.layout.head_dim):
                raise InvalidRequest(f"KV layout mismatch: decode expects {expected}, this worker has {self.layout}")
        if request.skip_blocks * self.block_size >= len(request.prompt_token_ids):
            raise InvalidRequest(f"skip_blocks={request.skip_blocks} covers the whole prompt; at least its last "
                                 "token must be prefilled")
        if not (request.lease_s >= 0 and request.lease_s <= 600):
            raise InvalidRequest(f"lease_s must be in [0, 600], got {request.lease_s}")
        kwargs = sampling_kwargs_from_proto(request.sampling_params)
        if kwargs.get("n", 1) != 1:
            raise InvalidRequest("a prefill serves one sequence (n must be 1)")
        kwargs.pop("prompt_logprobs", None)  # decode workers prefill prompt_logprobs requests themselves
        kwargs.update(max_tokens=1, min_tokens=0)  # only the first token is sampled here
        return SamplingParams(**kwargs), request.lease_s or DEFAULT_LEASE_S  # type: ignore[arg-type]

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        request_id = self._by_caller_id.get(request.request_id)
        if request_id is not None:
            self._cancel(request_id)
        return pb.AbortResponse(found=request_id is not None)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        return await self.engine.call(lambda e: info_response(e, pb.WORKER_ROLE_PREFILL, self.ctx.worker_id))

    async def StreamKVEvents(self, request: pb.KVEventsRequest, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[pb.KVEventBatch]:
        async for batch in self.ctx.events.subscribe():
            yield batch


def add_prefill_servicer(server: grpc.aio.Server, ctx: WorkerContext) -> PrefillServicer:
    servicer = PrefillServicer(ctx)
    kvflow_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
    return servicer
