"""Python SDK for kvflow's gRPC `Generation` API (the router's `--grpc-port`, or a decode worker directly: pass
`cluster_token=` when the workers hold one, e.g. os.environ["KVFLOW_CLUSTER_TOKEN"]; mTLS workers need a channel
from `cluster.auth.ClusterAuth` instead).

    from kvflow.client import Client
    with Client("127.0.0.1:50051") as client:
        result = client.generate("The capital of France is", max_tokens=8, temperature=0)
        print(result.text)
        for item in client.generate_stream([1, 2, 3], max_tokens=8):
            if item.final:  # the last item: the whole result (its text is the chunks' text again)
                print(f" [{item.choices[0].finish_reason}, {item.completion_tokens} tokens]")
            else:
                print(item.text, end="")

A stream yields `Chunk`s (`final` false), then one `GenerateResult` (`final` true) with the full text, usage and
finish reasons.

Sampling keyword arguments are `SamplingParams` fields (structured_outputs included): only those given travel,
converted by `cluster.wire` as the router does, and values the server would refuse are refused before the call.
Errors are typed (`InvalidArgumentError`, `UnavailableError`, ... all `KvflowError`); calls have a deadline
(`timeout`), and a request that fails with UNAVAILABLE before any output is retried with backoff.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import grpc

from cluster.auth import TOKEN_METADATA
from cluster.request_ids import OWNER_TOKEN_METADATA, request_id_or_new
from cluster.wire import FINISH_REASON_FROM_PROTO, sampling_params_to_proto
from engine.errors import InvalidRequest
from engine.sampling_params import SamplingParams
from kvflow.closing import Closing
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc


class KvflowError(Exception):
    """Base of every SDK error; `code` is the gRPC status code name (each kind declares its own in its class line)."""

    code = "UNKNOWN"

    def __init_subclass__(cls, *, code: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code:
            cls.code = code

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgumentError(KvflowError, code="INVALID_ARGUMENT"):
    """The server refused the request as it is (OUT_OF_RANGE and FAILED_PRECONDITION too), or the SDK did first."""


class UnauthenticatedError(KvflowError, code="UNAUTHENTICATED"):
    """No API key or cluster token, or not the server's."""


class NotFoundError(KvflowError, code="NOT_FOUND"):
    """The server does not know what the request names (a model)."""


class ResourceExhaustedError(KvflowError, code="RESOURCE_EXHAUSTED"):
    """The server has no room for the request now."""


class UnavailableError(KvflowError, code="UNAVAILABLE"):
    """The server cannot take the request now (retried with backoff while no output came)."""


class DeadlineExceededError(KvflowError, code="DEADLINE_EXCEEDED"):
    """The call ran past its `timeout`."""


class InternalError(KvflowError, code="INTERNAL"):
    """The server failed, or the stream ended without a result."""


_ERRORS: dict[str, type[KvflowError]] = {cls.code: cls for cls in (
    InvalidArgumentError, UnauthenticatedError, NotFoundError, ResourceExhaustedError, UnavailableError,
    DeadlineExceededError, InternalError)}
_ERRORS["OUT_OF_RANGE"] = InvalidArgumentError
_ERRORS["FAILED_PRECONDITION"] = InvalidArgumentError


def _error(code: str, message: str) -> KvflowError:
    return _ERRORS.get(code, KvflowError)(f"{code}: {message}")


def _checked(response: pb.GenerateResponse) -> pb.GenerateResponse:
    """The response, unless it is the server's in-band error: then that error, typed."""
    if response.WhichOneof("response") == "error":
        raise _error(response.error.code, response.error.message)
    return response


def _from_rpc(exc: grpc.RpcError) -> KvflowError:
    code = exc.code().name if hasattr(exc, "code") and exc.code() else "UNKNOWN"  # type: ignore[attr-defined]
    return _error(code, exc.details() if hasattr(exc, "details") else str(exc))  # type: ignore[attr-defined]


@dataclass
class Choice:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)


@dataclass
class GenerateResult:
    request_id: str
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefill_path: str  # "disaggregated" | "local" | "unspecified"
    ttft_s: float
    final: ClassVar[bool] = True  # a stream's last item (its text repeats the chunks')

    @property
    def text(self) -> str:
        return self.choices[0].text if self.choices else ""


