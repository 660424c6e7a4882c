"""Decode worker: serves `Generation.Generate` to the router, getting prompt KV from a prefill worker.

Per request: if a prefill address is given, the request is single-sample, and at least
`--disagg-min-prompt-tokens` prompt tokens miss the local prefix cache, blocks for the prompt are reserved and
the KV is pulled from the prefill worker (leading blocks cached here are skipped). Otherwise, or when the pull
fails (counted in kvflow:disagg_fallback_total{reason}), the prompt is prefilled here; so is a prompt whose
prefill address is not in `--prefill-allowlist` (reason "prefill_not_allowed", decode_worker/allowlist.py): that
check comes first, so no channel is ever opened to (and no cluster credential sent to) an address it refuses. The
KV arrives through the worker's `KVReceiver` (cluster/transfer/). Tokens stream to the caller from this worker only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from cluster.transfer.contract import DEFAULT_LEASE_S, PullJob, PullResult
from cluster.transfer.prefill_stream import finish_uncancelled
from cluster.transfer.protocols import FirstTokenCallback, KVReceiver
from cluster.wire import FINISH_REASON_TO_PROTO, logprobs_to_proto, sampling_params_from_proto
from cluster.worker.runtime import WorkerContext, WorkerServicer, admitted, info_response
from decode_worker.allowlist import PrefillAllowlist
from engine.errors import InvalidRequest
from engine.kv_layout import KVTransferError
from engine.llm_engine import LLMEngine, RemoteSlot
from engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from engine.sampling_params import SamplingParams
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc

logger = logging.getLogger(__name__)



@dataclass
class _Choice:
    """What was already sent of one sample."""

    num_tokens: int = 0
    text: list[str] = field(default_factory=list)


class GenerationServicer(WorkerServicer, kvflow_pb2_grpc.GenerationServicer):
    def __init__(self, ctx: WorkerContext, disagg_min_prompt_tokens: int,
                 prefill_allowlist: Sequence[str] = ()) -> None:
        self.ctx = ctx
        self.engine = ctx.engine
        self.disagg_min_prompt_tokens = disagg_min_prompt_tokens
        self.allowlist = PrefillAllowlist(prefill_allowlist, holds_token=ctx.auth.token is not None)
        self.receiver: KVReceiver = ctx.transfer.receiver
        ctx.on_drain_timeout.append(self._abort_all)
        self._active: set[str] = set()
        self._drained: set[str] = set()  # aborted by the drain timeout, not by their caller
        self._pulls: dict[str, asyncio.Task] = {}  # requests whose reserved blocks the receiver is writing
        self._aborted_pulls: set[str] = set()

    @admitted
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        arrival = time.perf_counter()
        request_id = request.request_id or uuid.uuid4().hex
        try:
            params, prompt = self._parse(request)
            if request_id in self._active:
                raise InvalidRequest(f"request id {request_id!r} is already in use")
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        address = request.disaggregation.prefill_address
        min_tokens = request.disaggregation.min_prompt_tokens or self.disagg_min_prompt_tokens
        resumed = list(request.resume_token_ids)  # migrated here: prefill prompt + resumed tokens locally
        # (A tensor-parallel engine's ranks each pull their own heads over KV links: cluster/transfer/link/.)
        remote = bool(address) and params.n == 1 and params.prompt_logprobs is None and not resumed
        extra_keys = tuple(request.cache_salt)

        def admit(engine: LLMEngine) -> RemoteSlot | None:
            if remote:
                slot = engine.add_remote_prefill_request(request_id, prompt, params, "delta", extra_keys, min_tokens)
                if slot is not None:
                    return slot
            engine.add_request(request_id, prompt, params, "delta", extra_keys, resume_output_token_ids=resumed)
            return None

        stream = self.engine.open_stream(request_id)
        self._active.add(request_id)
        finished = False
        pull: asyncio.Future | None = None
        try:
            try:
                await self.engine.ready_grammar(params)  # compiled off the engine loop, within the budget
                slot = await self.engine.call(admit)
            except InvalidRequest as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                return
            admitted = time.perf_counter() - arrival
            path, pull_s, transfer_s, remote_cached, remote = pb.PREFILL_PATH_LOCAL, 0.0, 0.0, 0, None
            if slot is not None:
                # The pull runs beside the stream: the prefill worker's first token streams as soon as it arrives,
                # while its KV is still landing.
                pull = asyncio.ensure_future(self._pull(address, slot, extra_keys))
            choices = [_Choice(num_tokens=len(resumed)) for _ in range(params.n)]  # resumed ones were sent
            first_token_s: float | None = None
            while True:
                if pull is not None:
                    item = await self._next_during_pull(stream, pull)
                    if pull.done():
                        path, pull_s, transfer_s, remote_cached, remote = pull.result()
                        pull = None
                    if item is None:
                        continue
                else:
                    item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    yield pb.GenerateResponse(request_id=request_id, error=pb.GenerateError(
                        code="INTERNAL", message=f"the engine failed: {item}"))
                    return
                if first_token_s is None and any(c.token_ids for c in item.outputs):
                    first_token_s = time.perf_counter() - arrival
                timings = pb.Timings(queue_s=admitted, ttft_s=first_token_s or 0.0, prefill_s=pull_s,
                                     kv_transfer_s=transfer_s, e2e_s=time.perf_counter() - arrival, remote=remote)
                usage = self._usage(item, remote_cached)
                if request.stream:
                    for completion in item.outputs:
                        chunk = self._chunk(completion, choices[completion.index], usage, timings)
                        if chunk is not None:
                            yield pb.GenerateResponse(request_id=request_id, chunk=chunk)
                else:
                    for completion in item.outputs:
                        self._chunk(completion, choices[completion.index], usage, timings)
                if item.finished:
                    finished = True
                    if request_id in self._drained and params.n == 1 and \
                            item.outputs[0].finish_reason == "abort":
                        yield pb.GenerateResponse(request_id=request_id, error=pb.GenerateError(
                            code="UNAVAILABLE", message="the decode worker drained before the request finished"))
                        return
                    yield pb.GenerateResponse(request_id=request_id, complete=self._complete(
                        item, choices, usage, timings, path, len(resumed)))
                    return
        finally:
            if pull is not None and not pull.done():  # no write into the request's blocks may outlive it
                pull.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):  # the cleanup below must still run
                    await finish_uncancelled(pull)
            self._active.discard(request_id)
            self._drained.discard(request_id)
            self.engine.close_stream(request_id)
            if not finished:  # the caller went away (or we failed): free the request's blocks now
                self.engine.submit(lambda e: e.abort_request(request_id))

    @staticmethod
    async def _next_during_pull(stream: asyncio.Queue, pull: asyncio.Future) -> object | None:
        """The stream's next item, or None when the pull finished first (its result is then due)."""
        getter = asyncio.ensure_future(stream.get())
        done, _ = await asyncio.wait({getter, pull}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            return getter.result()
        getter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await getter
        if not getter.cancelled():  # it got an item as it was being cancelled
            return getter.result()
        return None

    async def _pull(self, address: str, slot: RemoteSlot, extra_keys: tuple[str, ...]
                    ) -> tuple[int, float, float, int, pb.Timings | None]:
        """Get the prompt KV into the reserved blocks; on failure recompute locally.

        Returns (path, pull seconds, wire seconds, prompt tokens the prefill worker found in its prefix cache,
        the prefill worker's timings)."""
        request_id = slot.request_id
        job = PullJob(request_id, slot.prompt_token_ids, slot.params, slot.block_ids, slot.num_cached_blocks,
                      extra_keys, DEFAULT_LEASE_S)
        async def take_first_token(token: int, logprobs: PositionLogprobs | None, sampler_state: bytes) -> None:
            await self.engine.call(lambda e: e.take_remote_first_token(request_id, token, logprobs, sampler_state))

        task = asyncio.ensure_future(self._allowed_pull(address, job, take_first_token))
        self._pulls[request_id] = task
        try:
            result = await task
        except asyncio.CancelledError:
            if request_id not in self._aborted_pulls:
                raise  # the caller went away: Generate's cleanup aborts the request
            await self.engine.call(lambda e: e.abort_request(request_id))  # Abort RPC mid-pull
            return pb.PREFILL_PATH_LOCAL, 0.0, 0.0, 0, None
        except KVTransferError as exc:
            logger.warning("request %s: KV transfer from %s failed (%s); prefilling locally", request_id, address,
                           exc)
            self.ctx.metrics.record_fallback(exc.reason)
            await self.engine.call(lambda e: e.fail_remote_prefill(request_id))
            return pb.PREFILL_PATH_LOCAL, 0.0, 0.0, 0, None
        finally:
            self._pulls.pop(request_id, None)
            self._aborted_pulls.discard(request_id)
        self.ctx.metrics.record_transfer(result.backend, result.num_bytes, result.seconds)
        block_size = self.ctx.kv_port.layout.block_size
        self.ctx.events.transfer_pace.observe(result.num_blocks_received * block_size, result.wire_seconds)
        # Tokens the prefill worker served from its cache (not the ones this worker had: those were not sent).
        own_cached = slot.num_cached_blocks * block_size
        self.ctx.metrics.fetched_tokens.inc(max(result.remote_cached_tokens - own_cached, 0))
        await self.engine.call(
            lambda e: e.finish_remote_prefill(request_id, result.first_token_id, result.first_token_logprobs,
                                              result.sampler_state))
        return (pb.PREFILL_PATH_DISAGGREGATED, result.seconds, result.wire_seconds, result.remote_cached_tokens,
                result.remote_timings)  # type: ignore[return-value]

    async def _allowed_pull(self, address: str, job: PullJob, on_first_token: FirstTokenCallback) -> PullResult:
        """The pull, if `address` is in --prefill-allowlist (checked before anything is sent there)."""
        if not await self.allowlist.allows(address):
            raise KVTransferError("prefill_not_allowed", f"prefill address {address} is not in --prefill-allowlist")
        return await self.receiver.pull(address, job, on_first_token)

    def _parse(self, request: pb.GenerateRequest) -> tuple[SamplingParams, str | dict[str, list[int]]]:
        params = sampling_params_from_proto(request.sampling_params)
        kind = request.WhichOneof("input")
        if kind == "text":
            if not request.text:
                raise InvalidRequest("the prompt is empty")
            return params, request.text
        if kind == "token_ids":
            return params, {"prompt_token_ids": list(request.token_ids.ids)}
        raise InvalidRequest("the request needs `text` or `token_ids`")

    @staticmethod
    def _usage(output: RequestOutput, remote_cached: int) -> pb.Usage:
        # A transferred prompt was computed by the prefill worker: its prefix hit is what this request saved.
        return pb.Usage(prompt_tokens=len(output.prompt_token_ids),
                        completion_tokens=sum(len(c.token_ids) for c in output.outputs),
                        cached_tokens=max(output.num_cached_tokens, remote_cached))

    @staticmethod
    def _chunk(completion: CompletionOutput, sent: _Choice, usage: pb.Usage, timings: pb.Timings
               ) -> pb.GenerateChunk | None:
        """The new part of one sample since the last chunk (delta text, new token ids), or None."""
        new_tokens = completion.token_ids[sent.num_tokens :]
        logprobs = []
        if completion.logprobs is not None:
            logprobs = [logprobs_to_proto(t, lp) for t, lp in
                        zip(new_tokens, completion.logprobs[sent.num_tokens :], strict=False)]
        sent.num_tokens = len(completion.token_ids)
        if completion.text:
            sent.text.append(completion.text)
        if not new_tokens and not completion.text:
            return None
        chunk = pb.GenerateChunk(index=completion.index, token_ids=new_tokens, text=completion.text,
                                 logprobs=logprobs, usage=usage, timings=timings)
        if completion.finish_reason is not None:  # the sample's last chunk carries its end (as vLLM's streams)
            _set_finish(chunk, completion)
        return chunk

    @staticmethod
    def _complete(output: RequestOutput, choices: list[_Choice], usage: pb.Usage, timings: pb.Timings,
                  path: int, num_resumed: int = 0) -> pb.GenerateComplete:
        out = []
        for completion in output.outputs:
            choice = pb.CompletionChoice(
                index=completion.index, token_ids=completion.token_ids, text="".join(choices[completion.index].text))
            _set_finish(choice, completion)
            if completion.logprobs is not None:
                choice.logprobs.extend(logprobs_to_proto(t, lp) for t, lp in  # logprobs of this worker's tokens
                                       zip(completion.token_ids[num_resumed:], completion.logprobs, strict=False))
            out.append(choice)
        prompt_logprobs = []
        if output.prompt_logprobs is not None:
            for token, entry in zip(output.prompt_token_ids, output.prompt_logprobs, strict=False):
                prompt_logprobs.append(logprobs_to_proto(token, entry) if entry else pb.TokenLogprob())
        return pb.GenerateComplete(choices=out, usage=usage, timings=timings, prefill_path=path,
                                   prompt_token_ids=output.prompt_token_ids, prompt_logprobs=prompt_logprobs)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=self._abort(request.request_id))

    def _abort(self, request_id: str) -> bool:
        """End an active request with finish_reason abort (its stream then completes); False if unknown."""
        found = request_id in self._active
        pull = self._pulls.get(request_id)
        if pull is not None:  # freeing now would race the KV writes: the pull stops them first, then aborts
            self._aborted_pulls.add(request_id)
            pull.cancel()
        elif found:
            self.engine.submit(lambda e: e.abort_request(request_id))
        return found

    def _abort_all(self) -> None:
        """The drain timeout passed: end what is still running here. Single-sample streams end UNAVAILABLE, so the
        router migrates them to another decode worker with the tokens already sent; others end with ABORT."""
        for request_id in list(self._active):
            self._drained.add(request_id)
            self._abort(request_id)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        info = await self.engine.call(lambda e: info_response(e, self.ctx.role, self.ctx.worker_id,
                                                              self.disagg_min_prompt_tokens))
        return self.info_for_caller(info, context)


def _set_finish(message: pb.GenerateChunk | pb.CompletionChoice, completion: CompletionOutput) -> None:
    message.finish_reason = FINISH_REASON_TO_PROTO.get(completion.finish_reason or "abort", pb.FINISH_REASON_ABORT)
    if isinstance(completion.stop_reason, str):
        message.stop_string = completion.stop_reason
    elif isinstance(completion.stop_reason, int):
        message.stop_token_id = completion.stop_reason


def add_generation_servicer(server: grpc.aio.Server, ctx: WorkerContext, disagg_min_prompt_tokens: int,
                            prefill_allowlist: Sequence[str] = ()) -> GenerationServicer:
    servicer = GenerationServicer(ctx, disagg_min_prompt_tokens, prefill_allowlist)
    kvflow_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    return servicer
