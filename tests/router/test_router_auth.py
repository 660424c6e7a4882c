"""The router's trust rules, with a real router in front of fake workers (tests/helpers/router_fakes.py).

Request ids are scoped per caller and owner token: the gRPC `Abort` of another connection (no API key), or of the
same connection without the request's owner token, does not find a request, nor does it reach an HTTP request by
its x-request-id, while the owner's own `Abort` stops it; with API keys, each key is a caller. `/metrics` can require the API key. The router presents the cluster token on every call to
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
from router.ownership import OWNER_TOKEN_METADATA, api_keys, caller_identity, presented_key, token_owner
from tests.helpers.router_fakes import SLOW_PROMPT, FakeWorkers, RouterHarness

API_KEY = "router-test-key"
OTHER_KEY = "router-test-other-key"
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


def _token(value: str) -> tuple[tuple[str, str], ...]:
    return ((OWNER_TOKEN_METADATA, value),)


def test_abort_reaches_only_the_callers_own_request(workers: FakeWorkers) -> None:
    harness = RouterHarness(workers)
    try:
        with _channel(harness) as owner_channel, _channel(harness) as other_channel:
            owner = kvflow_pb2_grpc.GenerationStub(owner_channel)
            other = kvflow_pb2_grpc.GenerationStub(other_channel)
            responses = _slow_call(owner, "job-1", _token("owner-token"))
            assert not other.Abort(pb.AbortRequest(request_id="job-1"), metadata=_token("owner-token"),
                                   timeout=10).found  # another connection, even with the token
            # The owner's own connection without the token, or with another one (a second channel sharing it).
            assert not owner.Abort(pb.AbortRequest(request_id="job-1"), timeout=10).found
            assert not owner.Abort(pb.AbortRequest(request_id="job-1"), metadata=_token("other"), timeout=10).found
            assert list(workers.decode.running) and not any(e.is_set() for e in workers.decode.running.values())
            assert owner.Abort(pb.AbortRequest(request_id="job-1"), metadata=_token("owner-token"), timeout=10).found
            (last,) = list(responses)
            assert last.complete.choices[0].finish_reason == pb.FINISH_REASON_ABORT
            assert not owner.Abort(pb.AbortRequest(request_id="job-1"), metadata=_token("owner-token"),
                                   timeout=10).found  # finished: gone
            # An HTTP request's x-request-id is no handle for a gRPC caller either.
            with harness.http.stream("POST", "/v1/completions", headers={"x-request-id": "job-2"},
                                     json={"prompt": SLOW_PROMPT, "max_tokens": 4, "stream": True}) as response:
                assert response.status_code == 200
                next(response.iter_lines())
                assert not owner.Abort(pb.AbortRequest(request_id="job-2"), timeout=10).found
                assert not any(e.is_set() for e in workers.decode.running.values())
    finally:
        harness.close()


def test_the_router_returns_the_owner_token_it_bound_the_request_to(workers: FakeWorkers) -> None:
    harness = RouterHarness(workers)
    try:
        with _channel(harness) as channel:
            stub = kvflow_pb2_grpc.GenerationStub(channel)
            call = stub.Generate(pb.GenerateRequest(request_id="job-4", token_ids=pb.TokenIds(ids=SLOW_PROMPT),
                                                    stream=True, sampling_params=pb.SamplingParams(max_tokens=4)),
                                 timeout=60)
            token = dict(call.initial_metadata())[OWNER_TOKEN_METADATA]
            assert len(token) >= 16
            responses = iter(call)
            next(responses)
            assert stub.Abort(pb.AbortRequest(request_id="job-4"), metadata=_token(token), timeout=10).found
            assert list(responses)[-1].complete.choices[0].finish_reason == pb.FINISH_REASON_ABORT
    finally:
        harness.close()


def test_with_api_keys_each_key_is_a_caller(workers: FakeWorkers) -> None:
    harness = RouterHarness(workers, api_key=f"{API_KEY}, {OTHER_KEY}")
    key = (("authorization", f"Bearer {API_KEY}"),)
    other_key = (("authorization", f"Bearer {OTHER_KEY}"),)
    try:
        with _channel(harness) as first_channel, _channel(harness) as second_channel:
            first = kvflow_pb2_grpc.GenerationStub(first_channel)
            second = kvflow_pb2_grpc.GenerationStub(second_channel)
            responses = _slow_call(first, "job-3", key + _token("t1"))
            with pytest.raises(grpc.RpcError) as caught:
                second.Abort(pb.AbortRequest(request_id="job-3"), metadata=_token("t1"), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert not second.Abort(pb.AbortRequest(request_id="job-3"), metadata=other_key + _token("t1"),
                                    timeout=10).found  # another tenant's key
            assert not second.Abort(pb.AbortRequest(request_id="job-3"), metadata=key + _token("t2"),
                                    timeout=10).found  # the same key, another client
            assert second.Abort(pb.AbortRequest(request_id="job-3"), metadata=key + _token("t1"), timeout=10).found
            assert list(responses)[-1].complete.choices[0].finish_reason == pb.FINISH_REASON_ABORT
        assert harness.http.get("/v1/models", headers={"Authorization": f"Bearer {OTHER_KEY}"}).status_code == 200
        assert httpx.get(f"{harness.url}/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    finally:
        harness.close()


def test_api_key_lists_are_parsed_and_checked() -> None:
    assert api_keys(" a, b ,,c ") == ("a", "b", "c")
    assert presented_key(("a", "b"), "Bearer b") == "b"
    assert presented_key(("a", "b"), "Bearer c") is None and presented_key((), "Bearer a") is None
    assert caller_identity("key-a", "peer") != caller_identity("key-b", "peer")
    assert "key-a" not in caller_identity("key-a", "p") and "secret" not in token_owner("key:x", "secret")
    assert token_owner("key:x", None) != token_owner("key:x", "t") != token_owner("key:y", "t")
    with pytest.raises(ValueError, match="--api-key"):
        RouterConfig(decode=("x:1",), api_key=" , ").validate()


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
