"""Request ids through a real router in front of fake workers (tests/helpers/router_fakes.py): a caller's id is kept,
a missing one is minted as 32 hex digits, each worker attempt gets `<id>@<8 hex digits>`, and the OpenAI response ids
are `cmpl-<id>` / `chatcmpl-<id>`, on the HTTP and gRPC fronts and from the SDK."""

from __future__ import annotations

import re

import grpc
import pytest

from kvflow.client import Client
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc
from tests.helpers.router_fakes import FakeWorkers, RouterHarness

MINTED = re.compile(r"[0-9a-f]{32}")
ATTEMPT_SUFFIX = re.compile(r"@[0-9a-f]{8}")


def worker_saw(workers: FakeWorkers, request_id: str) -> None:
    """The last worker request was an attempt at `request_id`."""
    seen = workers.decode.requests[-1].request_id
    caller_id, _, suffix = seen.rpartition("@")
    assert caller_id == request_id and ATTEMPT_SUFFIX.fullmatch("@" + suffix), seen


@pytest.mark.parametrize(("path", "body", "prefix"), [
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}, "cmpl-"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, "chatcmpl-"),
])
def test_http_ids(router: RouterHarness, workers: FakeWorkers, path: str, body: dict, prefix: str) -> None:
    response = router.post(path, body, headers={"x-request-id": "my-id-7"})
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == "my-id-7" and response.json()["id"] == prefix + "my-id-7"
    worker_saw(workers, "my-id-7")
    response = router.post(path, body)
    minted = response.headers["x-request-id"]
    assert MINTED.fullmatch(minted) and response.json()["id"] == prefix + minted
    worker_saw(workers, minted)


def test_grpc_and_sdk_ids(router: RouterHarness, workers: FakeWorkers) -> None:
    with grpc.insecure_channel(router.grpc_address) as channel:
        stub = kvflow_pb2_grpc.GenerationStub(channel)
        for given in ("job-1", ""):
            request = pb.GenerateRequest(request_id=given, token_ids=pb.TokenIds(ids=[1, 2]),
                                         sampling_params=pb.SamplingParams(max_tokens=2))
            answered = list(stub.Generate(request, timeout=10))[-1].request_id
            assert answered == given if given else MINTED.fullmatch(answered), answered
            worker_saw(workers, answered)
    with Client(router.grpc_address, max_retries=0) as client:
        assert client.generate([1, 2], request_id="job-2", max_tokens=2).request_id == "job-2"
        worker_saw(workers, "job-2")
        minted = client.generate([1, 2], max_tokens=2).request_id
        assert MINTED.fullmatch(minted)
        worker_saw(workers, minted)
