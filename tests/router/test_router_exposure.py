"""What the router shows and to whom (issue #27, items 3, 8 and 10), with a real router in front of fake workers
(tests/helpers/router_fakes.py): with --api-key every path that costs work needs the key, /health and /version do
not, /metrics follows --metrics-require-api-key; worker addresses and ids appear in /v1/models and /metrics labels
only with --expose-worker-addresses (metric names never change); an over-long x-request-id is not echoed; the HTTP
server's own 400 is OpenAI JSON."""

from __future__ import annotations

import re
import socket

import httpx
import pytest

from cluster.request_ids import MAX_REQUEST_ID_CHARS
from router.metrics import opaque_worker_name
from tests.helpers.router_fakes import FakeWorkers, RouterHarness

API_KEY = "exposure-test-key"
WORKER_METRICS = ("vllm:kv_cache_usage_perc", "kvflow:worker_num_requests_running", "kvflow:worker_pool")


@pytest.fixture(scope="module")
def keyed(workers: FakeWorkers) -> RouterHarness:
    harness = RouterHarness(workers, api_key=API_KEY)
    yield harness
    harness.close()


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}), ("GET", "/v1/models", None),
    ("POST", "/v1/responses", {"input": "hi"}), ("GET", "/no-such-path", None),
])
def test_every_working_endpoint_needs_the_key(keyed: RouterHarness, method: str, path: str, body: dict | None) -> None:
    response = httpx.request(method, keyed.url + path, json=body)
    assert response.status_code == 401 and response.json()["error"]["type"] == "AuthenticationError"
    wrong = httpx.request(method, keyed.url + path, json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    if path != "/no-such-path":
        assert keyed.http.request(method, path, json=body).status_code == 200


def test_probes_stay_open(keyed: RouterHarness) -> None:
    for path in ("/health", "/version", "/metrics"):  # /metrics: open unless --metrics-require-api-key
        assert httpx.get(keyed.url + path).status_code == 200, path


def _worker_labels(text: str) -> set[str]:
    return set(re.findall(r'worker="([^"]*)"', text))


def test_worker_addresses_are_hidden_by_default(router: RouterHarness, workers: FakeWorkers) -> None:
    models = router.http.get("/v1/models").text
    metrics = router.http.get("/metrics").text
    for shown in (models, metrics):
        for secret in (workers.decode_address, workers.prefill_address, "fake-"):
            assert secret not in shown
    for name in WORKER_METRICS:  # the names are a contract: only label values change
        assert name in metrics
    labels = _worker_labels(metrics)
    assert labels and labels <= {opaque_worker_name("fake-1"), opaque_worker_name("fake-2"),
                                 opaque_worker_name("fake-3")}, labels
    listing = router.http.get("/v1/models").json()["data"][0]["parallel"]["workers"]
    assert all("address" not in w and w["worker_id"].startswith("worker-") for w in listing)


def test_operators_may_expose_worker_addresses(workers: FakeWorkers) -> None:
    harness = RouterHarness(workers, expose_worker_addresses=True)
    try:
        listing = harness.http.get("/v1/models").json()["data"][0]["parallel"]["workers"]
        assert {w["address"] for w in listing} == {workers.decode_address, workers.prefill_address}
        assert {w["worker_id"] for w in listing} <= {"fake-1", "fake-2", "fake-3"}
        assert _worker_labels(harness.http.get("/metrics").text) & {"fake-1", "fake-2", "fake-3"}
    finally:
        harness.close()


def test_opaque_names_are_stable_and_keyed() -> None:
    assert opaque_worker_name("decode-host-50052") == opaque_worker_name("decode-host-50052")
    assert opaque_worker_name("decode-host-50052") != opaque_worker_name("decode-host-50053")
    assert opaque_worker_name("decode-host-50052", b"token") != opaque_worker_name("decode-host-50052")


def test_long_request_ids_are_not_echoed(router: RouterHarness) -> None:
    body = {"prompt": [1, 2], "max_tokens": 1}
    kept = "k" * MAX_REQUEST_ID_CHARS
    assert router.post("/v1/completions", body, headers={"x-request-id": kept}).headers["x-request-id"] == kept
    response = router.post("/v1/completions", body, headers={"x-request-id": "x" * 8192})
    assert response.status_code == 200
    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"])
    # 64 KB: within the HTTP server's header limit or not, depending on how the bytes arrive; never echoed.
    huge = router.post("/v1/completions", body, headers={"x-request-id": "x" * 65536})
    if huge.status_code == 200:
        assert re.fullmatch(r"[0-9a-f]{32}", huge.headers["x-request-id"])
    else:  # the HTTP server's own 400, as OpenAI JSON
        assert huge.status_code == 400 and huge.json()["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize("length", [b"10000000000000000000000000", b"12abc", b"-1"])
def test_malformed_content_length_is_openai_json(router: RouterHarness, length: bytes) -> None:
    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + length + b"\r\n\r\n{}")
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), raw
    error = httpx.Response(400, content=body).json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
