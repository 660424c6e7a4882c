"""A KV link's rendezvous store, over the prefill worker's authenticated gRPC port instead of an open c10d TCPStore.

The prefill rank keeps one in-process `dist.HashStore` per link (`LinkStores`). Every other rank of a link (the
decode worker's rank 0, and the tensor-parallel ranks > 0 of both workers, which are processes of their own) builds
its pair groups on `RpcLinkStore`, a `dist.Store` whose every call is a `KVLinkStore` RPC, carrying the cluster
credential like every worker RPC, that the prefill worker applies to that link's store. Rank 0 of the decode worker
calls through its worker's channel on the event loop; a rank process dials the prefill worker itself
(`dial_link_store`) with the credential its worker handed it in the environment (`ClusterAuth.from_env`). So no
store port is open to anyone who can reach the host. NCCL's and gloo's own data sockets remain: see
cluster/transfer/link/__init__.py.

Invariants:
- a request names its link and only keys under that link's prefix; an unknown link is NOT_FOUND, another key
  PERMISSION_DENIED;
- a link's store holds at most MAX_KEYS keys (enough for every pair group of a link between TP4 workers: at most
  16 pairs, each a handful of gloo keys) of at most MAX_KEY_CHARS characters and MAX_VALUE_BYTES bytes, so a
  peer cannot grow the prefill worker (RESOURCE_EXHAUSTED past them);
- no call blocks the event loop or holds a thread: GET and WAIT poll for their keys on the loop (`_present`), at
  most the link's setup timeout, and only then touch the store;
- c10d's own polls of keys outside the link (ProcessGroupNCCL's watchdog checks its store's root for a dump flag)
  are answered "absent" on the calling side: no RPC, no refusal logged every second;
- the decode side keeps its `RpcLinkStore` referenced for as long as the process group lives (c10d calls back into
  the Python object).
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Callable
from typing import Any

import grpc
import torch.distributed as dist

from cluster.auth import ClusterAuth
from protos.kvflow.v1 import kvflow_pb2 as pb
from protos.kvflow.v1 import kvflow_pb2_grpc

MAX_KEYS = 256
MAX_KEY_CHARS = 512
MAX_VALUE_BYTES = 1 << 20  # an NCCL unique id is 128 bytes; gloo's addresses a few hundred
POLL_FIRST_S, POLL_MAX_S = 0.001, 0.05  # a waiting GET or WAIT checks its keys this often (doubling)
CHANNEL_OPTIONS = (("grpc.max_send_message_length", 2 * MAX_VALUE_BYTES),
                   ("grpc.max_receive_message_length", 2 * MAX_VALUE_BYTES))
KEYED_OPS = frozenset({pb.KV_LINK_STORE_OP_SET, pb.KV_LINK_STORE_OP_GET, pb.KV_LINK_STORE_OP_ADD,
                       pb.KV_LINK_STORE_OP_COMPARE_SET, pb.KV_LINK_STORE_OP_DELETE})
WRITE_OPS = frozenset({pb.KV_LINK_STORE_OP_SET, pb.KV_LINK_STORE_OP_ADD, pb.KV_LINK_STORE_OP_COMPARE_SET})


def link_prefix(link_id: str) -> str:
    """The prefix of the link's keys in its store (the KVLinkStore RPC accepts no other key for the link)."""
    return f"kvflow/link/{link_id}/"


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
        entry = self._stores[request.link_id]
        _, store, keys = entry
        operation = self._operation(request, store, keys)
        if operation is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown store operation {request.op}")
        waited = _waited_keys(request)
        wait_s = min(request.timeout_s or self.timeout_s, self.timeout_s)
        if waited and not await _present(store, waited, wait_s, lambda: self._stores.get(request.link_id) is entry):
            if self._stores.get(request.link_id) is not entry:
                await context.abort(grpc.StatusCode.NOT_FOUND, "the KV link closed")
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"link store: no key {waited[0][:80]!r} after "
                                                                   f"{wait_s:.1f} s")
        try:
            return operation()
        except (RuntimeError, ValueError) as exc:  # a c10d error (DistStoreError is a RuntimeError)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"link store: {exc}")
            raise

    def _operation(self, request: pb.KVLinkStoreRequest, store: dist.HashStore,
                   keys: set[str]) -> Callable[[], pb.KVLinkStoreResponse] | None:
        """The call on the store itself, which never blocks: GET and WAIT run once their keys are present."""
        key = request.key

        def written(response: pb.KVLinkStoreResponse) -> pb.KVLinkStoreResponse:
            keys.add(key)
            return response

        return {
            pb.KV_LINK_STORE_OP_SET: lambda: written(_set(store, key, request.value)),
            pb.KV_LINK_STORE_OP_GET: lambda: pb.KVLinkStoreResponse(value=store.get(key)),
            pb.KV_LINK_STORE_OP_ADD: lambda: written(pb.KVLinkStoreResponse(number=store.add(key, request.amount))),
            pb.KV_LINK_STORE_OP_WAIT: lambda: pb.KVLinkStoreResponse(ok=True),
            pb.KV_LINK_STORE_OP_CHECK: lambda: pb.KVLinkStoreResponse(ok=store.check(list(request.keys))),
            pb.KV_LINK_STORE_OP_COMPARE_SET: lambda: written(pb.KVLinkStoreResponse(
                value=store.compare_set(key, request.expected, request.value))),
            pb.KV_LINK_STORE_OP_DELETE: lambda: pb.KVLinkStoreResponse(ok=store.delete_key(key)),
            pb.KV_LINK_STORE_OP_NUM_KEYS: lambda: pb.KVLinkStoreResponse(number=store.num_keys()),
        }.get(request.op)


