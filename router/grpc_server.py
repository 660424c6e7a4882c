"""The router's public gRPC front: the `Generation` service, routed to decode workers like the HTTP API.

Like the HTTP front, it refuses new calls (UNAVAILABLE) while the router drains and ends those still running at the
drain deadline with UNAVAILABLE. It sends no keep-alive messages: a silent stream is not an idle gRPC channel
(HTTP/2 pings keep the connection; a call's deadline is the client's), so a gap in tokens needs nothing here.

Input is checked as on the HTTP front (the router's bounds, the engine's sampling rules, token ids in the vocabulary,
lengths, an output constraint's syntax): a refusal ends the call with INVALID_ARGUMENT before any worker sees the
request. So do bytes that are not a valid request message: the handlers are built here with a deserializer that
never raises (the generated glue's would make the call end UNKNOWN). Every `SamplingParams` field the caller set
reaches the worker, converted by `cluster.wire` as on the other fronts. Request ids are scoped per caller and owner
token (router/ownership.py): `Generate` returns its owner token in the initial metadata, and `Abort` finds only
requests whose caller presents that token.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from cluster.request_ids import request_id_or_new
from cluster.wire import sampling_params_from_proto, sampling_params_to_proto
from engine.errors import InvalidRequest
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc
from router.core import Router, error_from
from router.errors import BadRequest
from router.openai_protocol import MAX_LOGIT_BIAS_ENTRIES
from router.ownership import OWNER_TOKEN_METADATA, caller_identity, owner_token, presented_key, token_owner
from router.structured_output import check as check_constraint

logger = logging.getLogger(__name__)


class GenerationService(kvflow_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def _identity(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's identity (router/ownership.py); a call without a configured key ends UNAUTHENTICATED."""
        keys = self.router.config.accepted_keys
        key = presented_key(keys, str(_metadata(context).get("authorization", ""))) if keys else None
        if keys and key is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing API key")
        return caller_identity(key, f"grpc:{context.peer()}")

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        identity = await self._identity(context)
        token = owner_token(_metadata(context).get(OWNER_TOKEN_METADATA))
        await context.send_initial_metadata(((OWNER_TOKEN_METADATA, token),))
        request_id = request_id_or_new(request.request_id)
        relay = None
        try:
            with self.router.lifecycle.admitted() as ticket:
                token_ids = await self._token_ids(request)
                params = self.router.params_for_prompt(self._checked_params(request.sampling_params),
                                                       len(token_ids), request.WhichOneof("input") or "input")
                relay = ticket.relay(self.router.generate(request_id, token_ids, params, list(request.cache_salt),
                                                          owner=token_owner(identity, token)))
                async for response in relay:
                    if request.stream or response.WhichOneof("response") == "complete":
                        response.request_id = request_id
                        yield response
        except Exception as exc:  # ShuttingDown (draining, or the drain deadline) included: UNAVAILABLE
            error = error_from(exc)
            await context.abort(error.grpc_code, error.message)
        finally:  # a cancelled call (the client went) cancels the worker call too
            if relay is not None:
                relay.close()

    async def _token_ids(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "token_ids":
            ids = list(request.token_ids.ids)
            self.router.check_token_ids(ids, "token_ids")
            return ids
        if kind == "text":
            tokenizers = await self.router.ensure_tokenizers()
            try:
                return await tokenizers.run(tokenizers.encode, request.text)
            except InvalidRequest as exc:  # no tokenizer on the router
                raise BadRequest(str(exc), "text") from exc
        raise BadRequest("GenerateRequest needs 'text' or 'token_ids'", "input")

    def _checked_params(self, params: pb.SamplingParams) -> pb.SamplingParams:
        """Validate with the router's bounds and the engine's rules (a clear INVALID_ARGUMENT here, not a worker
        round trip); forwards exactly the fields the caller set, so the workers' generation defaults fill the rest."""
        config = self.router.config
        if (params.n or 1) > config.max_n:
            raise BadRequest(f"n must be at most {config.max_n} (--max-n), got {params.n}", "n")
        for name in ("logprobs", "prompt_logprobs"):
            if params.HasField(name) and getattr(params, name) > config.max_logprobs:
                raise BadRequest(f"{name} must be at most {config.max_logprobs} (--max-logprobs), got "
                                 f"{getattr(params, name)}", name)
        if len(params.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise BadRequest(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries", "logit_bias")
        self.router.check_token_ids(list(params.logit_bias), "logit_bias")
        self.router.check_token_ids(list(params.allowed_token_ids), "allowed_token_ids")
        checked = sampling_params_from_proto(params)
        if checked.structured_outputs is not None:  # a schema xgrammar cannot compile never reaches a worker
            check_constraint(checked.structured_outputs, "structured_outputs")
        return sampling_params_to_proto(checked, explicit_only=True)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:  # noqa: N802
        owner = token_owner(await self._identity(context), _metadata(context).get(OWNER_TOKEN_METADATA))
        try:
            return pb.AbortResponse(found=await self.router.abort(request.request_id, owner))
        except grpc.aio.AioRpcError:
            return pb.AbortResponse(found=False)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:  # noqa: N802
        info = self.router.pool.model_info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker has answered yet")
        return pb.InfoResponse(role=pb.WORKER_ROLE_ROUTER, model=info.model, model_id=info.model_id,
                               block_size=info.block_size, max_model_len=info.max_model_len,
                               vocab_size=info.vocab_size, worker_id="router")

    async def StreamKVEvents(self, request: pb.KVEventsRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the router has no KV cache; subscribe to workers")
        yield pb.KVEventBatch()  # unreachable; makes this an async generator


class _Undecodable:
    """What request bytes that do not parse become; the method then ends the call INVALID_ARGUMENT."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _lenient(message_type: type[Message]) -> Callable[[bytes], Message | _Undecodable]:
    def deserialize(data: bytes) -> Message | _Undecodable:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return _Undecodable(f"the request is not a valid {message_type.DESCRIPTOR.full_name}: {exc}")

    return deserialize


def _guarded(method: Callable[..., Any], streaming: bool) -> Callable[..., Any]:
    if streaming:
        async def stream(request: Message | _Undecodable,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            async for response in method(request, context):
                yield response

        return stream

    async def unary(request: Message | _Undecodable, context: grpc.aio.ServicerContext) -> Message:
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return await method(request, context)

    return unary


def generation_handler(service: GenerationService) -> grpc.GenericRpcHandler:
    """The `Generation` service's handlers, built from its descriptor with `_lenient` deserializers."""
    descriptor = pb.DESCRIPTOR.services_by_name["Generation"]
    handlers = {}
    for method in descriptor.methods:
        if method.client_streaming:  # not in the service today; a stream of requests needs another handler kind
            raise TypeError(f"{method.full_name}: client-streaming methods are not handled here")
        request_type, response_type = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else \
            grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(_guarded(getattr(service, method.name), method.server_streaming),
                                     request_deserializer=_lenient(request_type),
                                     response_serializer=response_type.SerializeToString)
    return grpc.method_handlers_generic_handler(descriptor.full_name, handlers)


async def start_grpc_server(router: Router, host: str, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((generation_handler(GenerationService(router)),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the gRPC port {host}:{port}")
    await server.start()
    logger.info("gRPC Generation service on %s:%d", host, bound)
    return server


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return {key: str(value) for key, value in (context.invocation_metadata() or ())}
