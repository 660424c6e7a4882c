"""No unauthenticated RPC reaches a worker (cluster/auth.py), with real worker processes (`tiny` model on CPU).

Token: every worker RPC (Generate, Prefill, KVLink, StreamKVEvents, Abort) without the token or with a wrong one
ends UNAUTHENTICATED, even when its bytes are not a valid request, while the same calls with the token get the
RPC's own answer; Info and health answer anyone, Info with role and version only (a router without the token
adopts no model from it); a disaggregated request over a KV link works with it. Prefill allowlist: a decode worker never dials a prefill address outside it (a honeypot
sees no call, no token), prefills locally and counts reason="prefill_not_allowed". mTLS: with a throwaway CA, a
client without a certificate, with one from another CA, or checking the wrong name is refused; the cluster's own
certificate works, decode -> prefill included.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.auth import TLS_ENV, TOKEN_ENV, TOKEN_METADATA, ClusterAuth, TLSFiles
from cluster.routing.index import MemoryIndex
from decode_worker.allowlist import PrefillAllowlist, split_host_port
from kvflow.client import Client, UnauthenticatedError
from kvflow.launcher import free_port
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc
from router.workers import WorkerPool
from tests.helpers.pd import (
    Worker,
    channel_to,
    generate,
    info,
    metric,
    start_worker,
    wait_healthy,
    wait_until,
)

TOKEN = "test-cluster-token-0123456789"
AUTH = ClusterAuth(TOKEN)
TINY = ("--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20))
PROMPT = [(37 * k) % 400 + 50 for k in range(150)]  # tiny has 512 token ids
LOCAL_ONLY = 1 << 30  # min_prompt_tokens no prompt reaches


def _start(role: str, tmp: Path, *extra: str, env: dict[str, str] | None = None) -> Worker:
    return start_worker(role, tmp, *TINY, *extra, model="tiny", env={TOKEN_ENV: "", **(env or {})})


@pytest.fixture(scope="module")
def tmp_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("auth_logs")


@pytest.fixture(scope="module")
def secured(tmp_logs: Path) -> Iterator[tuple[Worker, Worker]]:
    """A prefill and a decode worker holding TOKEN; KV moves over a (gloo) link, so KVLink is in the path."""
    env = {TOKEN_ENV: TOKEN}
    prefill = _start("prefill", tmp_logs, "--kv-transfer-backend", "nccl", env=env)
    decode = None
    try:
        decode = _start("decode", tmp_logs, "--kv-transfer-backend", "nccl", "--prefill-allowlist",
                        prefill.address, env=env)
        wait_healthy(prefill, auth=AUTH)
        wait_healthy(decode, auth=AUTH)
        yield prefill, decode
    finally:
        prefill.stop()
        if decode is not None:
            decode.stop()


def _calls(prefill: Worker, decode: Worker) -> dict[str, tuple[Worker, str, bool, bytes]]:
    """RPC -> (worker, method path, server streaming, request bytes): valid but useless requests."""
    layout = pb.KVLayout(dtype="float32", num_layers=1, block_size=16, num_kv_heads=1, head_dim=1)
    return {
        "Generate": (decode, "/kvflow.v1.Generation/Generate", True, pb.GenerateRequest().SerializeToString()),
        "decode Abort": (decode, "/kvflow.v1.Generation/Abort", False, pb.AbortRequest(request_id="x")
                         .SerializeToString()),
        "decode StreamKVEvents": (decode, "/kvflow.v1.Generation/StreamKVEvents", True,
                                  pb.KVEventsRequest(subscriber="t").SerializeToString()),
        "Prefill": (prefill, "/kvflow.v1.Prefill/Prefill", True, pb.PrefillRequest().SerializeToString()),
        "prefill Abort": (prefill, "/kvflow.v1.Prefill/Abort", False, pb.AbortRequest(request_id="x")
                          .SerializeToString()),
        "prefill StreamKVEvents": (prefill, "/kvflow.v1.Prefill/StreamKVEvents", True,
                                   pb.KVEventsRequest(subscriber="t").SerializeToString()),
        "KVLink": (prefill, "/kvflow.v1.Prefill/KVLink", True,
                   pb.KVLinkRequest(link_id="", backend=pb.KV_TRANSFER_BACKEND_GLOO, layout=layout)
                   .SerializeToString()),
    }


def _call(worker: Worker, method: str, streaming: bool, request: bytes, auth: ClusterAuth) -> grpc.StatusCode:
    """The call's status code (OK once a first response arrived: event streams never end by themselves)."""
    with auth.channel(worker.address) as channel:
        try:
            if streaming:
                stream = channel.unary_stream(method)(request, timeout=20)
                next(iter(stream))
                stream.cancel()
            else:
                channel.unary_unary(method)(request, timeout=20)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_every_worker_rpc_needs_the_token(secured: tuple[Worker, Worker]) -> None:
    prefill, decode = secured
    # With the token each RPC gives its own answer to these requests: the interceptor let them through.
    expected = {"Generate": grpc.StatusCode.INVALID_ARGUMENT, "decode Abort": grpc.StatusCode.OK,
                "decode StreamKVEvents": grpc.StatusCode.OK, "Prefill": grpc.StatusCode.INVALID_ARGUMENT,
                "prefill Abort": grpc.StatusCode.OK, "prefill StreamKVEvents": grpc.StatusCode.OK,
                "KVLink": grpc.StatusCode.FAILED_PRECONDITION}
    for name, (worker, method, streaming, request) in _calls(prefill, decode).items():
        assert _call(worker, method, streaming, request, AUTH) == expected[name], name
        for wrong in (ClusterAuth(), ClusterAuth("not-the-cluster-token-0000")):
            assert _call(worker, method, streaming, request, wrong) == grpc.StatusCode.UNAUTHENTICATED, name
            # Bytes that are no request at all are refused the same way: nothing is parsed before the check.
            assert _call(worker, method, streaming, b"\xff\xff\xff", wrong) == grpc.StatusCode.UNAUTHENTICATED, name
    # The token must be the metadata value itself, not a prefix of it or its neighbour.
    with grpc.insecure_channel(decode.address) as channel:
        stub = kvflow_pb2_grpc.GenerationStub(channel)
        for metadata in ([(TOKEN_METADATA, TOKEN + "x")], [(TOKEN_METADATA, TOKEN[:-1])],
                         [("authorization", f"Bearer {TOKEN}")]):
            with pytest.raises(grpc.RpcError) as caught:
                stub.Abort(pb.AbortRequest(request_id="x"), metadata=metadata, timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert not stub.Abort(pb.AbortRequest(request_id="x"), metadata=[(TOKEN_METADATA, TOKEN)], timeout=10).found


def test_info_and_health_answer_probes_without_the_token(secured: tuple[Worker, Worker]) -> None:
    for worker, role in zip(secured, (pb.WORKER_ROLE_PREFILL, pb.WORKER_ROLE_DECODE), strict=True):
        with grpc.insecure_channel(worker.address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        anonymous = info(worker, auth=ClusterAuth())
        assert anonymous == pb.InfoResponse(role=role, version=anonymous.version) and anonymous.version
        wrong = info(worker, auth=ClusterAuth("not-the-cluster-token-0000"))
        assert wrong == anonymous
        full = info(worker, auth=AUTH)
        assert full.model == "tiny" and full.model_id and full.block_size == 16 and full.num_kv_blocks > 0
        assert full.worker_id and full.device == "cpu"


def test_sdk_calls_a_worker_with_the_token(secured: tuple[Worker, Worker]) -> None:
    _, decode = secured
    with Client(decode.address, cluster_token=TOKEN, timeout=60) as client:
        assert client.generate(PROMPT[:20], max_tokens=2, temperature=0).completion_tokens == 2
    with Client(decode.address, timeout=60) as client, pytest.raises(UnauthenticatedError):
        client.generate(PROMPT[:20], max_tokens=2)


def test_router_pool_without_the_token_adopts_nothing(secured: tuple[Worker, Worker]) -> None:
    _, decode = secured
    for auth in (ClusterAuth(), AUTH):
        pool = WorkerPool(MemoryIndex(), "auth-test", auth=auth)
        pool.set_addresses("decode", [decode.address])
        try:
            if auth is AUTH:
                wait_until(lambda p=pool: bool(p.workers("decode")), 10.0, "the worker to join with the token")
                assert pool.model_info is not None and pool.model_info.model == "tiny"
            else:
                time.sleep(1.5)  # several Info attempts
                assert pool.model_info is None and not pool.workers("decode", healthy_only=False)[0].info
        finally:
            pool.stop()


def test_disaggregated_request_over_a_link_with_the_token(secured: tuple[Worker, Worker]) -> None:
    prefill, decode = secured
    # Different salts: the disaggregated run cannot reuse the local run's cached blocks.
    local = generate(decode, PROMPT, prefill, auth=AUTH, cache_salt=("local",), min_prompt_tokens=LOCAL_ONLY)
    remote = generate(decode, PROMPT, prefill, auth=AUTH, cache_salt=("remote",))
    assert (local.prefill_path, remote.prefill_path) == (pb.PREFILL_PATH_LOCAL, pb.PREFILL_PATH_DISAGGREGATED)
    assert list(remote.choices[0].token_ids) == list(local.choices[0].token_ids)  # tiny's dummy weights are seeded
    assert metric(decode, "kvflow:kv_transfer_bytes_total", 'backend="gloo"') > 0  # over the KVLink


class Honeypot(grpc.GenericRpcHandler):
    """A gRPC server that records every call (method and metadata) and answers UNAVAILABLE."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.address = f"127.0.0.1:{free_port()}"
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self._server.add_generic_rpc_handlers((self,))
        self._server.add_insecure_port(self.address)
        self._server.start()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        self.calls.append((details.method, dict(details.invocation_metadata or ())))

        def refuse(request: bytes, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "honeypot")

        return grpc.unary_stream_rpc_method_handler(refuse)

    def close(self) -> None:
        self._server.stop(grace=None)


def test_decode_never_dials_a_prefill_address_outside_the_allowlist(secured: tuple[Worker, Worker]) -> None:
    prefill, decode = secured
    honeypot = Honeypot()
    try:
        refused = metric(decode, "kvflow:disagg_fallback_total", 'reason="prefill_not_allowed"')
        stranger = Worker("prefill", int(honeypot.address.rsplit(":", 1)[1]), 0, None, Path())  # type: ignore[arg-type]
        complete = generate(decode, [t + 3 for t in PROMPT], stranger, auth=AUTH)
        assert complete.prefill_path == pb.PREFILL_PATH_LOCAL
        assert honeypot.calls == [], "the decode worker called an address outside its allowlist"
        assert metric(decode, "kvflow:disagg_fallback_total", 'reason="prefill_not_allowed"') == refused + 1
        # The allowed prefill worker is still used.
        assert generate(decode, [t + 4 for t in PROMPT], prefill, auth=AUTH).prefill_path == \
            pb.PREFILL_PATH_DISAGGREGATED
    finally:
        honeypot.close()


# ---- allowlist and flags, no workers ---------------------------------------------------------------------------
def test_allowlist_rules() -> None:
    async def check() -> None:
        listed = PrefillAllowlist(["localhost:5000", "10.0.0.7:6000", "[::1]:7000"], holds_token=True)
        assert await listed.allows("127.0.0.1:5000")  # localhost resolves to it
        assert await listed.allows("LOCALHOST:5000") and await listed.allows("10.0.0.7:6000")
        assert await listed.allows("[::1]:7000") and await listed.allows("[0:0::1]:7000")
        for address in ("127.0.0.1:5001", "10.0.0.8:6000", "10.0.0.7:5000", "evil.example:5000", "garbage",
                        "127.0.0.1:", ":5000", "localhost.evil.example:5000"):
            assert not await listed.allows(address), address
        assert not await PrefillAllowlist([], holds_token=True).allows("127.0.0.1:5000")
        assert await PrefillAllowlist([], holds_token=False).allows("anything:1")  # plain local dev

    asyncio.run(check())
    for bad in ("localhost", "localhost:http", "host:70000", ":5000"):
        with pytest.raises(ValueError):
            split_host_port(bad)


def _auth_args(**values: str | None) -> argparse.Namespace:
    base = dict(cluster_token=None, tls_cert=None, tls_key=None, tls_ca=None, tls_server_name=None)
    return argparse.Namespace(**{**base, **values})


def test_credential_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert not ClusterAuth.from_args(_auth_args()).enabled
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert ClusterAuth.from_args(_auth_args()).token == TOKEN
    assert ClusterAuth.from_args(_auth_args(cluster_token="flag-token-0123456789")).token == "flag-token-0123456789"
    assert TOKEN not in repr(ClusterAuth.from_args(_auth_args()))
    generated = ClusterAuth().with_token()
    assert generated.token and len(generated.token) >= 32 and generated.token != ClusterAuth().with_token().token
    for bad in (dict(cluster_token="short"), dict(cluster_token="line\nbreak-0123456789"),
                dict(tls_cert=str(tmp_path / "c.pem")), dict(tls_server_name="x")):
        with pytest.raises(ValueError):
            ClusterAuth.from_args(_auth_args(**bad))



def test_a_credential_reaches_a_child_process_through_its_environment(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """What a worker hands its tensor-parallel rank processes (`env`) is what they present (`from_env`)."""
    for name in (TOKEN_ENV, *TLS_ENV):
        monkeypatch.delenv(name, raising=False)
    tls = TLSFiles(tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "ca.pem", "kvflow-worker")
    for auth in (ClusterAuth(TOKEN, tls), ClusterAuth(TOKEN), ClusterAuth(tls=TLSFiles(*(tmp_path / n for n in
                                                                                      ("c", "k", "ca"))))):
        with monkeypatch.context() as child:
            for name, value in auth.env().items():
                child.setenv(name, value)
            assert ClusterAuth.from_env() == auth
    assert ClusterAuth().env() == {} and ClusterAuth.from_env() == ClusterAuth()
    assert TOKEN not in " ".join(ClusterAuth(tls=tls).env().values())


# ---- mTLS --------------------------------------------------------------------------------------------------------
SERVER_NAME = "kvflow-worker"


def make_certs(directory: Path) -> dict[str, Path]:
    """A throwaway CA and a node certificate it signs (DNS SAN kvflow-worker, server and client use), plus a rogue
    CA's certificate with the same name, by the openssl CLI."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory, timeout=60)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    for ca in ("ca", "rogue-ca"):
        openssl("req", "-x509", *ec, "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "1", "-subj", f"/CN={ca}",
                "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    (directory / "leaf.cnf").write_text(f"subjectAltName=DNS:{SERVER_NAME}\nbasicConstraints=CA:FALSE\n"
                                        "extendedKeyUsage=serverAuth,clientAuth\n")
    for leaf, ca in (("node", "ca"), ("rogue", "rogue-ca")):
        openssl("req", *ec, "-keyout", f"{leaf}.key", "-out", f"{leaf}.csr", "-subj", f"/CN={leaf}")
        openssl("x509", "-req", "-in", f"{leaf}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
                "-out", f"{leaf}.pem", "-days", "1", "-extfile", "leaf.cnf")
    return {name: directory / name for name in ("ca.pem", "node.pem", "node.key", "rogue.pem", "rogue.key")}


@pytest.fixture(scope="module")
def mtls(tmp_logs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Worker, Worker, dict]]:
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    flags = ("--tls-cert", str(certs["node.pem"]), "--tls-key", str(certs["node.key"]), "--tls-ca",
             str(certs["ca.pem"]), "--tls-server-name", SERVER_NAME)
    auth = ClusterAuth(tls=TLSFiles(certs["node.pem"], certs["node.key"], certs["ca.pem"], SERVER_NAME))
    prefill = _start("prefill", tmp_logs, *flags)
    decode = None
    try:
        decode = _start("decode", tmp_logs, *flags)
        wait_healthy(prefill, auth=auth)
        wait_healthy(decode, auth=auth)
        yield prefill, decode, {"auth": auth, **certs}
    finally:
        prefill.stop()
        if decode is not None:
            decode.stop()


def test_mtls_refuses_clients_without_the_cluster_certificate(mtls: tuple[Worker, Worker, dict]) -> None:
    prefill, decode, certs = mtls
    refused = {
        "no certificate": ClusterAuth(),
        "another CA's certificate": ClusterAuth(tls=TLSFiles(certs["rogue.pem"], certs["rogue.key"], certs["ca.pem"],
                                                             SERVER_NAME)),
        "the IP checked, not the certificate's name": ClusterAuth(tls=TLSFiles(certs["node.pem"], certs["node.key"],
                                                                                certs["ca.pem"])),
    }
    for worker in (prefill, decode):
        for name, auth in refused.items():
            with pytest.raises(grpc.RpcError) as caught:
                info(worker, auth=auth)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, name
            with channel_to(worker, auth) as channel, pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        described = info(worker, auth=certs["auth"])
        assert described.model == "tiny" and described.num_kv_blocks > 0  # mTLS alone: full Info


def test_mtls_cluster_serves_a_disaggregated_request(mtls: tuple[Worker, Worker, dict]) -> None:
    prefill, decode, certs = mtls
    remote = generate(decode, PROMPT, prefill, auth=certs["auth"], cache_salt=("remote",))
    assert remote.prefill_path == pb.PREFILL_PATH_DISAGGREGATED  # the decode worker dialed prefill with its cert
    local = generate(decode, PROMPT, prefill, auth=certs["auth"], cache_salt=("local",), min_prompt_tokens=LOCAL_ONLY)
    assert list(remote.choices[0].token_ids) == list(local.choices[0].token_ids)

