"""A gloo KV link's rendezvous store over the prefill worker's authenticated gRPC port (cluster/transfer/link/store.py):
a pair group forms through it, the 16 pair groups of a fully crossed link between TP4 workers form through it within
its bounds, a tensor-parallel rank process without the cluster credential is refused, and a peer cannot reach
another link's keys nor grow the store (issue 27); every link, NCCL included, rendezvouses only there (a decode
rank refuses anything else, and c10d's own polls outside the link cost no call)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import grpc
import pytest
import torch

from cluster.auth import TOKEN_ENV, ClusterAuth
from cluster.transfer.link.group import (
    DECODE_RANK,
    PREFILL_RANK,
    PairGroup,
    RankGroups,
    join_groups,
)
from cluster.transfer.link.heads import plan_heads
from cluster.transfer.link.ranks import _link_store
from cluster.transfer.link.store import (
    MAX_KEYS,
    MAX_VALUE_BYTES,
    LinkStores,
    RpcLinkStore,
    dial_link_store,
    link_prefix,
)
from kvflow.launcher import free_port
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc


class _StoreOnly(kvflow_pb2_grpc.PrefillServicer):
    def __init__(self, stores: LinkStores) -> None:
        self.stores = stores

    async def KVLinkStore(self, request, context):  # noqa: ANN001, ANN201, N802
        return await self.stores.serve(request, context)


TOKEN = "link-store-test-token-0123456789"
Served = tuple[LinkStores, kvflow_pb2_grpc.PrefillStub, asyncio.AbstractEventLoop]


def _serve(auth: ClusterAuth) -> Iterator[tuple[Served, str]]:
    """A `KVLinkStore` server demanding `auth` (its address, and a stub presenting `auth`), on a loop thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    stores, address = LinkStores(timeout_s=20), f"127.0.0.1:{free_port()}"

    async def start() -> tuple[grpc.aio.Server, kvflow_pb2_grpc.PrefillStub]:
        server = grpc.aio.server(interceptors=auth.server_interceptors())
        kvflow_pb2_grpc.add_PrefillServicer_to_server(_StoreOnly(stores), server)
        auth.add_port(server, address)
        await server.start()
        return server, kvflow_pb2_grpc.PrefillStub(auth.aio_channel(address))

    server, stub = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield (stores, stub, loop), address
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


@pytest.fixture()
def served() -> Iterator[Served]:
    for server, _ in _serve(ClusterAuth()):
        yield server


@pytest.fixture()
def served_with_token() -> Iterator[tuple[Served, str]]:
    yield from _serve(ClusterAuth(TOKEN))


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


def test_a_decode_rank_refuses_a_rendezvous_other_than_the_rpc_store() -> None:
    """An older prefill worker's `ready` named an open TCPStore (NCCL links): no link forms on it."""
    ready = pb.KVLinkReady(store_prefix=link_prefix("old"), timeout_s=1)
    with pytest.raises(RuntimeError, match="KVLinkStore RPC"):
        join_groups("gloo", ready, None, ())


def test_c10d_polls_outside_the_link_are_answered_without_a_call() -> None:
    """ProcessGroupNCCL's watchdog checks its store's root for a dump flag about once a second: the link store says
    "absent" on the spot instead of sending an RPC the prefill worker would refuse."""

    class NoCalls:
        def KVLinkStore(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201, N802
            raise AssertionError("no RPC expected")

    store = RpcLinkStore(NoCalls(), "link-w", None, 1.0)
    assert store.check(["exception_dump"]) is False
    assert store.check([link_prefix("link-w") + "k", "exception_dump"]) is False


def _rank_doc(link_id: str, address: str) -> dict:
    """What rank 0 tells a tensor-parallel rank's agent about a gloo link's store (cluster/transfer/link/send.py)."""
    return {"link": link_id, "address": address, "timeout_s": 20}


def test_a_rank_process_reaches_the_link_store_only_with_the_cluster_credential(
        served_with_token, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    (stores, _, _), address = served_with_token
    stores.open("link-t", link_prefix("link-t"))
    key = link_prefix("link-t") + "k"
    channels: list[grpc.Channel] = []
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    without = _link_store(_rank_doc("link-t", address), channels)
    with pytest.raises(RuntimeError, match="UNAUTHENTICATED"):
        without.set(key, b"v")
    monkeypatch.setenv(TOKEN_ENV, TOKEN)  # what the worker hands its ranks (ClusterAuth.env)
    with_token = _link_store(_rank_doc("link-t", address), channels)
    with_token.set(key, b"v")
    assert with_token.get(key) == b"v"
    for channel in channels:
        channel.close()


def test_a_tp4_links_sixteen_pair_groups_form_within_the_store_bounds(served_with_token) -> None:  # noqa: ANN001
    """Every prefill rank of TP4 sends heads to every decode rank of TP4 (the most pairs a TP4 x TP4 link can
    have): all 16 pair groups rendezvous through one link's store, prefill rank 0 on the store itself, the 7 other
    ranks over the RPC, each on its own thread (like rank processes), and greet in pair order."""
    (stores, _, _), address = served_with_token
    prefix = link_prefix("link-tp4")
    local = stores.open("link-tp4", prefix)
    plan = plan_heads(tuple(tuple(range(4 * r, 4 * r + 4)) for r in range(4)),
                      tuple(tuple(range(r, 16, 4)) for r in range(4)))
    assert len(plan.pairs) == 16
    failures: list[BaseException] = []
    channels: list[grpc.Channel] = []

    def rank(side: int, index: int) -> None:
        try:
            store = local
            if (side, index) != (PREFILL_RANK, 0):
                store, channel = dial_link_store(address, "link-tp4", 20, ClusterAuth(TOKEN))
                channels.append(channel)
            pairs = plan.sending(index) if side == PREFILL_RANK else plan.receiving(index)
            groups = RankGroups("gloo", store, prefix, pairs, side, 20)
            if not groups.hello(torch.device("cpu"), threading.Event()):
                raise RuntimeError("hello failed")
            groups.close(failed=False)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            failures.append(exc)

    threads = [threading.Thread(target=rank, args=(side, index)) for side in (PREFILL_RANK, DECODE_RANK)
               for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures, failures
    assert not any(thread.is_alive() for thread in threads)
    assert 16 <= local.num_keys() <= MAX_KEYS
    for channel in channels:
        channel.close()
