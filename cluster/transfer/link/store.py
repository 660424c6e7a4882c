"""A KV link's rendezvous store, over the prefill worker's authenticated gRPC port instead of an open c10d TCPStore.

The prefill rank keeps one in-process `dist.HashStore` per link (`LinkStores`). The decode rank's process group is
built on `RpcLinkStore`, a `dist.Store` whose every call is a `KVLinkStore` RPC, carrying the cluster credential like
every worker RPC, that the prefill worker applies to that link's store. So no store port is open to anyone who can
reach the host. NCCL's and gloo's own data sockets remain: see cluster/transfer/link/__init__.py.

Invariants:
- a request names its link and only keys under that link's prefix; an unknown link is NOT_FOUND, another key
  PERMISSION_DENIED;
- a link's store holds at most MAX_KEYS keys of at most MAX_KEY_CHARS characters and MAX_VALUE_BYTES bytes, so a
  peer cannot grow the prefill worker (RESOURCE_EXHAUSTED past them);
- blocking calls (GET, WAIT) wait on a thread, never on the event loop, and at most the link's setup timeout;
- the decode side keeps its `RpcLinkStore` referenced for as long as the process group lives (c10d calls back into
  the Python object).
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable
from typing import Any

import grpc
import torch.distributed as dist

from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc

MAX_KEYS = 256
MAX_KEY_CHARS = 512
MAX_VALUE_BYTES = 1 << 20  # an NCCL unique id is 128 bytes; gloo's addresses a few hundred
KEYED_OPS = frozenset({pb.KV_LINK_STORE_OP_SET, pb.KV_LINK_STORE_OP_GET, pb.KV_LINK_STORE_OP_ADD,
                       pb.KV_LINK_STORE_OP_COMPARE_SET, pb.KV_LINK_STORE_OP_DELETE})
WRITE_OPS = frozenset({pb.KV_LINK_STORE_OP_SET, pb.KV_LINK_STORE_OP_ADD, pb.KV_LINK_STORE_OP_COMPARE_SET})


class LinkStores:
    """The prefill worker's link stores, by link id."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._stores: dict[str, tuple[str, dist.HashStore, set[str]]] = {}

    def open(self, link_id: str, prefix: str) -> dist.HashStore:
        store = dist.HashStore()
        store.set_timeout(datetime.timedelta(seconds=self.timeout_s))
        self._stores[link_id] = (prefix, store, set())
        return store

    def close(self, link_id: str) -> None:
        self._stores.pop(link_id, None)

    def _refusal(self, request: pb.KVLinkStoreRequest) -> tuple[grpc.StatusCode, str] | None:
        entry = self._stores.get(request.link_id)
        if entry is None:
            return grpc.StatusCode.NOT_FOUND, "no KV link with this link_id"
        prefix, _, keys = entry
        for key in ([request.key] if request.op in KEYED_OPS else []) + list(request.keys):
            if not key.startswith(prefix) or len(key) > MAX_KEY_CHARS:
                return grpc.StatusCode.PERMISSION_DENIED, f"key {key[:80]!r} is not this link's"
        if max(len(request.value), len(request.expected)) > MAX_VALUE_BYTES:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, f"a link store value holds at most {MAX_VALUE_BYTES} bytes"
        if request.op in WRITE_OPS and request.key not in keys and len(keys) >= MAX_KEYS:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, f"a link store holds at most {MAX_KEYS} keys"
        return None

    async def serve(self, request: pb.KVLinkStoreRequest, context: grpc.aio.ServicerContext) -> pb.KVLinkStoreResponse:
        """The `KVLinkStore` RPC."""
        refusal = self._refusal(request)
        if refusal is not None:
            await context.abort(*refusal)
        _, store, keys = self._stores[request.link_id]
        operation = self._operation(request, store, keys)
        if operation is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown store operation {request.op}")
        try:
            return await asyncio.to_thread(operation)
        except (RuntimeError, ValueError) as exc:  # c10d's timeout (DistStoreError is a RuntimeError)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"link store: {exc}")
            raise

    def _operation(self, request: pb.KVLinkStoreRequest, store: dist.HashStore,
                   keys: set[str]) -> Callable[[], pb.KVLinkStoreResponse] | None:
        key, wait_s = request.key, min(request.timeout_s or self.timeout_s, self.timeout_s)
        timeout = datetime.timedelta(seconds=wait_s)

        def written(response: pb.KVLinkStoreResponse) -> pb.KVLinkStoreResponse:
            keys.add(key)
            return response

        return {
            pb.KV_LINK_STORE_OP_SET: lambda: written(_set(store, key, request.value)),
            pb.KV_LINK_STORE_OP_GET: lambda: _get(store, key, timeout),
            pb.KV_LINK_STORE_OP_ADD: lambda: written(pb.KVLinkStoreResponse(number=store.add(key, request.amount))),
            pb.KV_LINK_STORE_OP_WAIT: lambda: _wait(store, list(request.keys), timeout),
            pb.KV_LINK_STORE_OP_CHECK: lambda: pb.KVLinkStoreResponse(ok=store.check(list(request.keys))),
            pb.KV_LINK_STORE_OP_COMPARE_SET: lambda: written(pb.KVLinkStoreResponse(
                value=store.compare_set(key, request.expected, request.value))),
            pb.KV_LINK_STORE_OP_DELETE: lambda: pb.KVLinkStoreResponse(ok=store.delete_key(key)),
            pb.KV_LINK_STORE_OP_NUM_KEYS: lambda: pb.KVLinkStoreResponse(number=store.num_keys()),
        }.get(request.op)


