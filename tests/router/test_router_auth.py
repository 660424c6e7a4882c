"""The router's trust rules, with a real router in front of fake workers (tests/helpers/router_fakes.py).

Request ids are scoped per caller: the gRPC `Abort` of another connection (no API key) does not find a request,
nor does it reach an HTTP request by its x-request-id, while the owner's own `Abort` stops it; with an API key,
the key is the caller. `/metrics` can require the API key. The router presents the cluster token on every call to
a worker.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx
import pytest

from cluster.auth import TOKEN_METADATA, ClusterAuth
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc
from router.config import RouterConfig
from tests.helpers.router_fakes import SLOW_PROMPT, FakeWorkers, RouterHarness

API_KEY = "router-test-key"
TOKEN = "router-test-cluster-token-0123"


def _channel(harness: RouterHarness) -> grpc.Channel:
    # Its own connection: channels of one process otherwise share one, and so one peer.
    return grpc.insecure_channel(harness.grpc_address, options=[("grpc.use_local_subchannel_pool", 1)])


def _slow_call(stub: kvflow_pb2_grpc.GenerationStub, request_id: str, metadata: tuple = ()) -> Iterator:
    """Start a SLOW_PROMPT request and wait for its first chunk (the router now knows the request)."""
    call = stub.Generate(pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=SLOW_PROMPT),
                                            stream=True, sampling_params=pb.SamplingParams(max_tokens=4)),
                         metadata=metadata, timeout=60)
    responses = iter(call)
    assert next(responses).WhichOneof("response") == "chunk"
    return responses


def test_abort_reaches_only_the_callers_own_request(workers: FakeWorkers) -> None:
    harness = RouterHarness(workers)
    try:
        with _channel(harness) as owner_channel, _channel(harness) as other_channel:
            owner = kvflow_pb2_grpc.GenerationStub(owner_channel)
            other = kvflow_pb2_grpc.GenerationStub(other_channel)
            responses = _slow_call(owner, "job-1")
            assert not other.Abort(pb.AbortRequest(request_id="job-1"), timeout=10).found
            assert list(workers.decode.running) and not any(e.is_set() for e in workers.decode.running.values())
            assert owner.Abort(pb.AbortRequest(request_id="job-1"), timeout=10).found
            (last,) = list(responses)
            assert last.complete.choices[0].finish_reason == pb.FINISH_REASON_ABORT
            assert not owner.Abort(pb.AbortRequest(request_id="job-1"), timeout=10).found  # finished: gone
            # An HTTP request's x-request-id is no handle for a gRPC caller either.
            with harness.http.stream("POST", "/v1/completions", headers={"x-request-id": "job-2"},
                                     json={"prompt": SLOW_PROMPT, "max_tokens": 4, "stream": True}) as response:
                assert response.status_code == 200
                next(response.iter_lines())
                assert not owner.Abort(pb.AbortRequest(request_id="job-2"), timeout=10).found
                assert not any(e.is_set() for e in workers.decode.running.values())
    finally:
        harness.close()


def test_with_an_api_key_the_key_is_the_caller(workers: FakeWorkers) -> None:
    harness = RouterHarness(workers, api_key=API_KEY)
    key = (("authorization", f"Bearer {API_KEY}"),)
    try:
        with _channel(harness) as first_channel, _channel(harness) as second_channel:
            first = kvflow_pb2_grpc.GenerationStub(first_channel)
            second = kvflow_pb2_grpc.GenerationStub(second_channel)
            responses = _slow_call(first, "job-3", key)
            with pytest.raises(grpc.RpcError) as caught:
                second.Abort(pb.AbortRequest(request_id="job-3"), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert second.Abort(pb.AbortRequest(request_id="job-3"), metadata=key, timeout=10).found
            assert list(responses)[-1].complete.choices[0].finish_reason == pb.FINISH_REASON_ABORT
    finally:
        harness.close()


def test_metrics_can_require_the_api_key(workers: FakeWorkers) -> None:
    with pytest.raises(ValueError, match="--metrics-require-api-key needs --api-key"):
        RouterConfig(decode=("x:1",), metrics_require_api_key=True).validate()
    harness = RouterHarness(workers, api_key=API_KEY, metrics_require_api_key=True)
    try:
        assert httpx.get(f"{harness.url}/metrics").status_code == 401
        assert httpx.get(f"{harness.url}/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        allowed = harness.http.get("/metrics")
        assert allowed.status_code == 200 and "vllm:num_requests_running" in allowed.text
        assert httpx.get(f"{harness.url}/health").status_code == 200  # probes still need no key
    finally:
        harness.close()
    harness = RouterHarness(workers, api_key=API_KEY)
    try:
        assert httpx.get(f"{harness.url}/metrics").status_code == 200  # the default: open, like /health
    finally:
        harness.close()


def test_router_presents_the_cluster_token_to_workers(workers: FakeWorkers) -> None:
    workers.decode.metadata.clear()
    harness = RouterHarness(workers, cluster=ClusterAuth(TOKEN))
    try:
        assert harness.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
        seen = {name for name, _ in workers.decode.metadata}
        assert {"Info", "StreamKVEvents", "Generate"} <= seen
        assert all(metadata.get(TOKEN_METADATA) == TOKEN for _, metadata in workers.decode.metadata)
    finally:
        harness.close()