@dataclass
class Chunk:
    index: int
    text: str  # new text since the previous chunk
    token_ids: list[int]
    final: ClassVar[bool] = False


def build_request(prompt: str | Sequence[int], request_id: str | None, sampling: dict[str, Any],
                  stream: bool, cache_salt: str | None = None) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=request_id_or_new(request_id), sampling_params=sampling_params(sampling),
                                 stream=stream, cache_salt=[cache_salt] if cache_salt else [])
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(int(t) for t in prompt)
    return request


def sampling_params(sampling: dict[str, Any]) -> pb.SamplingParams:
    """The wire form of `SamplingParams` keyword arguments: only those given (None: not given), so the server's
    generation defaults fill the rest. Raises InvalidArgumentError as the server would, before any call."""
    given = {name: value for name, value in sampling.items() if value is not None}
    if "logit_bias" in given:  # JSON-style maps have string keys: token ids either way
        given["logit_bias"] = {int(token): float(bias) for token, bias in given["logit_bias"].items()}
    try:
        params = SamplingParams(**given)
    except InvalidRequest as exc:
        raise InvalidArgumentError(f"INVALID_ARGUMENT: {exc}") from None
    return sampling_params_to_proto(params, explicit_only=True)


def result_from(request_id: str, complete: pb.GenerateComplete) -> GenerateResult:
    choices = [Choice(c.index, c.text, list(c.token_ids), FINISH_REASON_FROM_PROTO.get(c.finish_reason), list(c.logprobs))
               for c in complete.choices]
    path = pb.PrefillPath.Name(complete.prefill_path).removeprefix("PREFILL_PATH_").lower()
    return GenerateResult(request_id, choices, complete.usage.prompt_tokens, complete.usage.completion_tokens,
                          complete.usage.cached_tokens, path, complete.timings.ttft_s)


def stream_item(request_id: str, response: pb.GenerateResponse) -> Chunk | GenerateResult | None:
    """What a streaming call yields for one response: a chunk, the final result, or nothing."""
    kind = response.WhichOneof("response")
    if kind == "chunk":
        return Chunk(response.chunk.index, response.chunk.text, list(response.chunk.token_ids))
    if kind == "complete":
        return result_from(request_id, response.complete)
    return None


class _Base:
    def __init__(self, target: str, timeout: float = 60.0, max_retries: int = 3, retry_backoff_s: float = 0.2,
                 api_key: str | None = None, cluster_token: str | None = None, owner_token: str | None = None) -> None:
        if timeout <= 0 or max_retries < 0:
            raise ValueError("timeout must be > 0 and max_retries >= 0")
        self.target = target
        self.timeout = timeout
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        # This client's requests are abortable by this client only (router/ownership.py), whoever shares its key or
        # connection; pass `owner_token` to abort from another client object.
        self.owner_token = owner_token or secrets.token_urlsafe(16)
        metadata = [(OWNER_TOKEN_METADATA, self.owner_token)]
        if api_key:
            metadata.append(("authorization", f"Bearer {api_key}"))
        if cluster_token:
            metadata.append((TOKEN_METADATA, cluster_token))
        self.metadata = tuple(metadata)

    def _backoff(self, attempt: int) -> float:
        return self.retry_backoff_s * (2 ** attempt)

    def _retry_after(self, exc: grpc.RpcError, received: bool, attempt: int) -> float:
        """The pause before the next attempt at a failed Generate call, or raises its typed error: only UNAVAILABLE
        is retried, and only before any output (a retry after output would replay it)."""
        error = _from_rpc(exc)
        if isinstance(error, UnavailableError) and not received and attempt < self.max_retries:
            return self._backoff(attempt)
        raise error from None