def _waited_keys(request: pb.KVLinkStoreRequest) -> list[str]:
    """The keys a call waits for before it touches the store (GET: its key, WAIT: its keys)."""
    if request.op == pb.KV_LINK_STORE_OP_GET:
        return [request.key]
    return list(request.keys) if request.op == pb.KV_LINK_STORE_OP_WAIT else []


async def _present(store: dist.HashStore, keys: list[str], wait_s: float, still_open: Callable[[], bool]) -> bool:
    """Whether every key is in `store` within `wait_s` (False at once when the link closes), polled on the event
    loop: a waiting peer holds no thread (with tensor-parallel workers several ranks wait at once, and the one that
    sets the key must not queue behind them)."""
    deadline, delay = time.monotonic() + wait_s, POLL_FIRST_S
    while not store.check(keys):
        if time.monotonic() >= deadline or not still_open():
            return False
        await asyncio.sleep(delay)
        delay = min(2 * delay, POLL_MAX_S)
    return True


def _set(store: dist.HashStore, key: str, value: bytes) -> pb.KVLinkStoreResponse:
    store.set(key, value)
    return pb.KVLinkStoreResponse()


class RpcLinkStore(dist.Store):
    """A non-prefill rank's store: each c10d call is a `KVLinkStore` RPC to the prefill worker, blocking the calling
    (link) thread. With `loop` (the decode worker's rank 0), `stub` is an asyncio stub and the RPC runs on `loop`,
    the worker's event loop, where its channel lives; without, `stub` is a blocking one (a rank process's)."""

    def __init__(self, stub: Any, link_id: str, loop: asyncio.AbstractEventLoop | None, timeout_s: float) -> None:
        super().__init__()
        self._stub, self._link_id, self._loop, self._timeout_s = stub, link_id, loop, timeout_s
        self._prefix = link_prefix(link_id)

    def _call(self, op: int, **fields: Any) -> pb.KVLinkStoreResponse:
        request = pb.KVLinkStoreRequest(link_id=self._link_id, op=op, timeout_s=self._timeout_s, **fields)
        try:
            if self._loop is None:
                return self._stub.KVLinkStore(request, timeout=self._timeout_s + 5)
            return asyncio.run_coroutine_threadsafe(self._on_loop(request), self._loop).result(self._timeout_s + 10)
        except grpc.RpcError as exc:  # grpc.aio.AioRpcError is one too
            raise RuntimeError(f"KV link store {exc.code().name}: {exc.details()}") from None

    async def _on_loop(self, request: pb.KVLinkStoreRequest) -> pb.KVLinkStoreResponse:
        return await self._stub.KVLinkStore(request, timeout=self._timeout_s + 5)

    def set(self, key: str, value: str | bytes) -> None:
        self._call(pb.KV_LINK_STORE_OP_SET, key=key, value=value.encode() if isinstance(value, str) else value)

    def get(self, key: str) -> bytes:
        return self._call(pb.KV_LINK_STORE_OP_GET, key=key).value

    def add(self, key: str, amount: int) -> int:
        return self._call(pb.KV_LINK_STORE_OP_ADD, key=key, amount=amount).number

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._call(pb.KV_LINK_STORE_OP_WAIT, keys=keys)

    def check(self, keys: list[str]) -> bool:
        if not all(key.startswith(self._prefix) for key in keys):
            # ProcessGroupNCCL's watchdog polls its store's root for a job-wide "dump" flag about once a second;
            # a link's store has no root keys, so the answer is no, without a call
            return False
        return self._call(pb.KV_LINK_STORE_OP_CHECK, keys=keys).ok

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        as_bytes = [v.encode() if isinstance(v, str) else v for v in (expected, desired)]
        return self._call(pb.KV_LINK_STORE_OP_COMPARE_SET, key=key, expected=as_bytes[0], value=as_bytes[1]).value

    def delete_key(self, key: str) -> bool:
        return self._call(pb.KV_LINK_STORE_OP_DELETE, key=key).ok

    def num_keys(self) -> int:
        return self._call(pb.KV_LINK_STORE_OP_NUM_KEYS).number


def dial_link_store(address: str, link_id: str, timeout_s: float, auth: ClusterAuth) -> tuple[RpcLinkStore,
                                                                                            grpc.Channel]:
    """A rank process's store of a link whose prefill worker serves gRPC at `address`, presenting `auth` (the
    worker's credential, from the environment). The caller closes the channel once the link's groups are gone."""
    channel = auth.channel(address, CHANNEL_OPTIONS)
    return RpcLinkStore(kvflow_pb2_grpc.PrefillStub(channel), link_id, None, timeout_s), channel