def _set(store: dist.HashStore, key: str, value: bytes) -> pb.KVLinkStoreResponse:
    store.set(key, value)
    return pb.KVLinkStoreResponse()


def _get(store: dist.HashStore, key: str, timeout: datetime.timedelta) -> pb.KVLinkStoreResponse:
    store.wait([key], timeout)
    return pb.KVLinkStoreResponse(value=store.get(key))


def _wait(store: dist.HashStore, keys: list[str], timeout: datetime.timedelta) -> pb.KVLinkStoreResponse:
    store.wait(keys, timeout)
    return pb.KVLinkStoreResponse(ok=True)


class RpcLinkStore(dist.Store):
    """The decode rank's store: each c10d call is a `KVLinkStore` RPC to the prefill worker. Called on the link
    thread (blocking); the RPC itself runs on `loop`, the worker's event loop, where the channel lives."""

    def __init__(self, stub: kvflow_pb2_grpc.PrefillStub, link_id: str, loop: asyncio.AbstractEventLoop,
                 timeout_s: float) -> None:
        super().__init__()
        self._stub, self._link_id, self._loop, self._timeout_s = stub, link_id, loop, timeout_s

    def _call(self, op: int, **fields: Any) -> pb.KVLinkStoreResponse:
        request = pb.KVLinkStoreRequest(link_id=self._link_id, op=op, timeout_s=self._timeout_s, **fields)

        async def rpc() -> pb.KVLinkStoreResponse:  # the call is made on the loop, where the channel lives
            return await self._stub.KVLinkStore(request, timeout=self._timeout_s + 5)

        try:
            return asyncio.run_coroutine_threadsafe(rpc(), self._loop).result(self._timeout_s + 10)
        except grpc.aio.AioRpcError as exc:
            raise RuntimeError(f"KV link store {exc.code().name}: {exc.details()}") from None

    def set(self, key: str, value: str | bytes) -> None:
        self._call(pb.KV_LINK_STORE_OP_SET, key=key, value=value.encode() if isinstance(value, str) else value)

    def get(self, key: str) -> bytes:
        return self._call(pb.KV_LINK_STORE_OP_GET, key=key).value

    def add(self, key: str, amount: int) -> int:
        return self._call(pb.KV_LINK_STORE_OP_ADD, key=key, amount=amount).number

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._call(pb.KV_LINK_STORE_OP_WAIT, keys=keys)

    def check(self, keys: list[str]) -> bool:
        return self._call(pb.KV_LINK_STORE_OP_CHECK, keys=keys).ok

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        as_bytes = [v.encode() if isinstance(v, str) else v for v in (expected, desired)]
        return self._call(pb.KV_LINK_STORE_OP_COMPARE_SET, key=key, expected=as_bytes[0], value=as_bytes[1]).value

    def delete_key(self, key: str) -> bool:
        return self._call(pb.KV_LINK_STORE_OP_DELETE, key=key).ok

    def num_keys(self) -> int:
        return self._call(pb.KV_LINK_STORE_OP_NUM_KEYS).number