class Client(_Base, Closing):
    """Blocking client."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        self._channel = grpc.insecure_channel(target)
        self._stub = kvflow_pb2_grpc.GenerationStub(self._channel)

    def generate(self, prompt: str | Sequence[int], *, request_id: str | None = None,
                 timeout: float | None = None, cache_salt: str | None = None, **sampling: Any) -> GenerateResult:
        request = build_request(prompt, request_id, sampling, stream=False, cache_salt=cache_salt)
        for response in self._responses(request, timeout):
            if response.WhichOneof("response") == "complete":
                return result_from(request.request_id, response.complete)
        raise InternalError("INTERNAL: the stream ended without a result")

    def generate_stream(self, prompt: str | Sequence[int], *, request_id: str | None = None,
                        timeout: float | None = None, cache_salt: str | None = None,
                        **sampling: Any) -> Iterator[Chunk | GenerateResult]:
        """Chunks as they come, then the final `GenerateResult` (tell them apart by `.final`)."""
        request = build_request(prompt, request_id, sampling, stream=True, cache_salt=cache_salt)
        for response in self._responses(request, timeout):
            item = stream_item(request.request_id, response)
            if item is not None:
                yield item

    def _responses(self, request: pb.GenerateRequest, timeout: float | None) -> Iterator[pb.GenerateResponse]:
        for attempt in range(self.max_retries + 1):
            received = False
            try:
                for response in self._stub.Generate(request, timeout=timeout or self.timeout,
                                                    metadata=self.metadata):
                    received = True
                    yield _checked(response)
                return
            except grpc.RpcError as exc:
                time.sleep(self._retry_after(exc, received, attempt))

    def abort(self, request_id: str) -> bool:
        try:
            return self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.timeout,
                                    metadata=self.metadata).found
        except grpc.RpcError as exc:
            raise _from_rpc(exc) from None

    def info(self) -> pb.InfoResponse:
        for attempt in range(self.max_retries + 1):
            try:
                return self._stub.Info(pb.InfoRequest(), timeout=self.timeout, metadata=self.metadata)
            except grpc.RpcError as exc:
                error = _from_rpc(exc)
                if not isinstance(error, UnavailableError) or attempt == self.max_retries:
                    raise error from None
                time.sleep(self._backoff(attempt))
        raise UnavailableError("UNAVAILABLE: no answer")

    def close(self) -> None:
        self._channel.close()


class AsyncClient(_Base):
    """asyncio client (grpc.aio); create it inside the running event loop."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = kvflow_pb2_grpc.GenerationStub(self._channel)

    async def generate(self, prompt: str | Sequence[int], *, request_id: str | None = None,
                       timeout: float | None = None, cache_salt: str | None = None,
                       **sampling: Any) -> GenerateResult:
        request = build_request(prompt, request_id, sampling, stream=False, cache_salt=cache_salt)
        async for response in self._responses(request, timeout):
            if response.WhichOneof("response") == "complete":
                return result_from(request.request_id, response.complete)
        raise InternalError("INTERNAL: the stream ended without a result")

    async def generate_stream(self, prompt: str | Sequence[int], *, request_id: str | None = None,
                              timeout: float | None = None, cache_salt: str | None = None,
                              **sampling: Any) -> AsyncIterator[Chunk | GenerateResult]:
        request = build_request(prompt, request_id, sampling, stream=True, cache_salt=cache_salt)
        async for response in self._responses(request, timeout):
            item = stream_item(request.request_id, response)
            if item is not None:
                yield item

    async def _responses(self, request: pb.GenerateRequest,
                         timeout: float | None) -> AsyncIterator[pb.GenerateResponse]:
        for attempt in range(self.max_retries + 1):
            received = False
            try:
                async for response in self._stub.Generate(request, timeout=timeout or self.timeout,
                                                          metadata=self.metadata):
                    received = True
                    yield _checked(response)
                return
            except grpc.aio.AioRpcError as exc:
                await asyncio.sleep(self._retry_after(exc, received, attempt))

    async def abort(self, request_id: str) -> bool:
        try:
            return (await self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=self.timeout,
                                           metadata=self.metadata)).found
        except grpc.aio.AioRpcError as exc:
            raise _from_rpc(exc) from None

    async def info(self) -> pb.InfoResponse:
        try:
            return await self._stub.Info(pb.InfoRequest(), timeout=self.timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise _from_rpc(exc) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


__all__ = ["AsyncClient", "Chunk", "Choice", "Client", "DeadlineExceededError", "GenerateResult", "InternalError",
           "InvalidArgumentError", "KvflowError", "NotFoundError", "ResourceExhaustedError",
           "UnauthenticatedError", "UnavailableError"]
