"""Cluster credentials: which callers a worker serves, and how the cluster's own clients present themselves.

A worker holds a credential when it is given a shared token (`--cluster-token`, or the env `KVFLOW_CLUSTER_TOKEN`,
preferred: a command line shows in `ps`), mTLS files (`--tls-cert/--tls-key/--tls-ca`), or both. Then:

- Every RPC but `PUBLIC_METHODS` (`Info` and grpc.health.v1, for probes) needs the token in the
  `x-kvflow-cluster-token` metadata, compared in constant time. A missing or wrong one ends the call
  UNAUTHENTICATED before the request is parsed or any handler runs (`TokenInterceptor`).
- `Info` answers anyone, but a caller without the token gets only `public_info` (role and version): model paths,
  devices, capacity and load are for the cluster.
- With mTLS the port speaks TLS only and requires a client certificate signed by `--tls-ca` at the handshake, for
  every method, probes included: gRPC Python cannot make client certificates optional. Clients check the worker's
  certificate against the same CA, for the host they dial (an IP needs an IP SAN) or `--tls-server-name`.
- Every channel the cluster opens to a worker (router, decode -> prefill, the launcher's readiness probe,
  benchmarks and tests) comes from `ClusterAuth.channel` / `aio_channel`: the token on each call, the client
  certificate on the channel.

No credential at all (plain local dev) keeps the old behaviour: workers serve everyone on a plaintext port.
The token never appears in a repr, a log line or a command line built here; it travels to child processes in the
environment only.

KV links rendezvous over the authenticated `KVLinkStore` RPC (NCCL and gloo links, tensor-parallel ranks included:
a worker hands its rank processes this credential with `env`, and they read it with `from_env`). Not covered here:
the NCCL/gloo sockets behind every link have no authentication of their own; their addresses are only handed out
over that authenticated rendezvous, and the network must keep strangers away from the workers' ports (the Helm
chart's NetworkPolicies admit only decode pods to prefill pods). Workers' `--metrics-port` is plain Prometheus HTTP.
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from protos.kvflow.v1 import kvflow_pb2 as pb

TOKEN_ENV = "KVFLOW_CLUSTER_TOKEN"
# mTLS file paths handed to a worker's own child processes (its tensor-parallel ranks), with the token
TLS_ENV = ("KVFLOW_TLS_CERT", "KVFLOW_TLS_KEY", "KVFLOW_TLS_CA", "KVFLOW_TLS_SERVER_NAME")
TOKEN_METADATA = "x-kvflow-cluster-token"
# Readable without the token: probes (kubelet gRPC probes, the launcher) and a role/version `Info`.
PUBLIC_METHODS = frozenset(
    {f"/{service.full_name}/Info" for service in pb.DESCRIPTOR.services_by_name.values()}
    | {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch", "/grpc.health.v1.Health/List"})
MIN_TOKEN_CHARS = 16
REFUSED = "missing or wrong cluster token (x-kvflow-cluster-token)"


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of mutual TLS: this process's certificate and key (it serves with them and dials with them) and
    the CA both sides check the peer's certificate against."""

    cert: Path
    key: Path
    ca: Path
    server_name: str | None = None  # the name clients check workers' certificates for (default: the dialed host)

    def read(self) -> tuple[bytes, bytes, bytes]:
        return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()

    def argv(self) -> list[str]:
        out = ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]
        return out + (["--tls-server-name", self.server_name] if self.server_name else [])


@dataclass(frozen=True)
class ClusterAuth:
    """The cluster credential of one process: what its worker port demands and what its channels present."""

    token: str | None = field(default=None, repr=False)
    tls: TLSFiles | None = None

    def __post_init__(self) -> None:
        if self.token is None:
            return
        if len(self.token) < MIN_TOKEN_CHARS:
            raise ValueError(f"the cluster token must have at least {MIN_TOKEN_CHARS} characters")
        if not (self.token.isascii() and self.token.isprintable()):
            raise ValueError("the cluster token must be printable ASCII (it travels as gRPC metadata)")

    @property
    def enabled(self) -> bool:
        return self.token is not None or self.tls is not None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClusterAuth:
        """From `add_cluster_auth_args` flags; the token falls back to the env `KVFLOW_CLUSTER_TOKEN`."""
        token = args.cluster_token or os.environ.get(TOKEN_ENV) or None
        files = (args.tls_cert, args.tls_key, args.tls_ca)
        if any(files) and not all(files):
            raise ValueError("mTLS needs all of --tls-cert, --tls-key and --tls-ca")
        if args.tls_server_name and not all(files):
            raise ValueError("--tls-server-name needs --tls-cert, --tls-key and --tls-ca")
        tls = None
        if all(files):
            tls = TLSFiles(Path(args.tls_cert), Path(args.tls_key), Path(args.tls_ca), args.tls_server_name or None)
            for path in (tls.cert, tls.key, tls.ca):
                if not path.is_file():
                    raise ValueError(f"TLS file {path} does not exist")
        return cls(token, tls)

    @classmethod
    def from_env(cls) -> ClusterAuth:
        """The token of `KVFLOW_CLUSTER_TOKEN` (what tools calling an existing cluster's workers present), and the
        mTLS files of `TLS_ENV` where all three are set (what a worker hands its tensor-parallel ranks)."""
        cert, key, ca, server_name = (os.environ.get(name) or None for name in TLS_ENV)
        tls = TLSFiles(Path(cert), Path(key), Path(ca), server_name) if cert and key and ca else None
        return cls(os.environ.get(TOKEN_ENV) or None, tls)

    def with_token(self) -> ClusterAuth:
        """This credential, with a fresh random token if it has none (a cluster started here owns its token)."""
        return self if self.token else dataclasses.replace(self, token=secrets.token_urlsafe(32))

    def env(self) -> dict[str, str]:
        """Environment handing this credential to a child process (the token, and the mTLS files' paths)."""
        out = {TOKEN_ENV: self.token} if self.token else {}
        if self.tls is not None:
            paths = (str(self.tls.cert), str(self.tls.key), str(self.tls.ca), self.tls.server_name or "")
            out.update(zip(TLS_ENV, paths, strict=True))
        return out

    def accepts(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        """Whether call metadata carries this token (True when there is none to check: mTLS alone, or no auth)."""
        if self.token is None:
            return True
        return _token_matches(metadata, self.token.encode())

    # ---- server ----------------------------------------------------------------------------------------------
    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenInterceptor(self.token)] if self.token else []

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Listen on `address`: TLS requiring a CA-signed client certificate with mTLS, plaintext otherwise."""
        if self.tls is None:
            return server.add_insecure_port(address)
        cert, key, ca = self.tls.read()
        return server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                                                         require_client_auth=True))

    # ---- clients ---------------------------------------------------------------------------------------------
    def _channel_credentials(self) -> grpc.ChannelCredentials | None:
        if self.tls is None:
            return None
        cert, key, ca = self.tls.read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def _options(self, options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        out = list(options)
        if self.tls is not None and self.tls.server_name:
            out.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return out

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel to a worker that presents this credential on every call."""
        credentials = self._channel_credentials()
        if credentials is None:
            channel = grpc.insecure_channel(address, options=self._options(options))
        else:
            channel = grpc.secure_channel(address, credentials, options=self._options(options))
        if self.token is None:
            return channel
        return grpc.intercept_channel(channel, _SyncToken(self.token))

    def aio_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """An asyncio channel to a worker that presents this credential on every call."""
        interceptors = _aio_token_interceptors(self.token) if self.token else None
        credentials = self._channel_credentials()
        if credentials is None:
            return grpc.aio.insecure_channel(address, options=self._options(options), interceptors=interceptors)
        return grpc.aio.secure_channel(address, credentials, options=self._options(options),
                                       interceptors=interceptors)


