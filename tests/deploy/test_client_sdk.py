"""kvflow.client against a scripted fake Generation server: results, streaming, typed errors, deadlines, and
retries on UNAVAILABLE before any output (never after)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from kvflow.client import (
    AsyncClient,
    Client,
    DeadlineExceededError,
    GenerateResult,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from kvflow.launcher import free_port
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc


class FakeGeneration(kvflow_pb2_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.calls = 0
        self.fail_first = 0  # calls that end UNAVAILABLE before any output
        self.last_request: pb.GenerateRequest | None = None

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):  # noqa: N802
        self.calls += 1
        self.last_request = request
        if self.calls <= self.fail_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "worker restarting")
        prompt = request.text or " ".join(map(str, request.token_ids.ids))
        if prompt == "invalid":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1]")
        if prompt == "slow":
            time.sleep(2)
        if prompt == "overloaded":
            yield pb.GenerateResponse(request_id=request.request_id,
                                      error=pb.GenerateError(code="RESOURCE_EXHAUSTED", message="queue full"))
            return
        if prompt == "dies midway":
            yield pb.GenerateResponse(request_id=request.request_id, chunk=pb.GenerateChunk(text="a"))
            context.abort(grpc.StatusCode.UNAVAILABLE, "worker died")
        if request.stream:
            for piece in ("Hel", "lo"):
                yield pb.GenerateResponse(request_id=request.request_id, chunk=pb.GenerateChunk(text=piece))
        yield pb.GenerateResponse(request_id=request.request_id, complete=pb.GenerateComplete(
            choices=[pb.CompletionChoice(text="Hello", token_ids=[1, 2], finish_reason=pb.FINISH_REASON_LENGTH)],
            usage=pb.Usage(prompt_tokens=3, completion_tokens=2), prefill_path=pb.PREFILL_PATH_DISAGGREGATED))


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeGeneration, str]]:
    servicer = FakeGeneration()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    kvflow_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    yield servicer, address
    server.stop(0)


def test_generate_stream_and_params(fake: tuple[FakeGeneration, str]) -> None:
    servicer, address = fake
    with Client(address) as client:
        result = client.generate("hi", max_tokens=2, temperature=0.0, stop=["."], skip_special_tokens=False,
                                 logit_bias={7: -100, "9": 2.5})
        assert result.text == "Hello" and result.completion_tokens == 2 and result.prefill_path == "disaggregated"
        request = servicer.last_request
        assert request.sampling_params.max_tokens == 2 and request.sampling_params.HasField("temperature")
        assert list(request.sampling_params.stop) == ["."] and request.sampling_params.skip_special_tokens_false
        assert dict(request.sampling_params.logit_bias) == {7: -100.0, 9: 2.5}
        items = list(client.generate_stream([5, 6, 7], max_tokens=2))
        assert [i.text for i in items[:-1]] == ["Hel", "lo"] and isinstance(items[-1], GenerateResult)
        with pytest.raises(InvalidArgumentError, match="unknown sampling parameter"):
            client.generate("hi", temprature=0.5)


def test_typed_errors_and_deadline(fake: tuple[FakeGeneration, str]) -> None:
    _, address = fake
    with Client(address, max_retries=0, timeout=0.5) as client:
        with pytest.raises(InvalidArgumentError, match="top_p"):
            client.generate("invalid")
        with pytest.raises(ResourceExhaustedError, match="queue full"):
            client.generate("overloaded")
        with pytest.raises(DeadlineExceededError):
            client.generate("slow")


def test_retries_unavailable_only_before_output(fake: tuple[FakeGeneration, str]) -> None:
    servicer, address = fake
    servicer.calls, servicer.fail_first = 0, 2
    with Client(address, max_retries=3, retry_backoff_s=0.01) as client:
        assert client.generate("hi").text == "Hello"
        assert servicer.calls == 3
        servicer.calls, servicer.fail_first = 0, 5
        with pytest.raises(UnavailableError):
            client.generate("hi")
        assert servicer.calls == 4  # 1 + 3 retries
        servicer.calls, servicer.fail_first = 0, 0
        with pytest.raises(UnavailableError, match="worker died"):
            list(client.generate_stream("dies midway"))
        assert servicer.calls == 1  # output was already delivered: no silent replay


def test_async_client(fake: tuple[FakeGeneration, str]) -> None:
    servicer, address = fake

    async def run() -> None:
        servicer.calls, servicer.fail_first = 0, 1
        async with AsyncClient(address, retry_backoff_s=0.01) as client:
            assert (await client.generate("hi")).text == "Hello"
            pieces = [item async for item in client.generate_stream("hi")]
            assert isinstance(pieces[-1], GenerateResult) and pieces[0].text == "Hel"
            with pytest.raises(InvalidArgumentError):
                await client.generate("invalid")

    asyncio.run(run())


def test_unreachable_server_is_unavailable() -> None:
    client = Client(f"127.0.0.1:{free_port()}", max_retries=1, retry_backoff_s=0.01, timeout=2)
    with pytest.raises(UnavailableError):
        client.generate("hi")
    client.close()
