"""The router's public gRPC front: the `Generation` service, routed to decode workers like the HTTP API."""

from __future__ import annotations

import logging
import secrets
import uuid

import grpc

from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc
from router.core import Router, error_from
from router.errors import BadRequest
from router.openai_protocol import to_proto

logger = logging.getLogger(__name__)


class GenerationService(kvflow_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        key = self.router.config.api_key
        if not key:
            return
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not secrets.compare_digest(str(given).encode(), f"Bearer {key}".encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing API key")

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        await self._authorize(context)
        request_id = request.request_id or uuid.uuid4().hex
        try:
            token_ids = await self._token_ids(request)
            params = self._checked_params(request.sampling_params)
            max_tokens = self.router.check_prompt(len(token_ids), params.max_tokens
                                                  if params.HasField("max_tokens") else None)
            params.max_tokens = max_tokens or params.max_tokens
            stream = self.router.generate(request_id, token_ids, params, list(request.cache_salt))
            async for response in stream:
                if request.stream or response.WhichOneof("response") == "complete":
                    response.request_id = request_id
                    yield response
        except Exception as exc:
            error = error_from(exc)
            await context.abort(error.grpc_code, error.message)

    async def _token_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "text":
            tokenizers = await self.router.ensure_tokenizers()
            return await tokenizers.run(tokenizers.encode, request.text)
        raise BadRequest("GenerateRequest needs 'text' or 'token_ids'")

    @staticmethod
    def _checked_params(params: pb.SamplingParams) -> pb.SamplingParams:
        """Validate with the engine's rules (a clear INVALID_ARGUMENT here, not a worker round trip)."""
        from engine.sampling_params import SamplingParams

        kwargs = {name: getattr(params, name) for name in (
            "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "seed", "max_tokens", "logprobs", "prompt_logprobs") if params.HasField(name)}
        kwargs.update(n=params.n or 1, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
                      min_tokens=params.min_tokens)
        checked = SamplingParams(**kwargs)
        out = to_proto(checked, set(kwargs))
        out.include_stop_str_in_output = params.include_stop_str_in_output
        out.ignore_eos = params.ignore_eos
        out.skip_special_tokens_false = params.skip_special_tokens_false
        if params.HasField("prompt_logprobs"):
            out.prompt_logprobs = params.prompt_logprobs
        if not params.HasField("max_tokens"):
            out.ClearField("max_tokens")
        return out

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:  # noqa: N802
        await self._authorize(context)
        try:
            return pb.AbortResponse(found=await self.router.abort(request.request_id))
        except grpc.aio.AioRpcError:
            return pb.AbortResponse(found=False)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:  # noqa: N802
        info = self.router.pool.model_info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker has answered yet")
        return pb.InfoResponse(role=pb.WORKER_ROLE_ROUTER, model=info.model, model_id=info.model_id,
                               block_size=info.block_size, max_model_len=info.max_model_len, worker_id="router")

    async def StreamKVEvents(self, request: pb.KVEventsRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the router has no KV cache; subscribe to workers")
        yield pb.KVEventBatch()  # unreachable; makes this an async generator


async def start_grpc_server(router: Router, host: str, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    kvflow_pb2_grpc.add_GenerationServicer_to_server(GenerationService(router), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the gRPC port {host}:{port}")
    await server.start()
    logger.info("gRPC Generation service on %s:%d", host, bound)
    return server
