"""A gloo KV link's rendezvous store over the prefill worker's authenticated gRPC port (cluster/transfer/link/store.py):
a pair group forms through it, and a peer cannot reach another link's keys nor grow the store (issue 27); and the
NCCL links' TCPStore listens on the worker's advertised address alone."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import grpc
import psutil
import pytest
import torch

from cluster.transfer.link.group import DECODE_RANK, PREFILL_RANK, PairGroup, link_prefix, serve_store
from cluster.transfer.link.store import MAX_KEYS, MAX_VALUE_BYTES, LinkStores, RpcLinkStore
from kvflow.launcher import free_port
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc


class _StoreOnly(kvflow_pb2_grpc.PrefillServicer):
    def __init__(self, stores: LinkStores) -> None:
        self.stores = stores

    async def KVLinkStore(self, request, context):  # noqa: ANN001, ANN201, N802
        return await self.stores.serve(request, context)


@pytest.fixture()
def served() -> Iterator[tuple[LinkStores, kvflow_pb2_grpc.PrefillStub, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    stores, port = LinkStores(timeout_s=20), free_port()

    async def start() -> tuple[grpc.aio.Server, kvflow_pb2_grpc.PrefillStub]:
        server = grpc.aio.server()
        kvflow_pb2_grpc.add_PrefillServicer_to_server(_StoreOnly(stores), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server, kvflow_pb2_grpc.PrefillStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))

    server, stub = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield stores, stub, loop
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_a_gloo_pair_forms_through_the_rpc_store(served) -> None:  # noqa: ANN001
    stores, stub, loop = served
    prefix = link_prefix("link-a")
    prefill_store = stores.open("link-a", prefix)
    received: dict[str, torch.Tensor] = {}

    def prefill() -> None:
        PairGroup("gloo", prefill_store, prefix, PREFILL_RANK, 20).send(torch.arange(4.0)).wait()

    def decode() -> None:
        group = PairGroup("gloo", RpcLinkStore(stub, "link-a", loop, 20), prefix, DECODE_RANK, 20)
        received["t"] = torch.zeros(4)
        group.recv(received["t"]).wait()

    threads = [threading.Thread(target=prefill), threading.Thread(target=decode)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert torch.equal(received["t"], torch.arange(4.0))


def _call(stub: kvflow_pb2_grpc.PrefillStub, loop: asyncio.AbstractEventLoop, **fields) -> pb.KVLinkStoreResponse:  # noqa: ANN003
    async def call() -> pb.KVLinkStoreResponse:
        return await stub.KVLinkStore(pb.KVLinkStoreRequest(**fields), timeout=10)

    return asyncio.run_coroutine_threadsafe(call(), loop).result(15)


def test_a_peer_reaches_only_its_links_keys_within_bounds(served) -> None:  # noqa: ANN001
    stores, stub, loop = served
    stores.open("link-b", link_prefix("link-b"))
    stores.open("link-c", link_prefix("link-c"))
    key = link_prefix("link-b") + "k"

    def refused(code: grpc.StatusCode, **fields) -> None:  # noqa: ANN003
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            _call(stub, loop, **fields)
        assert caught.value.code() == code, caught.value.details()

    _call(stub, loop, link_id="link-b", op=pb.KV_LINK_STORE_OP_SET, key=key, value=b"v")
    assert _call(stub, loop, link_id="link-b", op=pb.KV_LINK_STORE_OP_GET, key=key).value == b"v"
    refused(grpc.StatusCode.NOT_FOUND, link_id="nope", op=pb.KV_LINK_STORE_OP_GET, key=key)
    refused(grpc.StatusCode.PERMISSION_DENIED, link_id="link-c", op=pb.KV_LINK_STORE_OP_GET, key=key)
    refused(grpc.StatusCode.PERMISSION_DENIED, link_id="link-b", op=pb.KV_LINK_STORE_OP_SET, key="other/k")
    refused(grpc.StatusCode.RESOURCE_EXHAUSTED, link_id="link-b", op=pb.KV_LINK_STORE_OP_SET, key=key,
            value=b"x" * (MAX_VALUE_BYTES + 1))
    for i in range(MAX_KEYS - 1):
        _call(stub, loop, link_id="link-b", op=pb.KV_LINK_STORE_OP_SET, key=f"{key}{i}", value=b"")
    refused(grpc.StatusCode.RESOURCE_EXHAUSTED, link_id="link-b", op=pb.KV_LINK_STORE_OP_SET, key=key + "more")
    refused(grpc.StatusCode.DEADLINE_EXCEEDED, link_id="link-b", op=pb.KV_LINK_STORE_OP_GET,
            key=key + "never", timeout_s=0.2)
    stores.close("link-b")
    refused(grpc.StatusCode.NOT_FOUND, link_id="link-b", op=pb.KV_LINK_STORE_OP_GET, key=key)


def test_the_nccl_links_tcp_store_listens_on_the_workers_address_alone() -> None:
    store = serve_store("127.0.0.1")
    listening = [c.laddr.ip for c in psutil.net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port]
    assert listening == ["127.0.0.1"], listening