def add_cluster_auth_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster credential (workers serve only holders of it)")
    g.add_argument("--cluster-token", default=None,
                   help=f"shared token every worker RPC must carry (prefer the env {TOKEN_ENV}: a command line "
                        "is visible to every local user in `ps`)")
    g.add_argument("--tls-cert", default=None, help="PEM certificate for mTLS: served by workers, presented "
                                                    "as the client certificate when calling workers")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default=None, help="PEM CA that signs every cluster member's certificate")
    g.add_argument("--tls-server-name", default=None,
                   help="name workers' certificates are checked for (default: the host dialed, e.g. the pod IP, "
                        "which then needs an IP SAN); give every worker a certificate with this DNS SAN")


def public_info(info: pb.InfoResponse) -> pb.InfoResponse:
    """What `Info` tells a caller without the cluster token: enough for a probe, nothing about the deployment."""
    return pb.InfoResponse(role=info.role, version=info.version)


def _token_matches(metadata: Sequence[tuple[str, str | bytes]] | None, token: bytes) -> bool:
    for key, value in metadata or ():
        if key == TOKEN_METADATA:
            given = value.encode() if isinstance(value, str) else value
            return hmac.compare_digest(given, token)
    return False


# ---- server interceptor ----------------------------------------------------------------------------------------
class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but `PUBLIC_METHODS` that lacks the token: UNAUTHENTICATED, request bytes unparsed."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails],
                                                             Awaitable[grpc.RpcMethodHandler]],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method in PUBLIC_METHODS \
                or _token_matches(details.invocation_metadata, self._token):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call UNAUTHENTICATED."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)
        yield  # unreachable; makes this an async generator

    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    shape = (handler.request_streaming, handler.response_streaming)
    # No request deserializer: the refused caller's bytes are never parsed.
    return make[shape](streaming if handler.response_streaming else unary,
                       response_serializer=handler.response_serializer)


# ---- client interceptors ---------------------------------------------------------------------------------------
def _with_token(metadata: Any, token: str) -> list[tuple[str, str]]:
    return [*(metadata or ()), (TOKEN_METADATA, token)]


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._token = token

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _SyncCallDetails(details.method, details.timeout, _with_token(details.metadata, self._token),
                                details.credentials, getattr(details, "wait_for_ready", None),
                                getattr(details, "compression", None))

    def _forward(self, continuation: Any, details: grpc.ClientCallDetails, request_or_requests: Any) -> Any:
        return continuation(self._details(details), request_or_requests)

    # Every call shape adds the token the same way.
    intercept_unary_unary = intercept_unary_stream = intercept_stream_unary = intercept_stream_stream = _forward


@dataclass(frozen=True)
class _SyncCallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _AioToken:
    def __init__(self, token: str) -> None:
        self._token = token

    async def _forward(self, continuation: Any, call: grpc.aio.ClientCallDetails, request_or_requests: Any) -> Any:
        details = call._replace(metadata=grpc.aio.Metadata(*_with_token(call.metadata, self._token)))
        return await continuation(details, request_or_requests)


# One class per call shape: a grpc.aio channel files each interceptor under the first shape it has.
class _AioUnaryUnary(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _AioToken._forward


class _AioUnaryStream(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _AioToken._forward


class _AioStreamUnary(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _AioToken._forward


class _AioStreamStream(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _AioToken._forward


def _aio_token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """One interceptor per call shape: a grpc.aio channel files each interceptor under the first shape it has."""
    return [kind(token) for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]
