"""What both ends of a KV link share: the pair's own 2-rank process group, the rendezvous (a gloo link's store over
the KVLinkStore RPC, store.py, for NCCL and gloo links alike), the heartbeat of the `KVLink`
stream, and waiting for a send or receive without blocking past the link's death (see
cluster/transfer/link/__init__.py for the link's invariants)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from cluster.transfer.link.heads import HeadPair
from engine.parallel.nccl_env import set_nccl_env_defaults
from protos.kvflow.v1 import kvflow_pb2 as pb

logger = logging.getLogger(__name__)
HEARTBEAT_S = 0.5
LINK_DEAD_S = 2.0  # no message on the KVLink stream for this long: the peer is dead
SETUP_TIMEOUT_S = 60.0  # process-group rendezvous and the first message (NCCL communicator creation)
REOPEN_BACKOFF_S = 1.0  # after a failed open, pulls to that peer use the fallback this long
POLL_S = 0.0002
PREFILL_RANK, DECODE_RANK = 0, 1

set_nccl_env_defaults()  # before any link's communicator exists


def link_backend_for(device: torch.device) -> str:
    """The torch.distributed backend a link uses from this device: NCCL for GPUs, gloo for CPUs."""
    return "nccl" if device.type == "cuda" else "gloo"


def link_backend_available(device: torch.device) -> bool:
    if not dist.is_available():
        return False
    return dist.is_nccl_available() if device.type == "cuda" else dist.is_gloo_available()


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """fp8 KV blocks travel as their bytes (gloo has no float8 type); the same storage, so a receive fills them."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


class PairGroup:
    """A 2-rank process group of its own (never the global default group)."""

    def __init__(self, backend: str, store: dist.Store, prefix: str, rank: int, timeout_s: float) -> None:
        self.backend = backend
        self._store = store  # referenced while the group lives: c10d calls back into a Python store
        prefixed = dist.PrefixStore(prefix, store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg: Any = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, 2, timeout)
        self.peer = 1 - rank

    def send(self, tensor: torch.Tensor) -> Any:
        return self.pg.send([_raw(tensor)], self.peer, 0)

    def recv(self, tensor: torch.Tensor) -> Any:
        return self.pg.recv([_raw(tensor)], self.peer, 0)

    def close(self, failed: bool) -> None:
        """Tear the communicator down: `abort` after a failure (pending operations end with an error), else a
        clean `shutdown`. Either way no NCCL thread outlives the link (one left at exit kills the process)."""
        for name in (("abort", "shutdown") if failed else ("shutdown", "abort")):
            method = getattr(self.pg, name, None)
            if method is not None:
                with contextlib.suppress(Exception):  # already broken: nothing left to release
                    method()
                return


class RankGroups:
    """One rank's pair groups of a link: one per peer rank it moves heads with (cluster/transfer/link/heads.py),
    built, greeted and used in the plan's pair order. Blocking: call it on a link thread."""

    def __init__(self, backend: str, store: dist.Store, prefix: str, pairs: tuple[HeadPair, ...], side: int,
                 timeout_s: float) -> None:
        self.pairs = pairs
        self.groups: list[PairGroup] = []
        for pair in pairs:  # each constructor waits for its peer: in pair order on both sides
            self.groups.append(PairGroup(backend, store, pair_prefix(prefix, pair), side, timeout_s))

    def hello(self, device: torch.device, broken: threading.Event) -> bool:
        """The first message of every pair (NCCL builds its communicator there), in pair order."""
        for group in self.groups:
            token = torch.ones(1, device=device)
            work = group.send(token) if group.peer == DECODE_RANK else group.recv(token)
            if not complete(work, device, broken):
                return False
        return True

    def send(self, tensors: list[torch.Tensor], device: torch.device, broken: threading.Event) -> bool:
        """One tensor per pair, in pair order; False if the link broke first."""
        return all(complete(group.send(tensor), device, broken) for group, tensor in zip(self.groups, tensors,
                                                                                          strict=True))

    def recv(self, buffers: list[torch.Tensor], device: torch.device, broken: threading.Event) -> bool:
        return all(complete(group.recv(buffer), device, broken) for group, buffer in zip(self.groups, buffers,
                                                                                          strict=True))

    def close(self, failed: bool) -> None:
        for group in self.groups:
            group.close(failed)


# ---- rendezvous ------------------------------------------------------------------------------------------------
def pair_prefix(prefix: str, pair: HeadPair) -> str:
    """The pair's keys in the link's store: rank 0 to rank 0 under the link's own prefix (one-rank workers' links
    rendezvous as before tensor-parallel links existed), the other pairs under their own."""
    return prefix if (pair.src, pair.dst) == (0, 0) else f"{prefix}{pair.src}-{pair.dst}/"


def join_groups(backend: str, ready: pb.KVLinkReady, store: dist.Store, pairs: tuple[HeadPair, ...]) -> RankGroups:
    """A decode rank's end: its pair groups as their decode rank (blocking), on the link's store (the prefill
    worker's KVLinkStore RPC)."""
    check_rpc_rendezvous(ready.rpc_store)
    timeout_s = ready.timeout_s or SETUP_TIMEOUT_S
    return RankGroups(backend, store, ready.store_prefix, pairs, DECODE_RANK, timeout_s)


def check_rpc_rendezvous(rpc_store: bool) -> None:
    """Links rendezvous only over the authenticated KVLinkStore RPC; a prefill worker that offers anything else
    (an older one's open TCPStore) gets no link: the pull falls back."""
    if not rpc_store:
        raise RuntimeError("the prefill worker offered a KV-link rendezvous other than its authenticated "
                           "KVLinkStore RPC (an older kvflow?): this worker opens no such link")


# ---- the KVLink stream -----------------------------------------------------------------------------------------
async def notices_and_heartbeats(notices: asyncio.Queue[pb.KVLinkChunk | None],
                                 ranks_alive: Callable[[], bool] = lambda: True) -> AsyncIterator[pb.KVLinkMessage]:
    """The prefill side's KVLink messages after `ready`: each notice in order, a heartbeat whenever `HEARTBEAT_S`
    passes without one; ends at the None that says the link broke, or once a tensor-parallel rank of this worker
    is gone (ending the stream tells the decode side)."""
    while True:
        try:
            notice = await asyncio.wait_for(notices.get(), HEARTBEAT_S)
        except asyncio.TimeoutError:
            if not ranks_alive():
                return
            yield pb.KVLinkMessage(heartbeat=pb.KVLinkHeartbeat(sent_unix_s=time.time()))
            continue
        if notice is None:
            return
        yield pb.KVLinkMessage(chunk=notice)


# ---- both link threads -----------------------------------------------------------------------------------------
def complete(work: Any, device: torch.device, broken: threading.Event) -> bool:
    """Wait on this thread until `work` (a send or recv just issued on the current stream) has finished on the
    device; False if the link broke first. Gloo's wait blocks until done or raises when the peer is gone."""
    if device.type != "cuda":
        work.wait()
        return True
    work.wait()  # device side: the current stream waits for NCCL's
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    while not done.query():
        if broken.is_set():
            return False
        time.sleep(POLL_S)
    return True


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """NCCL and CUDA streams bind to the calling thread's current device: make it the worker's."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield
